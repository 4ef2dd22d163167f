"""List-column ops: ``truncate_pad`` a ragged list into a dense matrix."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from leanml.features.columns import Column, Ragged
from leanml.features.ops.base import Op, OpContext, register_op
from leanml.utils import LeanmlError


@register_op
@dataclass(kw_only=True)
class TruncatePad(Op):
    """A list column to a dense ``[n, max_len]`` int64 matrix: keep the ``first`` or ``last`` ``max_len``
    items, pad the rest with ``pad``."""

    kind: ClassVar[str] = "truncate_pad"
    has_torch: ClassVar[bool] = True
    input: str
    output: str
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
        off = np.asarray(col.offsets)
        lengths = np.minimum(np.diff(off), L)
        starts = off[:-1] if self.keep == "first" else off[1:] - lengths
        pos = np.arange(L, dtype=np.int64)
        out = ctx.alloc((n, L), np.int64)
        out.fill(self.pad)
        mask = pos[None, :] < lengths[:, None]
        if len(col.values):
            idx = starts[:, None] + pos[None, :]
            out[mask] = np.asarray(col.values)[idx[mask]]
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
