"""Pure numeric core of FISTAPruner against independent references (scikit-learn Lasso, eigvalsh, lstsq)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.linear_model import Lasso

from builders import fista_options
from leanml.config import ConfigError
from leanml.prune.cores.fista import FistaProblem, fista_prune, tune_lambda
from leanml.prune.cores.lasso import (
    FistaSteps,
    fista_solve,
    hard_threshold,
    lasso_objective,
    power_iteration,
    soft_threshold,
    stationarity,
)
from leanml.prune.cores.refine import Refit, refine_apg, refine_cg, row_output_errors
from leanml.prune.masks import MaskSpec, satisfies_nm, sparsity_of


def _problem(N: int = 300, n: int = 24, m: int = 5, seed: int = 0, cond: float = 0.3):
    """Correlated inputs X (N x n), dense weights W (m x n); H = X^T X / N, C = W H."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, n, generator=g, dtype=torch.float64) @ (
        torch.eye(n, dtype=torch.float64) + cond * torch.randn(n, n, generator=g, dtype=torch.float64)
    )
    W = torch.randn(m, n, generator=g, dtype=torch.float64)
    H = X.T @ X / N
    return X, W, H, W @ H


def test_power_iteration_matches_eigvalsh():
    _, _, H, _ = _problem(n=40)
    assert power_iteration(H, iters=500, tol=1e-12) == pytest.approx(float(torch.linalg.eigvalsh(H).max()), rel=1e-6)
    assert power_iteration(torch.zeros(5, 5)) == 0.0


def test_soft_threshold_elementwise():
    x = torch.tensor([[-3.0, -0.5, 0.0, 0.2, 2.0]])
    expected = np.sign(x.numpy()) * np.maximum(np.abs(x.numpy()) - 1.0, 0)
    assert torch.allclose(soft_threshold(x, 1.0), torch.from_numpy(expected).float())
    per_row = soft_threshold(torch.ones(2, 3), torch.tensor([[0.25], [2.0]]))
    assert torch.allclose(per_row, torch.tensor([[0.75] * 3, [0.0] * 3]))


@pytest.mark.parametrize("per_row", [False, True])
def test_fista_matches_sklearn_lasso_per_row(per_row: bool):
    X, W, H, C = _problem()
    lam = torch.tensor([0.02, 0.05, 0.1, 0.2, 0.4], dtype=torch.float64) if per_row else 0.05
    res = fista_solve(H, C, lam, steps=FistaSteps(iters=4000, tol=1e-13))
    lams = lam.tolist() if per_row else [lam] * W.shape[0]
    for i, a in enumerate(lams):
        # sklearn minimises 1/(2 N) ||y - X w||^2 + alpha ||w||_1; ours is the same up to a constant
        ref = Lasso(alpha=a, fit_intercept=False, tol=1e-12, max_iter=100_000).fit(X.numpy(), (X @ W[i]).numpy())
        assert np.abs(ref.coef_ - res.W[i].numpy()).max() < 1e-4
        assert np.array_equal(ref.coef_ == 0, res.W[i].numpy() == 0) or np.abs(ref.coef_).min() < 1e-6


def test_objective_never_rises_with_restart_and_does_without():
    # near its minimum plain FISTA overshoots (momentum) and the objective ripples upwards
    _, _, H, C = _problem()
    plain = fista_solve(H, C, 0.1, steps=FistaSteps(iters=300, restart=False))
    assert np.diff(plain.objective).max() > 0  # the restart below has something to prevent
    mono = fista_solve(H, C, 0.1, steps=FistaSteps(iters=300, restart=True))
    assert np.diff(mono.objective).max() <= 1e-12 * abs(mono.objective[0])
    assert mono.restarts > 0
    assert mono.objective[-1] <= plain.objective[-1] + 1e-6 * abs(plain.objective[-1])
    # the reported per-row objective equals a fresh evaluation
    assert torch.allclose(mono.row_objective, lasso_objective(mono.W, H, C, 0.1))


