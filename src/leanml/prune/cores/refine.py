"""Least-squares refit of kept weights on a fixed support, and the per-row helpers FISTA shares.

Notation as in :mod:`leanml.prune.cores.fista`: ``H`` (n x n) the pruned-path input moment, ``C = W G``
(m x n), ``dense_const`` the per-row dense output energy ``w Hd w^T``. Every function works on all rows
at once; each row is its own problem.

- :func:`row_output_errors` -- per-row output error ``||w* X* - w X||^2 / N``,
- :func:`fill_kept_zeros` -- one Jacobi step for kept-but-zero weights,
- :func:`refine_apg` -- accelerated projected gradient on the support,
- :func:`refine_cg` -- conjugate gradients on the support.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

#: ways to refit the kept weights after a hard threshold: accelerated projected gradient, conjugate gradients
REFINE_METHODS = ("apg", "cg")


#: bytes of one row block's working array on CPU (see :func:`row_blocks`)
BLOCK_BYTES = 4 << 20
#: fewest rows in a block: matrix products on fewer rows lose speed
MIN_BLOCK_ROWS = 256


def row_blocks(m: int, n: int, like: torch.Tensor) -> list[slice]:
    """Row ranges over which the row-separable solvers run one after another.

    On CPU a block holds about :data:`BLOCK_BYTES` per (rows x ``n``) array (at least
    :data:`MIN_BLOCK_ROWS` rows): the iterations' elementwise steps then work in cache on buffers the
    allocator reuses, instead of streaming whole matrices through memory and faulting in fresh pages
    for every temporary. On other devices, one block. Rows are independent problems, so the results
    are those of one block up to the matrix products' rounding."""
    if like.device.type != "cpu":
        return [slice(0, m)]
    rows = max(MIN_BLOCK_ROWS, BLOCK_BYTES // max(1, n * like.element_size()))
    return [slice(i, min(i + rows, m)) for i in range(0, m, rows)]


def row_dot(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """Per-row dot products ``(A * B).sum(1)`` without the temporary."""
    return torch.linalg.vecdot(A, B, dim=1)


def gram_product(X: torch.Tensor, H: torch.Tensor, low: torch.Tensor | None = None) -> torch.Tensor:
    """``X @ H``; with ``low`` (``H`` already cast to a narrower dtype, e.g. bfloat16) the product runs in
    that dtype and comes back in ``X``'s (several times faster where the hardware has bfloat16 matrix
    units). Callers pass differences (a step, a search direction), so the rounding is relative to the
    change, not to the weights."""
    if low is None:
        return X @ H
    return (X.to(low.dtype) @ low).to(X.dtype)


def converged(residual_sq: float, reference_sq: float, tol: float) -> bool:
    """The stopping rule every iterative solver here shares: the optimality residual (the gradient on
    the support, or FISTA's minimal subgradient) is at most ``tol`` times the norm of the problem's
    cross moment ``C`` on the same rows (both given squared). Relative to the problem's own scale, it
    holds alike at every width and magnitude of the statistics, and from any start point."""
    return residual_sq <= tol * tol * reference_sq


def momentum(t: torch.Tensor, bad: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """FISTA's ``t_{k+1}`` and ``beta = (t_k - 1) / t_{k+1}`` per row; restarted rows get ``t = 1``,
    ``beta = 0``."""
    t_next = (1.0 + torch.sqrt(1.0 + 4.0 * t * t)) / 2.0
    beta = (t - 1.0) / t_next
    if bad is not None:
        badc = bad.unsqueeze(1)
        beta = beta.masked_fill(badc, 0.0)
        t_next = t_next.masked_fill(badc, 1.0)
    return t_next, beta


def keep_rows(bad: torch.Tensor, new: list[torch.Tensor], old: list[torch.Tensor]) -> None:
    """Rows flagged ``bad`` of each tensor in ``new`` take their values from ``old`` (in place)."""
    idx = bad.nonzero().squeeze(1)
    for a, b in zip(new, old):
        a.index_copy_(0, idx, b.index_select(0, idx))


def row_output_errors(
    W_new: torch.Tensor, H: torch.Tensor, C: torch.Tensor, dense_const: torch.Tensor, WH: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-row mean squared output error ``||w* X* - w X||^2 / N`` (shape (m,), clamped at 0).

    ``dense_const`` is the per-row ``w Hd w^T`` (the dense output energy), ``C = W G``; ``WH`` may pass
    a precomputed ``W_new @ H``.
    """
    if WH is None:
        WH = W_new @ H
    return (row_dot(WH, W_new) - 2.0 * row_dot(C, W_new) + dense_const).clamp_min(0.0)


def fill_kept_zeros(
    W: torch.Tensor, mask: torch.Tensor, H: torch.Tensor, C: torch.Tensor, dense_const: torch.Tensor
) -> torch.Tensor:
    """Give kept-but-zero weights their coordinate-wise optimal value (one Jacobi step).

    Rows whose output error would rise keep their old values, so the error never increases.
    """
    Z = mask & (W == 0)
    if not bool(Z.any()):
        return W
    WH = W @ H
    diag = torch.diagonal(H).clamp_min(1e-30)
    W_new = torch.where(Z, (C - WH) / diag, W)
    old = row_output_errors(W, H, C, dense_const, WH)
    new = row_output_errors(W_new, H, C, dense_const)
    return torch.where((new < old).unsqueeze(1), W_new, W)


def _no_worse(
    X: torch.Tensor, XH: torch.Tensor, W: torch.Tensor, WH: torch.Tensor, C: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``X`` and ``XH = X @ H``, except rows whose objective is above the start ``W``'s (``WH = W @ H``),
    which keep the start (in place)."""
    worse = 0.5 * row_dot(XH, X) - row_dot(C, X) > 0.5 * row_dot(WH, W) - row_dot(C, W)
    if bool(worse.any()):
        keep_rows(worse, [X, XH], [W, WH])
    return X, XH


@dataclass(frozen=True)
class Refit:
    """How a refit of the kept weights runs: at most ``iters`` iterations; ``tol`` > 0 stops a block of
    rows once its gradient on the support is within ``tol`` of ``C``'s norm there (:func:`converged`);
    ``used`` (a list) receives the iterations each block ran."""

    iters: int
    tol: float = 0.0
    used: list[int] | None = None


def refine_apg(
    W: torch.Tensor, mask: torch.Tensor, H: torch.Tensor, C: torch.Tensor, L: float, steps: Refit,
    WH: torch.Tensor | None = None, H_low: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Refit the kept weights: minimise ``1/2 tr(W H W^T) - tr(C W^T)`` over ``W`` supported on ``mask``.

    Accelerated projected gradient (the projection zeroes the pruned weights, step ``1/L``) with a
    per-row function-value restart, so the output error of every row never rises; starts at ``W``.
    Returns the refit weights and their product ``W @ H``; ``WH`` may pass the product of the start
    (``W``, then already zero off ``mask``). ``H_low``: the iterations' products run in that dtype (see
    :func:`gram_product`); the result's product is then recomputed exactly and a row worse than its
    start keeps the start (``WH`` must then be exact). ``steps``: see :class:`Refit`."""
    if WH is None:
        W = W * mask
        WH = W @ H
    if steps.iters <= 0 or L <= 0.0:
        return W, WH
    return _blocked(_apg_rows, W, mask, H, C, WH, H_low, L, steps)


def _blocked(
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor]], W: torch.Tensor, mask: torch.Tensor, H: torch.Tensor,
    C: torch.Tensor, WH: torch.Tensor, H_low: torch.Tensor | None, *args: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the refit ``fn`` over :func:`row_blocks` and join the blocks' weights and products."""
    parts = [fn(W[s], mask[s], H, C[s], WH[s], H_low, *args) for s in row_blocks(W.shape[0], W.shape[1], W)]
    if len(parts) == 1:
        return parts[0]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _apg_rows(
    W: torch.Tensor, mask: torch.Tensor, H: torch.Tensor, C: torch.Tensor, WH: torch.Tensor,
    H_low: torch.Tensor | None, L: float, steps: Refit,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`refine_apg` on one block of rows (``W`` zero off ``mask``, ``WH`` its product)."""
    iters, tol, used = steps.iters, steps.tol, steps.used
    keep = mask.to(W.dtype)
    W0, W0H = W, WH
    res_W = W
    F_prev = 0.5 * row_dot(WH, W) - row_dot(C, W)
    ref = float(row_dot(C * keep, C).sum()) if tol > 0.0 else 0.0
    Y, YH = W, WH
    t = torch.ones(W.shape[0], 1, dtype=W.dtype, device=W.device)
    done = 0
    for k in range(iters):
        Z = torch.add(Y, YH - C, alpha=-1.0 / L).mul_(keep)
        ZH = Z @ H if H_low is None else WH + gram_product(Z - res_W, H, H_low)
        F = 0.5 * row_dot(ZH, Z) - row_dot(C, Z)
        up = F > F_prev
        bad = None
        if bool(up.any()):
            bad = up
            keep_rows(bad, [Z, ZH], [res_W, WH])
            F = torch.where(bad, F_prev, F)
        t_next, beta = momentum(t, bad)
        Y = torch.lerp(Z, res_W, -beta)
        YH = torch.lerp(ZH, WH, -beta)
        res_W, WH, F_prev, t = Z, ZH, F, t_next
        done = k + 1
        if tol > 0.0:
            grad = (ZH - C).mul_(keep)
            if converged(float(row_dot(grad, grad).sum()), ref, tol):
                break
    if used is not None:
        used.append(done)
    if H_low is not None:  # the iterations' products were rounded: the result's, exactly
        res_W, WH = _no_worse(res_W, res_W @ H, W0, W0H, C)
    return res_W, WH


def refine_cg(
    W: torch.Tensor, mask: torch.Tensor, H: torch.Tensor, C: torch.Tensor, steps: Refit,
    WH: torch.Tensor | None = None, H_low: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`refine_apg` by conjugate gradients: the same least-squares refit of the kept weights.

    Every row runs its own conjugate-gradient recursion on its support (all rows at once, one
    ``n x n`` product per iteration). In exact arithmetic the objective of every row falls at each
    step and reaches the minimum on the support after at most ``|support|`` steps; a row whose
    objective ends above its start (rounding) keeps its start. Returns the weights and ``W @ H``;
    ``WH`` may pass the product of the start (``W``, then already zero off ``mask``). ``H_low`` as in
    :func:`refine_apg`; so is ``steps``."""
    if WH is None:
        W = W * mask
        WH = W @ H
    if steps.iters <= 0:
        return W, WH
    return _blocked(_cg_rows, W, mask, H, C, WH, H_low, steps)


def _cg_rows(
    W: torch.Tensor, mask: torch.Tensor, H: torch.Tensor, C: torch.Tensor, WH: torch.Tensor,
    H_low: torch.Tensor | None, steps: Refit,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`refine_cg` on one block of rows (``W`` zero off ``mask``, ``WH`` its product)."""
    iters, tol, used = steps.iters, steps.tol, steps.used
    keep = mask.to(W.dtype)
    X, XH = W.clone(), WH.clone()
    R = (C - WH).mul_(keep)  # minus the gradient, on the support
    P = R.clone()
    rr = row_dot(R, R)
    ref = float(row_dot(C * keep, C).sum()) if tol > 0.0 else 0.0
    done = 0
    for k in range(iters):
        if tol > 0.0 and converged(float(rr.sum()), ref, tol):
            break
        Q = gram_product(P, H, H_low)
        pq = row_dot(P, Q)
        alpha = torch.where(pq > 0, rr / pq.clamp_min(1e-30), torch.zeros_like(pq)).unsqueeze(1)
        done = k + 1
        X.add_(alpha * P)
        XH.add_(alpha * Q)
        R.sub_(Q.mul_(keep).mul_(alpha))
        rr_new = row_dot(R, R)
        beta = torch.where(rr > 0, rr_new / rr.clamp_min(1e-30), torch.zeros_like(rr)).unsqueeze(1)
        P = torch.addcmul(R, beta, P)
        rr = rr_new
    if used is not None:
        used.append(done)
    if H_low is not None:
        XH = X @ H  # the iterations' products were rounded: the result's, exactly
    return _no_worse(X, XH, W, WH, C)
