"""FISTAPruner behind the layer-wise engine: l1-regularised layer-wise reconstruction solved by FISTA.

Per linear of a group, with the engine's statistics ``H`` (pruned-path input), ``G`` (dense x pruned)
and ``Hd`` (dense input), :func:`leanml.prune.cores.fista.fista_prune` minimises
``1/2 ||W* X* - W X||^2 + lambda ||W*||_1`` (all rows at once), tunes lambda over T rounds and
hard-thresholds to the exact target. The numeric work lives in :mod:`leanml.prune.cores.fista`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal, get_args

import torch

from leanml.config import Bounds, Form, option, require
from leanml.errors import LeanmlError
from leanml.prune.base import Group, GroupStats, LinearSpecs, Pruner, linear_spec
from leanml.prune.cores.fista import FistaProblem, fista_prune
from leanml.prune.cores.refine import REFINE_METHODS
from leanml.prune.masks import MaskSpec

WarmStart = Literal["dense", "magnitude", "wanda", "sparsegpt"]
WARM_STARTS: tuple[str, ...] = get_args(WarmStart)
Precision = Literal["auto", "float32", "bfloat16"]


def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU advertises bfloat16 dot-product or matrix instructions (Linux ``/proc/cpuinfo``
    flags ``avx512_bf16``, ``amx_bf16``); False where that cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        return False
    return False


def solve_low_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The dtype of the FISTA solver's products (None: the working float32) for ``precision`` on ``device``."""
    if precision == "float32":
        return None
    if precision == "bfloat16":
        return torch.bfloat16
    if device.type == "cuda":  # bfloat16 tensor cores from compute capability 8 (Ampere) on
        return torch.bfloat16 if torch.cuda.get_device_capability(device)[0] >= 8 else None
    return torch.bfloat16 if device.type == "cpu" and cpu_has_bf16_matmul() else None


def warm_start_weights(name: str, W: torch.Tensor, stats: GroupStats, spec: MaskSpec, shared: Any = None):
    """The start point of FISTA: the dense weights or a baseline's pruned weights."""
    from leanml.prune.cores.magnitude import magnitude_prune
    from leanml.prune.cores.sparsegpt import sparsegpt_prune
    from leanml.prune.cores.wanda import wanda_prune

    if name == "dense":
        return W
    if name == "magnitude":
        return magnitude_prune(W, spec)
    if name == "wanda":
        return wanda_prune(W, stats.sq_norms, spec)
    if name == "sparsegpt":
        return sparsegpt_prune(W, stats.H, spec, U=shared)
    raise LeanmlError(f"unknown FISTA warm start {name!r}; choose one of: {', '.join(WARM_STARTS)}")


#: the named settings: every field a preset sets, and its value there (``None`` in :class:`FistaOptions`
#: means "the preset's"). ``default``: the best quality at its cost; ``fast``: the cheapest setting
#: measured that still beats SparseGPT clearly (bench/results/prune_frontier.md: one FISTA step; a Wanda
#: start or SparseGPT's target, cheaper still, gave back most of the gain).
PRESETS: dict[str, dict[str, Any]] = {
    "default": {"iters": 10, "refine": 5, "tol": 0.0, "warm_start": "sparsegpt", "correction": 0.5,
                "refit_start": True},
    "fast": {"iters": 1, "refine": 5, "tol": 0.0, "warm_start": "sparsegpt", "correction": 0.5,
             "refit_start": True},
}
Preset = Literal["default", "fast"]


