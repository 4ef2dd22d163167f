"""``content_ids``: an ad's content IDs from the serving table the visual-IDs system exports.

The table format is defined once, in :mod:`leanml.ctr.content_ids.schema` (a light module: NumPy and
pyarrow only), and this op reads it through that module, so a table written by
``leanml ctr content-ids assign`` is exactly what this op expects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from leanml.ctr.content_ids.schema import ContentIdTable, read_table, write_table
from leanml.errors import LeanmlError
from leanml.features.ops.base import Op, OpContext, register_op
from leanml.features.ops.columns import Column


@register_op
@dataclass(kw_only=True)
class ContentIdLookup(Op):
    """Content IDs of an ad from the visual-IDs serving table (schema: ``leanml.ctr.content_ids.schema``).

    Output ``[n, M]`` int64. Codes lie in ``[0, K)``; an ad not in the table gets ``K`` at every position
    (the "unknown" id) and is counted in ``<name>:misses``, or fails naming the ad with
    ``on_missing: error``. With ``offset: true`` position ``m`` is shifted to ``m * (K + 1) + code``, so
    a model that pools the ``M`` ids through ONE embedding table still tells positions apart
    (cardinality ``M * (K + 1)``; otherwise ``K + 1``). ``m`` / ``k``, when given, are checked against
    the table's metadata; give ``k`` (and ``m`` with ``offset``) so a model can be sized from the graph
    before the table is read.
    """

    kind: ClassVar[str] = "content_ids"
    input: str
    output: str
    table: str
    k: int | None = None
    m: int | None = None
    offset: bool = False
    on_missing: str = "unknown"
    _state: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.on_missing not in ("unknown", "error"):
            raise LeanmlError(f"op {self.name}: on_missing {self.on_missing!r}; use unknown or error")

    def spec(self) -> dict[str, Any]:
        d = super().spec()
        d.pop("_state", None)
        if not self.offset:
            d.pop("offset", None)
        if self.on_missing == "unknown":
            d.pop("on_missing", None)
        return d

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_state"] = None
        return state

    def cardinality(self, output: str) -> int | None:
        m, k = (self._state[1].m, self._state[1].k) if self._state is not None else (self.m, self.k)
        if k is None or (self.offset and m is None):
            return None
        return (k + 1) * (m if self.offset else 1)

    def load(self, ctx: OpContext) -> ContentIdTable:
        path = ctx.resolve_table(self.table)
        key = (str(path), path.stat().st_mtime)
        if self._state is not None and self._state[0] == key:
            return self._state[1]
        table = read_table(path, m=self.m, k=self.k)
        self._state = (key, table)
        return table

    def forward(self, cols: list[Column], ctx: OpContext) -> list[Column]:
        (col,) = cols
        table = self.load(ctx)
        codes, missing = table.lookup(np.asarray(col, dtype=np.int64), self.on_missing)
        out = ctx.alloc(codes.shape, np.int64)
        if self.offset:
            np.add(codes, np.arange(table.m, dtype=np.int64) * (table.k + 1), out=out)
        else:
            out[...] = codes
        ctx.counters[f"{self.name}:misses"] += int(missing.sum())
        return [out]


def read_content_id_table(path: Path, m: int | None = None, k: int | None = None) -> ContentIdTable:
    """Read and validate a serving table (see ``leanml.ctr.content_ids.schema.read_table``)."""
    return read_table(path, m=m, k=k)


def write_content_id_table(path: Path, ad_ids: np.ndarray, codes: np.ndarray, k: int) -> Path:
    """Write a serving table of codes ``[n, M]`` in ``[0, K)`` (the same writer `assign` uses)."""
    return write_table(path, ad_ids, codes, k)
