"""Column types of FeatureBox: 1-D numpy arrays (ints, floats, objects for strings), 1-D/2-D torch
tensors, or :class:`Ragged` lists (flat values plus row offsets), and the helpers every op and the
scheduler use on them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class Ragged:
    """A list column: row ``i`` is ``values[offsets[i]:offsets[i+1]]``; ``offsets`` has n+1 entries."""

    values: Any
    offsets: Any

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> Any:
        return self.offsets[1:] - self.offsets[:-1]

    def rows(self) -> list[list[Any]]:
        v = self.values.tolist() if hasattr(self.values, "tolist") else list(self.values)
        o = [int(x) for x in self.offsets]
        return [v[o[i] : o[i + 1]] for i in range(len(o) - 1)]

    @classmethod
    def from_rows(cls, rows: list[list[Any]], dtype: Any = np.int64) -> Ragged:
        lengths = np.array([len(r) for r in rows], dtype=np.int64)
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        flat = [x for r in rows for x in r]
        values = np.empty(len(flat), dtype=object) if dtype is object else np.array(flat, dtype=dtype)
        if dtype is object:
            values[:] = flat
        return cls(values, offsets)


Column = Any  # np.ndarray | torch.Tensor | Ragged


def num_rows(col: Column) -> int:
    return len(col)


def is_torch(col: Column) -> bool:
    return isinstance(col.values if isinstance(col, Ragged) else col, torch.Tensor)


def to_device(col: Column, device: torch.device) -> Column:
    """Move a column to ``device`` (numpy on cpu when ``device`` is cpu; string columns stay numpy)."""
    if isinstance(col, Ragged):
        return Ragged(to_device(col.values, device), to_device(col.offsets, device))
    if device.type == "cpu":
        return col.cpu().numpy() if isinstance(col, torch.Tensor) else col
    if isinstance(col, np.ndarray):
        if col.dtype == object:
            return col
        return torch.from_numpy(np.ascontiguousarray(col)).to(device, non_blocking=True)
    return col.to(device, non_blocking=True)


def column_nbytes(col: Column) -> int:
    if isinstance(col, Ragged):
        return column_nbytes(col.values) + column_nbytes(col.offsets)
    if isinstance(col, torch.Tensor):
        return col.numel() * col.element_size()
    return int(col.nbytes)


def select_rows(col: Column, mask: np.ndarray) -> Column:
    """Rows where ``mask`` is true (numpy or torch, flat or ragged)."""
    if isinstance(col, Ragged):
        if isinstance(col.values, torch.Tensor):
            m = torch.as_tensor(mask, device=col.values.device)
            lengths = col.lengths()
            vmask = torch.repeat_interleave(m, lengths)
            new_len = lengths[m]
            offsets = torch.zeros(len(new_len) + 1, dtype=torch.int64, device=m.device)
            offsets[1:] = torch.cumsum(new_len, 0)
            return Ragged(col.values[vmask], offsets)
        lengths = np.diff(col.offsets)
        vmask = np.repeat(mask, lengths)
        offsets = np.zeros(int(mask.sum()) + 1, dtype=np.int64)
        np.cumsum(lengths[mask], out=offsets[1:])
        return Ragged(col.values[vmask], offsets)
    if isinstance(col, torch.Tensor):
        return col[torch.as_tensor(mask, device=col.device)]
    return col[mask]


def copy_out(col: Column) -> Column:
    """Copy a numpy column out of the arena (before it crosses to another device asynchronously)."""
    if isinstance(col, Ragged):
        return Ragged(np.array(col.values), np.array(col.offsets))
    return np.array(col)
