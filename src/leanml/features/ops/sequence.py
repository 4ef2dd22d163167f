"""List-column ops: ``truncate_pad`` a ragged list into a dense matrix."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from leanml.errors import LeanmlError
from leanml.features.ops.base import MapOp, OpContext, register_op
from leanml.features.ops.columns import Column, Ragged


@register_op
@dataclass(kw_only=True)
class TruncatePad(MapOp):
    """A list column to a dense ``[n, max_len]`` int64 matrix: keep the ``first`` or ``last`` ``max_len``
    items, pad the rest with ``pad``."""

    kind: ClassVar[str] = "truncate_pad"
    max_len: int
    pad: int = -1
    keep: str = "first"

    def __post_init__(self) -> None:
        if self.max_len < 1:
            raise LeanmlError(f"truncate_pad {self.output}: max_len must be >= 1")
        if self.keep not in ("first", "last"):
            raise LeanmlError(f"truncate_pad {self.output}: keep must be first or last")
        super().__post_init__()

    def forward(self, cols: list[Column], ctx: OpContext) -> list[Column]:
        (col,) = cols
        if not isinstance(col, Ragged):
            raise LeanmlError(f"truncate_pad {self.output}: input {self.input!r} is not a list column; split it first")
        n, L = len(col), self.max_len
        off = np.asarray(col.offsets, dtype=np.int64)
        values = np.asarray(col.values)
        out = ctx.alloc((n, L), np.int64)
        out.fill(self.pad)
        if len(values):
            # work per list item (not per output cell): item j of row r lands at r * L + (j - first kept item of r)
            lengths = np.diff(off)
            row = np.repeat(np.arange(n, dtype=np.int64), lengths)
            first = off[:-1] if self.keep == "first" else np.maximum(off[1:] - L, off[:-1])
            pos = np.arange(len(values), dtype=np.int64) - first[row]
            kept = (pos >= 0) & (pos < L)
            flat = out.reshape(-1)
            flat[row[kept] * L + pos[kept]] = values[kept]
        return [out]

    def forward_torch(self, cols: list[Column], ctx: OpContext) -> list[Column]:
        (col,) = cols
        off = col.offsets
        lengths = torch.clamp(off[1:] - off[:-1], max=self.max_len)
        starts = off[:-1] if self.keep == "first" else off[1:] - lengths
        pos = torch.arange(self.max_len, device=off.device)
        mask = pos[None, :] < lengths[:, None]
        out = torch.full((len(lengths), self.max_len), self.pad, dtype=torch.int64, device=off.device)
        if col.values.numel():
            idx = (starts[:, None] + pos[None, :]).clamp(max=col.values.numel() - 1)
            out = torch.where(mask, col.values[idx], out)
        return [out]
