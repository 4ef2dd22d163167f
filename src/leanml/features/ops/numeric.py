"""Numeric ops: ``bucketize``, ``normalize``, ``log``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from leanml.errors import LeanmlError
from leanml.features.ops.base import MapOp, OpContext, register_op
from leanml.features.ops.columns import Column


@register_op
@dataclass(kw_only=True)
class Bucketize(MapOp):
    """Bucket id of a numeric field: ``i`` such that ``boundaries[i-1] <= x < boundaries[i]`` (0..len)."""

    kind: ClassVar[str] = "bucketize"
    boundaries: list[float]

    def __post_init__(self) -> None:
        b = list(self.boundaries)
        if not b or any(y <= x for x, y in zip(b, b[1:])):
            raise LeanmlError(f"bucketize {self.output}: boundaries must be a non-empty increasing list")
        super().__post_init__()

    def cardinality(self, output: str) -> int | None:
        return len(self.boundaries) + 1

    def forward(self, cols: list[Column], ctx: OpContext) -> list[Column]:
        (col,) = cols
        out = ctx.alloc(len(col), np.int64)
        out[:] = np.searchsorted(np.asarray(self.boundaries, dtype=np.float64), col, side="right")
        return [out]

    def forward_torch(self, cols: list[Column], ctx: OpContext) -> list[Column]:
        (col,) = cols
        b = torch.tensor(self.boundaries, dtype=torch.float64, device=col.device)
        return [torch.bucketize(col.to(torch.float64), b, right=True)]


@register_op
@dataclass(kw_only=True)
class Normalize(MapOp):
    """``(x - mean) / std`` as float32, optionally clipped to ``[-clip, clip]``."""

    kind: ClassVar[str] = "normalize"
    mean: float = 0.0
    std: float = 1.0
    clip: float | None = None

    def __post_init__(self) -> None:
        if not self.std > 0:
            raise LeanmlError(f"normalize {self.output}: std must be > 0")
        super().__post_init__()

    def forward(self, cols: list[Column], ctx: OpContext) -> list[Column]:
        (col,) = cols
        out = ctx.alloc(len(col), np.float32)
        np.subtract(col, self.mean, out=out, casting="unsafe")
        np.divide(out, np.float32(self.std), out=out)
        if self.clip is not None:
            np.clip(out, -self.clip, self.clip, out=out)
        return [out]

    def forward_torch(self, cols: list[Column], ctx: OpContext) -> list[Column]:
        (col,) = cols
        out = (col.to(torch.float32) - np.float32(self.mean)) / np.float32(self.std)
        return [out.clamp(-self.clip, self.clip) if self.clip is not None else out]


@register_op
@dataclass(kw_only=True)
class LogTransform(MapOp):
    """``log1p(max(x, 0))`` as float32 (counts, prices, dwell times)."""

    kind: ClassVar[str] = "log"

    def forward(self, cols: list[Column], ctx: OpContext) -> list[Column]:
        (col,) = cols
        out = ctx.alloc(len(col), np.float32)
        np.maximum(col, 0, out=out, casting="unsafe")
        np.log1p(out, out=out)
        return [out]

    def forward_torch(self, cols: list[Column], ctx: OpContext) -> list[Column]:
        (col,) = cols
        return [torch.log1p(col.to(torch.float32).clamp_min(0))]
