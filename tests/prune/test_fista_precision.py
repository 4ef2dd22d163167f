"""FISTAPruner's products in bfloat16: close to float32 where inputs are tame, never worse than the start
where they are not (a massive-activation feature), against exact float64 references."""

from __future__ import annotations

import pytest
import torch

import leanml.prune.methods.fista as fista_method
from builders import fista_options
from leanml.prune.cores.fista import FistaProblem, fista_prune
from leanml.prune.cores.lasso import hard_threshold
from leanml.prune.cores.refine import Refit, gram_product, refine_apg, refine_cg, row_output_errors
from leanml.prune.masks import MaskSpec, sparsity_of


def _inputs(N: int = 600, n: int = 48, m: int = 16, seed: int = 0, outlier: float = 1.0):
    """Inputs X (N x n) whose feature scales spread over two decades; ``outlier`` multiplies feature 0
    (LLMs' massive activations: diag(H) then spans ``outlier**2`` more)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(n, generator=g, dtype=torch.float64))
    X = torch.randn(N, n, generator=g, dtype=torch.float64) * scale
    X = X + 0.3 * X[:, torch.randperm(n, generator=g)]  # correlated features
    X[:, 0] *= outlier
    W = torch.randn(m, n, generator=g, dtype=torch.float64) * 0.1
    return X, W, X.T @ X / N


def _objective(Wx: torch.Tensor, H: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
    """Per-row ``1/2 w H w^T - c w^T`` in float64."""
    Wx, H, C = Wx.double(), H.double(), C.double()
    return 0.5 * ((Wx @ H) * Wx).sum(1) - (C * Wx).sum(1)


def test_gram_product_rounds_only_when_asked():
    _, W, H = _inputs()
    W32, H32 = W.float(), H.float()
    assert torch.equal(gram_product(W32, H32), W32 @ H32)
    low = gram_product(W32, H32, H32.to(torch.bfloat16))
    assert low.dtype == torch.float32
    rel = float((low.double() - W @ H).norm() / (W @ H).norm())
    assert 0.0 < rel < 1e-2  # bfloat16 keeps 8 bits of mantissa


@pytest.mark.parametrize("refit", ["cg", "apg"])
@pytest.mark.parametrize("outlier", [1.0, 1000.0])
def test_low_precision_refit_is_never_worse_than_its_start(refit, outlier):
    """With a feature 1000x the others (diag(H) over 1e6x), rounded products can send an iteration
    astray; the exact check at the end keeps every row at or below its start."""
    X, W, H = _inputs(outlier=outlier)
    W32, H32 = W.float(), H.float()
    C = W32 @ H32
    mask = hard_threshold(W32, MaskSpec(0.5)) != 0
    start = W32 * mask
    if refit == "cg":
        R, RH = refine_cg(start, mask, H32, C, Refit(20), start @ H32, H32.to(torch.bfloat16))
        R32 = refine_cg(start, mask, H32, C, Refit(20), start @ H32)[0]
    else:
        L = float(torch.linalg.eigvalsh(H).max()) * 1.001
        R, RH = refine_apg(start, mask, H32, C, L, Refit(20), start @ H32, H32.to(torch.bfloat16))
        R32 = refine_apg(start, mask, H32, C, L, Refit(20), start @ H32)[0]
    assert torch.equal(RH, R @ H32)  # the returned product is the exact one
    assert (R[~mask] == 0).all()
    f_start, f_low, f32 = _objective(start, H, C), _objective(R, H, C), _objective(R32, H, C)
    assert (f_low <= f_start + 1e-6 * f_start.abs()).all()
    if outlier == 1.0:
        # tame inputs: the rounded refit gains nearly what the float32 one gains
        assert float((f_start - f_low).sum()) >= 0.95 * float((f_start - f32).sum())


@pytest.mark.parametrize("pattern", [None, (2, 4)])
def test_fista_prune_in_bfloat16_against_float32(pattern):
    spec = MaskSpec(0.5, pattern=pattern)
    for outlier in (1.0, 1000.0):
        X, W, H = _inputs(outlier=outlier, seed=1)
        W32, H32 = W.float(), H.float()
        const = ((W @ H) * W).sum(1)
        start = hard_threshold(W32, spec)
        start_err = row_output_errors(start.double(), H, W @ H, const)
        o = fista_options(iters=10, refine_iters=5, refine_method="cg", precondition=True)
        r16 = fista_prune(W32, H32, spec, o, FistaProblem(W_start=start), low_dtype=torch.bfloat16)
        r32 = fista_prune(W32, H32, spec, o, FistaProblem(W_start=start))
        assert sparsity_of(r16.W) == pytest.approx(0.5)
        e16 = row_output_errors(r16.W.double(), H, W @ H, const)
        e32 = row_output_errors(r32.W.double(), H, W @ H, const)
        # every row at or below its rounded start, measured in float64
        assert (e16 <= start_err * (1 + 1e-5) + 1e-9).all()
        assert float(e16.sum()) <= 1.05 * float(e32.sum())
        # the reported errors are the exact ones, not the rounded products'
        assert torch.allclose(r16.error.double(), e16, rtol=1e-3, atol=1e-6 * float(const.max()))


def test_precision_option_resolves_per_device(monkeypatch):
    cpu = torch.device("cpu")
    assert isinstance(fista_method.cpu_has_bf16_matmul(), bool)
    assert fista_method.solve_low_dtype("float32", cpu) is None
    assert fista_method.solve_low_dtype("bfloat16", cpu) is torch.bfloat16
    monkeypatch.setattr(fista_method, "cpu_has_bf16_matmul", lambda: True)
    assert fista_method.solve_low_dtype("auto", cpu) is torch.bfloat16
    monkeypatch.setattr(fista_method, "cpu_has_bf16_matmul", lambda: False)
    assert fista_method.solve_low_dtype("auto", cpu) is None
