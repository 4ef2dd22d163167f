"""Table ops: ``dict_join`` looks columns of a user/item table up by key."""

from __future__ import annotations

import gzip
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa

from leanml.errors import LeanmlError
from leanml.features.ops.base import Op, OpContext, register_op
from leanml.features.ops.columns import Column, take_rows

_TABLES: dict[tuple[str, float], Any] = {}
_PREPARED: dict[tuple[str, float, str], Any] = {}  # per process; forked workers inherit what the parent built
_TABLES_LOCK = threading.Lock()
TEXT_BYTES_FACTOR = 3.0  # in-memory bytes per byte of a text table (pandas strings and indexes), measured ~2-3
DENSE_KEYS = 1 << 22  # integer keys spanning at most max(this, 4 x rows) ids get a direct lookup array


def memory_available() -> int:
    """Bytes this process can still allocate: ``MemAvailable``, capped by the cgroup memory limit."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    for limit_f, usage_f in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                             ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                              "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = Path(limit_f).read_text().strip()
            if limit != "max" and int(limit) < 1 << 60:
                left = int(limit) - int(Path(usage_f).read_text().strip())
                avail = left if avail is None else min(avail, left)
        except (OSError, ValueError):
            continue
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            avail = 1 << 62
    return max(int(avail), 0)


def table_memory_estimate(path: Path) -> int:
    """Rough in-memory bytes of a table once loaded (text: 3 x its uncompressed size; Parquet: 2 x uncompressed)."""
    name = path.name.lower()
    if name.endswith(".parquet"):
        import pyarrow.parquet as pq

        md = pq.ParquetFile(path).metadata
        return 2 * sum(md.row_group(i).total_byte_size for i in range(md.num_row_groups))
    size = path.stat().st_size
    if name.endswith(".gz"):
        with open(path, "rb") as fh:  # gzip trailer: uncompressed size mod 2**32
            fh.seek(-4, os.SEEK_END)
            size = max(size, int.from_bytes(fh.read(4), "little"))
    return int(size * TEXT_BYTES_FACTOR)


def load_table(path: Path) -> Any:
    """A user/item table as a DataFrame (JSON lines, TSV with header, CSV or Parquet), cached per process.

    Joins hold their tables in memory; a table that would not fit raises :class:`LeanmlError` before
    anything is read (and so does running out of memory while reading it).
    """
    import pandas as pd

    key = (str(path), path.stat().st_mtime)
    with _TABLES_LOCK:
        if key in _TABLES:
            return _TABLES[key]
    name = path.name.lower().removesuffix(".gz")
    if not name.endswith((".jsonl", ".json", ".ndjson", ".parquet", ".tsv", ".csv")):
        raise LeanmlError(f"table {path}: use .jsonl, .tsv, .csv or .parquet")
    need, avail = table_memory_estimate(path), memory_available()
    too_big = (f"table {path} needs about {need / 2**30:.2f} GiB in memory but only {avail / 2**30:.2f} GiB are "
               "available; joins hold their table in memory, so shrink it (fewer columns or rows) or free memory")
    if need > avail:
        raise LeanmlError(too_big)
    try:
        if name.endswith((".jsonl", ".json", ".ndjson")):
            df = _read_jsonl(path)
        elif name.endswith(".parquet"):
            df = pd.read_parquet(path)
        elif name.endswith(".tsv"):
            df = pd.read_csv(path, sep="\t", keep_default_na=False)
        else:
            df = pd.read_csv(path, keep_default_na=False)
    except MemoryError as exc:
        raise LeanmlError(too_big) from exc
    with _TABLES_LOCK:
        _TABLES[key] = df
    return df


def _read_jsonl(path: Path) -> Any:
    """JSON lines through arrow's native reader (about 3x pandas); pandas when arrow cannot type a column."""
    import pandas as pd
    import pyarrow.json as pj

    try:
        with (gzip.open(path, "rb") if path.name.lower().endswith(".gz") else open(path, "rb")) as fh:
            return pj.read_json(fh).to_pandas()
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        return pd.read_json(path, lines=True, dtype=False)


