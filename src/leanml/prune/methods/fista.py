"""FISTAPruner behind the layer-wise engine: l1-regularised layer-wise reconstruction solved by FISTA.

Per linear of a group, with the engine's statistics ``H`` (pruned-path input), ``G`` (dense x pruned)
and ``Hd`` (dense input), :func:`leanml.prune.cores.fista.fista_prune` minimises
``1/2 ||W* X* - W X||^2 + lambda ||W*||_1`` (all rows at once), tunes lambda over T rounds and
hard-thresholds to the exact target. The numeric work lives in :mod:`leanml.prune.cores.fista`.
"""

from __future__ import annotations

import argparse
import inspect
import math
from typing import Any, ClassVar

import torch

from leanml.prune.base import Group, GroupStats, LinearSpecs, Pruner, linear_spec
from leanml.prune.cores.fista import fista_prune, power_iteration, shift_diagonal
from leanml.prune.cores.refine import REFINE_METHODS
from leanml.prune.masks import MaskSpec
from leanml.utils import LeanmlError

WARM_STARTS = ("dense", "magnitude", "wanda", "sparsegpt")


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


class FistaPruner(Pruner):
    """FISTAPruner (convex l1 layer-wise pruning, FISTA solver, lambda tuning, exact hard threshold).

    Options (CLI ``--fista-*``): ``lam`` initial lambda relative to each row's zeroing lambda
    ``max_j |C_rj|``; ``iters`` K FISTA iterations per round; ``rounds`` T lambda-tuning rounds (default 1:
    one FISTA run at the initial lambda; the paper's 3 rounds cost about 3x the solve); ``xi``
    the target of ``E_round / E_total``; ``warm_start``; ``lambda_scope`` one lambda per row or per
    layer; ``damp`` damping of ``H`` (fraction of its mean diagonal); ``refine`` iterations of a
    least-squares refit of the kept weights after the hard threshold (0 = the paper's procedure);
    ``precondition`` solve in diagonally rescaled variables (same minimiser, much faster convergence).
    """

    name: ClassVar[str] = "fista"
    needs_dense: ClassVar[bool] = True
    accepts_cross: ClassVar[bool] = True
    default_scope: ClassVar[str] = "layer"

    def __init__(
        self,
        lam: float = 1e-3,
        iters: int = 20,
        rounds: int = 1,
        xi: float = 0.3,
        warm_start: str = "sparsegpt",
        lambda_scope: str = "row",
        damp: float = 0.0,
        refine: int = 20,
        tol: float = 0.0,
        precondition: bool = True,
        refine_method: str = "cg",
        correction: float = 0.5,
        ridge: float = 0.1,
    ) -> None:
        if not (math.isfinite(ridge) and ridge >= 0):
            raise LeanmlError(f"--fista-ridge must be a finite number >= 0, got {ridge}")
        if not (math.isfinite(correction) and 0.0 <= correction <= 1.0):
            raise LeanmlError(f"--fista-correction must be a number in [0, 1], got {correction}")
        if not (math.isfinite(lam) and lam >= 0):
            raise LeanmlError(f"--fista-lambda must be a finite number >= 0, got {lam}")
        if iters < 1:
            raise LeanmlError(f"--fista-iters (K) must be >= 1, got {iters}")
        if rounds < 1:
            raise LeanmlError(f"--fista-rounds (T) must be >= 1, got {rounds}")
        if not (math.isfinite(xi) and xi > 0):
            raise LeanmlError(f"--fista-xi must be a finite number > 0, got {xi}")
        if warm_start not in WARM_STARTS:
            raise LeanmlError(f"unknown --fista-warm-start {warm_start!r}; choose one of: {', '.join(WARM_STARTS)}")
        if lambda_scope not in ("row", "layer"):
            raise LeanmlError(f"--fista-lambda-scope must be 'row' or 'layer', got {lambda_scope!r}")
        if not (math.isfinite(damp) and damp >= 0):
            raise LeanmlError(f"--fista-damp must be a finite number >= 0, got {damp}")
        if refine < 0:
            raise LeanmlError(f"--fista-refine must be >= 0, got {refine}")
        if not (math.isfinite(tol) and tol >= 0):
            raise LeanmlError(f"--fista-tol must be a finite number >= 0, got {tol}")
        if refine_method not in REFINE_METHODS:
            raise LeanmlError(f"unknown --fista-refine-method {refine_method!r}; choose one of: {', '.join(REFINE_METHODS)}")
        if lam == 0 and rounds > 1:
            raise LeanmlError("--fista-lambda 0 cannot be tuned by bisection; give a positive value or --fista-rounds 1")
        self.lam = lam
        self.iters = iters
        self.rounds = rounds
        self.xi = xi
        self.warm_start = warm_start
        self.lambda_scope = lambda_scope
        self.damp = damp
        self.refine = refine
        self.tol = tol
        self.precondition = precondition
        self.refine_method = refine_method
        self.correction = correction
        self.ridge = ridge

    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser) -> None:
        # the defaults are the constructor's: the CLI and the Python API cannot drift apart
        d = {k: v.default for k, v in inspect.signature(cls.__init__).parameters.items() if k != "self"}
        g = parser.add_argument_group("fista (FISTAPruner)")
        g.add_argument(
            "--fista-lambda", type=float, default=d["lam"],
            help="initial l1 weight, relative to each row's zeroing lambda max|C| (C: the cross moment of its target; W G for the paper's) (default %(default)s)",
        )  # fmt: skip
        g.add_argument("--fista-iters", type=int, default=d["iters"],
                       help="K: FISTA iterations per round (default %(default)s)")
        g.add_argument("--fista-rounds", type=int, default=d["rounds"], help="T: lambda-tuning rounds (default %(default)s)")
        g.add_argument(
            "--fista-xi", type=float, default=d["xi"],
            help="xi: lambda rises while E_round/E_total exceeds it, else falls (default %(default)s)",
        )  # fmt: skip
        g.add_argument(
            "--fista-warm-start", default=d["warm_start"], choices=WARM_STARTS,
            help="start point of FISTA (default %(default)s)",
        )  # fmt: skip
        g.add_argument(
            "--fista-lambda-scope", default=d["lambda_scope"], choices=("row", "layer"),
            help="one lambda per output row or one per linear (default %(default)s)",
        )  # fmt: skip
        g.add_argument("--fista-damp", type=float, default=d["damp"],
                       help="damping of H, fraction of mean diag (default %(default)s)")
        g.add_argument(
            "--fista-refine", type=int, default=d["refine"],
            help="least-squares refit iterations of the kept weights after each hard threshold "
            "(default %(default)s; 0 = the paper's procedure)",
        )  # fmt: skip
        g.add_argument(
            "--fista-refine-method", default=d["refine_method"], choices=REFINE_METHODS,
            help="how the kept weights are refit: cg (conjugate gradients, per row on its support) or apg "
            "(accelerated projected gradient) (default %(default)s)",
        )  # fmt: skip
        g.add_argument(
            "--fista-tol", type=float, default=d["tol"],
            help="stop a FISTA run early when the relative change falls below this (default %(default)s: run K)",
        )  # fmt: skip
        g.add_argument(
            "--fista-no-precondition", action="store_true",
            help="run FISTA on H itself instead of the diagonally rescaled problem (same minimiser, slower)",
        )  # fmt: skip
        g.add_argument(
            "--fista-correction", type=float, default=d["correction"],
            help="weight in [0, 1] of the dense model's outputs in each layer's target: 1 = the dense model's "
            "activations (corrects the error of the layers pruned before; the paper's), 0 = the dense layer "
            "on the pruned model's inputs (SparseGPT's target), between = a blend (default %(default)s)",
        )  # fmt: skip
        g.add_argument(
            "--fista-ridge", type=float, default=d["ridge"],
            help="pull the kept weights toward the dense ones: adds R * mean(diag H) * ||W* - W||^2 to each "
            "layer's objective (default %(default)s)",
        )  # fmt: skip

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> FistaPruner:
        return cls(
            lam=args.fista_lambda,
            iters=args.fista_iters,
            rounds=args.fista_rounds,
            xi=args.fista_xi,
            warm_start=args.fista_warm_start,
            lambda_scope=args.fista_lambda_scope,
            damp=args.fista_damp,
            refine=args.fista_refine,
            tol=args.fista_tol,
            precondition=not args.fista_no_precondition,
            refine_method=args.fista_refine_method,
            correction=args.fista_correction,
            ridge=args.fista_ridge,
        )

    def config(self) -> dict[str, Any]:
        return {
            "lambda": self.lam,
            "iters": self.iters,
            "rounds": self.rounds,
            "xi": self.xi,
            "warm_start": self.warm_start,
            "lambda_scope": self.lambda_scope,
            "damp": self.damp,
            "refine": self.refine,
            "tol": self.tol,
            "precondition": self.precondition,
            "refine_method": self.refine_method,
            "correction": self.correction,
            "ridge": self.ridge,
        }

    def prune_group(self, group: Group, stats: GroupStats, spec: LinearSpecs) -> dict[str, dict[str, Any]]:
        """Prune every linear of the group; L (power iteration on H) is computed once per group."""
        H = stats.H.to(torch.promote_types(stats.H.dtype, torch.float32))
        Hs = H
        if self.damp > 0:
            Hs = shift_diagonal(H, self.damp * float(torch.diagonal(H).mean()))
        L = power_iteration(Hs) * 1.001
        shared = None
        if self.warm_start == "sparsegpt":
            from leanml.prune.cores.sparsegpt import hinv_upper

            shared = hinv_upper(stats.H, 0.01)[0]
        out: dict[str, dict[str, Any]] = {}
        for name, lin in group.linears.items():
            W = lin.weight.data
            lspec = linear_spec(spec, name)
            start = warm_start_weights(self.warm_start, W, stats, lspec, shared)
            res = fista_prune(
                W,
                H,
                lspec,
                G=stats.G,
                C=stats.C[name] if stats.C and name in stats.C else None,
                Hd=stats.Hd,
                dense_const=stats.out_sq[name] if stats.out_sq and name in stats.out_sq else None,
                W_start=start,
                lam=self.lam,
                rounds=self.rounds,
                iters=self.iters,
                xi=self.xi,
                lambda_scope=self.lambda_scope,
                damp=self.damp,
                refine_iters=self.refine,
                tol=self.tol,
                L=L,
                precondition=self.precondition,
                refine_method=self.refine_method,
                correction=self.correction,
                ridge=self.ridge,
            )
            lin.weight.data.copy_(res.W.to(W.dtype))
            err, start_err = float(res.error.sum()), float(res.start_error.sum())
            out[name] = {
                "fista_error": err,
                "warm_start_error": start_err,
                "fista_gain": 1.0 - err / start_err if start_err > 0 else 0.0,
                "lambda_final_mean": float(res.lam.mean()),
                "rounds": [{k: v for k, v in h.items() if k != "round"} for h in res.history],
            }
        return out
