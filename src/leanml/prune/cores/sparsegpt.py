"""SparseGPT (Frantar & Alistarh, 2023): blocked OBS with the upper Cholesky factor of ``(H + damp I)^-1``,
lazy batch updates per block of columns.

- :func:`hinv_upper` -- the factor and the mask of dead inputs,
- :func:`sparsegpt_prune` -- one matrix, :func:`sparsegpt_prune_many` -- the matrices of one group in one sweep,
- :func:`single_thread` -- run a block with one torch thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from leanml.errors import LeanmlError
from leanml.prune.masks import (
    MaskSpec,
    lowest_indices,
    prune_count,
    prune_lowest_per_row,
    row_quotas,
)


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """Run the block with one torch thread (restored afterwards)."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def hinv_upper(H: torch.Tensor, damp: float = 0.01) -> tuple[torch.Tensor, torch.Tensor]:
    """Upper Cholesky factor ``U`` of ``(H + damp * mean(diag H) * I)^-1`` and the mask of dead inputs.

    Inputs whose ``H_jj`` is zero (never active) get ``H_jj = 1`` so the factorisation exists.
    """
    if damp < 0:
        raise LeanmlError(f"damping must be >= 0, got {damp}")
    H = H.to(torch.float32).clone()
    dead = torch.diagonal(H) == 0
    H[dead, dead] = 1.0
    diag = torch.arange(H.shape[0], device=H.device)
    H[diag, diag] += damp * torch.mean(torch.diagonal(H))
    with single_thread():  # LAPACK's threaded factorisations at these sizes mostly wait on each other
        L = torch.linalg.cholesky(H)
        Hinv = torch.cholesky_inverse(L)
        return torch.linalg.cholesky(Hinv, upper=True), dead


def sparsegpt_prune(
    W: torch.Tensor,
    H: torch.Tensor,
    spec: MaskSpec,
    damp: float = 0.01,
    blocksize: int = 128,
    U: torch.Tensor | None = None,
) -> torch.Tensor:
    """SparseGPT: prune ``W`` (out x in) given ``H = E[x x^T]`` (in x in), updating the kept weights.

    Columns are processed left to right in blocks of ``blocksize``. Unstructured masks are chosen per
    block by the OBS saliency ``w^2 / U_jj^2`` — per row within the block for a row scope, over the
    whole block (the original method) for ``"layer"``. N:M masks are chosen every ``M``
    columns. ``U`` may pass a precomputed :func:`hinv_upper` factor (shared by linears of one input).
    """
    return sparsegpt_prune_many([W], H, [spec], damp, blocksize, U)[0]


def sparsegpt_prune_many(
    Ws: list[torch.Tensor],
    H: torch.Tensor,
    specs: list[MaskSpec],
    damp: float = 0.01,
    blocksize: int = 128,
    U: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """:func:`sparsegpt_prune` for several matrices that read the same input (a group), in one sweep.

    The OBS update of a row depends only on that row and ``H``, so the rows of all matrices are
    stacked and swept together (one column loop instead of one per matrix); each matrix's mask is
    still chosen with its own spec and quota, so the result equals separate calls.
    """
    if blocksize < 1:
        raise LeanmlError(f"blocksize must be >= 1, got {blocksize}")
    if len(Ws) != len(specs) or not Ws:
        raise ValueError("one spec per weight matrix, at least one matrix")
    cols = Ws[0].shape[1]
    if any(w.shape[1] != cols for w in Ws):
        raise ValueError("the matrices of one sweep must share their input dimension")
    if H.shape != (cols, cols):
        raise ValueError(f"H must be ({cols}, {cols}) for W with {cols} columns, got {tuple(H.shape)}")
    nm = specs[0].pattern
    if any(s.pattern != nm for s in specs):
        raise ValueError("the matrices of one sweep must share their N:M pattern")
    if nm is not None and blocksize % nm[1]:
        raise LeanmlError(f"blocksize {blocksize} must be a multiple of M={nm[1]} for the {nm[0]}:{nm[1]} pattern")
    if U is None:
        U, dead = hinv_upper(H, damp)
    else:
        dead = torch.diagonal(H) == 0
    sizes = [w.shape[0] for w in Ws]
    bounds = [(sum(sizes[:k]), sum(sizes[: k + 1])) for k in range(len(Ws))]
    W = torch.cat([w.to(torch.float32) for w in Ws])
    W[:, dead] = 0
    quotas = [row_quotas(r1 - r0, cols, s) if nm is None and s.row_scope else None
              for (r0, r1), s in zip(bounds, specs)]
    for i1 in range(0, cols, blocksize):
        i2 = min(i1 + blocksize, cols)
        # the block is held transposed (one contiguous row per input column): the sequential sweep
        # below reads and updates one column at a time
        W1t = W[:, i1:i2].T.contiguous()
        Err1t = torch.empty_like(W1t)
        U1 = U[i1:i2, i1:i2]
        d1 = torch.diagonal(U1).unsqueeze(1)
        if nm is None:
            scores = (W1t**2 / d1**2).T
            prune1t = torch.cat([_block_prune_mask(scores[r0:r1], s, i1, i2, cols, q)
                                 for (r0, r1), s, q in zip(bounds, specs, quotas)]).T.contiguous()
            coeft = prune1t.to(W1t.dtype) / d1  # err = w * coef: the pruned part over U_jj
        else:
            prune1t = torch.zeros_like(W1t, dtype=torch.bool)
            coeft = torch.zeros_like(W1t)
        with single_thread():  # thousands of tiny ops: thread hand-offs would cost more than they save
            for i in range(i2 - i1):
                if nm is not None and i % nm[1] == 0:
                    n, m = nm
                    block = W1t[i : i + m] ** 2 / d1[i : i + m] ** 2
                    drop = block.topk(m - n, dim=0, largest=False).indices
                    prune1t[i : i + m].scatter_(0, drop, True)
                    coeft[i : i + m] = prune1t[i : i + m].to(W1t.dtype) / d1[i : i + m]
                err = torch.mul(W1t[i], coeft[i], out=Err1t[i])
                # column i is final now (never read again); the later columns compensate
                W1t[i + 1 :].addr_(U1[i, i + 1 :], err, alpha=-1.0)
        W[:, i1:i2] = W1t.masked_fill_(prune1t, 0.0).T
        W[:, i2:] -= Err1t.T @ U[i1:i2, i2:]
    return [W[r0:r1].to(w.dtype) for (r0, r1), w in zip(bounds, Ws)]


def _block_prune_mask(
    scores: torch.Tensor, spec: MaskSpec, i1: int, i2: int, cols: int, quotas: torch.Tensor | None
) -> torch.Tensor:
    """Weights to prune in the block of columns ``[i1, i2)`` of a matrix with ``cols`` columns, lowest
    scores first.

    Quotas use cumulative rounding (per row ``round(q_r * i2 / cols) - round(q_r * i1 / cols)`` for the
    row quotas ``q_r`` of :func:`~leanml.prune.masks.row_quotas`; over all rows for scope ``"layer"``),
    so the whole matrix meets the exact target whatever the block size.
    """
    rows = scores.shape[0]
    if quotas is not None:
        q = quotas.to(torch.float64)
        k = (q * i2 / cols).round().long() - (q * i1 / cols).round().long()
        return prune_lowest_per_row(scores, k)
    prune = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    total = prune_count(spec, rows * cols)
    k = int(round(total * i2 / cols)) - int(round(total * i1 / cols))
    if k:
        prune.view(-1)[lowest_indices(scores.reshape(-1), k)] = True
    return prune
