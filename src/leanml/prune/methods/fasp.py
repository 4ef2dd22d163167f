"""Structured pruning of interlinked pairs behind the layer-wise engine: FASP and three baselines.

All four methods act only on the structured pair groups of a decoder layer (``attn_out``: the query,
key and value rows of a key/value group -> its output-projection columns; ``mlp_out``: MLP input rows ->
MLP output columns). They set the pruned producer rows, producer biases and consumer columns to exact
zeros, then :meth:`finalize` removes the units physically (smaller MLPs, fewer heads).

How many units each layer loses (``alloc``):

- ``"score"`` (default): ``sparsity`` is the fraction of *all* the model's parameters to remove
  (embeddings and head count in the total but are never cut). A dense pre-pass (:meth:`prepare`) scores
  every attention group and MLP unit of every layer with the method's own unit score, normalizes each
  layer's scores to sum 1, and :func:`leanml.prune.cores.fasp.allocate` picks the number of groups and of MLP
  units per layer -- the same in every layer, as stock configs require -- that meets the budget with the
  least score lost.
- ``"uniform"``: every layer keeps the same fraction of units of each pair (rounding rule in
  :func:`leanml.prune.cores.fasp.num_kept`; attention units are whole groups).

========================  ========================================  ==============================
method                    unit score                                consumer update
========================  ========================================  ==============================
``fasp``                  ``sum_i |W_ij| ||X_j||``                  least-squares restoration
``wanda-sp``              same as FASP                              none (columns zeroed)
``magnitude-sp``          ``||W_:,j||``                             none
``flap``                  ``Var(X_j) ||W_:,j||^2``                  bias compensation ``W_:,P E[x_P]``
========================  ========================================  ==============================

Attention units follow grouped-query attention: one unit is one key/value head with the query heads
that read it (the adapter's ``StructUnits``). Families whose stock attention cannot lose heads (OPT,
GPT-NeoX) and models with one key/value group are refused when attention is among the pairs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from leanml.config import Bounds, ConfigError, Form, default, given, option, require
from leanml.errors import LeanmlError
from leanml.finite import solver_error
from leanml.models import surgery
from leanml.models.layout import DecoderAdapter
from leanml.prune.base import Group, GroupStats, Pruner
from leanml.prune.cores import fasp as core
from leanml.prune.masks import MaskSpec

PAIRS = {"attention": "attn_out", "mlp": "mlp_out"}
ALLOCS = ("score", "uniform")


@dataclass(frozen=True)
class StructuredOptions:
    """structured pair pruning (fasp, wanda-sp, magnitude-sp, flap)"""

    prefix: ClassVar[str] = "fasp-"

    pairs: str | tuple[str, ...] = option("attention,mlp", "pairs to prune: attention (whole key/value groups), "
                                                           "mlp, or both (comma separated; from Python also a tuple)")
    alloc: Literal["score", "uniform"] = option(
        "score", "score: the sparsity is the fraction of all parameters removed, split between attention groups and "
        "MLP units by score; uniform: every pair of every layer loses that fraction of its units")
    groups: int | None = option(None, "with score allocation: remove exactly this many key/value groups per layer "
                                      "(default: chosen by score)", form=Form(show_default=False))
    plan_samples: int = option(default(8), "with score allocation: calibration windows the allocation's dense "
                                           "pre-pass reads", bounds=Bounds(ge=1))
    multiple: int = option(1, "round the kept units per layer to a multiple of this", bounds=Bounds(ge=1))
    shrink: bool = option(True, "remove pruned units physically (smaller MLPs and attention); off, they stay "
                                "as zeros", form=Form(negative="--fasp-no-shrink"))

    def __post_init__(self) -> None:
        require(self, bool(self.pair_names) and all(p in PAIRS for p in self.pair_names), "pairs",
                f"must list some of {', '.join(PAIRS)} (comma separated), got {self.pairs!r}")
        require(self, self.alloc in ALLOCS, "alloc", f"must be one of {', '.join(ALLOCS)}, got {self.alloc!r}")
        require(self, self.groups is None or (self.alloc == "score" and "attention" in self.pair_names
                                              and self.groups >= 0), ("groups", "alloc", "pairs"),
                f"groups needs alloc score with attention among pairs and a count >= 0, got {self.groups}")
        require(self, self.alloc == "score" or not given(self.plan_samples), ("plan_samples", "alloc"),
                f"plan_samples sets the windows of alloc score's pre-pass, which alloc {self.alloc} does not run: "
                "drop plan_samples or use alloc score")

    @property
    def pair_names(self) -> tuple[str, ...]:
        """The pairs as a tuple (``("attention", "mlp")``)."""
        names = self.pairs.split(",") if isinstance(self.pairs, str) else self.pairs
        return tuple(p.strip() for p in names if p.strip())


@dataclass(frozen=True)
class FaspOptions(StructuredOptions):
    """structured pair pruning (fasp, wanda-sp, magnitude-sp, flap; --fasp-damp and --fasp-target: fasp only)"""

    damp: float = option(0.01, "fasp: least-squares damping towards the dense weights, relative to each feature's "
                               "diag(H)", bounds=Bounds(ge=0))
    target: Literal["pruned", "dense"] = option(
        "pruned", "fasp: refit against the pruned-path input (W H[:,S] (H[S,S]+dI)^-1) or against the dense "
        "model's input (W G[:,S] ...; needs the dense statistics, slower)")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self, self.target in ("dense", "pruned"), "target",
                f"must be 'dense' or 'pruned', got {self.target!r}")


class StructuredPairPruner(Pruner):
    """Common driver of the structured pair methods; subclasses define :meth:`unit_scores` and
    :meth:`update`."""

    name: ClassVar[str] = "structured-pairs"
    structured: ClassVar[bool] = True
    supports_pattern: ClassVar[bool] = False

    #: whether the allocation pre-pass needs calibration data (magnitude-sp reads weights only)
    plan_needs_data: ClassVar[bool] = True

    Options: ClassVar[type] = StructuredOptions

    def config(self) -> dict[str, Any]:
        """Method options, with the pairs as a list however they were given (the report and the resume
        fingerprint see one form)."""
        return {**super().config(), "pairs": list(self.options.pair_names)}

    def __init__(self, options: Any = None, /, **changes: Any) -> None:
        super().__init__(options, **changes)
        self.group_names = frozenset(PAIRS[p] for p in self.options.pair_names)  # the groups this method prunes
        self._bias_params_added = 0  # biases created by bias compensation, for the params_before count
        #: score allocation: units removed per layer by group name ("attn_out", "mlp_out"), and its record
        self.plan: dict[str, Any] | None = None

    # ---- method-specific parts -------------------------------------------------------------------
    def unit_scores(
        self, W: torch.Tensor, sq_norms: torch.Tensor, mean: torch.Tensor | None, columns: torch.Tensor
    ) -> torch.Tensor:
        """Per unit, its score (higher: more important) from the consumer weight ``W`` and per input
        column the mean square ``sq_norms`` (``diag(H)``) and mean of the consumer's input."""
        raise NotImplementedError

    def update(
        self, W: torch.Tensor, stats: GroupStats, keep_cols: torch.Tensor, prune_cols: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """New consumer weight (zeros outside ``keep_cols``) and an optional bias increment."""
        return core.zero_columns(W, keep_cols), None

    # ---- engine hooks ----------------------------------------------------------------------------
    def check_layer(self, groups: list[Group], spec: MaskSpec) -> None:
        """Fail before calibration on a layer without the pairs, attention whose heads cannot be
        removed, or (uniform allocation) a sparsity that would leave a pair with no unit (the engine
        itself refuses N:M patterns for structured methods)."""
        pairs = [g for g in groups if g.units is not None and g.name in self.group_names]
        missing = self.group_names - {g.name for g in pairs}
        if missing:
            raise LeanmlError(f"{self.name}: this architecture has no known pair map for {', '.join(sorted(missing))}")
        for g in pairs:
            if g.fixed_reason is not None:
                raise ConfigError(f"{g.fixed_reason}; use pairs mlp", type(self.options), ("pairs",))
            if self.options.alloc == "uniform":
                core.num_kept(g.units.n_units, spec.sparsity, self.options.multiple)
            elif not 0.0 <= spec.sparsity < 1.0:
                raise ConfigError(f"structured sparsity must be in [0, 1), got {spec.sparsity}", None, ("sparsity",))

    def touches(self, group: Group) -> bool:
        """Only the selected structured pairs (``attn_out``, ``mlp_out``) are pruned (under a score
        allocation, only those it takes units from)."""
        if group.units is None or group.name not in self.group_names:
            return False
        return self.plan is None or self.plan["removed"].get(group.name, 0) > 0

    # ---- score allocation ------------------------------------------------------------------------
    @torch.no_grad()
    def prepare(
        self,
        model: nn.Module,
        adapter: DecoderAdapter,
        calib_ids: torch.Tensor,
        *,
        batch_size: int = 8,
        device: torch.device | str | None = None,
        spec: MaskSpec | None = None,
        progress: bool = True,
    ) -> dict[str, Any]:
        """The score allocation's dense pre-pass (``alloc="score"``; nothing otherwise): walk the dense
        model layer by layer on the first ``plan_samples`` calibration windows, score every attention
        group and MLP unit with :meth:`unit_scores` on the dense inputs, and choose the units removed per layer
        (:func:`leanml.prune.cores.fasp.allocate`). An infeasible budget fails before the pass."""
        if self.options.alloc != "score" or spec is None:
            return {}
        layers = adapter.layers()
        pairs0 = {g.name: g for g in adapter.pairs(layers[0]) if g.units is not None and g.name in self.group_names}
        costs = {name: _unit_cost(g) for name, g in pairs0.items()}
        total = surgery.count_parameters(model)
        budget = int(round(spec.sparsity * total))
        n_units = {name: g.units.n_units for name, g in pairs0.items()}  # type: ignore[union-attr]
        # feasibility from the shapes alone, before any calibration pass
        dummy = {name: torch.zeros(len(layers), n) for name, n in n_units.items()}
        core.allocate(dummy.get("attn_out"), dummy.get("mlp_out"), costs.get("attn_out", 0),
                      costs.get("mlp_out", 0), budget, self.options.multiple, self.options.groups)
        scores = self._dense_scores(model, adapter, calib_ids[: self.options.plan_samples], batch_size, device,
                                    progress)
        att, mlp = core.normalize_layer_scores(scores.get("attn_out"), scores.get("mlp_out"))
        choice = core.allocate(att, mlp, costs.get("attn_out", 0), costs.get("mlp_out", 0), budget,
                               self.options.multiple, self.options.groups)
        removed = {"attn_out": int(choice["groups_removed"]), "mlp_out": int(choice["units_removed"])}
        self.plan = {
            "removed": {k: v for k, v in removed.items() if k in pairs0},
            "units": n_units,
            "budget_params": budget,
            "params_dense": total,
            "params_removed_planned": int(choice["params_removed"]),
            "unit_params": costs,
            "score_lost": float(choice["score_lost"]),
        }
        return self.plan

    def _dense_scores(
        self, model: nn.Module, adapter: DecoderAdapter, calib_ids: torch.Tensor, batch_size: int,
        device: torch.device | str | None, progress: bool,
    ) -> dict[str, torch.Tensor]:
        """(layers, units) dense unit scores of every selected pair."""
        from tqdm.auto import tqdm

        from leanml.models.layerwise import capture_layer_inputs, layer_on, outer_on, run_layer, to_device

        layers = adapter.layers()
        device = torch.device(device) if device is not None else next(model.parameters()).device
        if self.plan_needs_data:
            with outer_on(model, adapter, device):
                hidden, kwargs = capture_layer_inputs(model, adapter, calib_ids, batch_size)
        out: dict[str, list[torch.Tensor]] = {}
        for i in tqdm(range(len(layers)), desc=f"{self.name} allocation", unit="layer", disable=not progress):
            layer = layers[i]
            pairs = [g for g in adapter.pairs(layer) if g.units is not None and g.name in self.group_names]
            acc: dict[str, list[Any]] = {g.name: [0.0, 0.0, 0] for g in pairs}
            handles = []
            for g in pairs:
                def hook(module: nn.Module, args: tuple[Any, ...], a: list[Any] = acc[g.name]) -> None:
                    x = args[0].reshape(-1, args[0].shape[-1]).double()
                    a[0] = a[0] + (x * x).sum(0)
                    a[1] = a[1] + x.sum(0)
                    a[2] += x.shape[0]

                handles.append(layer.get_submodule(g.leader).register_forward_pre_hook(hook))
            try:
                with layer_on(layer, device):
                    if self.plan_needs_data:
                        kw = [to_device(k, device) for k in kwargs[i]]
                        hidden = run_layer(layer, hidden, kw, batch_size, device)
                    for g in pairs:
                        W = g.linears[g.leader].weight.detach()
                        a = acc[g.name]
                        n = max(a[2], 1)
                        sq = a[0] / n if a[2] else torch.zeros(W.shape[1], dtype=torch.float64, device=W.device)
                        mean = a[1] / n if a[2] else torch.zeros_like(sq)
                        out.setdefault(g.name, []).append(self.unit_scores(W, sq, mean, g.units.columns).cpu())
            finally:
                for h in handles:
                    h.remove()
        return {name: torch.stack(v) for name, v in out.items()}

    def keep_count(self, group: Group, spec: MaskSpec) -> int:
        """Units of ``group`` this layer keeps."""
        n_units = group.units.n_units  # type: ignore[union-attr]
        if self.options.alloc == "uniform":
            return core.num_kept(n_units, spec.sparsity, self.options.multiple)
        if self.plan is None:
            raise ConfigError(f"{self.name} with alloc score needs its allocation pre-pass (prepare) before "
                              "pruning; run it through leanml.prune.engine.prune_model or use alloc uniform",
                              type(self.options), ("alloc",))
        return n_units - int(self.plan["removed"].get(group.name, 0))

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs: the count of biases added by bias compensation so far and the
        score allocation."""
        return {"bias_params_added": self._bias_params_added, "plan": self.plan}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._bias_params_added = int(state.get("bias_params_added", 0))
        self.plan = state.get("plan", self.plan)

    @staticmethod
    def merge_states(states: list[dict[str, Any]]) -> dict[str, Any]:
        """Ranks prune disjoint layers: the biases they added add up; every rank computed the same
        allocation from the same dense model and data."""
        return {"bias_params_added": sum(int(s.get("bias_params_added", 0)) for s in states),
                "plan": next((s["plan"] for s in states if s.get("plan") is not None), None)}

    def prune_group(self, group: Group, stats: GroupStats, spec: MaskSpec) -> dict[str, dict[str, Any]]:
        """Prune the units of a structured pair group; other groups are left untouched."""
        if not self.touches(group):
            return {}
        if spec.pattern is not None:
            raise ConfigError(f"{self.name} removes whole units and has no N:M pattern; drop pattern", None,
                              ("pattern",))
        if len(group.linears) != 1:
            raise LeanmlError(f"group {group.name} has {len(group.linears)} consumers; expected one")
        cname, consumer = next(iter(group.linears.items()))
        W = consumer.weight.detach()
        stats = _to_device(stats, W.device)
        units = group.units
        n_units = int(units.columns.shape[0])
        keep = self.keep_count(group, spec)
        scores = self.unit_scores(W, stats.sq_norms, stats.mean, units.columns)
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
        """Physically shrink the MLPs and the attention (unless ``shrink`` is off) and make added
        biases loadable.

        Returns parameter counts before pruning and after, the new MLP width and head counts, live
        units and key/value groups per layer, and the score allocation.
        """
        before = surgery.count_parameters(model) - self._bias_params_added
        groups_before = adapter.num_kv_heads if adapter.v_proj is not None else None
        flags = surgery.ensure_bias_format(model, adapter)
        mlp: dict[str, Any] = {"intermediate_size": None, "live_units": []}
        att: dict[str, Any] = {"num_key_value_heads": None, "num_attention_heads": None, "live_groups": []}
        if self.options.shrink:
            att = surgery.shrink_attention(model, adapter)
            mlp = surgery.shrink_mlp(model, adapter)
        after = surgery.count_parameters(model)
        removed_groups = None
        if att["live_groups"] and groups_before is not None:
            removed_groups = groups_before - max(att["live_groups"])
        return {
            "params_before": before,
            "params_after": after,
            "nonzero_params_after": surgery.count_nonzero(model),
            "intermediate_size": mlp["intermediate_size"],
            "mlp_live_units": mlp["live_units"],
            "num_attention_heads": att["num_attention_heads"],
            "num_key_value_heads": att["num_key_value_heads"],
            "attention_groups_removed": removed_groups,
            "attention_live_groups": att["live_groups"],
            "bias_flags_enabled": flags,
            "allocation": self.plan,
        }


def _unit_cost(group: Group) -> int:
    """Parameters one unit of a structured pair holds in one layer: its producer rows (with biases) and
    its consumer columns."""
    assert group.units is not None
    cost = 0
    for name, prod in group.producers.items():
        cost += int(group.units.rows[name].shape[1]) * (prod.in_features + (prod.bias is not None))
    consumer = group.linears[group.leader]
    return cost + int(group.units.columns.shape[1]) * consumer.out_features


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

    Options: ClassVar[type] = FaspOptions

    def __init__(self, options: Any = None, /, **changes: Any) -> None:
        super().__init__(options, **changes)
        # the dense statistics (G) are only needed when refitting against the dense model
        self.needs_dense = self.options.target == "dense"  # type: ignore[misc]

    def unit_scores(
        self, W: torch.Tensor, sq_norms: torch.Tensor, mean: torch.Tensor | None, columns: torch.Tensor
    ) -> torch.Tensor:
        return core.fasp_scores(W, sq_norms, columns)

    def update(
        self, W: torch.Tensor, stats: GroupStats, keep_cols: torch.Tensor, prune_cols: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        G = stats.G if self.options.target == "dense" else None
        try:
            return core.restore_least_squares(W, stats.H, keep_cols, G=G, damp=self.options.damp), None
        except (LeanmlError, torch.linalg.LinAlgError):  # the damped matrix is not positive definite
            raise solver_error("FASP's least-squares restoration", "damp", self.options.damp,
                               stats.H, owner=type(self.options)) from None


class WandaStructuredPruner(StructuredPairPruner):
    """Wanda-sp: FASP's unit score, pruned columns zeroed without restoration."""

    name: ClassVar[str] = "wanda-sp"

    def unit_scores(
        self, W: torch.Tensor, sq_norms: torch.Tensor, mean: torch.Tensor | None, columns: torch.Tensor
    ) -> torch.Tensor:
        return core.fasp_scores(W, sq_norms, columns)


class MagnitudeStructuredPruner(StructuredPairPruner):
    """Magnitude-sp: units ranked by the norms of their consumer columns; no data used."""

    name: ClassVar[str] = "magnitude-sp"
    plan_needs_data: ClassVar[bool] = False

    def unit_scores(
        self, W: torch.Tensor, sq_norms: torch.Tensor, mean: torch.Tensor | None, columns: torch.Tensor
    ) -> torch.Tensor:
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
                    f"use fasp or wanda-sp, or pairs {other[0]}", owner=type(self.options), fields=("pairs",)
                )

    @staticmethod
    def _mean(mean: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
        if mean is None:
            raise LeanmlError("flap needs the calibration input means, which this engine did not provide")
        return mean.to(like.dtype)

    def unit_scores(
        self, W: torch.Tensor, sq_norms: torch.Tensor, mean: torch.Tensor | None, columns: torch.Tensor
    ) -> torch.Tensor:
        return core.flap_scores(W, sq_norms, self._mean(mean, sq_norms), columns)

    def update(
        self, W: torch.Tensor, stats: GroupStats, keep_cols: torch.Tensor, prune_cols: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        delta = core.bias_compensation(W, self._mean(stats.mean, stats.H), prune_cols)
        return core.zero_columns(W, keep_cols), delta
