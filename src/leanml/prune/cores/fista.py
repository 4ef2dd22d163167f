"""Numeric core of FISTAPruner: convex l1 layer-wise pruning solved by FISTA, then an exact hard threshold.

For one linear operator with dense weight ``W`` (m x n), dense input ``X`` and pruned-path input ``X*``
(columns are tokens), the engine gives the token-averaged statistics ``H = X* X*^T / N`` and
``G = X X*^T / N`` (and ``Hd = X X^T / N``). With ``C = W G`` the problem

    minimise over W*:  1/2 tr(W* H W*^T) - tr(C W*^T) + lambda * ||W*||_1

equals ``1/(2N) ||W* X* - W X||_F^2 + lambda ||W*||_1`` up to a constant. It separates by output row,
so every function here works on all rows at once with matrix products; ``lambda`` is a scalar or one
value per row.

Everything in this module is a pure function of tensors (no model objects, no I/O):

- :class:`LambdaTuner` / :func:`tune_lambda` -- the T-round lambda search by bisection on
  ``E_round / E_total`` against ``xi``,
- :func:`fista_prune` -- the whole per-operator procedure.

Every knob comes from one options object (:class:`FistaSettings`: ``FistaOptions`` declares each field
and its default once); the functions here have no defaults of their own.

The problem's pieces and FISTA itself (Lipschitz constant, thresholds, objective, :func:`fista_solve`)
live in :mod:`leanml.prune.cores.lasso`; the output errors and the refit of the kept weights in
:mod:`leanml.prune.cores.refine`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from leanml.prune.cores.lasso import (
    FistaSteps,
    fista_solve,
    power_iteration,
    prune_scores,
    row_lambda,
    shift_diagonal,
)
from leanml.prune.cores.refine import (
    Refit,
    fill_kept_zeros,
    gram_product,
    refine_apg,
    refine_cg,
    row_blocks,
    row_dot,
    row_output_errors,
)
from leanml.prune.masks import MaskSpec, keep_mask


class FistaSettings(Protocol):
    """What the per-operator procedure reads from its options (``FistaOptions`` of
    :mod:`leanml.prune.methods.fista` declares each field and its default, once)."""

    lam: float
    iters: int
    rounds: int
    xi: float
    lambda_scope: str
    damp: float
    refine: int
    refine_method: str
    tol: float
    precondition: bool
    correction: float
    ridge: float
    refit_start: bool


@dataclass
class TuneResult:
    """Output of :func:`tune_lambda` / :func:`fista_prune`."""

    W: torch.Tensor  # exactly sparse
    lam: torch.Tensor  # final lambda per row (m,)
    error: torch.Tensor  # per-row output error of W (m,)
    start_error: torch.Tensor  # per-row output error of the hard-thresholded start point (m,)
    history: list[dict[str, Any]] = field(default_factory=list)
    #: the step's Lipschitz constant: of the preconditioned matrix when FISTA ran preconditioned
    L: float = 0.0
    #: FISTA iterations run per round (the most any block of rows ran), refit iterations per block (mean)
    fista_iters: list[int] = field(default_factory=list)
    refine_iters_used: float = 0.0
    #: rows whose solve gave a non-finite value and that kept their warm start instead
    fallback_rows: int = 0


class LambdaTuner:
    """T rounds of FISTA + hard threshold for one linear, keeping the sparse solution of least output error.

    Round ``t`` runs up to ``iters`` FISTA iterations at the current lambda, warm-started from the best
    FISTA iterate so far (round 1: the start point), hard-thresholds it to ``spec``, refits the kept
    weights (up to ``refine`` iterations), and measures per row the rounding error
    ``E_round = ||(W_round - W_fista) X*||`` and the total error ``E_total = ||W_round X* - W X||``.
    A row (``lambda_scope="row"``) or the whole matrix (``"layer"``) keeps the candidate with the least
    ``E_total``; with a per-layer mask (``spec.scope == "layer"``) candidates are compared for the whole
    matrix so the exact layer sparsity holds. Lambda then moves by geometric bisection: if
    ``E_round / E_total > xi`` the FISTA solution was too dense, lambda rises (x10 until an upper
    bound is known), else it falls (/10 until a lower bound is known). Both solvers stop a block of rows
    early once it is stationary to ``tol`` (see :func:`~leanml.prune.cores.refine.converged`).

    The hard-thresholded start (refit too with ``refit_start``) is itself a candidate, so the result
    never has a larger output error than the start point rounded to ``spec``. A candidate row that is
    not finite (a diverging solve) is never chosen; a start row that is not finite after its refit
    falls back to the start rounded, and ``fallback_rows`` counts both. ``H_solve`` (e.g. damped ``H``)
    is used inside FISTA; errors are always measured with ``H``.

    ``precondition``: FISTA runs on the same problem in the variables ``V = W D`` with
    ``D = diag(sqrt(diag H))``, i.e. on ``D^-1 H D^-1`` (unit diagonal, far better conditioned when a
    few input features carry most of the energy) with the weighted penalty ``sum_j |v_j| / d_j``.
    The minimiser is unchanged; only the iterates reach it faster.

    ``low_dtype`` (e.g. ``torch.bfloat16``): the products inside FISTA and the refits run in that dtype
    on differences (a step, a search direction, ``W_round - W_fista``); every candidate's product and
    error is computed in the working dtype, and a refit row that is worse than its start, measured so,
    keeps its start.

    ``cache``: a dict that linears sharing ``H_solve`` (same damping and ridge) pass alike; the first
    linear fills it with what depends on that matrix alone (its preconditioned form, Lipschitz constants,
    narrow copies), the next ones reuse it. ``L`` is computed only when the solver needs it.
    """

    def __init__(self, H: torch.Tensor, C: torch.Tensor, dense_const: torch.Tensor, spec: MaskSpec,
                 options: FistaSettings, solve: Solve) -> None:
        self.H, self.C, self.dense_const, self.spec, self.o = H, C, dense_const, spec, options
        self.m = C.shape[0]
        self.blocks = row_blocks(self.m, C.shape[1], C)
        self.used: list[int] = []
        self.fallback = 0
        self._matrices(solve)

    # ------------------------------------------------------------ the solver's matrices
    def _matrices(self, solve: Solve) -> None:
        """``Hs`` (the solver's matrix), its preconditioned form and narrow copies, from ``cache``."""
        H, cache, low = self.H, solve.cache, solve.low_dtype
        self.Hs = Hs = H if solve.H_solve is None else solve.H_solve
        self.shared = Hs is H  # products with the solver's matrix serve for the errors too (no damping)
        self.cache = cache
        if solve.L is not None:
            cache["L"] = solve.L
        self.d = None
        if self.o.precondition:
            if "Hp" not in cache:
                d = torch.diagonal(Hs).clamp_min(0).sqrt()
                cache["d"] = torch.where(d > 0, d, torch.ones_like(d))
                cache["Hp"] = Hs / cache["d"].unsqueeze(0) / cache["d"].unsqueeze(1)
                cache["Lp"] = power_iteration(cache["Hp"]) * 1.001
            self.d, self.Hp, self.Lp = cache["d"], cache["Hp"], cache["Lp"]
        elif "L" not in cache:
            cache["L"] = power_iteration(Hs) * 1.001
        if low is not None and "Hs_low" not in cache:
            cache["Hs_low"] = Hs.to(low)
            cache["Hp_low"] = None if self.d is None else self.Hp.to(low)
        if low is not None and not self.shared and "H_low" not in cache:
            cache["H_low"] = H.to(low)
        self.Hs_low, self.Hp_low = cache.get("Hs_low"), cache.get("Hp_low")
        self.H_err_low = self.Hs_low if self.shared else cache.get("H_low")

    def lipschitz(self) -> float:
        """``lambda_max(Hs)``, computed on first use (the preconditioned solver needs only ``Lp``)."""
        if "L" not in self.cache:
            self.cache["L"] = power_iteration(self.Hs) * 1.001
        return self.cache["L"]

    # ------------------------------------------------------------ steps on one block of rows (``s``)
    # Products are carried in the original variables: ``X @ Hs``. In the rescaled ones (V = W D,
    # Hp = D^-1 Hs D^-1) the product V @ Hp equals (W @ Hs) / d.
    def refit(self, s: slice, Wr: torch.Tensor, mask: torch.Tensor,
              WrH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The kept weights of rows ``s`` refit on their support (``refine`` iterations at most)."""
        o, d, C = self.o, self.d, self.C
        steps = Refit(o.refine, o.tol, self.used)
        if o.refine_method == "cg":
            if d is None:
                return refine_cg(Wr, mask, self.Hs, C[s], steps, WrH, self.Hs_low)
            V, VH = refine_cg(Wr * d, mask, self.Hp, C[s] / d, steps, WrH / d, self.Hp_low)
        else:
            if d is None:
                return refine_apg(Wr, mask, self.Hs, C[s], self.lipschitz(), steps, WrH, self.Hs_low)
            V, VH = refine_apg(Wr * d, mask, self.Hp, C[s] / d, self.Lp, steps, WrH / d, self.Hp_low)
        return V / d, VH * d

    def rounded(self, Wx: torch.Tensor, WxH: torch.Tensor, mask: torch.Tensor, rounding: bool,
                refit: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``Wx`` (with ``WxH = Wx @ Hs``) hard-thresholded to ``mask`` and (with ``refit``) refit: the
        weights, their per-row output error and, with ``rounding``, the rounding error
        ``||(W_round - Wx) X*||`` per row."""
        H, C, dc = self.H, self.C, self.dense_const
        out, err = torch.empty_like(Wx), Wx.new_empty(self.m)
        e_round = Wx.new_empty(self.m) if rounding else None
        for s in self.blocks:
            Wb, WbH, mb = Wx[s], WxH[s], mask[s]
            Wr = Wb * mb
            # a block already within the mask (a pruned warm start) keeps its product
            WrH = Wr @ self.Hs if rounding or bool(((Wb != 0) & ~mb).any()) else WbH
            if rounding:
                D = Wr - Wb
                # from the two products at hand, or (products in the narrow dtype) from the difference
                if self.H_err_low is None:
                    DH = (WrH - WbH) if self.shared else D @ H
                else:
                    DH = gram_product(D, H, self.H_err_low)
                e_round[s] = row_dot(DH, D).clamp_min(0.0).sqrt()  # type: ignore[index]
                del D, DH
            if refit and self.o.refine > 0:
                Wr, WrH = self.refit(s, Wr, mb, WrH)
            elif rounding:
                Wr, WrH = fill_kept_zeros(Wr, mb, H, C[s], dc[s]), None
            err[s] = row_output_errors(Wr, H, C[s], dc[s], WrH if self.shared else None)
            out[s] = Wr
        return out, err, e_round

    def masked(self, Wx: torch.Tensor, WxH: torch.Tensor) -> torch.Tensor:
        """The mask ``spec`` keeps of ``Wx``, ranked by :func:`prune_scores` (the gradient ``WxH - C``)."""
        scores = torch.empty_like(Wx)
        for s in self.blocks:
            scores[s] = prune_scores(Wx[s], WxH[s] - self.C[s])
        return keep_mask(scores, self.spec)

    def solve(self, W0: torch.Tensor, W0H: torch.Tensor,
              lam: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, int]]:
        """FISTA from ``W0`` at ``lam`` over every block: the iterate, its product, and counts."""
        o, d, C = self.o, self.d, self.C
        Wf, WfH = torch.empty_like(W0), torch.empty_like(W0)
        counts = {"restarts": 0, "nonzero": 0, "iters": 0}
        for s in self.blocks:
            if d is None:
                steps = FistaSteps(iters=o.iters, tol=o.tol, track=False, L=self.lipschitz())
                res = fista_solve(self.Hs, C[s], lam[s], W0=W0[s], steps=steps, W0H=W0H[s], H_low=self.Hs_low)
                Wf[s], WfH[s] = res.W, res.WH
            else:
                steps = FistaSteps(iters=o.iters, tol=o.tol, track=False, L=self.Lp)
                res = fista_solve(self.Hp, C[s] / d, lam[s], W0=W0[s] * d, steps=steps, col_weights=1.0 / d,
                                  W0H=W0H[s] / d, H_low=self.Hp_low)
                Wf[s], WfH[s] = res.W / d, res.WH * d  # type: ignore[operator]
            counts["restarts"] += res.restarts
            counts["nonzero"] += int((res.W != 0).sum())
            counts["iters"] = max(counts["iters"], res.iters)
            del res
        return Wf, WfH, counts

    # ------------------------------------------------------------ the procedure
    def start_candidate(self, start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The start rounded to the mask (and refit with ``refit_start``): weights, errors, and the start's
        product. Rows that come out non-finite fall back to the start rounded without a refit."""
        startH = start @ self.Hs
        mask = self.masked(start, startH)
        W, err, _ = self.rounded(start, startH, mask, rounding=False, refit=self.o.refit_start)
        bad = ~(torch.isfinite(err) & torch.isfinite(W).all(1))
        if bool(bad.any()):
            plain = start * mask
            W = torch.where(bad.unsqueeze(1), plain, W)
            err = torch.where(bad, row_output_errors(plain, self.H, self.C, self.dense_const), err)
            self.fallback += int(bad.sum())
        return W, err, startH, mask

    def run(self, lam0: torch.Tensor | float, start: torch.Tensor) -> TuneResult:
        o = self.o
        lam = row_lambda(lam0, self.m, self.C).reshape(-1).clone()
        if o.lambda_scope == "layer":
            lam = lam.mean().expand(self.m).clone()
        lo, hi = torch.zeros_like(lam), torch.full_like(lam, float("inf"))
        best_sparse, best_err, startH, _ = self.start_candidate(start)
        start_err = best_err.clone()
        best_iterate, best_iterateH = start, startH
        history: list[dict[str, Any]] = []
        iters: list[int] = []
        layer_choice = (self.spec.scope == "layer" and self.spec.pattern is None) or o.lambda_scope == "layer"
        for r in range(o.rounds):
            Wf, WfH, counts = self.solve(best_iterate, best_iterateH, lam)
            iters.append(counts["iters"])
            Wr, err, e_round = self.rounded(Wf, WfH, self.masked(Wf, WfH), rounding=True)
            assert e_round is not None
            finite = torch.isfinite(err) & torch.isfinite(Wr).all(1) & torch.isfinite(Wf).all(1)
            self.fallback += int((~finite).sum())
            if layer_choice:
                better = torch.full_like(err, bool(finite.all() and err.sum() < best_err.sum()), dtype=torch.bool)
            else:
                better = finite & (err < best_err)
            bc = better.unsqueeze(1)
            best_sparse = torch.where(bc, Wr, best_sparse)
            best_iterate = torch.where(bc, Wf, best_iterate)
            best_iterateH = torch.where(bc, WfH, best_iterateH)
            best_err = torch.where(better, err, best_err)
            del Wr, Wf, WfH
            ratio = self._ratio(e_round, err, lam)
            history.append({"round": r + 1, "lambda_mean": float(lam.mean()), "ratio_mean": float(ratio.mean()),
                            "error": float(err.sum()), "best_error": float(best_err.sum()),
                            "fista_nonzero": counts["nonzero"] / start.numel(), "restarts": counts["restarts"],
                            "fista_iters": counts["iters"]})
            lam, lo, hi = self._bisect(ratio, lam, lo, hi)
        L = self.Lp if self.d is not None else self.lipschitz()
        used = sum(self.used) / len(self.used) if self.used else 0.0
        return TuneResult(W=best_sparse, lam=lam, error=best_err, start_error=start_err, history=history, L=L,
                          fista_iters=iters, refine_iters_used=used, fallback_rows=self.fallback)

    def _ratio(self, e_round: torch.Tensor, err: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
        """``E_round / E_total`` per row (one value for the layer with ``lambda_scope="layer"``); a
        non-finite ratio counts as "too dense" (lambda rises)."""
        e_total = err.sqrt()
        if self.o.lambda_scope == "layer":
            ratio_l = float(e_round.pow(2).sum().sqrt()) / max(float(e_total.pow(2).sum().sqrt()), 1e-30)
            ratio = torch.full_like(lam, ratio_l)
        else:
            ratio = e_round / e_total.clamp_min(1e-30)
        return torch.nan_to_num(ratio, nan=float("inf"))

    def _bisect(self, ratio: torch.Tensor, lam: torch.Tensor, lo: torch.Tensor,
                hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Geometric bisection of lambda on ``ratio`` against ``xi``: (lambda, lower, upper bound)."""
        up = ratio > self.o.xi
        lo = torch.where(up, lam, lo)
        hi = torch.where(up, hi, lam)
        lam = torch.where(
            up,
            torch.where(torch.isfinite(hi), (lo * hi).sqrt(), lam * 10.0),
            torch.where(lo > 0, (lo * hi).sqrt(), lam / 10.0),
        )
        return lam, lo, hi


@dataclass
class Solve:
    """What one solve needs besides the options: the solver's matrix (``H`` damped; None: ``H``), a known
    Lipschitz constant, the dtype of the solver's products, and the cache shared by a group's linears."""

    H_solve: torch.Tensor | None = None
    L: float | None = None
    low_dtype: torch.dtype | None = None
    cache: dict[str, Any] = field(default_factory=dict)


def tune_lambda(
    start: torch.Tensor,
    H: torch.Tensor,
    C: torch.Tensor,
    dense_const: torch.Tensor,
    spec: MaskSpec,
    lam0: torch.Tensor | float,
    options: FistaSettings,
    solve: Solve | None = None,
) -> TuneResult:
    """:class:`LambdaTuner` on one linear: ``options`` (see :class:`FistaSettings`) from ``start`` (the
    dense weights or a warm start); ``solve`` (default: :class:`Solve`'s defaults) as in :class:`Solve`."""
    tuner = LambdaTuner(H, C, dense_const, spec, options, Solve() if solve is None else solve)
    return tuner.run(lam0, start.to(C.dtype))


@dataclass(frozen=True)
class FistaProblem:
    """What :func:`fista_prune` may be given besides ``W`` and ``H``: the dense statistics ``G``/``Hd``
    (default ``H``: no dense/pruned distinction), or instead the product ``C = W G`` and the per-row
    ``dense_const = w Hd w^T`` (the dense output's mean square); the start ``W_start`` (default ``W``);
    and the Lipschitz constant ``L`` of the (damped) ``H`` when several linears share it."""

    G: torch.Tensor | None = None
    Hd: torch.Tensor | None = None
    W_start: torch.Tensor | None = None
    L: float | None = None
    dense_const: torch.Tensor | None = None
    C: torch.Tensor | None = None


def _targets(W: torch.Tensor, H: torch.Tensor, o: FistaSettings,
             p: FistaProblem) -> tuple[torch.Tensor, torch.Tensor]:
    """``C`` and the per-row dense energy of the blended target ``beta Y_dense + (1 - beta) W X*``."""
    G, Hd, C, dense_const = p.G, p.Hd, p.C, p.dense_const
    if C is None:
        C = W @ (H if G is None else G.to(W.dtype))
    else:
        C = C.to(W.dtype)
    if dense_const is None:
        Hdc = H if Hd is None else Hd.to(W.dtype)
        dense_const = ((W @ Hdc) * W).sum(1)
    else:
        dense_const = dense_const.to(W.dtype)
    if o.correction < 1.0:
        # target b Y + (1-b) W X*: cross moment b C + (1-b) W H, energy per row
        # b^2 |y|^2 + 2 b (1-b) <y, w x*> + (1-b)^2 w H w^T, with <y, w x*> = (C * W).sum(1)
        b = o.correction
        WH = W @ H
        dense_const = b * b * dense_const + 2 * b * (1 - b) * (C * W).sum(1) + (1 - b) ** 2 * (WH * W).sum(1)
        C = b * C + (1 - b) * WH
    return C, dense_const


def fista_prune(
    W: torch.Tensor,
    H: torch.Tensor,
    spec: MaskSpec,
    options: FistaSettings,
    problem: FistaProblem | None = None,
    *,
    low_dtype: torch.dtype | None = None,
    cache: dict[str, Any] | None = None,
) -> TuneResult:
    """Prune one weight matrix ``W`` (m x n) to ``spec`` with FISTAPruner at ``options``.

    ``H`` and ``problem``'s ``G``/``Hd`` are the token-averaged statistics (``G``/``Hd`` default to ``H``:
    no dense/pruned distinction; see :class:`FistaProblem`). ``options.lam`` is *relative*: the initial
    per-row lambda is ``lam * max_j |C_rj|`` (the smallest lambda whose solution is the zero row), the
    per-layer one ``lam`` times the mean of those.
    ``damp`` adds ``damp * mean(diag H) * I`` to ``H`` inside FISTA. Computes in float32 (or ``H``'s
    dtype if wider) and returns weights in ``W``'s dtype inside :class:`TuneResult`. ``problem.L`` may
    pass the Lipschitz constant of the (damped) ``H`` when several linears share it. ``problem.dense_const``
    may pass the per-row ``w Hd w^T`` (the dense output's mean square) instead of ``Hd``, and
    ``problem.C`` the product ``W G`` instead of ``G``. ``correction`` (beta in [0, 1]) blends the target:
    ``beta Y_dense + (1 - beta) W X*``, the dense model's outputs and the dense layer's outputs on the
    pruned-path inputs; 1 is the paper's objective, 0 SparseGPT's. ``ridge`` (rho >= 0) adds
    ``rho * mean(diag H) * ||W* - W||^2`` per row (the reported errors include it); a given ``L`` is for
    ``H`` (damped) without it. Ridge and damping both scale with ``mean(diag H)`` of ``H`` itself.
    ``low_dtype`` runs the solver's products on differences in that dtype (see :class:`LambdaTuner`).
    ``cache``: one dict per group of linears that share ``H`` (and these options), reused across them;
    the results are the same with or without it. The options' ranges are checked where they are made.
    """
    o, p = options, FistaProblem() if problem is None else problem
    L, W_start = p.L, p.W_start
    dtype = torch.promote_types(H.dtype, torch.float32)
    Wc, Hc = W.to(dtype), H.to(dtype)
    C, dense_const = _targets(Wc, Hc, o, p)
    mean_diag = float(torch.diagonal(Hc).mean())  # the scale of ridge and damp alike (before either)
    cache = {} if cache is None else cache
    if o.ridge > 0:
        # as if one row sqrt(N r) e_j -> sqrt(N r) W e_j per input feature j joined the N calibration tokens
        r = o.ridge * mean_diag
        if "Hc" not in cache:
            cache["Hc"] = shift_diagonal(Hc, r)
        Hc = cache["Hc"]
        C = C + r * Wc
        dense_const = dense_const + r * (Wc * Wc).sum(1)
        if L is not None:
            L = L + r
    if o.damp > 0 and "Hs" not in cache:
        cache["Hs"] = shift_diagonal(Hc, o.damp * mean_diag)
    Hs = cache["Hs"] if o.damp > 0 else Hc
    lam0 = o.lam * C.abs().amax(1)
    if o.lambda_scope == "layer":
        lam0 = torch.full_like(lam0, float(lam0.mean()))
    start = Wc if W_start is None else W_start.to(dtype)
    res = tune_lambda(start, Hc, C, dense_const, spec, lam0, o,
                      Solve(H_solve=Hs, L=L, low_dtype=low_dtype, cache=cache))
    res.W = res.W.to(W.dtype)
    return res
