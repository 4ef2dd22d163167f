"""The contract between the layer-wise engine and pruning methods.

The engine walks a model one decoder layer at a time. Inside a layer it visits :class:`Group` s in
forward order (linears reading the same input, found automatically; for structured methods the
declared pairs of :mod:`leanml.models.adapters`). For each group it accumulates the input statistics
of that group (:class:`GroupStats`) over the calibration tokens, then calls
:meth:`Pruner.prune_group`, which rewrites the group's weights in place.

Notation (per group, n = input features of the group's linears):

- ``X*`` the group's input on the *pruned path*: the calibration inputs pushed through the already
  pruned parts of the model (with intra-layer correction: including the already pruned groups of the
  current layer).
- ``X`` the group's input in the *dense* model on the same calibration tokens.
- ``H  = mean over tokens of x* x*^T``  (n x n)
- ``G  = mean over tokens of x  x*^T``  (n x n, dense rows x pruned-path columns); only when the
  pruner sets ``needs_dense = True``
- ``Hd = mean over tokens of x  x^T``   (n x n); only when ``needs_dense``. When the engine runs the
  dense layer's linears anyway it records instead, per linear, ``out_sq = diag(W Hd W^T)``: the mean
  squared dense output of each row (bias excluded), which is all a method needs from ``Hd``.
- ``C = W G`` per linear: for methods with ``accepts_cross``, the engine accumulates it directly from
  the dense outputs ``y = W x`` (``mean of y x*^T``) instead of ``G`` when the group's outputs are
  narrower than its input (an MLP down projection), which costs less.

so for a dense weight W and a candidate W*, the mean squared output error against the dense layer is
``tr(W* H W*^T) - 2 tr(W G W*^T) + tr(W Hd W^T)`` (see :func:`output_error`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any, ClassVar

import torch
from torch import nn

from leanml.models.layout import Group, StructUnits
from leanml.prune.masks import MaskSpec

__all__ = ["Group", "GroupStats", "LinearSpecs", "NoOptions", "Pruner", "StructUnits", "linear_spec", "output_error"]

#: what :meth:`Pruner.prune_group` receives: one spec for the group, or one per linear name
LinearSpecs = MaskSpec | Mapping[str, MaskSpec]


def linear_spec(spec: LinearSpecs, name: str) -> MaskSpec:
    """The mask spec of linear ``name``: ``spec`` itself, or its entry when it maps names to specs."""
    return spec if isinstance(spec, MaskSpec) else spec[name]


@dataclass
class GroupStats:
    """Second-moment statistics of one group's input, averaged over ``ntokens`` calibration tokens."""

    H: torch.Tensor
    G: torch.Tensor | None = None
    Hd: torch.Tensor | None = None
    ntokens: int = 0
    #: per input feature, the mean of the pruned-path input (FLAP's fluctuation and bias compensation)
    mean: torch.Tensor | None = None
    #: per linear name, ``diag(W Hd W^T)``: the mean squared dense output per row (bias excluded)
    out_sq: dict[str, torch.Tensor] | None = None
    #: per linear name, ``C = W G`` (mean of ``y x*^T`` with ``y`` the dense output, bias excluded),
    #: given instead of ``G`` to methods with ``accepts_cross`` when that is cheaper
    C: dict[str, torch.Tensor] | None = None

    def cross(self, name: str, W: torch.Tensor) -> torch.Tensor | None:
        """``C = W G`` of linear ``name`` (dense weight ``W``): from ``C`` when given, else from ``G``;
        ``None`` when there is no dense/pruned distinction."""
        if self.C is not None and name in self.C:
            return self.C[name].to(self.H.dtype)
        return None if self.G is None else W.to(self.H.dtype) @ self.G

    def dense_energy(self, name: str, W: torch.Tensor) -> torch.Tensor:
        """Per output row of linear ``name`` (dense weight ``W``), ``w Hd w^T``: the dense output's mean
        square (from ``out_sq``, else ``Hd``, else ``H`` when there is no dense/pruned distinction)."""
        if self.out_sq is not None and name in self.out_sq:
            return self.out_sq[name].to(self.H.dtype)
        Wd = W.to(self.H.dtype)
        return ((Wd @ (self.H if self.Hd is None else self.Hd)) * Wd).sum(1)

    @property
    def sq_norms(self) -> torch.Tensor:
        """Per input feature, the squared L2 norm of the pruned-path input divided by ``ntokens``."""
        return torch.diagonal(self.H)


