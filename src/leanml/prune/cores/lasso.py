"""The convex l1 problem of one linear operator and its FISTA solver (pure functions of tensors).

Notation as in :mod:`leanml.prune.cores.fista`: ``H`` (n x n) the pruned-path input moment, ``C`` (m x n)
the cross moment of the target; the problem separates by output row and every function works on all rows
at once.

- :func:`power_iteration` -- the Lipschitz constant ``L = lambda_max(H)``,
- :func:`soft_threshold`, :func:`hard_threshold` (exact unstructured per row / per layer or N:M),
  :func:`prune_scores` (the ranking the hard threshold uses),
- :func:`lasso_objective`,
- :func:`fista_solve` -- FISTA with a per-row function-value restart, so the objective never rises.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from leanml.prune.cores.refine import converged, gram_product, keep_rows, momentum, row_blocks, row_dot
from leanml.prune.masks import MaskSpec, keep_mask


def power_iteration(H: torch.Tensor, iters: int = 100, tol: float = 1e-6, seed: int = 0) -> float:
    """Largest eigenvalue of the symmetric positive semi-definite matrix ``H`` by power iteration.

    Deterministic (seeded start vector). Returns 0.0 for an all-zero ``H``.
    """
    if H.dim() != 2 or H.shape[0] != H.shape[1]:
        raise ValueError(f"H must be square, got shape {tuple(H.shape)}")
    n = H.shape[0]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    v = torch.randn(n, 1, generator=gen, dtype=torch.float64).to(device=H.device, dtype=H.dtype)
    v = v / v.norm()
    est = 0.0
    for _ in range(iters):
        w = H @ v
        norm = float(w.norm())
        if norm == 0.0 or not math.isfinite(norm):
            return 0.0 if norm == 0.0 else float("nan")
        v = w / norm
        if abs(norm - est) <= tol * norm:
            est = norm
            break
        est = norm
    # Rayleigh quotient of the final vector (a lower bound that converges to lambda_max)
    return float(max(est, float((v.T @ (H @ v)).squeeze())))


def shift_diagonal(H: torch.Tensor, value: float) -> torch.Tensor:
    """``H + value * I`` (a new tensor)."""
    return H + value * torch.eye(H.shape[0], dtype=H.dtype, device=H.device)


def soft_threshold(X: torch.Tensor, tau: torch.Tensor | float) -> torch.Tensor:
    """``sign(x) * max(|x| - tau, 0)`` elementwise; ``tau`` (>= 0) is a scalar or broadcasts (e.g. (m, 1)).

    Computed as ``x - clamp(x, -tau, tau)``: the same values in two passes over ``x``."""
    return X - X.clamp(-tau, tau)


def hard_threshold(W: torch.Tensor, spec: MaskSpec, scores: torch.Tensor | None = None) -> torch.Tensor:
    """Keep the largest ``|W|`` (or ``scores``) under ``spec`` exactly, zero the rest.

    Unstructured per row (``spec.scope == "row"``) keeps the same count in every row, per layer one
    threshold for the matrix; ``spec.pattern = (n, m)`` keeps the ``n`` largest of every ``m``
    consecutive weights along the input dimension.
    """
    mask = keep_mask(W.abs() if scores is None else scores, spec)
    return W * mask


def prune_scores(W: torch.Tensor, grad: torch.Tensor | None = None) -> torch.Tensor:
    """Scores for the final hard threshold: ``|W|`` for non-zeros; zeros rank below every non-zero.

    Among exact zeros (common in l1 solutions) the one with the larger gradient magnitude ``|grad|``
    ranks higher (its coordinate would decrease the objective most), so when a row or N:M block has
    fewer non-zeros than it may keep, the kept zero positions are the most useful ones to refill.
    """
    if grad is None:
        return W.abs()
    return torch.where(W != 0, W.abs(), -1.0 / (1.0 + grad.abs()))


def row_lambda(lam: torch.Tensor | float, m: int, like: torch.Tensor) -> torch.Tensor:
    lam_t = torch.as_tensor(lam, dtype=like.dtype, device=like.device)
    if lam_t.dim() == 0:
        lam_t = lam_t.expand(m)
    lam_t = lam_t.reshape(-1)
    if lam_t.numel() != m:
        raise ValueError(f"lambda must be a scalar or have one value per row ({m}), got {lam_t.numel()}")
    if bool((lam_t < 0).any()):
        raise ValueError("lambda must be non-negative")
    return lam_t.reshape(m, 1)


def _l1(W: torch.Tensor, col_weights: torch.Tensor | None) -> torch.Tensor:
    """Per-row ``sum_j u_j |w_j|`` (``u = 1`` when ``col_weights`` is None; else shape (1, n) or (n,))."""
    absW = W.abs()
    return absW.sum(1) if col_weights is None else absW @ col_weights.reshape(-1)


def lasso_objective(
    W: torch.Tensor,
    H: torch.Tensor,
    C: torch.Tensor,
    lam: torch.Tensor | float,
    WH: torch.Tensor | None = None,
    col_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-row objective ``1/2 w H w^T - c w^T + lambda_row sum_j u_j |w_j|`` (shape (m,)).

    ``WH`` may pass a precomputed ``W @ H``; ``col_weights`` ``u`` (n,) weights the l1 term per input
    column (default 1).
    """
    if WH is None:
        WH = W @ H
    lam_r = row_lambda(lam, W.shape[0], W).reshape(-1)
    return 0.5 * row_dot(WH, W) - row_dot(C, W) + lam_r * _l1(W, col_weights)


