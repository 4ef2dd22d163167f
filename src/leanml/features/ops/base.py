"""The operator base class, its context (arena, device, counters, tables) and the registry of op kinds."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from leanml.config import ConfigError
from leanml.errors import LeanmlError
from leanml.features.ops import hashing as H
from leanml.features.ops.columns import Column
from leanml.features.run.arena import Arena, NoArena


@dataclass
class OpContext:
    """What an op may use besides its inputs: the arena, the target device, counters, table locations."""

    arena: Arena | NoArena = field(default_factory=NoArena)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    counters: Counter = field(default_factory=Counter)
    tables: dict[str, str] = field(default_factory=dict)
    data_dir: Path | None = None

    def alloc(self, shape: int | tuple[int, ...], dtype: Any) -> np.ndarray:
        return self.arena.alloc(shape, dtype)

    def resolve_table(self, table: str) -> Path:
        path = Path(self.tables.get(table, table))
        if not path.is_absolute() and self.data_dir is not None:
            path = self.data_dir / path
        if not path.exists():
            raise ConfigError(f"table {table!r} not found at {path}; override its path ({table}=PATH) or set "
                              "data_dir", None, ("data_dir",))
        return path


# ----------------------------------------------------------------------------------------------- base
OPS: dict[str, type[Op]] = {}


def register_op(cls: type[Op]) -> type[Op]:
    OPS[cls.kind] = cls
    return cls


@dataclass(kw_only=True)
class Op:
    """Base of all operators. Subclasses set ``kind`` and implement :meth:`forward` (numpy).

    ``rowwise``: output row i depends only on input row i (every bundled op). The scheduler then
    computes an op whose inputs all come from one joined table once per entity of that table, when
    the table is loaded, and gathers the results per log row. ``accepts_gathered``: :meth:`forward`
    takes :class:`~leanml.features.ops.columns.Gathered` inputs as they are (otherwise the scheduler
    materialises them first).
    """

    kind: ClassVar[str] = ""
    has_torch: ClassVar[bool] = False
    is_filter: ClassVar[bool] = False
    rowwise: ClassVar[bool] = True
    accepts_gathered: ClassVar[bool] = False
    default_placement: ClassVar[str] = "cpu"
    name: str = ""
    placement: str = ""

    def __post_init__(self) -> None:
        if not self.placement:
            self.placement = self.default_placement
        if self.placement not in ("cpu", "gpu"):
            raise LeanmlError(f"op {self.name or self.kind}: placement {self.placement!r} must be cpu or gpu")
        if self.placement == "gpu" and not self.has_torch:
            raise LeanmlError(f"op {self.name or self.kind} ({self.kind}) has no GPU implementation; "
                              "use placement: cpu")
        if not self.name:
            self.name = self.outputs[0]

    @property
    def inputs(self) -> list[str]:
        """Input column names; by default the op's single ``input`` field."""
        return [self.input]

    @property
    def outputs(self) -> list[str]:
        """Output column names; by default the op's single ``output`` field."""
        return [self.output]

    def forward(self, cols: list[Column], ctx: OpContext) -> list[Column]:
        """numpy implementation: input columns in ``inputs`` order -> output columns in ``outputs`` order."""
        raise NotImplementedError

    def forward_torch(self, cols: list[Column], ctx: OpContext) -> list[Column]:
        """torch implementation (on ``ctx.device``); only when ``has_torch``."""
        raise NotImplementedError

    def cardinality(self, output: str) -> int | None:
        """Number of distinct ids an output can take (for embedding tables), when it is categorical."""
        return None

    def spec(self) -> dict[str, Any]:
        """The YAML/dict form of this op."""
        d: dict[str, Any] = {"op": self.kind}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "placement" and v == self.default_placement:
                continue
            if f.name == "name" and v == self.outputs[0]:
                continue
            if v is None or v == {} or v == []:
                continue
            d[f.name] = v
        return d


@dataclass(kw_only=True)
class MapOp(Op):
    """An op from one input column to one output column (most bundled ops), computable on the GPU too."""

    has_torch: ClassVar[bool] = True
    input: str
    output: str


def op_from_spec(spec: dict[str, Any]) -> Op:
    """Build an op from its dict form ``{"op": "hash", "input": ..., "output": ...}``."""
    if not isinstance(spec, dict) or "op" not in spec:
        raise LeanmlError(f"each op must be a mapping with an 'op' key (got {spec!r})")
    kind = spec["op"]
    if kind not in OPS:
        raise LeanmlError(f"unknown op {kind!r}; known ops: {', '.join(sorted(OPS))}")
    cls = OPS[kind]
    params = {k: v for k, v in spec.items() if k != "op"}
    allowed = {f.name.rstrip("_") for f in fields(cls) if not f.name.startswith("_")}
    unknown = set(params) - allowed
    if unknown:
        raise LeanmlError(f"op {kind}: unknown keys {sorted(unknown)}; allowed: {sorted(allowed)}")
    try:
        return cls(**params)
    except TypeError as exc:
        raise LeanmlError(f"op {kind}: {exc}; allowed keys: {sorted(allowed)}") from exc


def default_seed(name: str) -> int:
    return H.ref_fnv1a(name.encode()) & 0xFFFFFFFF


def describe_ops() -> str:
    """One line per op kind (for ``--help``)."""
    return "\n".join(f"  {k:13s} {(OPS[k].__doc__ or '').strip().splitlines()[0]}" for k in sorted(OPS))


def dumps_spec(op: Op) -> str:
    return json.dumps(op.spec())
