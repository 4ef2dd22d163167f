"""Table ops: ``dict_join`` looks columns of a user/item table up by key."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from leanml.features.columns import Column
from leanml.features.ops.base import Op, OpContext, register_op
from leanml.utils import LeanmlError

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