@dataclass
class FistaResult:
    """Output of :func:`fista_solve`."""

    W: torch.Tensor
    objective: list[float] = field(default_factory=list)  # sum over rows, index 0 = start point
    iters: int = 0
    restarts: int = 0
    row_objective: torch.Tensor | None = None
    #: ``W @ H`` of the returned iterate (saves the caller a product)
    WH: torch.Tensor | None = None


def stationarity(W: torch.Tensor, grad: torch.Tensor, lam: torch.Tensor | float) -> float:
    """Squared norm of the minimal subgradient of ``1/2 w H w^T - c w^T + sum_j lam_j |w_j|`` at ``W``
    (``grad = W H - C``; ``lam`` per weight or broadcastable): zero exactly at the minimiser."""
    lam = torch.as_tensor(lam, dtype=grad.dtype, device=grad.device)
    sub = torch.where(W != 0, grad + lam * torch.sign(W), (grad.abs() - lam).clamp_min(0.0))
    return float(row_dot(sub, sub).sum())


@dataclass(frozen=True)
class FistaSteps:
    """How :func:`fista_solve` steps: at most ``iters`` iterations, the stopping tolerance ``tol`` (0: run
    them all), the per-row function-value ``restart``, whether to ``track`` the objective, and the
    Lipschitz constant ``L`` of ``H`` (the step is ``1/L``; None: computed)."""

    iters: int = 20
    tol: float = 0.0
    restart: bool = True
    track: bool = True
    L: float | None = None


def fista_solve(
    H: torch.Tensor,
    C: torch.Tensor,
    lam: torch.Tensor | float,
    W0: torch.Tensor | None = None,
    steps: FistaSteps | None = None,
    col_weights: torch.Tensor | None = None,
    W0H: torch.Tensor | None = None,
    H_low: torch.Tensor | None = None,
) -> FistaResult:
    """Minimise ``1/2 tr(W H W^T) - tr(C W^T) + sum_rows lambda_r ||w_r||_1`` by FISTA, all rows at once.

    ``steps`` (:class:`FistaSteps`, default its defaults): step ``1/L`` with ``L = lambda_max(H)``
    (computed by :func:`power_iteration` when not given). With ``restart`` (default) a row whose
    objective would rise keeps its previous iterate and its momentum is reset (``t = 1``), so the next
    step is a plain proximal-gradient step from there: the per-row objective never rises. One ``n x n``
    product per iteration (``Y H`` is carried as a linear combination of ``W_k H``); ``W0H`` may pass
    ``W0 @ H``, and the result carries ``W @ H``. Stops
    after ``iters`` iterations or when the minimal subgradient (:func:`stationarity`) falls below ``tol``
    times the norm of ``C`` (:func:`~leanml.prune.cores.refine.converged`; over a block of rows: on CPU
    the rows run in blocks, see :func:`~leanml.prune.cores.refine.row_blocks`, and each block stops on
    its own). ``iters`` of the result: the most any block ran. ``col_weights`` (n,)
    turns the penalty into the weighted ``lambda_r sum_j u_j |w_rj|`` (used by the diagonal
    preconditioner). ``H_low`` (``H`` in a narrower dtype, e.g. bfloat16) runs each iteration's product
    in that dtype on the step ``W_k - W_{k-1}`` (see :func:`~leanml.prune.cores.refine.gram_product`).
    """
    m, n = C.shape
    if H.shape != (n, n):
        raise ValueError(f"H must be {n}x{n} to match C {tuple(C.shape)}, got {tuple(H.shape)}")
    steps = FistaSteps() if steps is None else steps
    if steps.iters < 0:
        raise ValueError("iters must be >= 0")
    lam_r = row_lambda(lam, m, C)
    if steps.L is None:
        steps = replace(steps, L=power_iteration(H) * 1.001)
    if steps.L <= 0.0:
        # H == 0: the smooth part is linear, the minimiser is unbounded unless C == 0; keep the start
        return FistaResult(W=torch.zeros_like(C) if W0 is None else W0.to(C.dtype).clone(), objective=[], iters=0)
    parts = [
        _fista_rows(H, C[s], lam_r[s], None if W0 is None else W0[s], steps, col_weights,
                    None if W0H is None else W0H[s], H_low)
        for s in row_blocks(m, n, C)
    ]
    if len(parts) == 1:
        return parts[0]
    length = max(len(p.objective) for p in parts)
    objective = ([sum(p.objective[min(i, len(p.objective) - 1)] for p in parts) for i in range(length)]
                 if steps.track else [])
    return FistaResult(
        W=torch.cat([p.W for p in parts]),
        objective=objective,
        iters=max(p.iters for p in parts),
        restarts=sum(p.restarts for p in parts),
        row_objective=torch.cat([p.row_objective for p in parts]),  # type: ignore[misc]
        WH=torch.cat([p.WH for p in parts]),  # type: ignore[misc]
    )


