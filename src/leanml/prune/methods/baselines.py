"""Baseline pruners for the engine: magnitude, Wanda and SparseGPT.

Their math is in :mod:`leanml.prune.cores.magnitude`, :mod:`leanml.prune.cores.wanda` and
:mod:`leanml.prune.cores.sparsegpt`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from leanml.config import Bounds, option
from leanml.finite import solver_error
from leanml.prune.base import Group, GroupStats, LinearSpecs, Pruner, linear_spec
from leanml.prune.cores.magnitude import magnitude_prune
from leanml.prune.cores.sparsegpt import hinv_upper, sparsegpt_prune_many
from leanml.prune.cores.wanda import wanda_prune
from leanml.prune.masks import MaskSpec


class _UnstructuredPruner(Pruner):
    """Shared driver: prune every linear of every group with :meth:`prune_weight`.

    Statistics come from one pass of the dense layer by default (``default_intra_layer = False``), as in
    the papers of magnitude, Wanda and SparseGPT."""

    default_scope: ClassVar[str] = "row"
    default_intra_layer: ClassVar[bool] = False

    def prune_group(self, group: Group, stats: GroupStats | None, spec: LinearSpecs) -> dict[str, dict[str, Any]]:
        # the engine reports each linear's error; nothing extra to add here
        shared = self.prepare(stats) if stats is not None else None
        for name, lin in group.linears.items():
            lin.weight.data.copy_(self.prune_weight(lin.weight.data, stats, linear_spec(spec, name), shared))
        return {}

    def prepare(self, stats: GroupStats) -> Any:
        return None

    def prune_weight(self, W: torch.Tensor, stats: GroupStats | None, spec: MaskSpec, shared: Any) -> torch.Tensor:
        raise NotImplementedError


class MagnitudePruner(_UnstructuredPruner):
    """Magnitude pruning: needs no calibration statistics (one threshold per matrix by default)."""

    name = "magnitude"
    default_scope = "layer"
    needs_stats = False

    def prune_weight(self, W, stats, spec, shared):
        return magnitude_prune(W, spec)


class WandaPruner(_UnstructuredPruner):
    """Wanda: ``|W| * ||X||`` scores, compared per output row by default (the paper's choice)."""

    name = "wanda"
    default_scope = "row"

    def prune_weight(self, W, stats, spec, shared):
        return wanda_prune(W, stats.sq_norms, spec)


@dataclass(frozen=True)
class SparseGPTOptions:
    """sparsegpt"""

    prefix: ClassVar[str] = "sparsegpt-"

    damp: float = option(0.01, "damping, fraction of mean diag(H)", bounds=Bounds(ge=0))
    blocksize: int = option(128, "columns per lazy-update block", bounds=Bounds(ge=1))


class SparseGPTPruner(_UnstructuredPruner):
    """SparseGPT: OBS with the Cholesky factor of ``H^-1`` (options :class:`SparseGPTOptions`)."""

    name = "sparsegpt"
    default_scope = "layer"
    Options = SparseGPTOptions

    def prune_group(self, group: Group, stats: GroupStats | None, spec: LinearSpecs) -> dict[str, dict[str, Any]]:
        """All linears of the group in one OBS sweep (they share ``H`` and its factor)."""
        names = list(group.linears)
        o = self.options
        try:
            U = hinv_upper(stats.H, o.damp)[0]
        except torch.linalg.LinAlgError:  # the damped H is not positive definite (or overflowed)
            raise solver_error("SparseGPT's Cholesky factorisation", "damp", o.damp, stats.H,
                               f"group {group.name}", owner=SparseGPTOptions) from None
        new = sparsegpt_prune_many([group.linears[n].weight.data for n in names], stats.H,
                                   [linear_spec(spec, n) for n in names], o.damp, o.blocksize, U=U)
        for n, W in zip(names, new):
            group.linears[n].weight.data.copy_(W)
        return {}
