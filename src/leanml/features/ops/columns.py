"""Column types of FeatureBox and the helpers every op and the scheduler use on them.

A column is one of

* a 1-D numpy array (ints, floats; ``object`` for strings in the pure-Python reference path),
* a ``pyarrow`` string array (what the native readers produce for ``str`` fields),
* a 1-D/2-D torch tensor (outputs of ops placed on the GPU),
* a :class:`Ragged` list column (flat values plus row offsets), or
* a :class:`Gathered` column: per-entity values (one row per user or item, computed once when the
  table was loaded) and the entity row of every log row; it is materialised only where a row-level
  op or the collate step needs the values.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
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
        v = to_pylist(self.values)
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


@dataclass(eq=False)
class EntityColumn:
    """A column with one row per entity (plus a last row for keys missing from the table).

    ``memo`` caches derived per-entity arrays (e.g. the field hashes a cross needs), computed once.
    """

    values: Any
    memo: dict[Any, Any] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def derived(self, key: Any, fn: Any) -> Any:
        """``fn(values)``, computed on first use and kept."""
        with self.lock:
            if key not in self.memo:
                self.memo[key] = fn(self.values)
            return self.memo[key]


@dataclass
class Gathered:
    """Row ``i`` is entity row ``index[i]`` of ``entity.values`` (see :class:`EntityColumn`)."""

    entity: EntityColumn
    index: np.ndarray

    def __len__(self) -> int:
        return len(self.index)

    def materialize(self) -> Any:
        return take_rows(self.entity.values, self.index)


Column = Any  # np.ndarray | pa.Array | torch.Tensor | Ragged | Gathered


def num_rows(col: Column) -> int:
    return len(col)


def is_torch(col: Column) -> bool:
    return isinstance(col.values if isinstance(col, Ragged) else col, torch.Tensor)


def is_arrow(col: Column) -> bool:
    return isinstance(col, pa.Array | pa.ChunkedArray)


def is_strings(col: Column) -> bool:
    """A string column: an arrow string array or a numpy ``object`` array."""
    if is_arrow(col):
        return pa.types.is_string(col.type) or pa.types.is_large_string(col.type)
    return isinstance(col, np.ndarray) and col.dtype == object


def as_arrow_strings(col: Column) -> pa.Array:
    """A string column as one arrow string array (objects are converted; non-strings via ``str``)."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if isinstance(col, pa.Array):
        return col
    values = col.tolist() if hasattr(col, "tolist") else list(col)
    try:
        return pa.array(values, type=pa.string())
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return pa.array([v if isinstance(v, str) else str(v) for v in values], type=pa.string())


def materialize(col: Column) -> Column:
    """Plain values of a column (a :class:`Gathered` column is looked up; others are returned as they are)."""
    return col.materialize() if isinstance(col, Gathered) else col


def to_pylist(values: Any) -> list[Any]:
    if is_arrow(values):
        return values.to_pylist()
    return values.tolist() if hasattr(values, "tolist") else list(values)


def to_numpy(col: Column) -> np.ndarray:
    """A flat column as numpy (arrow strings become ``object`` arrays)."""
    col = materialize(col)
    if is_arrow(col):
        return col.to_numpy(zero_copy_only=False)
    if isinstance(col, torch.Tensor):
        return col.detach().cpu().numpy()
    return np.asarray(col)


def take_rows(col: Column, index: np.ndarray) -> Column:
    """Rows ``index`` of a column (numpy, arrow, torch or ragged)."""
    if isinstance(col, Gathered):
        return Gathered(col.entity, np.asarray(col.index)[index])
    if isinstance(col, Ragged):
        off = np.asarray(col.offsets)
        starts = off[:-1][index]
        lengths = off[1:][index] - starts
        new_off = np.zeros(len(index) + 1, dtype=np.int64)
        np.cumsum(lengths, out=new_off[1:])
        total = int(new_off[-1])
        flat = np.arange(total, dtype=np.int64) + np.repeat(starts - new_off[:-1], lengths)
        return Ragged(take_rows(col.values, flat), new_off)
    if is_arrow(col):
        return col.take(pa.array(index))
    if isinstance(col, torch.Tensor):
        return col[torch.as_tensor(index, device=col.device)]
    return np.take(col, index, axis=0)


def to_device(col: Column, device: torch.device) -> Column:
    """Move a column to ``device`` (numpy on cpu when ``device`` is cpu; string columns stay on the CPU)."""
    if isinstance(col, Gathered):
        return col if device.type == "cpu" else to_device(col.materialize(), device)
    if isinstance(col, Ragged):
        return Ragged(to_device(col.values, device), to_device(col.offsets, device))
    if device.type == "cpu":
        return col.cpu().numpy() if isinstance(col, torch.Tensor) else col
    if is_strings(col):
        return col
    if isinstance(col, np.ndarray):
        return as_tensor(col).to(device, non_blocking=True)
    return col.to(device, non_blocking=True)


def as_tensor(col: np.ndarray) -> torch.Tensor:
    """A numpy column as a CPU tensor sharing its memory (copied when read-only, e.g. an arrow buffer)."""
    col = np.ascontiguousarray(col)
    return torch.from_numpy(col if col.flags.writeable else col.copy())


def column_nbytes(col: Column) -> int:
    if isinstance(col, Gathered):
        return int(col.index.nbytes)
    if isinstance(col, Ragged):
        return column_nbytes(col.values) + column_nbytes(col.offsets)
    if isinstance(col, torch.Tensor):
        return col.numel() * col.element_size()
    return int(col.nbytes)


def select_rows(col: Column, mask: np.ndarray) -> Column:
    """Rows where ``mask`` is true (numpy, arrow, torch, ragged or gathered)."""
    if isinstance(col, Gathered):
        return Gathered(col.entity, col.index[mask])
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
        return Ragged(select_rows(col.values, vmask), offsets)
    if is_arrow(col):
        return col.filter(pa.array(mask, type=pa.bool_()))
    if isinstance(col, torch.Tensor):
        return col[torch.as_tensor(mask, device=col.device)]
    return col[mask]


def copy_out(col: Column) -> Column:
    """Copy a numpy column out of the arena (before it crosses to another device asynchronously)."""
    if isinstance(col, Gathered):
        return col.materialize()
    if isinstance(col, Ragged):
        return Ragged(copy_out(col.values), np.array(col.offsets))
    if is_arrow(col):
        return col  # immutable, never arena memory
    return np.array(col)


def string_lengths(col: pa.Array) -> np.ndarray:
    """UTF-8 byte length of every value of an arrow string array."""
    return np.asarray(pc.binary_length(col).fill_null(0), dtype=np.int64)
