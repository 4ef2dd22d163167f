"""FISTAPruner behind the layer-wise engine: l1-regularised layer-wise reconstruction solved by FISTA.

Per linear of a group, with the engine's statistics ``H`` (pruned-path input), ``G`` (dense x pruned)
and ``Hd`` (dense input), :func:`leanml.prune.cores.fista.fista_prune` minimises
``1/2 ||W* X* - W X||^2 + lambda ||W*||_1`` (all rows at once), tunes lambda over T rounds and
hard-thresholds to the exact target. The numeric work lives in :mod:`leanml.prune.cores.fista`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, get_args

import torch

from leanml.config import option, require
from leanml.prune.base import Group, GroupStats, LinearSpecs, Pruner, linear_spec
from leanml.prune.cores.fista import fista_prune
from leanml.prune.cores.refine import REFINE_METHODS
from leanml.prune.masks import MaskSpec
from leanml.utils import LeanmlError

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


@dataclass(frozen=True)
class FistaOptions:
    """fista (FISTAPruner)"""

    prefix: ClassVar[str] = "fista-"

    lam: float = option(1e-3, "initial l1 weight, relative to each row's zeroing lambda max|C| (C: the cross "
                              "moment of its target; W G for the paper's)", flag="--fista-lambda")
    iters: int = option(10, "K: FISTA iterations per round")
    rounds: int = option(1, "T: lambda-tuning rounds (1: one FISTA run at the initial lambda; the paper's 3 "
                            "cost about 3x the solve)")
    xi: float = option(0.3, "xi: lambda rises while E_round/E_total exceeds it, else falls")
    warm_start: WarmStart = option("sparsegpt", "start point of FISTA")
    lambda_scope: Literal["row", "layer"] = option("row", "one lambda per output row or one per linear")
    damp: float = option(0.0, "damping of H, fraction of mean diag")
    refine: int = option(5, "least-squares refit iterations of the kept weights after each hard threshold "
                             "(0 = the paper's procedure)")
    refine_method: str = option("cg", "how the kept weights are refit: cg (conjugate gradients, per row on its "
                                      "support) or apg (accelerated projected gradient)", choices=REFINE_METHODS)
    tol: float = option(0.0, "stop a FISTA run early when the relative change falls below this (0: run K)")
    precondition: bool = option(True, "solve in diagonally rescaled variables (same minimiser, much faster "
                                      "convergence); --fista-no-precondition runs FISTA on H itself",
                                negative="--fista-no-precondition")
    correction: float = option(0.5, "weight in [0, 1] of the dense model's outputs in each layer's target: 1 = "
                                    "the dense model's activations (corrects the error of the layers pruned "
                                    "before; the paper's), 0 = the dense layer on the pruned model's inputs "
                                    "(SparseGPT's target), between = a blend")
    precision: Precision = option("auto", "dtype of the solver's matrix products (applied to steps, so the "
                                          "weights keep float32): bfloat16 is several times faster where the "
                                          "hardware has bfloat16 matrix units; auto = bfloat16 on CUDA GPUs of compute "
                                          "capability 8 or more and on CPUs with AVX512-BF16 or AMX, float32 "
                                          "elsewhere")
    ridge: float = option(0.1, "pull the kept weights toward the dense ones: adds R * mean(diag H) * ||W* - W||^2 "
                               "to each layer's objective")

    def __post_init__(self) -> None:
        def finite(x: float) -> bool:
            return math.isfinite(x)

        require(self, finite(self.ridge) and self.ridge >= 0, "ridge", f"must be a finite number >= 0, got {self.ridge}")
        require(self, finite(self.correction) and 0.0 <= self.correction <= 1.0, "correction",
                f"must be a number in [0, 1], got {self.correction}")
        require(self, finite(self.lam) and self.lam >= 0, "lam", f"must be a finite number >= 0, got {self.lam}")
        require(self, self.iters >= 1, "iters", f"(K) must be >= 1, got {self.iters}")
        require(self, self.rounds >= 1, "rounds", f"(T) must be >= 1, got {self.rounds}")
        require(self, finite(self.xi) and self.xi > 0, "xi", f"must be a finite number > 0, got {self.xi}")
        require(self, self.warm_start in WARM_STARTS, "warm_start",
                f"{self.warm_start!r} is unknown; choose one of: {', '.join(WARM_STARTS)}")
        require(self, self.lambda_scope in ("row", "layer"), "lambda_scope",
                f"must be 'row' or 'layer', got {self.lambda_scope!r}")
        require(self, finite(self.damp) and self.damp >= 0, "damp", f"must be a finite number >= 0, got {self.damp}")
        require(self, self.refine >= 0, "refine", f"must be >= 0, got {self.refine}")
        require(self, finite(self.tol) and self.tol >= 0, "tol", f"must be a finite number >= 0, got {self.tol}")
        require(self, self.precision in get_args(Precision), "precision",
                f"{self.precision!r} is unknown; choose one of: {', '.join(get_args(Precision))}")
        require(self, self.refine_method in REFINE_METHODS, "refine_method",
                f"{self.refine_method!r} is unknown; choose one of: {', '.join(REFINE_METHODS)}")
        require(self, not (self.lam == 0 and self.rounds > 1), ("lam", "rounds"),
                "lam 0 cannot be tuned by bisection; give a positive value or rounds 1")


class FistaPruner(Pruner):
    """FISTAPruner (convex l1 layer-wise pruning, FISTA solver, lambda tuning, exact hard threshold), with
    the options of :class:`FistaOptions` (flags ``--fista-*``)."""

    name: ClassVar[str] = "fista"
    needs_dense: ClassVar[bool] = True
    accepts_cross: ClassVar[bool] = True
    default_scope: ClassVar[str] = "layer"
    Options: ClassVar[type] = FistaOptions

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
            res = fista_prune(
                W,
                H,
                lspec,
                G=stats.G,
                C=stats.C[name] if stats.C and name in stats.C else None,
                Hd=stats.Hd,
                dense_const=stats.out_sq[name] if stats.out_sq and name in stats.out_sq else None,
                W_start=start,
                lam=o.lam,
                rounds=o.rounds,
                iters=o.iters,
                xi=o.xi,
                lambda_scope=o.lambda_scope,
                damp=o.damp,
                refine_iters=o.refine,
                tol=o.tol,
                precondition=o.precondition,
                refine_method=o.refine_method,
                correction=o.correction,
                ridge=o.ridge,
                low_dtype=low,
                cache=cache,
            )
            lin.weight.data.copy_(res.W.to(W.dtype))
            err, start_err = float(res.error.sum()), float(res.start_error.sum())
            out[name] = {
                "fista_error": err,
                "warm_start_error": start_err,
                "fista_gain": 1.0 - err / start_err if start_err > 0 else 0.0,
                "lambda_final_mean": float(res.lam.mean()),
                "product_dtype": str(low or H.dtype).removeprefix("torch."),
                "rounds": [{k: v for k, v in h.items() if k != "round"} for h in res.history],
            }
        return out