def test_fista_warm_start_and_tolerance():
    """``tol`` stops on the minimal subgradient relative to ``C``'s norm: a solve stopped so is stationary
    to that accuracy, and a warm start at its result stops at once with the same weights."""
    _, W, H, C = _problem()
    cold = fista_solve(H, C, 0.05, steps=FistaSteps(iters=5000, tol=1e-7))
    assert cold.iters < 5000
    assert stationarity(cold.W, cold.W @ H - C, 0.05) <= (1e-7) ** 2 * float((C * C).sum())
    warm = fista_solve(H, C, 0.05, W0=cold.W, steps=FistaSteps(iters=2000, tol=1e-5))
    assert warm.iters <= 2
    assert torch.allclose(warm.W, cold.W, atol=1e-6)
    looser = fista_solve(H, C, 0.05, steps=FistaSteps(iters=5000, tol=1e-3))
    assert looser.iters < cold.iters
    with pytest.raises(ValueError):
        fista_solve(H, C, -1.0)


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 7),
    blocks=st.integers(1, 6),
    sparsity=st.floats(0.05, 0.95),
    scope=st.sampled_from(["row", "layer"]),
    nm=st.sampled_from([None, (2, 4), (4, 8), (1, 4)]),
    seed=st.integers(0, 1000),
)
def test_hard_threshold_is_exact(rows, blocks, sparsity, scope, nm, seed):
    cols = 8 * blocks
    W = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    spec = MaskSpec(sparsity=sparsity, pattern=nm, scope=scope)
    P = hard_threshold(W, spec)
    kept = P != 0
    assert torch.equal(P[kept], W[kept])
    if nm is not None:
        assert satisfies_nm(P, *nm)
        assert sparsity_of(P) == pytest.approx(1 - nm[0] / nm[1])
    elif scope == "row":  # the matrix count, spread evenly over the rows
        assert int((~kept).sum()) == round(sparsity * W.numel())
        dropped = (~kept).sum(1)
        assert int(dropped.max() - dropped.min()) <= 1
    else:
        assert int(kept.sum()) == W.numel() - round(sparsity * W.numel())
    # what is kept is never smaller than what is dropped (per row / per layer)
    if nm is None and scope == "row":
        for r in range(rows):
            if kept[r].any() and (~kept[r]).any():
                assert W[r][kept[r]].abs().min() >= W[r][~kept[r]].abs().max()


def test_row_output_errors_match_direct_computation():
    X, W, H, C = _problem()
    g = torch.Generator().manual_seed(7)
    Xp = X + 0.1 * torch.randn(X.shape, generator=g, dtype=X.dtype)  # pruned-path input
    Hp, G, Hd = Xp.T @ Xp / len(X), X.T @ Xp / len(X), H
    Wn = hard_threshold(W, MaskSpec(0.5))
    direct = ((Xp @ Wn.T - X @ W.T) ** 2).mean(0)
    assert torch.allclose(row_output_errors(Wn, Hp, W @ G, ((W @ Hd) * W).sum(1)), direct, rtol=1e-9)


def test_refine_apg_matches_least_squares_on_support():
    X, W, H, C = _problem(n=16)
    mask = hard_threshold(W, MaskSpec(0.5)) != 0
    L = power_iteration(H) * 1.001
    R = refine_apg(W, mask, H, C, L, Refit(iters=3000))[0]
    for i in range(W.shape[0]):
        idx = mask[i].nonzero().squeeze(1)
        ref = torch.linalg.lstsq(X[:, idx], X @ W[i]).solution
        assert torch.allclose(R[i, idx], ref, atol=1e-6)
        assert (R[i, ~mask[i]] == 0).all()


