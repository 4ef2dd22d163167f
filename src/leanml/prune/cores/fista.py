"""Numeric core of FISTAPruner: convex l1 layer-wise pruning solved by FISTA, then an exact hard threshold.

For one linear operator with dense weight ``W`` (m x n), dense input ``X`` and pruned-path input ``X*``
(columns are tokens), the engine gives the token-averaged statistics ``H = X* X*^T / N`` and
``G = X X*^T / N`` (and ``Hd = X X^T / N``). With ``C = W G`` the problem

    minimise over W*:  1/2 tr(W* H W*^T) - tr(C W*^T) + lambda * ||W*||_1

equals ``1/(2N) ||W* X* - W X||_F^2 + lambda ||W*||_1`` up to a constant. It separates by output row,
so every function here works on all rows at once with matrix products; ``lambda`` is a scalar or one
value per row.

Everything in this module is a pure function of tensors (no model objects, no I/O):

- :func:`tune_lambda` -- the T-round lambda search by bisection on ``E_round / E_total`` against ``xi``,
- :func:`fista_prune` -- the whole per-operator procedure.

The problem's pieces and FISTA itself (Lipschitz constant, thresholds, objective, :func:`fista_solve`)
live in :mod:`leanml.prune.cores.lasso`; the output errors and the refit of the kept weights in
:mod:`leanml.prune.cores.refine`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from leanml.prune.cores.lasso import fista_solve, power_iteration, prune_scores, row_lambda, shift_diagonal
from leanml.prune.cores.refine import (
    REFINE_METHODS,
    fill_kept_zeros,
    gram_product,
    refine_apg,
    refine_cg,
    row_blocks,
    row_dot,
    row_output_errors,
)
from leanml.prune.masks import MaskSpec, keep_mask


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


def tune_lambda(
    W: torch.Tensor,
    H: torch.Tensor,
    C: torch.Tensor,
    dense_const: torch.Tensor,
    spec: MaskSpec,
    lam0: torch.Tensor | float,
    *,
    W_start: torch.Tensor | None = None,
    rounds: int = 3,
    iters: int = 20,
    xi: float = 0.3,
    lambda_scope: str = "row",
    L: float | None = None,
    H_solve: torch.Tensor | None = None,
    refine_iters: int = 0,
    tol: float = 0.0,
    precondition: bool = False,
    refine_method: str = "apg",
    low_dtype: torch.dtype | None = None,
    cache: dict[str, Any] | None = None,
) -> TuneResult:
    """T rounds of FISTA + hard threshold, keeping the sparse solution of least output error.

    Round ``t`` runs ``iters`` FISTA iterations at the current lambda, warm-started from the best
    FISTA iterate so far (round 1: ``W_start``, default ``W``), hard-thresholds it to ``spec``
    (optionally refits the kept weights), and measures per row the rounding error
    ``E_round = ||(W_round - W_fista) X*||`` and the total error ``E_total = ||W_round X* - W X||``.
    A row (``lambda_scope="row"``) or the whole matrix (``"layer"``) keeps the candidate with the least
    ``E_total``; with a per-layer mask (``spec.scope == "layer"``) candidates are compared for the whole
    matrix so the exact layer sparsity holds. Lambda then moves by geometric bisection: if
    ``E_round / E_total > xi`` the FISTA solution was too dense, lambda rises (x10 until an upper
    bound is known), else it falls (/10 until a lower bound is known).

    The hard-thresholded ``W_start`` is itself a candidate, so the result never has a larger output
    error than the start point rounded to ``spec``. ``H_solve`` (e.g. damped ``H``) is used inside
    FISTA; errors are always measured with ``H``.

    ``precondition``: FISTA runs on the same problem in the variables ``V = W D`` with
    ``D = diag(sqrt(diag H))``, i.e. on ``D^-1 H D^-1`` (unit diagonal, far better conditioned when a
    few input features carry most of the energy) with the weighted penalty ``sum_j |v_j| / d_j``.
    The minimiser is unchanged; only the iterates reach it faster. ``L`` is then recomputed.

    ``low_dtype`` (e.g. ``torch.bfloat16``): the products inside FISTA and the refits run in that dtype
    on differences (a step, a search direction, ``W_round - W_fista``); every candidate's product and
    error is computed in the working dtype, and a refit row that is worse than its start, measured so,
    keeps its start.

    ``cache``: a dict that linears sharing ``H_solve`` (same damping and ridge) pass alike; the first
    call fills it with what depends on that matrix alone (its preconditioned form, Lipschitz constants,
    narrow copies), the next ones reuse it. ``L`` is computed only when the solver needs it.
    """
    if lambda_scope not in ("row", "layer"):
        raise ValueError("lambda_scope must be 'row' or 'layer'")
    if refine_method not in REFINE_METHODS:
        raise ValueError(f"refine_method must be one of {REFINE_METHODS}")
    m = W.shape[0]
    Hs = H if H_solve is None else H_solve
    #: products with the solver's matrix serve for the errors too (no damping)
    shared = Hs is H
    # what depends on Hs alone is kept in ``cache`` for the next linear that shares it
    cache = {} if cache is None else cache
    if L is not None:
        cache["L"] = L
    d = None
    if precondition:
        if "Hp" not in cache:
            d = torch.diagonal(Hs).clamp_min(0).sqrt()
            cache["d"] = torch.where(d > 0, d, torch.ones_like(d))
            cache["Hp"] = Hs / cache["d"].unsqueeze(0) / cache["d"].unsqueeze(1)
            cache["Lp"] = power_iteration(cache["Hp"]) * 1.001
        d, Hp, Lp = cache["d"], cache["Hp"], cache["Lp"]
    elif "L" not in cache:
        cache["L"] = power_iteration(Hs) * 1.001
    if low_dtype is not None and "Hs_low" not in cache:
        cache["Hs_low"] = Hs.to(low_dtype)
        cache["Hp_low"] = None if d is None else Hp.to(low_dtype)
    Hs_low, Hp_low = cache.get("Hs_low"), cache.get("Hp_low")

    def lipschitz() -> float:
        """``lambda_max(Hs)``, computed on first use (the preconditioned solver needs only ``Lp``)."""
        if "L" not in cache:
            cache["L"] = power_iteration(Hs) * 1.001
        return cache["L"]

    # Products are carried in the original variables: ``X @ Hs``. In the rescaled ones (V = W D,
    # Hp = D^-1 Hs D^-1) the product V @ Hp equals (W @ Hs) / d. Everything below works on one block of
    # rows at a time (``s``); only the mask and the choice between candidates see the whole matrix.
    def _refit(s: slice, Wr: torch.Tensor, mask: torch.Tensor, WrH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if refine_method == "cg":
            if d is None:
                return refine_cg(Wr, mask, Hs, C[s], refine_iters, WrH, Hs_low)
            V, VH = refine_cg(Wr * d, mask, Hp, C[s] / d, refine_iters, WrH / d, Hp_low)
        else:
            if d is None:
                return refine_apg(Wr, mask, Hs, C[s], lipschitz(), refine_iters, WrH, Hs_low)
            V, VH = refine_apg(Wr * d, mask, Hp, C[s] / d, Lp, refine_iters, WrH / d, Hp_low)
        return V / d, VH * d

    if low_dtype is not None and not shared and "H_low" not in cache:
        cache["H_low"] = H.to(low_dtype)
    H_err_low = Hs_low if shared else cache.get("H_low")

    def rounded(
        Wx: torch.Tensor, WxH: torch.Tensor, mask: torch.Tensor, rounding: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``Wx`` (with ``WxH = Wx @ Hs``) hard-thresholded to ``mask`` and refit: the weights, their per-row
        output error and, with ``rounding``, the rounding error ``||(W_round - Wx) X*||`` per row."""
        out = torch.empty_like(Wx)
        err = Wx.new_empty(m)
        e_round = Wx.new_empty(m) if rounding else None
        for s in blocks:
            Wb, WbH, mb = Wx[s], WxH[s], mask[s]
            Wr = Wb * mb
            # a block already within the mask (a pruned warm start) keeps its product
            WrH = Wr @ Hs if rounding or bool(((Wb != 0) & ~mb).any()) else WbH
            if rounding:
                D = Wr - Wb
                # from the two products at hand, or (products in the narrow dtype) from the difference
                if H_err_low is None:
                    DH = (WrH - WbH) if shared else D @ H
                else:
                    DH = gram_product(D, H, H_err_low)
                e_round[s] = row_dot(DH, D).clamp_min(0.0).sqrt()  # type: ignore[index]
                del D, DH
            if refine_iters > 0:
                Wr, WrH = _refit(s, Wr, mb, WrH)
            elif rounding:
                Wr, WrH = fill_kept_zeros(Wr, mb, H, C[s], dense_const[s]), None
            err[s] = row_output_errors(Wr, H, C[s], dense_const[s], WrH if shared else None)
            out[s] = Wr
        return out, err, e_round

    def masked(Wx: torch.Tensor, WxH: torch.Tensor) -> torch.Tensor:
        """The mask ``spec`` keeps of ``Wx``, ranked by :func:`prune_scores` (the gradient ``WxH - C``)."""
        scores = torch.empty_like(Wx)
        for s in blocks:
            scores[s] = prune_scores(Wx[s], WxH[s] - C[s])
        return keep_mask(scores, spec)

    blocks = row_blocks(m, C.shape[1], C)
    lam = row_lambda(lam0, m, C).reshape(-1).clone()
    if lambda_scope == "layer":
        lam = lam.mean().expand(m).clone()
    lo = torch.zeros_like(lam)
    hi = torch.full_like(lam, float("inf"))
    start = (W if W_start is None else W_start).to(C.dtype)

    startH = start @ Hs
    start_mask = masked(start, startH)
    best_sparse, best_err, _ = rounded(start, startH, start_mask, rounding=False)
    start_err = best_err.clone()
    best_iterate, best_iterateH = start, startH
    history: list[dict[str, Any]] = []
    layer_choice = spec.scope == "layer" and spec.pattern is None
    for r in range(rounds):
        Wf, WfH = torch.empty_like(start), torch.empty_like(start)
        restarts, nonzero = 0, 0
        for s in blocks:
            lam_s = lam[s]
            if d is None:
                res = fista_solve(Hs, C[s], lam_s, W0=best_iterate[s], L=lipschitz(), iters=iters, tol=tol,
                                  track=False, W0H=best_iterateH[s], H_low=Hs_low)
                Wf[s], WfH[s] = res.W, res.WH
            else:
                res = fista_solve(Hp, C[s] / d, lam_s, W0=best_iterate[s] * d, L=Lp, iters=iters, tol=tol,
                                  track=False, col_weights=1.0 / d, W0H=best_iterateH[s] / d, H_low=Hp_low)
                Wf[s], WfH[s] = res.W / d, res.WH * d  # type: ignore[operator]
            restarts += res.restarts
            nonzero += int((res.W != 0).sum())
            del res
        mask = masked(Wf, WfH)
        Wr, err, e_round = rounded(Wf, WfH, mask, rounding=True)
        assert e_round is not None
        e_total = err.sqrt()
        if layer_choice or lambda_scope == "layer":
            better = torch.full_like(err, bool(err.sum() < best_err.sum()), dtype=torch.bool)
        else:
            better = err < best_err
        bc = better.unsqueeze(1)
        best_sparse = torch.where(bc, Wr, best_sparse)
        best_iterate = torch.where(bc, Wf, best_iterate)
        best_iterateH = torch.where(bc, WfH, best_iterateH)
        best_err = torch.where(better, err, best_err)
        del Wr, Wf, WfH
        if lambda_scope == "layer":
            ratio_l = float(e_round.pow(2).sum().sqrt()) / max(float(e_total.pow(2).sum().sqrt()), 1e-30)
            ratio = torch.full_like(lam, ratio_l)
        else:
            ratio = e_round / e_total.clamp_min(1e-30)
        history.append(
            {
                "round": r + 1,
                "lambda_mean": float(lam.mean()),
                "ratio_mean": float(ratio.mean()),
                "error": float(err.sum()),
                "best_error": float(best_err.sum()),
                "fista_nonzero": nonzero / start.numel(),
                "restarts": restarts,
            }
        )
        up = ratio > xi
        lo = torch.where(up, lam, lo)
        hi = torch.where(up, hi, lam)
        lam = torch.where(
            up,
            torch.where(torch.isfinite(hi), (lo * hi).sqrt(), lam * 10.0),
            torch.where(lo > 0, (lo * hi).sqrt(), lam / 10.0),
        )
    return TuneResult(W=best_sparse, lam=lam, error=best_err, start_error=start_err, history=history,
                      L=Lp if d is not None else lipschitz())


