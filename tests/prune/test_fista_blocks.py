"""FISTAPruner runs its rows in blocks on CPU (cache-sized working arrays); rows are independent
problems, so a blocked run must give the single-block result: same masks, same weights up to the
products' rounding, same errors, for every mask kind and lambda scope."""

from __future__ import annotations

import pytest
import torch

import leanml.prune.cores.refine as refine
from builders import fista_options
from leanml.prune.cores.fista import fista_prune
from leanml.prune.cores.lasso import FistaSteps, fista_solve
from leanml.prune.cores.refine import Refit, refine_apg, refine_cg, row_blocks
from leanml.prune.masks import MaskSpec


def _problem(m: int = 37, n: int = 24, N: int = 400, seed: int = 0, dtype: torch.dtype = torch.float64):
    """Float64 by default: the comparison then sees the blocking, not the products' rounding (in float32
    a different matrix-product kernel on a short block can tip a tie in the restart test)."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, n, generator=g, dtype=torch.float64) * torch.exp(
        torch.randn(n, generator=g, dtype=torch.float64))
    W = torch.randn(m, n, generator=g, dtype=torch.float64) * 0.1
    return W.to(dtype), (X.T @ X / N).to(dtype)


def _tiny_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of 8 rows (the problems above have 37: five blocks, the last one short)."""
    monkeypatch.setattr(refine, "MIN_BLOCK_ROWS", 8)
    monkeypatch.setattr(refine, "BLOCK_BYTES", 1)


def test_row_blocks_cover_the_rows_once(monkeypatch):
    x = torch.zeros(1, 100)
    assert row_blocks(1000, 100, x) == [slice(0, 1000)]  # 400 KB: one block
    _tiny_blocks(monkeypatch)
    blocks = row_blocks(37, 100, x)
    assert [(s.start, s.stop) for s in blocks] == [(0, 8), (8, 16), (16, 24), (24, 32), (32, 37)]


@pytest.mark.parametrize(
    "spec,lambda_scope",
    [
        (MaskSpec(0.5, scope="layer"), "row"),
        (MaskSpec(0.5, scope="row"), "row"),
        (MaskSpec(0.5, pattern=(2, 4)), "row"),
        (MaskSpec(0.6, scope="layer"), "layer"),
    ],
)
def test_blocked_prune_equals_one_block(monkeypatch, spec, lambda_scope):
    W, H = _problem()
    kw = dict(rounds=2, iters=6, refine_iters=3, refine_method="cg", precondition=True, ridge=0.1,
              correction=0.5, lambda_scope=lambda_scope, lam=1e-2)
    whole = fista_prune(W, H, spec, fista_options(**kw))
    _tiny_blocks(monkeypatch)
    blocked = fista_prune(W, H, spec, fista_options(**kw))
    assert torch.equal(whole.W != 0, blocked.W != 0)
    torch.testing.assert_close(blocked.W, whole.W, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(blocked.error, whole.error, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(blocked.lam, whole.lam)
    assert [h["restarts"] for h in blocked.history] == [h["restarts"] for h in whole.history]
    assert [h["fista_nonzero"] for h in blocked.history] == [h["fista_nonzero"] for h in whole.history]


def test_blocked_prune_in_bfloat16_keeps_its_error(monkeypatch):
    """Products in bfloat16 on float32 weights: a blocked run's error stays within the rounding of the
    single block's, and (a per-layer mask: the layer's sum) never above the start's."""
    W, H = _problem(m=96, n=32, dtype=torch.float32)
    o = fista_options(rounds=1, iters=10, refine_iters=5, refine_method="cg", precondition=True, ridge=0.1,
                      correction=0.5)
    spec = MaskSpec(0.5, scope="layer")
    whole = fista_prune(W, H, spec, o, low_dtype=torch.bfloat16)
    _tiny_blocks(monkeypatch)
    blocked = fista_prune(W, H, spec, o, low_dtype=torch.bfloat16)
    assert float(blocked.error.sum()) <= float(blocked.start_error.sum())
    torch.testing.assert_close(blocked.error.sum(), whole.error.sum(), rtol=1e-3, atol=0.0)


def test_blocked_solvers_equal_one_block(monkeypatch):
    W, H = _problem()
    C = W @ H
    mask = W.abs() > W.abs().median()
    L = float(torch.linalg.eigvalsh(H.double()).max()) * 1.001
    whole = fista_solve(H, C, 0.05, steps=FistaSteps(iters=30, L=L))
    cg = refine_cg(W * mask, mask, H, C, Refit(4))
    apg = refine_apg(W * mask, mask, H, C, L, Refit(10))
    _tiny_blocks(monkeypatch)
    blocked = fista_solve(H, C, 0.05, steps=FistaSteps(iters=30, L=L))
    torch.testing.assert_close(blocked.W, whole.W, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(blocked.WH, whole.WH, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(torch.tensor(blocked.objective), torch.tensor(whole.objective))
    assert blocked.restarts == whole.restarts and blocked.iters == whole.iters
    for ref, got in ((cg, refine_cg(W * mask, mask, H, C, Refit(4))),
                     (apg, refine_apg(W * mask, mask, H, C, L, Refit(10)))):
        torch.testing.assert_close(got[0], ref[0], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(got[1], ref[1], rtol=1e-4, atol=1e-6)
