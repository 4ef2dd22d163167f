"""Taylor pruning behind the layer-wise engine: keep the weights with the largest magnitude times gradient
of the layer's output energy (:mod:`leanml.prune.cores.taylor`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from leanml.config import option
from leanml.prune.base import Group, GroupStats, LinearSpecs, Pruner, linear_spec
from leanml.prune.cores.taylor import taylor_prune


@dataclass(frozen=True)
class TaylorOptions:
    """taylor (magnitude times gradient)"""

    prefix: ClassVar[str] = "taylor-"

    second_order: bool = option(False, "add the second-order term 1/2 w^2 H_jj: the score is then the exact change "
                                       "of the output energy when the weight alone is removed")


class TaylorPruner(Pruner):
    """One-shot Taylor scores ``|w * (W H)|`` (options :class:`TaylorOptions`), compared per output row."""

    name: ClassVar[str] = "taylor"
    default_scope: ClassVar[str] = "row"
    default_intra_layer: ClassVar[bool] = False
    Options: ClassVar[type] = TaylorOptions

    def prune_group(self, group: Group, stats: GroupStats | None, spec: LinearSpecs) -> dict[str, dict[str, Any]]:
        for name, lin in group.linears.items():
            W = lin.weight.data
            W.copy_(taylor_prune(W, stats.H, linear_spec(spec, name), self.options.second_order))
        return {}
