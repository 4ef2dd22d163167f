"""Row filter op: ``filter`` keeps the rows whose field passes a comparison."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from leanml.errors import LeanmlError
from leanml.features.ops.base import Op, OpContext, register_op
from leanml.features.ops.columns import Column, is_arrow

_ARROW_OPS = {"==": pc.equal, "!=": pc.not_equal, "<": pc.less, "<=": pc.less_equal, ">": pc.greater,
              ">=": pc.greater_equal}
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
        if is_arrow(col):
            if self.cmp in ("in", "not_in"):
                keep = np.asarray(pc.is_in(col, value_set=pa.array(self.value, type=col.type)), dtype=bool)
                return [keep if self.cmp == "in" else ~keep]
            return [np.asarray(_ARROW_OPS[self.cmp](col, pa.scalar(self.value, type=col.type)).fill_null(False),
                               dtype=bool)]
        if self.cmp in ("in", "not_in"):
            keep = np.isin(col, np.asarray(self.value, dtype=col.dtype if col.dtype != object else object))
            return [keep if self.cmp == "in" else ~keep]
        return [np.asarray(_FILTER_OPS[self.cmp](col, self.value), dtype=bool)]
