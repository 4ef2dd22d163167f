"""String field ops: ``split`` a delimited field into a list column."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from leanml.features.columns import Column, Ragged
from leanml.features.ops.base import Op, OpContext, register_op
from leanml.utils import LeanmlError


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