def test_tune_lambda_bisection_direction_and_best_candidate():
    _, W, H, C = _problem(n=32, m=6)
    const = ((W @ H) * W).sum(1)
    spec = MaskSpec(0.5)
    lam0 = 1e-3 * C.abs().amax(1)
    # xi = 0: every ratio exceeds it -> lambda rises x10 each round (no upper bound yet)
    up = tune_lambda(W, H, C, const, spec, lam0, fista_options(rounds=3, iters=5, xi=0.0))
    assert torch.allclose(up.lam, lam0 * 1000)
    # xi huge: lambda falls /10 each round
    down = tune_lambda(W, H, C, const, spec, lam0, fista_options(rounds=2, iters=5, xi=1e9))
    assert torch.allclose(down.lam, lam0 / 100)
    # a rise then a fall bisects geometrically between the two bounds
    res = tune_lambda(W, H, C, const, spec, lam0, fista_options(rounds=1, iters=5, xi=0.0))
    assert torch.allclose(res.lam, lam0 * 10)
    # the result is exact, never worse than the start rounded, and more rounds never hurt
    one = tune_lambda(W, H, C, const, spec, lam0, fista_options(rounds=1, iters=20))
    three = tune_lambda(W, H, C, const, spec, lam0, fista_options(rounds=3, iters=20))
    assert (three.error <= one.error + 1e-12).all()
    assert (three.error <= three.start_error + 1e-12).all()
    assert ((three.W != 0).sum(1) == 16).all()
    assert torch.allclose(three.error, row_output_errors(three.W, H, C, const))


def test_tune_lambda_bisects_between_bounds():
    _, W, H, C = _problem(n=32, m=1)
    const = ((W @ H) * W).sum(1)
    lam0 = torch.tensor([0.01], dtype=torch.float64)
    res = tune_lambda(W, H, C, const, MaskSpec(0.5), lam0, fista_options(rounds=4, iters=10, xi=0.3))
    lams = [h["lambda_mean"] for h in res.history] + [float(res.lam)]
    ratios = [h["ratio_mean"] for h in res.history]
    lo, hi = 0.0, float("inf")
    for r, lam_r in enumerate(ratios):
        if lam_r > 0.3:
            lo = lams[r]
        else:
            hi = lams[r]
        expected = (lo * hi) ** 0.5 if (lo > 0 and np.isfinite(hi)) else (lams[r] * 10 if lam_r > 0.3 else lams[r] / 10)
        assert lams[r + 1] == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("pattern,scope", [(None, "row"), (None, "layer"), ((2, 4), "row")])
def test_fista_prune_beats_magnitude_and_is_exact(pattern, scope):
    X, W, H, C = _problem(N=400, n=64, m=12, cond=0.5, seed=1)
    spec = MaskSpec(0.5, pattern=pattern, scope=scope)
    const = ((W @ H) * W).sum(1)
    mag = row_output_errors(hard_threshold(W, spec), H, C, const).sum()
    res = fista_prune(W.float(), H.float(), spec, fista_options(rounds=3, iters=20))
    assert res.W.dtype == torch.float32
    err = row_output_errors(res.W.double(), H, C, const).sum()
    assert err < 0.8 * mag
    if pattern:
        assert satisfies_nm(res.W, *pattern)
    assert sparsity_of(res.W) == pytest.approx(0.5)
    lam_layer = fista_prune(W.float(), H.float(), spec, fista_options(lambda_scope="layer"))
    assert lam_layer.lam.unique().numel() == 1
    assert sparsity_of(lam_layer.W) == pytest.approx(0.5)


def test_refine_cg_matches_least_squares_on_support():
    """Conjugate gradients reach the least-squares refit on the support in at most |support| steps."""
    X, W, H, C = _problem(n=16)
    mask = hard_threshold(W, MaskSpec(0.5)) != 0
    R = refine_cg(W, mask, H, C, Refit(iters=8))[0]  # 8 kept weights per row
    for i in range(W.shape[0]):
        idx = mask[i].nonzero().squeeze(1)
        ref = torch.linalg.lstsq(X[:, idx], X @ W[i]).solution
        assert torch.allclose(R[i, idx], ref, atol=1e-7)
        assert (R[i, ~mask[i]] == 0).all()
    # fewer steps: never worse than the start on the support
    start = W * mask
    few = refine_cg(W, mask, H, C, Refit(iters=2))[0]
    assert (lasso_objective(few, H, C, 0.0) <= lasso_objective(start, H, C, 0.0) + 1e-12).all()