def output_error(W: torch.Tensor, W_new: torch.Tensor, stats: GroupStats, name: str | None = None) -> float:
    """Mean over tokens of ``||W_new x* - W x||^2`` (needs ``G`` or ``C[name]``, and ``Hd`` or
    ``out_sq[name]``; without either cross statistic it uses ``x = x*``)."""
    W = W.to(stats.H.dtype)
    W_new = W_new.to(stats.H.dtype)
    C = stats.cross(name or "", W)
    if C is None:
        D = W_new - W
        return float(torch.einsum("ij,jk,ik->", D, stats.H, D))
    t1 = torch.einsum("ij,jk,ik->", W_new, stats.H, W_new)
    t2 = (C * W_new).sum()
    t3 = stats.dense_energy(name or "", W).sum()
    return float(t1 - 2 * t2 + t3)


@dataclass(frozen=True)
class NoOptions:
    """A method without options."""

    prefix: ClassVar[str] = ""


class Pruner:
    """Base class of pruning methods used by the engine.

    Subclasses set ``name``, optionally ``needs_dense`` (accumulate ``G`` and ``Hd``), ``needs_stats``
    (False: the method reads no calibration statistics), ``structured`` (the method removes units of
    the declared structured pairs and may shrink the model in :meth:`finalize`), ``default_scope``
    (the unstructured mask scope when the caller leaves it open) and ``default_intra_layer``
    (whether later groups of a layer see the already pruned earlier groups); implement
    :meth:`prune_group`. A method's options are one frozen dataclass, ``Options``, declared with
    :func:`leanml.config.option` and checked in its ``__post_init__``; its class variable ``prefix`` (e.g.
    ``"fista-"``) prefixes the generated flags (``--fista-iters``). The pruner holds it as ``options``.
    """

    name: ClassVar[str] = "base"
    needs_dense: ClassVar[bool] = False
    needs_stats: ClassVar[bool] = True
    structured: ClassVar[bool] = False
    supports_pattern: ClassVar[bool] = True
    #: the method reads the cross statistics only through :meth:`GroupStats.cross` (so the engine may
    #: give ``C`` per linear instead of ``G``)
    accepts_cross: ClassVar[bool] = False
    default_scope: ClassVar[str] = "row"
    default_intra_layer: ClassVar[bool] = True
    #: the options dataclass of this method
    Options: ClassVar[type] = NoOptions
    #: this pruner's options (set by ``__init__``; a subclass that sets nothing has none)
    options: Any = NoOptions()

    def __init__(self, options: Any = None, /, **changes: Any) -> None:
        """``options``: an ``Options`` object (None: the defaults); ``changes`` set single fields
        (``FistaPruner(iters=5)`` is ``FistaPruner(FistaOptions(iters=5))``)."""
        if options is None:
            options = self.Options(**changes)
        elif not isinstance(options, self.Options):
            raise TypeError(f"{type(self).__name__} takes {self.Options.__name__}, got {type(options).__name__}")
        elif changes:
            options = replace(options, **changes)
        self.options = options

    def config(self) -> dict[str, Any]:
        """Method options, recorded in the report."""
        return asdict(self.options)

    @classmethod
    def resolve_spec(cls, spec: MaskSpec) -> MaskSpec:
        """``spec`` with an open scope (``None``) set to this method's default: the one place where a
        mask scope is chosen, for the Python API and the CLI alike."""
        if spec.scope is None:
            return replace(spec, scope=cls.default_scope)
        return spec

    @classmethod
    def resolve_intra_layer(cls, intra_layer: bool | None) -> bool:
        """``intra_layer`` when given, else this method's default."""
        return cls.default_intra_layer if intra_layer is None else bool(intra_layer)

    def check_layer(self, groups: list[Group], spec: MaskSpec) -> None:
        """Raise :class:`~leanml.errors.LeanmlError` if this method cannot prune a layer with these groups
        at ``spec``; the engine calls it for every layer to prune before any calibration pass (for
        unstructured methods each group is one linear; for structured methods the declared pairs)."""

    def touches(self, group: Group) -> bool:
        """Whether :meth:`prune_group` may change ``group``; the engine gathers no statistics for (and
        does not call the method on) groups it leaves alone."""
        return True

    def prune_group(self, group: Group, stats: GroupStats | None, spec: LinearSpecs) -> dict[str, dict[str, Any]]:
        """Rewrite the weights of ``group.linears`` in place; return extra per-linear report fields.

        ``stats`` is ``None`` for methods with ``needs_stats = False``; ``spec`` is one
        :class:`MaskSpec` or one per linear name (see :func:`linear_spec`), already resolved."""
        raise NotImplementedError

    def finalize(self, model: nn.Module, adapter: Any) -> dict[str, Any]:
        """Called once after all layers are pruned, before saving (e.g. to shrink modules)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """What a resumed or multi-process run needs to carry over (default: nothing)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""

    @staticmethod
    def merge_states(states: list[dict[str, Any]]) -> dict[str, Any]:
        """Combine the states of several ranks that pruned disjoint layers (default: the first)."""
        return states[0] if states else {}