@dataclass(frozen=True)
class FistaOptions:
    """fista (FISTAPruner)"""

    prefix: ClassVar[str] = "fista-"

    preset: Preset | None = option(None, "named setting: default (the best quality at its cost) or fast (one "
                                         "FISTA step: the cheapest measured setting that beats SparseGPT; see "
                                         "docs/fista.md); it fills "
                                         "iters, refine, tol, warm-start, correction and refit-start, and refuses "
                                         "an explicit one that differs", form=Form(show_default=False))
    lam: float = option(1e-3, "initial l1 weight, relative to each row's zeroing lambda max|C| (C: the cross "
                              "moment of its target; W G for the paper's)", flag="--fista-lambda",
                        bounds=Bounds(ge=0))
    iters: int | None = option(None, "K: most FISTA iterations per round (default: the preset's)",
                               bounds=Bounds(ge=1),
                               form=Form(show_default=False))
    rounds: int = option(1, "T: lambda-tuning rounds (1: one FISTA run at the initial lambda; the paper's 3 "
                            "cost about 3x the solve)", bounds=Bounds(ge=1))
    xi: float = option(0.3, "xi: lambda rises while E_round/E_total exceeds it, else falls",
                       bounds=Bounds(ge=0))
    warm_start: WarmStart | None = option(None, "start point of FISTA (default: the preset's)",
                                          form=Form(show_default=False))
    lambda_scope: Literal["row", "layer"] = option("row", "one lambda per output row or one per linear")
    damp: float = option(0.0, "damping of H, fraction of mean diag", bounds=Bounds(ge=0))
    refine: int | None = option(None, "most least-squares refit iterations of the kept weights after each hard "
                                      "threshold (0 = the paper's procedure; default: the preset's)",
                                bounds=Bounds(ge=0),
                                form=Form(show_default=False))
    refine_method: str = option("cg", "how the kept weights are refit: cg (conjugate gradients, per row on its "
                                      "support) or apg (accelerated projected gradient)",
                                form=Form(choices=REFINE_METHODS))
    tol: float | None = option(None, "stop FISTA and the refit of a block of rows once its optimality residual is "
                                     "below this fraction of the norm of its target's cross moment (0: run the "
                                     "most iterations; default: the preset's)", bounds=Bounds(ge=0),
                               form=Form(show_default=False))
    precondition: bool = option(True, "solve in diagonally rescaled variables (same minimiser, much faster "
                                      "convergence); off, FISTA runs on H itself",
                                form=Form(negative="--fista-no-precondition"))
    correction: float | None = option(None, "weight in [0, 1] of the dense model's outputs in each layer's "
                                            "target: 1 = the dense model's activations (corrects the error of "
                                            "the layers pruned before; the paper's), 0 = the dense layer on the "
                                            "pruned model's inputs (SparseGPT's target, and no dense pass), "
                                            "between = a blend (default: the preset's)",
                                      bounds=Bounds(ge=0, le=1),
                                      form=Form(show_default=False))
    precision: Precision = option("auto", "dtype of the solver's matrix products (applied to steps, so the "
                                          "weights keep float32): bfloat16 is several times faster where the "
                                          "hardware has bfloat16 matrix units; auto = bfloat16 on CUDA GPUs of compute "
                                          "capability 8 or more and on CPUs with AVX512-BF16 or AMX, float32 "
                                          "elsewhere")
    ridge: float = option(0.1, "pull the kept weights toward the dense ones: adds R * mean(diag H) * ||W* - W||^2 "
                               "to each layer's objective", bounds=Bounds(ge=0))
    refit_start: bool | None = option(None, "refit the warm start's kept weights too, as a second candidate per "
                                            "row (default: the preset's)", form=Form(show_default=False))

    def __post_init__(self) -> None:
        chosen = PRESETS[self.preset or "default"]
        for name, value in chosen.items():
            mine = getattr(self, name)
            if mine is None:
                object.__setattr__(self, name, value)  # filled once, where the options are made
            else:
                require(self, self.preset is None or mine == value, ("preset", name),
                        f"preset {self.preset} sets {name} to {value!r}; {name} {mine!r} conflicts with it: "
                        f"drop one of the two")
        require(self, not (self.lam == 0 and self.rounds > 1), ("lam", "rounds"),
                "lam 0 cannot be tuned by bisection; give a positive value or rounds 1")


class FistaPruner(Pruner):
    """FISTAPruner (convex l1 layer-wise pruning, FISTA solver, lambda tuning, exact hard threshold), with
    the options of :class:`FistaOptions` (flags ``--fista-*``)."""

    name: ClassVar[str] = "fista"
    accepts_cross: ClassVar[bool] = True
    default_scope: ClassVar[str] = "layer"
    Options: ClassVar[type] = FistaOptions

    @property
    def needs_dense(self) -> bool:  # type: ignore[override]
        """The dense model's statistics only serve a target that blends in its outputs (``correction > 0``)."""
        return bool(self.options.correction)

    def prune_group(self, group: Group, stats: GroupStats, spec: LinearSpecs) -> dict[str, dict[str, Any]]:
        """Prune every linear of the group; what depends on ``H`` alone (its damped, ridged and
        preconditioned forms, Lipschitz constants) is computed once per group."""
        o = self.options
        H = stats.H.to(torch.promote_types(stats.H.dtype, torch.float32))
        cache: dict[str, Any] = {}  # the solver's matrices, shared by the group's linears
        shared = None
        if o.warm_start == "sparsegpt":
            from leanml.prune.cores.sparsegpt import hinv_upper

            shared = hinv_upper(stats.H, 0.01)[0]
        low = solve_low_dtype(o.precision, H.device)
        out: dict[str, dict[str, Any]] = {}
        for name, lin in group.linears.items():
            W = lin.weight.data
            lspec = linear_spec(spec, name)
            start = warm_start_weights(o.warm_start, W, stats, lspec, shared)
            problem = FistaProblem(
                G=stats.G if self.needs_dense else None,
                C=stats.C[name] if self.needs_dense and stats.C and name in stats.C else None,
                Hd=stats.Hd if self.needs_dense else None,
                dense_const=stats.out_sq[name] if self.needs_dense and stats.out_sq and name in stats.out_sq else None,
                W_start=start,
            )
            res = fista_prune(W, H, lspec, o, problem, low_dtype=low, cache=cache)
            lin.weight.data.copy_(res.W.to(W.dtype))
            out[name] = self._report(res, low or H.dtype)
        return out

    @staticmethod
    def _report(res: Any, product_dtype: torch.dtype) -> dict[str, Any]:
        err, start_err = float(res.error.sum()), float(res.start_error.sum())
        report = {
            "fista_error": err,
            "warm_start_error": start_err,
            "fista_gain": 1.0 - err / start_err if start_err > 0 else 0.0,
            "lambda_final_mean": float(res.lam.mean()),
            "product_dtype": str(product_dtype).removeprefix("torch."),
            "fista_iters": sum(res.fista_iters),
            "refine_iters_used": res.refine_iters_used,
            "rounds": [{k: v for k, v in h.items() if k != "round"} for h in res.history],
        }
        if res.fallback_rows:
            report["fallback_rows"] = res.fallback_rows
            report["warning"] = (f"{res.fallback_rows} row(s) gave a non-finite solve and kept their warm start; "
                                 "raise damp or use precision float32")
        return report
