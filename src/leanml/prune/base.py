"""The contract between the layer-wise engine and pruning methods.

The engine walks a model one decoder layer at a time. Inside a layer it visits :class:`Group` s in
order (attention input projections, attention output, MLP input, MLP output). For each group it
accumulates the input statistics of that group (:class:`GroupStats`) over the calibration tokens,
then calls :meth:`Pruner.prune_group`, which rewrites the group's weights in place.

Notation (per group, n = input features of the group's linears):

- ``X*`` the group's input on the *pruned path*: the calibration inputs pushed through the already
  pruned parts of the model (with intra-layer correction: including the already pruned groups of the
  current layer).
- ``X`` the group's input in the *dense* model on the same calibration tokens.
- ``H  = mean over tokens of x* x*^T``  (n x n)
- ``G  = mean over tokens of x  x*^T``  (n x n, dense rows x pruned-path columns); only when the
  pruner sets ``needs_dense = True``
- ``Hd = mean over tokens of x  x^T``   (n x n); only when ``needs_dense``.

so for a dense weight W and a candidate W*, the mean squared output error against the dense layer is
``tr(W* H W*^T) - 2 tr(W G W*^T) + tr(W Hd W^T)`` (see :func:`output_error`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from leanml.prune.masks import MaskSpec


@dataclass
class GroupStats:
    """Second-moment statistics of one group's input, averaged over ``ntokens`` calibration tokens."""

    H: torch.Tensor
    G: torch.Tensor | None = None
    Hd: torch.Tensor | None = None
    ntokens: int = 0
    #: per input feature, the mean of the pruned-path input (FLAP's fluctuation and bias compensation)
    mean: torch.Tensor | None = None

    @property
    def sq_norms(self) -> torch.Tensor:
        """Per input feature, the squared L2 norm of the pruned-path input divided by ``ntokens``."""
        return torch.diagonal(self.H)


def output_error(W: torch.Tensor, W_new: torch.Tensor, stats: GroupStats) -> float:
    """Mean over tokens of ``||W_new x* - W x||^2`` (needs ``G``/``Hd``; else uses ``x = x*``)."""
    W = W.to(stats.H.dtype)
    W_new = W_new.to(stats.H.dtype)
    if stats.G is None or stats.Hd is None:
        D = W_new - W
        return float(torch.einsum("ij,jk,ik->", D, stats.H, D))
    t1 = torch.einsum("ij,jk,ik->", W_new, stats.H, W_new)
    t2 = torch.einsum("ij,jk,ik->", W, stats.G, W_new)
    t3 = torch.einsum("ij,jk,ik->", W, stats.Hd, W)
    return float(t1 - 2 * t2 + t3)


@dataclass
class Group:
    """Linears of one decoder layer that read the same input.

    ``linears`` maps the linear's qualified name inside the decoder layer (e.g. ``"mlp.down_proj"``)
    to the module. For groups whose input columns are produced elementwise by earlier linears (the
    structured pairs: attention value -> output projection, MLP in -> MLP out), ``producers`` maps
    those earlier linears' names to modules and ``units`` describes the removable units:
    ``units.columns[u]`` are this group's input columns fed by unit ``u`` and ``units.rows[u]`` the
    producers' output rows of unit ``u`` (the same row indices in every producer).
    """

    name: str
    linears: dict[str, nn.Linear]
    producers: dict[str, nn.Linear] = field(default_factory=dict)
    units: StructUnits | None = None


@dataclass
class StructUnits:
    """Removable structured units of a (producers -> consumer) pair.

    ``columns``: (n_units, cols_per_unit) long tensor of consumer input columns per unit.
    ``rows``: (n_units, rows_per_unit) long tensor of producer output rows per unit.
    ``kind``: ``"mlp"`` or ``"attention"``.
    """

    columns: torch.Tensor
    rows: torch.Tensor
    kind: str


class Pruner:
    """Base class of pruning methods used by the engine.

    Subclasses set ``name``, optionally ``needs_dense`` (accumulate ``G`` and ``Hd``) and
    ``structured`` (the method removes units of structured pairs and may shrink the model in
    :meth:`finalize`), implement :meth:`prune_group`, and may add CLI options through
    :meth:`add_args` / :meth:`from_args` (prefix option names with the method name).
    """

    name: ClassVar[str] = "base"
    needs_dense: ClassVar[bool] = False
    structured: ClassVar[bool] = False
    supports_pattern: ClassVar[bool] = True

    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser) -> None:
        """Add method-specific CLI options (names prefixed with the method, e.g. ``--fista-iters``)."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Pruner:
        return cls()

    def config(self) -> dict[str, Any]:
        """Method options, recorded in the report."""
        return {}

    def check_layer(self, groups: list[Group], spec: MaskSpec) -> None:
        """Raise :class:`~leanml.utils.LeanmlError` if this method cannot prune a layer with these groups
        at ``spec``; the engine calls it for every layer to prune before any calibration pass."""

    def touches(self, group: Group) -> bool:
        """Whether :meth:`prune_group` may change ``group``; the engine gathers no statistics for (and
        does not call the method on) groups it leaves alone."""
        return True

    def prune_group(self, group: Group, stats: GroupStats, spec: MaskSpec) -> dict[str, dict[str, Any]]:
        """Rewrite the weights of ``group.linears`` in place; return extra per-linear report fields."""
        raise NotImplementedError

    def finalize(self, model: nn.Module, adapter: Any) -> dict[str, Any]:
        """Called once after all layers are pruned, before saving (e.g. to shrink modules)."""
        return {}
