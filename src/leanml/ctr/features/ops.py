"""Feature operators: small, uniform, each with a numpy (CPU) implementation and, where the work is
arithmetic, a torch implementation that runs on ``cuda`` when the scheduler places it there.

Every op declares ``inputs``, ``outputs`` and ``placement`` (``cpu`` or ``gpu``; ``gpu`` means "torch
on CUDA when present, else the CPU path"). Columns are 1-D numpy arrays (ints, floats or objects for
strings), 1-D/2-D torch tensors, or :class:`Ragged` lists (flat values plus row offsets).
Ops write their outputs into the per-batch :class:`~leanml.ctr.features.arena.Arena` where the size
is known, so intermediates reuse one buffer batch after batch.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from leanml.ctr.features import hashing as H
from leanml.ctr.features.arena import Arena, NoArena
from leanml.utils import LeanmlError


# --------------------------------------------------------------------------------------------- columns
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


# ------------------------------------------------------------------------------------------ op context
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
            raise LeanmlError(f"table {table!r} not found at {path}; pass --table {table}=PATH or --data-dir")
        return path


# ----------------------------------------------------------------------------------------------- base
OPS: dict[str, type[Op]] = {}


def register_op(cls: type[Op]) -> type[Op]:
    OPS[cls.kind] = cls
    return cls


@dataclass(kw_only=True)
class Op:
    """Base of all operators. Subclasses set ``kind`` and implement :meth:`forward` (numpy)."""

    kind: ClassVar[str] = ""
    has_torch: ClassVar[bool] = False
    is_filter: ClassVar[bool] = False
    default_placement: ClassVar[str] = "cpu"
    name: str = ""
    placement: str = ""

    def __post_init__(self) -> None:
        if not self.placement:
            self.placement = self.default_placement
        if self.placement not in ("cpu", "gpu"):
            raise LeanmlError(f"op {self.name or self.kind}: placement {self.placement!r} must be cpu or gpu")
        if self.placement == "gpu" and not self.has_torch:
            raise LeanmlError(f"op {self.name or self.kind} ({self.kind}) has no GPU implementation; use placement: cpu")
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


def _default_seed(name: str) -> int:
    return H.ref_fnv1a(name.encode()) & 0xFFFFFFFF


# ------------------------------------------------------------------------------------------------ ops
@register_op
@dataclass(kw_only=True)
class Split(Op):
    """Split a delimited string field into a list (``"3|17|5"`` -> ``[3, 17, 5]``). Empty string -> ``[]``.

    ``dtype: int`` parses items as integers; items that do not parse are dropped and counted.
    """

    kind: ClassVar[str] = "split"
    input: str
    output: str
    sep: str = "|"
    dtype: str = "str"

    def __post_init__(self) -> None:
        if self.dtype not in ("str", "int"):
            raise LeanmlError(f"split {self.output}: dtype must be str or int")
        if not self.sep:
            raise LeanmlError(f"split {self.output}: sep must be a non-empty string")
        super().__post_init__()

    def forward(self, cols: list[Column], ctx: OpContext) -> list[Column]:
        (col,) = cols
        sep = self.sep
        strs = [s if isinstance(s, str) else str(s) for s in col.tolist()]
        n = len(strs)
        lengths = ctx.alloc(n, np.int64)
        lengths[:] = np.fromiter((s.count(sep) + 1 if s else 0 for s in strs), dtype=np.int64, count=n)
        offsets = ctx.alloc(n + 1, np.int64)
        offsets[0] = 0
        np.cumsum(lengths, out=offsets[1:])
        joined = sep.join(s for s in strs if s)
        if self.dtype == "str":
            flat = joined.split(sep) if joined else []
            values = np.empty(len(flat), dtype=object)
            values[:] = flat
            return [Ragged(values, offsets)]
        values = _parse_ints(joined, sep, int(offsets[-1]))
        if values is None:
            flat = joined.split(sep) if joined else []
            good_rows, ok_items = [], []
            for i in range(n):
                items = flat[offsets[i] : offsets[i + 1]]
                kept = [int(x) for x in items if _is_int(x)]
                ctx.counters[f"{self.name}:bad_items"] += len(items) - len(kept)
                good_rows.append(len(kept))
                ok_items.extend(kept)
            lengths[:] = good_rows
            np.cumsum(lengths, out=offsets[1:])
            values = np.array(ok_items, dtype=np.int64)
        return [Ragged(values, offsets)]


_I64 = np.iinfo(np.int64)


def _parse_ints(joined: str, sep: str, expected: int) -> np.ndarray | None:
    """Fast C parse of ``sep``-joined integers; None when anything is off (the caller then goes item by item)."""
    if expected == 0:
        return np.empty(0, dtype=np.int64)
    if any(w in joined for w in (" ", "\t", "\n", "\r")):
        return None
    try:
        values = np.fromstring(joined.replace(sep, " "), dtype=np.int64, sep=" ")
    except ValueError:
        return None
    if len(values) != expected or (values == _I64.max).any() or (values == _I64.min).any():
        return None
    return values


def _is_int(s: str) -> bool:
    try:
        return -(2**63) <= int(s) < 2**63
    except ValueError:
        return False


@register_op
@dataclass(kw_only=True)
class Hash(Op):
    """Hash a field (int or str; flat or list) to 64-bit feature signs, masked to 63 bits, mod ``buckets``."""

    kind: ClassVar[str] = "hash"
    has_torch: ClassVar[bool] = True
    input: str
    output: str
    buckets: int | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.buckets is not None and self.buckets < 1:
            raise LeanmlError(f"hash {self.output}: buckets must be >= 1")
        super().__post_init__()

    @property
    def seed_value(self) -> int:
        return self.seed if self.seed is not None else _default_seed(self.output)

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
            return [to_device(_copy_out(out), ctx.device)]
        h = H.to_sign_torch(H.hash_ints_torch(values, self.seed_value), self.buckets)
        return [Ragged(h, col.offsets) if isinstance(col, Ragged) else h]


def _copy_out(col: Column) -> Column:
    """Copy a numpy column out of the arena (before it crosses to another device asynchronously)."""
    if isinstance(col, Ragged):
        return Ragged(np.array(col.values), np.array(col.offsets))
    return np.array(col)


@register_op
@dataclass(kw_only=True)
class Cross(Op):
    """Cross feature: hash-combine two or more fields (ints or strings) into one sign."""

    kind: ClassVar[str] = "cross"
    has_torch: ClassVar[bool] = True
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
        return self.seed if self.seed is not None else _default_seed(self.output)

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
            H.hash_values(col, 0, out=h, tmp=tmp)
            H.combine(acc, h, tmp=tmp)
        out = acc.view(np.int64)
        return [H.to_sign(acc, self.buckets, out=out)]

    def forward_torch(self, cols: list[Column], ctx: OpContext) -> list[Column]:
        if any(not isinstance(c, torch.Tensor) for c in cols):
            ctx.counters[f"{self.name}:cpu_fallback"] += 1
            out = self.forward([to_device(c, torch.device("cpu")) for c in cols], ctx)[0]
            return [to_device(np.array(out), ctx.device)]
        return [H.to_sign_torch(H.cross_ints_torch(list(cols), self.seed_value), self.buckets)]


@register_op
@dataclass(kw_only=True)
class Bucketize(Op):
    """Bucket id of a numeric field: ``i`` such that ``boundaries[i-1] <= x < boundaries[i]`` (0..len)."""

    kind: ClassVar[str] = "bucketize"
    has_torch: ClassVar[bool] = True
    input: str
    output: str
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
class Normalize(Op):
    """``(x - mean) / std`` as float32, optionally clipped to ``[-clip, clip]``."""

    kind: ClassVar[str] = "normalize"
    has_torch: ClassVar[bool] = True
    input: str
    output: str
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
class LogTransform(Op):
    """``log1p(max(x, 0))`` as float32 (counts, prices, dwell times)."""

    kind: ClassVar[str] = "log"
    has_torch: ClassVar[bool] = True
    input: str
    output: str

    def forward(self, cols: list[Column], ctx: OpContext) -> list[Column]:
        (col,) = cols
        out = ctx.alloc(len(col), np.float32)
        np.maximum(col, 0, out=out, casting="unsafe")
        np.log1p(out, out=out)
        return [out]

    def forward_torch(self, cols: list[Column], ctx: OpContext) -> list[Column]:
        (col,) = cols
        return [torch.log1p(col.to(torch.float32).clamp_min(0))]


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


# ------------------------------------------------------------------------------------------- tables
_TABLES: dict[tuple[str, float], Any] = {}
_TABLES_LOCK = threading.Lock()


def load_table(path: Path) -> Any:
    """A user/item table as a DataFrame (JSON lines, TSV with header, CSV or Parquet), cached per process."""
    import pandas as pd

    key = (str(path), path.stat().st_mtime)
    with _TABLES_LOCK:
        if key in _TABLES:
            return _TABLES[key]
    name = path.name.lower().removesuffix(".gz")
    if name.endswith((".jsonl", ".json", ".ndjson")):
        df = pd.read_json(path, lines=True, dtype=False)
    elif name.endswith(".parquet"):
        df = pd.read_parquet(path)
    elif name.endswith(".tsv"):
        df = pd.read_csv(path, sep="\t", keep_default_na=False)
    elif name.endswith(".csv"):
        df = pd.read_csv(path, keep_default_na=False)
    else:
        raise LeanmlError(f"table {path}: use .jsonl, .tsv, .csv or .parquet")
    with _TABLES_LOCK:
        _TABLES[key] = df
    return df


@register_op
@dataclass(kw_only=True)
class DictJoin(Op):
    """Look up columns of a user/item table by key (a hash join against an in-memory index; CPU).

    ``columns`` maps table column -> output column; rows without a match get ``defaults`` (0 / "" /
    NaN by type) and, when ``found`` is set, a 0 in that 0/1 output column.
    """

    kind: ClassVar[str] = "dict_join"
    input: str
    table: str
    key: str
    columns: dict[str, str]
    defaults: dict[str, Any] = field(default_factory=dict)
    found: str | None = None
    _index: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.columns:
            raise LeanmlError(f"dict_join on {self.table}: give at least one column to fetch")
        super().__post_init__()

    @property
    def inputs(self) -> list[str]:
        return [self.input]

    @property
    def outputs(self) -> list[str]:
        return list(self.columns.values()) + ([self.found] if self.found else [])

    def spec(self) -> dict[str, Any]:
        d = super().spec()
        d.pop("_index", None)
        return d

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_index"] = None
        return state

    def _prepare(self, ctx: OpContext) -> Any:
        path = ctx.resolve_table(self.table)
        cache_key = (str(path), path.stat().st_mtime)
        if self._index is not None and self._index[0] == cache_key:
            return self._index[1]
        import pandas as pd

        df = load_table(path)
        missing = [c for c in [self.key, *self.columns] if c not in df.columns]
        if missing:
            raise LeanmlError(f"table {path} lacks columns {missing}; it has {list(df.columns)}")
        keys = df[self.key]
        if keys.duplicated().any():
            raise LeanmlError(f"table {path}: key column {self.key!r} has duplicates; a join key must be unique")
        index = pd.Index(keys.to_numpy())
        cols = {}
        for c in self.columns:
            s = df[c]
            if pd.api.types.is_integer_dtype(s.dtype):
                arr, fill = s.to_numpy(np.int64), int(self.defaults.get(c, 0))
            elif pd.api.types.is_float_dtype(s.dtype):
                arr, fill = s.to_numpy(np.float64), float(self.defaults.get(c, np.nan))
            else:
                arr = np.array(["" if v is None or v is pd.NA or (isinstance(v, float) and np.isnan(v)) else
                                (v if isinstance(v, str) else "|".join(map(str, v)) if isinstance(v, list)
                                 else str(v)) for v in s.tolist()], dtype=object)
                fill = str(self.defaults.get(c, ""))
            cols[c] = (np.concatenate([arr, np.array([fill], dtype=arr.dtype)]), fill)
        prepared = (index, cols)
        self._index = (cache_key, prepared)
        return prepared

    def forward(self, cols: list[Column], ctx: OpContext) -> list[Column]:
        (keys,) = cols
        index, table = self._prepare(ctx)
        pos = index.get_indexer(keys)
        miss = pos < 0
        pos[miss] = len(index)  # the default row appended at the end
        outs = []
        for c in self.columns:
            arr, _ = table[c]
            if arr.dtype == object:
                outs.append(arr[pos])
            else:
                out = ctx.alloc(len(pos), arr.dtype)
                np.take(arr, pos, out=out)
                outs.append(out)
        if self.found:
            f = ctx.alloc(len(pos), np.int64)
            np.logical_not(miss, out=f, casting="unsafe")
            outs.append(f)
        ctx.counters[f"{self.name}:misses"] += int(miss.sum())
        return outs


_FILTER_OPS = {
    "==": np.equal, "!=": np.not_equal, "<": np.less, "<=": np.less_equal, ">": np.greater, ">=": np.greater_equal,
}


@register_op
@dataclass(kw_only=True)
class Filter(Op):
    """Keep rows where ``input <cmp> value`` (``cmp`` one of ==, !=, <, <=, >, >=, in, not_in).

    Its output is a boolean mask; the scheduler drops the rows from every column at the end of the level.
    """

    kind: ClassVar[str] = "filter"
    is_filter: ClassVar[bool] = True
    input: str
    output: str
    cmp: str
    value: Any

    def __post_init__(self) -> None:
        if self.cmp not in (*_FILTER_OPS, "in", "not_in"):
            raise LeanmlError(f"filter {self.output}: cmp {self.cmp!r} must be one of {[*_FILTER_OPS, 'in', 'not_in']}")
        if self.cmp in ("in", "not_in") and not isinstance(self.value, list):
            raise LeanmlError(f"filter {self.output}: cmp {self.cmp} needs a list value")
        super().__post_init__()

    def forward(self, cols: list[Column], ctx: OpContext) -> list[Column]:
        (col,) = cols
        if self.cmp in ("in", "not_in"):
            keep = np.isin(col, np.asarray(self.value, dtype=col.dtype if col.dtype != object else object))
            return [keep if self.cmp == "in" else ~keep]
        return [np.asarray(_FILTER_OPS[self.cmp](col, self.value), dtype=bool)]


@register_op
@dataclass(kw_only=True)
class ContentIdLookup(Op):
    """Visual content IDs of an ad from the table exported by the visual-IDs system.

    The Parquet table has columns ``ad_id`` (int64) and ``visual_ids`` (list<int64> of length M) and
    file metadata keys ``M`` and ``K`` (strings). Output: ``[n, M]`` int64 codes in ``[0, K)``; ads not
    in the table get ``K`` in every position (an extra "unknown" id).
    """

    kind: ClassVar[str] = "content_ids"
    input: str
    output: str
    table: str
    k: int | None = None  # the codebook size K, when known up front (checked against the table)
    _state: Any = field(default=None, repr=False, compare=False)

    def spec(self) -> dict[str, Any]:
        d = super().spec()
        d.pop("_state", None)
        return d

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_state"] = None
        return state

    def cardinality(self, output: str) -> int | None:
        if self._state is not None:
            return self._state[1][3] + 1
        return None if self.k is None else self.k + 1

    def load(self, ctx: OpContext) -> tuple[Any, np.ndarray, int, int]:
        path = ctx.resolve_table(self.table)
        key = (str(path), path.stat().st_mtime)
        if self._state is not None and self._state[0] == key:
            return self._state[1]
        state = read_content_id_table(path)
        if self.k is not None and state[3] != self.k:
            raise LeanmlError(f"content-ID table {path} has K={state[3]} but the graph says k: {self.k}; fix one")
        self._state = (key, state)
        return state

    def forward(self, cols: list[Column], ctx: OpContext) -> list[Column]:
        (col,) = cols
        index, codes, m, k = self.load(ctx)
        pos = index.get_indexer(np.asarray(col, dtype=np.int64))
        out = ctx.alloc((len(pos), m), np.int64)
        np.take(codes, np.where(pos < 0, len(codes) - 1, pos), axis=0, out=out)
        ctx.counters[f"{self.name}:misses"] += int((pos < 0).sum())
        return [out]


def read_content_id_table(path: Path) -> tuple[Any, np.ndarray, int, int]:
    """Read and validate a visual-IDs table: ``(index over ad_id, codes [rows+1, M] with a K row, M, K)``."""
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowInvalid) as exc:
        raise LeanmlError(f"content-ID table {path} is not readable Parquet ({exc})") from exc
    meta = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
    fix = "re-export it from the visual-IDs system (columns ad_id int64, visual_ids list<int64>; metadata M, K)"
    for key in ("M", "K"):
        if key not in meta or not meta[key].strip().isdigit():
            raise LeanmlError(f"content-ID table {path}: metadata key {key!r} missing or not an integer; {fix}")
    m, k = int(meta["M"]), int(meta["K"])
    schema = table.schema
    if "ad_id" not in schema.names or not pa.types.is_int64(schema.field("ad_id").type):
        raise LeanmlError(f"content-ID table {path}: needs an int64 column 'ad_id'; {fix}")
    t = schema.field("visual_ids").type if "visual_ids" in schema.names else None
    if t is None or not (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)) \
            or not pa.types.is_int64(t.value_type):
        raise LeanmlError(f"content-ID table {path}: needs a list<int64> column 'visual_ids'; {fix}")
    col = table.column("visual_ids").combine_chunks()
    lengths = np.asarray(col.value_lengths()) if not pa.types.is_fixed_size_list(t) else np.full(len(col), t.list_size)
    if len(col) and (lengths != m).any():
        raise LeanmlError(f"content-ID table {path}: every visual_ids list must have M={m} entries")
    codes = np.asarray(col.flatten(), dtype=np.int64).reshape(len(col), m)
    if codes.size and (codes.min() < 0 or codes.max() >= k):
        raise LeanmlError(f"content-ID table {path}: codes must lie in [0, K={k})")
    codes = np.concatenate([codes, np.full((1, m), k, dtype=np.int64)])
    ids = table.column("ad_id").to_numpy()
    if pd.Index(ids).has_duplicates:
        raise LeanmlError(f"content-ID table {path}: ad_id has duplicates")
    return pd.Index(ids), codes, m, k


def write_content_id_table(path: Path, ad_ids: np.ndarray, codes: np.ndarray, k: int) -> Path:
    """Write a table in the visual-IDs export schema (for tests and examples)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    m = codes.shape[1]
    arr = pa.array([list(map(int, r)) for r in codes], type=pa.list_(pa.int64()))
    table = pa.table({"ad_id": pa.array(np.asarray(ad_ids, dtype=np.int64)), "visual_ids": arr})
    table = table.replace_schema_metadata({"M": str(m), "K": str(k)})
    pq.write_table(table, path)
    return path


def describe_ops() -> str:
    """One line per op kind (for ``--help``)."""
    return "\n".join(f"  {k:13s} {(OPS[k].__doc__ or '').strip().splitlines()[0]}" for k in sorted(OPS))


def dumps_spec(op: Op) -> str:
    return json.dumps(op.spec())
