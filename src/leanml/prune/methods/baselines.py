"""Baseline pruning methods as pure functions of weights and input statistics, plus their engine classes.

- :func:`magnitude_prune`: keep the largest ``|W|``.
- :func:`wanda_prune`: keep the largest ``|W_ij| * ||X_j||`` (Sun et al., 2023).
- :func:`sparsegpt_prune`: blocked OBS with the upper Cholesky factor of ``(H + damp I)^-1``,
  lazy batch updates per block of columns (Frantar & Alistarh, 2023).
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from typing import Any, ClassVar

import torch

from leanml.prune.base import Group, GroupStats, LinearSpecs, Pruner, linear_spec
from leanml.prune.masks import (
    MaskSpec,
    keep_mask,
    lowest_indices,
    prune_count,
    prune_lowest_per_row,
    row_quotas,
)
from leanml.utils import LeanmlError


def magnitude_prune(W: torch.Tensor, spec: MaskSpec) -> torch.Tensor:
    """Zero the smallest-magnitude weights."""
    return W * keep_mask(W.float().abs(), spec)


def wanda_prune(W: torch.Tensor, sq_norms: torch.Tensor, spec: MaskSpec) -> torch.Tensor:
    """Zero the weights with the smallest ``|W_ij| * ||X_j||``; ``sq_norms[j]`` is ``||X_j||^2`` (any scale)."""
    if sq_norms.shape != (W.shape[1],):
        raise ValueError(f"sq_norms must have shape ({W.shape[1]},), got {tuple(sq_norms.shape)}")
    scores = W.float().abs() * sq_norms.float().clamp_min(0).sqrt().unsqueeze(0)
    return W * keep_mask(scores, spec)


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


class _UnstructuredPruner(Pruner):
    """Shared driver: prune every linear of every group with :meth:`prune_weight`.

    Statistics come from one pass of the dense layer by default (``default_intra_layer = False``), as in
    the papers of magnitude, Wanda and SparseGPT."""

    default_scope: ClassVar[str] = "row"
    default_intra_layer: ClassVar[bool] = False

    def prune_group(self, group: Group, stats: GroupStats | None, spec: LinearSpecs) -> dict[str, dict[str, Any]]:
        # the engine reports each linear's error; nothing extra to add here
        shared = self.prepare(stats) if stats is not None else None
        for name, lin in group.linears.items():
            lin.weight.data.copy_(self.prune_weight(lin.weight.data, stats, linear_spec(spec, name), shared))
        return {}

    def prepare(self, stats: GroupStats) -> Any:
        return None

    def prune_weight(self, W: torch.Tensor, stats: GroupStats | None, spec: MaskSpec, shared: Any) -> torch.Tensor:
        raise NotImplementedError


class MagnitudePruner(_UnstructuredPruner):
    """Magnitude pruning: needs no calibration statistics (one threshold per matrix by default)."""

    name = "magnitude"
    default_scope = "layer"
    needs_stats = False

    def prune_weight(self, W, stats, spec, shared):
        return magnitude_prune(W, spec)


class WandaPruner(_UnstructuredPruner):
    """Wanda: ``|W| * ||X||`` scores, compared per output row by default (the paper's choice)."""

    name = "wanda"
    default_scope = "row"

    def prune_weight(self, W, stats, spec, shared):
        return wanda_prune(W, stats.sq_norms, spec)


class SparseGPTPruner(_UnstructuredPruner):
    name = "sparsegpt"
    default_scope = "layer"

    def __init__(self, damp: float = 0.01, blocksize: int = 128) -> None:
        if damp < 0:
            raise LeanmlError(f"--sparsegpt-damp must be >= 0, got {damp}")
        if blocksize < 1:
            raise LeanmlError(f"--sparsegpt-blocksize must be >= 1, got {blocksize}")
        self.damp = damp
        self.blocksize = blocksize

    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("sparsegpt")
        g.add_argument("--sparsegpt-damp", type=float, default=0.01, help="damping, fraction of mean diag(H)")
        g.add_argument("--sparsegpt-blocksize", type=int, default=128, help="columns per lazy-update block")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SparseGPTPruner:
        return cls(damp=args.sparsegpt_damp, blocksize=args.sparsegpt_blocksize)

    def config(self) -> dict[str, Any]:
        return {"damp": self.damp, "blocksize": self.blocksize}

    def prune_group(self, group: Group, stats: GroupStats | None, spec: LinearSpecs) -> dict[str, dict[str, Any]]:
        """All linears of the group in one OBS sweep (they share ``H`` and its factor)."""
        names = list(group.linears)
        U = hinv_upper(stats.H, self.damp)[0]
        new = sparsegpt_prune_many([group.linears[n].weight.data for n in names], stats.H,
                                   [linear_spec(spec, n) for n in names], self.damp, self.blocksize, U=U)
        for n, W in zip(names, new):
            group.linears[n].weight.data.copy_(W)
        return {}