def _fista_rows(
    H: torch.Tensor,
    C: torch.Tensor,
    lam_r: torch.Tensor,
    W0: torch.Tensor | None,
    steps: FistaSteps,
    col_weights: torch.Tensor | None,
    W0H: torch.Tensor | None,
    H_low: torch.Tensor | None,
) -> FistaResult:
    """:func:`fista_solve` on one block of rows (``lam_r`` of shape (m, 1), ``steps.L > 0``)."""
    m, n = C.shape
    L, iters, tol, restart, track = steps.L, steps.iters, steps.tol, steps.restart, steps.track
    assert L is not None
    W_prev = torch.zeros_like(C) if W0 is None else W0.to(C.dtype).clone()
    WH_prev = W_prev @ H if W0H is None else W0H.to(C.dtype)
    u = None if col_weights is None else col_weights.to(C.dtype).reshape(-1)
    lam_v = lam_r.reshape(-1)
    F_prev = 0.5 * row_dot(WH_prev, W_prev) - row_dot(C, W_prev) + lam_v * _l1(W_prev, u)
    history = [float(F_prev.sum())] if track else []
    Y, YH = W_prev, WH_prev
    t = torch.ones(m, 1, dtype=C.dtype, device=C.device)
    tau = lam_r / L if u is None else (lam_r / L) * u.reshape(1, n)
    restarts = 0
    done = 0
    ref = float(row_dot(C, C).sum()) if tol > 0.0 else 0.0
    for k in range(iters):
        V = torch.add(Y, YH - C, alpha=-1.0 / L)  # gradient step
        Z = soft_threshold(V, tau)
        del V
        ZH = Z @ H if H_low is None else WH_prev + gram_product(Z - W_prev, H, H_low)
        F = 0.5 * row_dot(ZH, Z) - row_dot(C, Z) + lam_v * _l1(Z, u)
        bad = None
        if restart:
            up = F > F_prev
            nbad = int(up.sum())
            if nbad:
                restarts += nbad
                bad = up
                keep_rows(bad, [Z, ZH], [W_prev, WH_prev])
                F = torch.where(bad, F_prev, F)
        t_next, beta = momentum(t, bad)
        Y = torch.lerp(Z, W_prev, -beta)  # Z + beta (Z - W_prev)
        YH = torch.lerp(ZH, WH_prev, -beta)
        W_prev, WH_prev, F_prev, t = Z, ZH, F, t_next
        done = k + 1
        if track:
            history.append(float(F.sum()))
        if tol > 0.0 and converged(stationarity(Z, ZH - C, tau * L), ref, tol):
            break
    return FistaResult(W=W_prev, objective=history, iters=done, restarts=restarts, row_objective=F_prev, WH=WH_prev)