@pytest.mark.parametrize("refine_method", ["apg", "cg"])
def test_fista_prune_from_cross_product_equals_from_G(refine_method):
    """Giving ``C = W G`` (what the engine accumulates from dense outputs) instead of ``G`` changes nothing."""
    X, W, H, _ = _problem(n=32, m=6)
    g = torch.Generator().manual_seed(3)
    Xp = X + 0.1 * torch.randn(X.shape, generator=g, dtype=X.dtype)
    Hp, G = Xp.T @ Xp / len(X), X.T @ Xp / len(X)
    const = ((W @ H) * W).sum(1)
    o = fista_options(rounds=2, iters=10, refine_iters=5, precondition=True, refine_method=refine_method)
    a = fista_prune(W, Hp, MaskSpec(0.5), o, FistaProblem(G=G, dense_const=const))
    b = fista_prune(W, Hp, MaskSpec(0.5), o, FistaProblem(C=W @ G, dense_const=const))
    torch.testing.assert_close(a.W, b.W)
    torch.testing.assert_close(a.error, b.error)
    direct = ((Xp @ b.W.T - X @ W.T) ** 2).mean(0)
    torch.testing.assert_close(b.error, direct)


@pytest.mark.parametrize("beta", [0.0, 0.4, 1.0])
def test_correction_blends_the_target(beta):
    """``correction=beta`` solves for the explicit target ``beta W X + (1 - beta) W X*`` on inputs ``X*``:
    the same weights and errors as handing that target's cross moment and energy in directly."""
    X, W, _, _ = _problem(n=32, m=6)
    g = torch.Generator().manual_seed(5)
    Xp = X + 0.2 * torch.randn(X.shape, generator=g, dtype=X.dtype)
    N = len(X)
    Hp = Xp.T @ Xp / N
    Y = beta * X @ W.T + (1 - beta) * Xp @ W.T  # the blended target, token by token
    kw = dict(rounds=2, iters=10, refine_iters=5, precondition=True)
    got = fista_prune(W, Hp, MaskSpec(0.5), fista_options(correction=beta, **kw),
                      FistaProblem(C=W @ (X.T @ Xp / N), dense_const=((X @ W.T) ** 2).mean(0)))
    ref = fista_prune(W, Hp, MaskSpec(0.5), fista_options(**kw),
                      FistaProblem(C=Y.T @ Xp / N, dense_const=(Y**2).mean(0)))
    torch.testing.assert_close(got.W, ref.W)
    torch.testing.assert_close(got.error, ref.error)
    torch.testing.assert_close(got.error, ((Xp @ got.W.T - Y) ** 2).mean(0))
    with pytest.raises(ConfigError, match="correction"):  # refused where the options are made
        fista_options(correction=1.5)


