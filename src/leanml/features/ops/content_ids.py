"""``content_ids``: an ad's visual content IDs from the table the visual-IDs system exports."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from leanml.features.columns import Column
from leanml.features.ops.base import Op, OpContext, register_op
from leanml.utils import LeanmlError


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
