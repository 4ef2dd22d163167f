"""Structured pruning of interlinked pairs behind the layer-wise engine: FASP and three baselines.

All four methods act only on the structured pair groups of a decoder layer (``attn_out``: value rows
-> output-projection columns; ``mlp_out``: MLP input rows -> MLP output columns) and leave ``attn_in`` /
``mlp_in`` untouched. In every layer they keep the same fraction of units of each pair (uniform ratio,
rounding rule in :func:`leanml.prune.fasp.num_kept`), setting the pruned producer rows, producer biases
and consumer columns to exact zeros, then :meth:`finalize` removes the MLP units physically.

========================  ========================================  ==============================
method                    unit score                                consumer update
========================  ========================================  ==============================
``fasp``                  ``sum_i |W_ij| ||X_j||``                  least-squares restoration
``wanda-sp``              same as FASP                              none (columns zeroed)
``magnitude-sp``          ``||W_:,j||``                             none
``flap``                  ``Var(X_j) ||W_:,j||^2``                  bias compensation ``W_:,P E[x_P]``
========================  ========================================  ==============================

Attention units follow grouped-query attention: one unit is one value dimension of one key/value
head, feeding one output-projection column in each query head of its group (the adapter's
``StructUnits``). Attention keeps its stock shapes: its pruned dimensions stay exact zeros in the saved
model (see :mod:`leanml.models.surgery`).
"""

from __future__ import annotations

import argparse
from typing import Any, ClassVar

import torch
from torch import nn

from leanml.models import surgery
from leanml.prune import fasp as core
from leanml.prune.base import Group, GroupStats, Pruner
from leanml.prune.masks import MaskSpec
from leanml.utils import LeanmlError

PAIRS = {"attention": "attn_out", "mlp": "mlp_out"}


def _parse_pairs(text: str) -> tuple[str, ...]:
    names = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [p for p in names if p not in PAIRS]
    if bad or not names:
        raise LeanmlError(f"--fasp-pairs must list some of {', '.join(PAIRS)} (comma separated), got {text!r}")
    return names