def test_ridge_equals_appended_calibration_rows():
    """``ridge=rho`` solves the problem whose data gain rows ``sqrt(N r) I`` -> ``sqrt(N r) W``
    (r = rho * mean diag H): the ridge toward the dense weights, built here from the data side."""
    X, W, _, _ = _problem(n=24, m=5)
    g = torch.Generator().manual_seed(7)
    Xp = X + 0.2 * torch.randn(X.shape, generator=g, dtype=X.dtype)
    N, n = X.shape
    Hp = Xp.T @ Xp / N
    rho = 0.05
    r = rho * float(torch.diagonal(Hp).mean())
    Xa = torch.cat([Xp, (N * r) ** 0.5 * torch.eye(n, dtype=X.dtype)])
    Ya = torch.cat([X @ W.T, (N * r) ** 0.5 * W.T])
    kw = dict(rounds=2, iters=10, refine_iters=5, precondition=True)
    got = fista_prune(W, Hp, MaskSpec(0.5), fista_options(ridge=rho, **kw),
                      FistaProblem(C=W @ (X.T @ Xp / N), dense_const=((X @ W.T) ** 2).mean(0),
                                   L=power_iteration(Hp) * 1.001))
    ref = fista_prune(W, Xa.T @ Xa / N, MaskSpec(0.5), fista_options(**kw),
                      FistaProblem(C=Ya.T @ Xa / N, dense_const=(Ya**2).sum(0) / N))
    torch.testing.assert_close(got.W, ref.W)
    torch.testing.assert_close(got.error, ref.error)
    torch.testing.assert_close(got.error, ((Xa @ got.W.T - Ya) ** 2).sum(0) / N)
    # the pull shows: kept weights move less from the dense ones than without it
    free = fista_prune(W, Hp, MaskSpec(0.5), fista_options(**kw),
                       FistaProblem(C=W @ (X.T @ Xp / N), dense_const=((X @ W.T) ** 2).mean(0)))
    keep = got.W != 0
    assert ((got.W - W)[keep] ** 2).sum() < ((free.W - W)[free.W != 0] ** 2).sum()
    with pytest.raises(ConfigError, match="ridge"):
        fista_options(ridge=-1.0)


def test_preconditioned_tuning_solves_the_same_problem():
    # badly scaled inputs (a few loud features, as in LLM activations)
    X, W, H, C = _problem(n=32, m=4)
    scale = torch.ones(32, dtype=torch.float64)
    scale[:3] = 30.0
    X = X * scale
    H, C = X.T @ X / len(X), W @ (X.T @ X / len(X))
    d = torch.diagonal(H).sqrt()
    Hp, Cp = H / d[None] / d[:, None], C / d[None]
    pre = fista_solve(Hp, Cp, 0.05, steps=FistaSteps(iters=6000), col_weights=1 / d)
    for i in range(W.shape[0]):
        ref = Lasso(alpha=0.05, fit_intercept=False, tol=1e-12, max_iter=100_000).fit(X.numpy(), (X @ W[i]).numpy())
        assert np.abs(ref.coef_ - (pre.W[i] / d).numpy()).max() < 1e-4
    # with few iterations the rescaled problem reaches a lower objective
    few = fista_solve(H, C, 0.05, steps=FistaSteps(iters=20))
    few_pre = fista_solve(Hp, Cp, 0.05, steps=FistaSteps(iters=20), col_weights=1 / d)
    assert lasso_objective(few_pre.W / d, H, C, 0.05).sum() < lasso_objective(few.W, H, C, 0.05).sum()
    const = ((W @ H) * W).sum(1)
    a = tune_lambda(W, H, C, const, MaskSpec(0.5), 1e-2 * C.abs().amax(1), fista_options(precondition=True))
    assert (a.error <= a.start_error + 1e-12).all() and ((a.W != 0).sum(1) == 16).all()


@pytest.mark.parametrize("precondition,ridge,damp,method", [(True, 0.1, 0.0, "cg"), (False, 0.0, 0.05, "apg")])
def test_shared_cache_gives_the_same_weights(precondition, ridge, damp, method):
    """Linears sharing H reuse one cache of the solver's matrices; every result is bit-identical to a
    call without it, and the cache is filled once."""
    X, W, H, _ = _problem(N=400, n=32, m=10, seed=3)
    W2 = torch.randn(7, 32, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    o = fista_options(refine_iters=4, refine_method=method, precondition=precondition, ridge=ridge, damp=damp,
                      correction=0.5, iters=6)
    cache: dict = {}
    for Wi in (W, W2):
        alone = fista_prune(Wi.float(), H.float(), MaskSpec(0.5), o)
        shared = fista_prune(Wi.float(), H.float(), MaskSpec(0.5), o, cache=cache)
        assert torch.equal(alone.W, shared.W) and torch.equal(alone.error, shared.error)
    assert ("Hp" in cache) == precondition and ("L" in cache) == (not precondition)