class KeyIndex:
    """Key -> table row, for a unique key column: a direct lookup array for compact integer keys,
    a hash index otherwise. Keys absent from the table map to ``len(keys)`` (the default row)."""

    def __init__(self, keys: np.ndarray) -> None:
        self.keys = keys
        self.m = len(keys)
        self.lut: np.ndarray | None = None
        self._index: Any = None
        if keys.dtype.kind in "iu" and self.m:
            self.lo, self.hi = int(keys.min()), int(keys.max())
            if self.hi - self.lo < max(DENSE_KEYS, 4 * self.m):
                self.lut = np.full(self.hi - self.lo + 1, self.m, dtype=np.int64)
                self.lut[keys.astype(np.int64) - self.lo] = np.arange(self.m, dtype=np.int64)

    def positions(self, keys: Any) -> np.ndarray:
        if self.lut is not None and isinstance(keys, np.ndarray) and keys.dtype.kind in "iu":
            k = keys.astype(np.int64, copy=False)
            inside = (k >= self.lo) & (k <= self.hi)
            pos = self.lut[np.where(inside, k - self.lo, 0)]
            pos[~inside] = self.m
            return pos
        if self._index is None:
            import pandas as pd

            self._index = pd.Index(self.keys)
        vals = keys.to_numpy(zero_copy_only=False) if isinstance(keys, pa.Array | pa.ChunkedArray) else keys
        pos = self._index.get_indexer(vals)
        return np.where(pos < 0, self.m, pos).astype(np.int64)


@register_op
@dataclass(kw_only=True)
class DictJoin(Op):
    """Look up columns of a user/item table by key (an in-memory index; CPU).

    ``columns`` maps table column -> output column; rows without a match get ``defaults`` (0 / "" /
    NaN by type) and, when ``found`` is set, a 0 in that 0/1 output column. The outputs are entity
    columns: ops that only read them run once per table row (see :mod:`leanml.features.run.scheduler`).
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

    def prepare(self, ctx: OpContext) -> tuple[KeyIndex, dict[str, Any]]:
        """The key index and the entity columns (output name -> one row per table row + a default row)."""
        path = ctx.resolve_table(self.table)
        cache_key = (str(path), path.stat().st_mtime)
        if self._index is not None and self._index[0] == cache_key:
            return self._index[1]
        import json

        import pandas as pd

        spec_key = (*cache_key, json.dumps(self.spec(), sort_keys=True, default=str))
        with _TABLES_LOCK:
            hit = _PREPARED.get(spec_key)
        if hit is not None:
            self._index = (cache_key, hit)
            return hit

        df = load_table(path)
        missing = [c for c in [self.key, *self.columns] if c not in df.columns]
        if missing:
            raise LeanmlError(f"table {path} lacks columns {missing}; it has {list(df.columns)}")
        keys = df[self.key]
        if keys.duplicated().any():
            raise LeanmlError(f"table {path}: key column {self.key!r} has duplicates; a join key must be unique")
        index = KeyIndex(keys.to_numpy())
        cols: dict[str, Any] = {}
        for c, out in self.columns.items():
            s = df[c]
            if pd.api.types.is_integer_dtype(s.dtype):
                cols[out] = np.append(s.to_numpy(np.int64), np.int64(self.defaults.get(c, 0)))
            elif pd.api.types.is_float_dtype(s.dtype):
                cols[out] = np.append(s.to_numpy(np.float64), np.float64(self.defaults.get(c, np.nan)))
            else:
                strs = ["" if v is None or v is pd.NA or (isinstance(v, float) and np.isnan(v)) else
                        (v if isinstance(v, str) else "|".join(map(str, v)) if isinstance(v, list | tuple | np.ndarray)
                         else str(v))
                        for v in s.tolist()]
                cols[out] = pa.array([*strs, str(self.defaults.get(c, ""))], type=pa.string())
        if self.found:
            cols[self.found] = np.append(np.ones(len(df), dtype=np.int64), np.int64(0))
        prepared = (index, cols)
        self._index = (cache_key, prepared)
        with _TABLES_LOCK:
            _PREPARED[spec_key] = prepared
        return prepared

    def positions(self, keys: Column, ctx: OpContext) -> np.ndarray:
        """Table row of every key (``len(table)``, the default row, for keys not in the table); counts misses."""
        index, _ = self.prepare(ctx)
        pos = index.positions(keys)
        ctx.counters[f"{self.name}:misses"] += int((pos == index.m).sum())
        return pos

    def forward(self, cols: list[Column], ctx: OpContext) -> list[Column]:
        (keys,) = cols
        _, table = self.prepare(ctx)
        pos = self.positions(keys, ctx)
        outs = []
        for out in self.outputs:
            arr = table[out]
            if isinstance(arr, np.ndarray):
                o = ctx.alloc(len(pos), arr.dtype)
                np.take(arr, pos, out=o)
                outs.append(o)
            else:
                outs.append(take_rows(arr, pos))
        return outs
