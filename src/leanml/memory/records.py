"""What Adacc keeps of a plan: :class:`PlanRecord`, the solver's answer translated to groups and layers
(with its budget, predicted and measured peak), and :class:`ShapePlan`, what is cached per input shape
(the profile, the problem built from it, how its options map back to groups, and the smallest peak).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from leanml.memory.costs import Profile
from leanml.memory.plan_types import Problem, Solution
from leanml.memory.runtime import BITPACK, RECOMPUTE, RETAIN, SELECTIVE
from leanml.memory.structure import GroupKey


@dataclass
class PlanRecord:
    """A plan as applied: the solver's answer translated to groups and layers."""

    layer_checkpoint: list[bool]
    options: dict[GroupKey, str]
    budget_bytes: float
    model_budget_bytes: float
    predicted_peak: float
    predicted_time_s: float
    status: str
    solve_s: float
    measured_peak: int | None = None
    layer_modes: list[str] = field(default_factory=list)  # "" (per group), "checkpoint" or "compiled@b[+X]"
    unoptimized_peak: float = 0.0
    shape: str = ""

    def summary(self) -> dict[str, int]:
        """How many groups take each option (whole-layer options counted per layer)."""
        counts: dict[str, int] = {}
        whole = {i for i, m in enumerate(self.layer_modes) if m} | {i for i, c in enumerate(self.layer_checkpoint) if c}
        for key, opt in self.options.items():
            if key.layer is not None and key.layer in whole:
                continue
            counts[opt] = counts.get(opt, 0) + 1
        counts["checkpoint(layer)"] = sum(self.layer_checkpoint)
        for m in self.layer_modes:
            if m and m != "checkpoint":
                counts[f"{m}(layer)"] = counts.get(f"{m}(layer)", 0) + 1
        return counts

    def lossy(self) -> list[str]:
        """The lossy compressors the plan uses (per group, or inside compiled layers), sorted."""
        return sorted({o for o in self.options.values() if o not in (RETAIN, RECOMPUTE, SELECTIVE, BITPACK)}
                      | {m.partition("+")[2] for m in self.layer_modes if "+" in m})

    def drift_references(self, profile: Profile, caps: dict[str, float],
                         max_error: float) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
        """Per group compressed by the plan (by label): its profiled error, its error cap (``caps``, else
        ``max_error``) and its outlier ratio, what a :class:`~leanml.memory.policy.DriftMonitor` checks
        samples against."""
        errs, cap, outl = {}, {}, {}
        for key, opt in self.options.items():
            g = profile.groups.get(key)
            if g is None or opt in (RETAIN, RECOMPUTE, SELECTIVE, BITPACK) or opt not in g.compress:
                continue
            errs[key.label()] = g.compress[opt].error
            cap[key.label()] = caps.get(opt, max_error)
            outl[key.label()] = g.outlier_ratio
        return errs, cap, outl

    def to_json(self) -> dict[str, Any]:
        return {
            "shape": self.shape,
            "layer_checkpoint": self.layer_checkpoint,
            "layer_modes": self.layer_modes,
            "options": {k.label(): v for k, v in self.options.items()},
            "budget_bytes": self.budget_bytes,
            "model_budget_bytes": self.model_budget_bytes,
            "unoptimized_peak": self.unoptimized_peak,
            "predicted_peak": self.predicted_peak,
            "predicted_time_s": self.predicted_time_s,
            "measured_peak": self.measured_peak,
            "status": self.status,
            "solve_s": self.solve_s,
            "summary": self.summary(),
        }


@dataclass
class ShapePlan:
    """What is cached per input shape: the profile, the problem built from it (``names``/``post_names``:
    the option names of each group in the problem's order), its smallest peak and the plan applied."""

    profile: Profile
    record: PlanRecord
    problem: Problem
    names: list
    post_names: list[str]
    floor: float

    def record_of(self, sol: Solution, budget: float, model_budget: float) -> PlanRecord:
        """The solver's answer as a record: per group its option, per layer its whole-layer mode."""
        options: dict[GroupKey, str] = {}
        modes = []
        for layer, layer_names in enumerate(self.names):
            spec = self.problem.layers[layer]
            w = sol.whole[layer]
            modes.append(spec.whole[w].name if w >= 0 else "")
            for (key, opts), idx in zip(layer_names, sol.choices[layer]):
                options[key] = RETAIN if w >= 0 else opts[idx]
        if self.post_names:
            options[GroupKey(None, "post")] = self.post_names[sol.post]
        return PlanRecord(list(sol.checkpoint), options, budget, model_budget, sol.peak, sol.time, sol.status,
                          sol.solve_s, layer_modes=modes, unoptimized_peak=self.profile.peak_bytes,
                          shape=self.profile.shape)
