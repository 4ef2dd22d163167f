"""Hashing ops: ``hash`` one field and ``cross`` several into 63-bit feature signs (bit-identical on
numpy and torch, see :mod:`leanml.features.ops.hashing`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from leanml.errors import LeanmlError
from leanml.features.ops import hashing as H
from leanml.features.ops.base import MapOp, Op, OpContext, default_seed, register_op
from leanml.features.ops.columns import Column, Gathered, Ragged, copy_out, to_device


@register_op
@dataclass(kw_only=True)
class Hash(MapOp):
    """Hash a field (int or str; flat or list) to 64-bit feature signs, masked to 63 bits, mod ``buckets``."""

    kind: ClassVar[str] = "hash"
    buckets: int | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.buckets is not None and self.buckets < 1:
            raise LeanmlError(f"hash {self.output}: buckets must be >= 1")
        super().__post_init__()

    @property
    def seed_value(self) -> int:
        return self.seed if self.seed is not None else default_seed(self.output)

    def cardinality(self, output: str) -> int | None:
        return self.buckets

    def _hash_np(self, values: np.ndarray, ctx: OpContext) -> np.ndarray:
        out = ctx.alloc(len(values), np.int64)
        tmp = ctx.alloc(len(values), np.uint64)
        h = H.hash_values(values, self.seed_value, out=out.view(np.uint64), tmp=tmp)
        return H.to_sign(h, self.buckets, out=out)

    def forward(self, cols: list[Column], ctx: OpContext) -> list[Column]:
        (col,) = cols
        if isinstance(col, Ragged):
            return [Ragged(self._hash_np(col.values, ctx), col.offsets)]
        return [self._hash_np(col, ctx)]

    def forward_torch(self, cols: list[Column], ctx: OpContext) -> list[Column]:
        (col,) = cols
        values = col.values if isinstance(col, Ragged) else col
        if not isinstance(values, torch.Tensor):  # strings: hash on the CPU, ship the ids
            ctx.counters[f"{self.name}:cpu_fallback"] += 1
            out = self.forward([to_device(col, torch.device("cpu"))], ctx)[0]
            return [to_device(copy_out(out), ctx.device)]
        h = H.to_sign_torch(H.hash_ints_torch(values, self.seed_value), self.buckets)
        return [Ragged(h, col.offsets) if isinstance(col, Ragged) else h]


@register_op
@dataclass(kw_only=True)
class Cross(Op):
    """Cross feature: hash-combine two or more fields (ints or strings) into one sign."""

    kind: ClassVar[str] = "cross"
    has_torch: ClassVar[bool] = True
    accepts_gathered: ClassVar[bool] = True
    inputs_: list[str] = field(default_factory=list, metadata={"yaml": "inputs"})
    output: str
    buckets: int | None = None
    seed: int | None = None

    def __init__(self, *, inputs: list[str], output: str, buckets: int | None = None, seed: int | None = None,
                 name: str = "", placement: str = "") -> None:
        self.inputs_ = list(inputs)
        self.output, self.buckets, self.seed, self.name, self.placement = output, buckets, seed, name, placement
        if len(self.inputs_) < 2:
            raise LeanmlError(f"cross {output}: needs at least two inputs (got {self.inputs_})")
        if buckets is not None and buckets < 1:
            raise LeanmlError(f"cross {output}: buckets must be >= 1")
        self.__post_init__()

    @property
    def inputs(self) -> list[str]:
        return self.inputs_

    @property
    def outputs(self) -> list[str]:
        return [self.output]

    @property
    def seed_value(self) -> int:
        return self.seed if self.seed is not None else default_seed(self.output)

    def cardinality(self, output: str) -> int | None:
        return self.buckets

    def spec(self) -> dict[str, Any]:
        d = super().spec()
        d["inputs"] = d.pop("inputs_")
        return d

    def forward(self, cols: list[Column], ctx: OpContext) -> list[Column]:
        n = len(cols[0])
        acc = ctx.alloc(n, np.uint64)
        tmp = ctx.alloc(n, np.uint64)
        h = ctx.alloc(n, np.uint64)
        acc[:] = H.seed_key(self.seed_value)
        for col in cols:
            if isinstance(col, Gathered):  # a field of a joined table: hashed once per entity, gathered per row
                np.take(col.entity.derived("hash0", lambda v: H.hash_values(v, 0)), col.index, out=h)
            else:
                H.hash_values(col, 0, out=h, tmp=tmp)
            H.combine(acc, h, tmp=tmp)
        out = acc.view(np.int64)
        return [H.to_sign(acc, self.buckets, out=out)]

    def forward_torch(self, cols: list[Column], ctx: OpContext) -> list[Column]:
        if any(not isinstance(c, torch.Tensor) for c in cols):  # strings or gathered fields
            ctx.counters[f"{self.name}:cpu_fallback"] += 1
            out = self.forward([to_device(c, torch.device("cpu")) for c in cols], ctx)[0]
            return [to_device(np.array(out), ctx.device)]
        return [H.to_sign_torch(H.cross_ints_torch(list(cols), self.seed_value), self.buckets)]