def fista_prune(
    W: torch.Tensor,
    H: torch.Tensor,
    spec: MaskSpec,
    *,
    G: torch.Tensor | None = None,
    Hd: torch.Tensor | None = None,
    W_start: torch.Tensor | None = None,
    lam: float = 1e-3,
    rounds: int = 3,
    iters: int = 20,
    xi: float = 0.3,
    lambda_scope: str = "row",
    damp: float = 0.0,
    refine_iters: int = 0,
    tol: float = 0.0,
    L: float | None = None,
    precondition: bool = False,
    dense_const: torch.Tensor | None = None,
    refine_method: str = "apg",
    C: torch.Tensor | None = None,
    correction: float = 1.0,
    ridge: float = 0.0,
    low_dtype: torch.dtype | None = None,
    cache: dict[str, Any] | None = None,
) -> TuneResult:
    """Prune one weight matrix ``W`` (m x n) to ``spec`` with FISTAPruner.

    ``H``/``G``/``Hd`` are the token-averaged statistics (``G``/``Hd`` default to ``H``: no dense/pruned
    distinction). ``lam`` is *relative*: the initial per-row lambda is ``lam * max_j |C_rj|`` (the
    smallest lambda whose solution is the zero row), the per-layer one ``lam`` times the mean of those.
    ``damp`` adds ``damp * mean(diag H) * I`` to ``H`` inside FISTA. Computes in float32 (or ``H``'s
    dtype if wider) and returns weights in ``W``'s dtype inside :class:`TuneResult`. ``L`` may pass
    the Lipschitz constant of the (damped) ``H`` when several linears share it. ``precondition``
    solves in diagonally rescaled variables (same minimiser, faster; see :func:`tune_lambda`).
    ``dense_const`` may pass the per-row ``w Hd w^T`` (the dense output's mean square) instead of ``Hd``,
    and ``C`` the product ``W G`` instead of ``G``. ``correction`` (beta in [0, 1]) blends the target:
    ``beta Y_dense + (1 - beta) W X*``, the dense model's outputs and the dense layer's outputs on the
    pruned-path inputs; 1 (default) is the paper's objective, 0 SparseGPT's. ``ridge`` (rho >= 0) adds
    ``rho * mean(diag H) * ||W* - W||^2`` per row (the reported errors include it); a given ``L`` is for
    ``H`` (damped) without it. Ridge and damping both scale with ``mean(diag H)`` of ``H`` itself.
    ``low_dtype`` runs the solver's products on differences in that dtype (see :func:`tune_lambda`).
    ``cache``: one dict per group of linears that share ``H`` (and these options), reused across them
    (see :func:`tune_lambda`); the results are the same with or without it.
    """
    if ridge < 0:
        raise ValueError("ridge must be >= 0")
    if not 0.0 <= correction <= 1.0:
        raise ValueError("correction must be in [0, 1]")
    if lam < 0:
        raise ValueError("lambda must be >= 0")
    if lambda_scope not in ("row", "layer"):
        raise ValueError("lambda_scope must be 'row' or 'layer'")
    dtype = torch.promote_types(H.dtype, torch.float32)
    Wc = W.to(dtype)
    Hc = H.to(dtype)
    if C is None:
        C = Wc @ (Hc if G is None else G.to(dtype))
    else:
        C = C.to(dtype)
    if dense_const is None:
        Hdc = Hc if Hd is None else Hd.to(dtype)
        dense_const = ((Wc @ Hdc) * Wc).sum(1)
    else:
        dense_const = dense_const.to(dtype)
    if correction < 1.0:
        # target b Y + (1-b) W X*: cross moment b C + (1-b) W H, energy per row
        # b^2 |y|^2 + 2 b (1-b) <y, w x*> + (1-b)^2 w H w^T, with <y, w x*> = (C * W).sum(1)
        b = correction
        WH = Wc @ Hc
        dense_const = b * b * dense_const + 2 * b * (1 - b) * (C * Wc).sum(1) + (1 - b) ** 2 * (WH * Wc).sum(1)
        C = b * C + (1 - b) * WH
    mean_diag = float(torch.diagonal(Hc).mean())  # the scale of ridge and damp alike (before either)
    cache = {} if cache is None else cache
    if ridge > 0:
        # as if one row sqrt(N r) e_j -> sqrt(N r) W e_j per input feature j joined the N calibration tokens
        r = ridge * mean_diag
        if "Hc" not in cache:
            cache["Hc"] = shift_diagonal(Hc, r)
        Hc = cache["Hc"]
        C = C + r * Wc
        dense_const = dense_const + r * (Wc * Wc).sum(1)
        if L is not None:
            L = L + r
    if damp > 0 and "Hs" not in cache:
        cache["Hs"] = shift_diagonal(Hc, damp * mean_diag)
    Hs = cache["Hs"] if damp > 0 else Hc
    lam_max = C.abs().amax(1)
    lam0 = lam * lam_max
    if lambda_scope == "layer":
        lam0 = torch.full_like(lam0, float(lam0.mean()))
    res = tune_lambda(Wc, Hc, C, dense_const, spec, lam0, W_start=None if W_start is None else W_start.to(dtype),
                      rounds=rounds, iters=iters, xi=xi, lambda_scope=lambda_scope, L=L, H_solve=Hs,
                      refine_iters=refine_iters, tol=tol, precondition=precondition, refine_method=refine_method,
                      low_dtype=low_dtype, cache=cache)
    res.W = res.W.to(W.dtype)
    return res