class StructuredPairPruner(Pruner):
    """Common driver of the structured pair methods; subclasses define :meth:`unit_scores` and
    :meth:`update`."""

    name: ClassVar[str] = "structured-pairs"
    structured: ClassVar[bool] = True
    supports_pattern: ClassVar[bool] = False

    def __init__(
        self, pairs: tuple[str, ...] | str = ("attention", "mlp"), multiple: int = 1, shrink: bool = True
    ) -> None:
        self.pairs = _parse_pairs(pairs) if isinstance(pairs, str) else tuple(pairs)
        if any(p not in PAIRS for p in self.pairs):
            raise LeanmlError(f"unknown pair in {self.pairs}; choose from {', '.join(PAIRS)}")
        if multiple < 1:
            raise LeanmlError(f"--fasp-multiple must be >= 1, got {multiple}")
        self.group_names = frozenset(PAIRS[p] for p in self.pairs)  # the engine groups this method prunes
        self.multiple = int(multiple)
        self.shrink = bool(shrink)
        self._bias_params_added = 0  # biases created by bias compensation, for the params_before count

    # ---- CLI -------------------------------------------------------------------------------------
    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser) -> None:
        """Options shared by ``fasp``, ``wanda-sp``, ``magnitude-sp`` and ``flap`` (added once)."""
        if "--fasp-pairs" in parser._option_string_actions:  # noqa: SLF001 - shared by four methods
            return
        g = parser.add_argument_group("structured pair pruning (fasp, wanda-sp, magnitude-sp, flap)")
        g.add_argument("--fasp-pairs", default="attention,mlp",
                       help="pairs to prune: attention (value -> output projection), mlp, or both "
                            "(default: attention,mlp)")
        g.add_argument("--fasp-multiple", type=int, default=1,
                       help="round the kept units per layer to a multiple of this (default: 1)")
        g.add_argument("--fasp-no-shrink", action="store_true",
                       help="keep pruned MLP units as zeros instead of physically smaller MLPs")
        g.add_argument("--fasp-damp", type=float, default=0.01,
                       help="fasp: least-squares damping towards the dense weights, relative to each "
                            "feature's diag(H) (default: 0.01)")
        g.add_argument("--fasp-target", choices=("pruned", "dense"), default="pruned",
                       help="fasp: refit against the pruned-path input (W H[:,S] (H[S,S]+dI)^-1; default) or "
                            "against the dense model's input (W G[:,S] ...; needs the dense statistics, slower)")

    @classmethod
    def _common(cls, args: argparse.Namespace) -> dict[str, Any]:
        return {
            "pairs": getattr(args, "fasp_pairs", "attention,mlp"),
            "multiple": getattr(args, "fasp_multiple", 1),
            "shrink": not getattr(args, "fasp_no_shrink", False),
        }

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Pruner:
        return cls(**cls._common(args))

    def config(self) -> dict[str, Any]:
        return {"pairs": list(self.pairs), "multiple": self.multiple, "shrink": self.shrink}

    # ---- method-specific parts -------------------------------------------------------------------
    def unit_scores(self, W: torch.Tensor, stats: GroupStats, columns: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def update(
        self, W: torch.Tensor, stats: GroupStats, keep_cols: torch.Tensor, prune_cols: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """New consumer weight (zeros outside ``keep_cols``) and an optional bias increment."""
        return core.zero_columns(W, keep_cols), None

    # ---- engine hooks ----------------------------------------------------------------------------
    def check_layer(self, groups: list[Group], spec: MaskSpec) -> None:
        """Fail before calibration on a layer without the pairs or a sparsity that would leave a pair
        with no unit (the engine itself refuses N:M patterns for structured methods)."""
        pairs = [g for g in groups if self.touches(g)]
        missing = self.group_names - {g.name for g in pairs}
        if missing:
            raise LeanmlError(f"{self.name}: this architecture has no known pair map for {', '.join(sorted(missing))}")
        for g in pairs:
            core.num_kept(g.units.n_units, spec.sparsity, self.multiple)

    def touches(self, group: Group) -> bool:
        """Only the selected structured pairs (``attn_out``, ``mlp_out``) are pruned."""
        return group.units is not None and group.name in self.group_names

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs: the count of biases added by bias compensation so far."""
        return {"bias_params_added": self._bias_params_added}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._bias_params_added = int(state.get("bias_params_added", 0))

    @staticmethod
    def merge_states(states: list[dict[str, Any]]) -> dict[str, Any]:
        """Ranks prune disjoint layers: the biases they added add up."""
        return {"bias_params_added": sum(int(s.get("bias_params_added", 0)) for s in states)}

    def prune_group(self, group: Group, stats: GroupStats, spec: MaskSpec) -> dict[str, dict[str, Any]]:
        """Prune the units of a structured pair group; other groups are left untouched."""
        if not self.touches(group):
            return {}
        if spec.pattern is not None:
            raise LeanmlError(f"{self.name} removes whole units and has no N:M pattern; drop --pattern")
        if len(group.linears) != 1:
            raise LeanmlError(f"group {group.name} has {len(group.linears)} consumers; expected one")
        cname, consumer = next(iter(group.linears.items()))
        W = consumer.weight.detach()
        stats = _to_device(stats, W.device)
        units = group.units
        n_units = int(units.columns.shape[0])
        keep = core.num_kept(n_units, spec.sparsity, self.multiple)
        scores = self.unit_scores(W, stats, units.columns)
        kept = core.select_units(scores, keep)
        pruned = core.complement(kept, n_units)
        keep_cols = core.unit_columns(units.columns, kept)
        prune_cols = core.unit_columns(units.columns, pruned)
        W_new, bias_delta = self.update(W, stats, keep_cols.to(W.device), prune_cols.to(W.device))
        with torch.no_grad():
            consumer.weight.copy_(W_new)
            if bias_delta is not None:
                if consumer.bias is None:
                    consumer.bias = nn.Parameter(torch.zeros(consumer.out_features, dtype=W.dtype, device=W.device))
                    self._bias_params_added += consumer.out_features
                consumer.bias.add_(bias_delta.to(W.dtype))
            for pname, prod in group.producers.items():
                rows = units.rows[pname][pruned.to(units.rows[pname].device)].flatten().to(prod.weight.device)
                prod.weight[rows] = 0
                if prod.bias is not None:
                    prod.bias[rows] = 0
        frac = 1.0 - keep / n_units
        info = {"pair": units.kind, "units": n_units, "units_kept": keep, "structured_sparsity": frac}
        report = {cname: dict(info, role="consumer")}
        for pname in group.producers:
            report[pname] = dict(info, role="producer")
        return report

    def finalize(self, model: nn.Module, adapter: Any) -> dict[str, Any]:
        """Physically shrink the MLPs (unless ``shrink`` is off) and make added biases loadable.

        Returns parameter counts before pruning and after, the new MLP width and live units per layer.
        """
        before = surgery.count_parameters(model) - self._bias_params_added
        flags = surgery.ensure_bias_format(model, adapter)
        mlp = {"intermediate_size": None, "live_units": []}
        if self.shrink:
            mlp = surgery.shrink_mlp(model, adapter)
        after = surgery.count_parameters(model)
        return {
            "params_before": before,
            "params_after": after,
            "nonzero_params_after": surgery.count_nonzero(model),
            "intermediate_size": mlp["intermediate_size"],
            "mlp_live_units": mlp["live_units"],
            "bias_flags_enabled": flags,
            "attention": "pruned value/output dimensions kept as exact zeros (stock shapes)",
        }


def _to_device(stats: GroupStats, device: torch.device) -> GroupStats:
    if stats.H.device == device:
        return stats
    return GroupStats(
        H=stats.H.to(device),
        G=None if stats.G is None else stats.G.to(device),
        Hd=None if stats.Hd is None else stats.Hd.to(device),
        ntokens=stats.ntokens,
        mean=None if stats.mean is None else stats.mean.to(device),
        out_sq=None if stats.out_sq is None else {k: v.to(device) for k, v in stats.out_sq.items()},
    )


class FaspPruner(StructuredPairPruner):
    """FASP: Wanda-like unit scores, then least-squares restoration of the consumer on the kept columns."""

    name: ClassVar[str] = "fasp"

    def __init__(self, damp: float = 0.01, target: str = "pruned", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not damp >= 0:
            raise LeanmlError(f"--fasp-damp must be >= 0, got {damp}")
        if target not in ("dense", "pruned"):
            raise LeanmlError(f"--fasp-target must be 'dense' or 'pruned', got {target!r}")
        self.damp = float(damp)
        self.target = target
        # the dense statistics (G) are only needed when refitting against the dense model
        self.needs_dense = target == "dense"  # type: ignore[misc]

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Pruner:
        return cls(
            damp=getattr(args, "fasp_damp", 0.01), target=getattr(args, "fasp_target", "pruned"), **cls._common(args)
        )

    def config(self) -> dict[str, Any]:
        return dict(super().config(), damp=self.damp, target=self.target)

    def unit_scores(self, W: torch.Tensor, stats: GroupStats, columns: torch.Tensor) -> torch.Tensor:
        return core.fasp_scores(W, stats.sq_norms, columns)

    def update(
        self, W: torch.Tensor, stats: GroupStats, keep_cols: torch.Tensor, prune_cols: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        G = stats.G if self.target == "dense" else None
        return core.restore_least_squares(W, stats.H, keep_cols, G=G, damp=self.damp), None


class WandaStructuredPruner(StructuredPairPruner):
    """Wanda-sp: FASP's unit score, pruned columns zeroed without restoration."""

    name: ClassVar[str] = "wanda-sp"

    def unit_scores(self, W: torch.Tensor, stats: GroupStats, columns: torch.Tensor) -> torch.Tensor:
        return core.fasp_scores(W, stats.sq_norms, columns)


class MagnitudeStructuredPruner(StructuredPairPruner):
    """Magnitude-sp: units ranked by the norms of their consumer columns; no data used."""

    name: ClassVar[str] = "magnitude-sp"

    def unit_scores(self, W: torch.Tensor, stats: GroupStats, columns: torch.Tensor) -> torch.Tensor:
        return core.magnitude_scores(W, columns)


class FlapPruner(StructuredPairPruner):
    """FLAP-style: fluctuation score ``Var(X_j) ||W_:,j||^2`` and bias compensation.

    Uses the per-column input mean ``stats.mean`` accumulated by the engine. Consumers without a bias
    gain one; :meth:`finalize` turns on the family's bias flag (LLaMA's ``attention_bias`` /
    ``mlp_bias``) so the stock classes load it. Families whose stock layers cannot hold that bias are
    refused before calibration.
    """

    name: ClassVar[str] = "flap"

    def check_layer(self, groups: list[Group], spec: MaskSpec) -> None:
        """Also refuse pairs whose consumer cannot carry the compensation bias in the stock format."""
        super().check_layer(groups, spec)
        for g in groups:
            if self.touches(g) and not g.consumer_bias_ok:
                other = [p for p, name in PAIRS.items() if name != g.name]
                raise LeanmlError(
                    f"flap adds a bias to {g.leader}, which this architecture's stock layers cannot hold; "
                    f"use fasp or wanda-sp, or --fasp-pairs {other[0]}"
                )

    @staticmethod
    def _mean(stats: GroupStats) -> torch.Tensor:
        mean = stats.mean
        if mean is None:
            raise LeanmlError("flap needs the calibration input means, which this engine did not provide")
        return mean.to(stats.H.dtype)

    def unit_scores(self, W: torch.Tensor, stats: GroupStats, columns: torch.Tensor) -> torch.Tensor:
        return core.flap_scores(W, stats.sq_norms, self._mean(stats), columns)

    def update(
        self, W: torch.Tensor, stats: GroupStats, keep_cols: torch.Tensor, prune_cols: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        delta = core.bias_compensation(W, self._mean(stats), prune_cols)
        return core.zero_columns(W, keep_cols), delta
