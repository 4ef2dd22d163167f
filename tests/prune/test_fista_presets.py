"""FISTA's named settings, its stopping rule and its fallback when a solve diverges."""

from __future__ import annotations

import pytest
import torch

from builders import fista_options
from leanml.cli import main
from leanml.config import ConfigError
from leanml.prune.cores.fista import FistaProblem, fista_prune
from leanml.prune.cores.refine import Refit, refine_cg, row_dot
from leanml.prune.masks import MaskSpec, sparsity_of
from leanml.prune.methods.fista import PRESETS, FistaOptions, FistaPruner


def test_presets_fill_the_fields_left_open():
    for name, fields in PRESETS.items():
        o = FistaOptions(preset=name)
        assert {k: getattr(o, k) for k in fields} == fields
    # no preset: the default preset's values, any field changeable on top
    assert FistaOptions().iters == PRESETS["default"]["iters"]
    assert FistaOptions(iters=3).iters == 3 and FistaOptions(iters=3).refine == PRESETS["default"]["refine"]
    # an explicit field equal to the preset's is no conflict
    assert FistaOptions(preset="fast", iters=1).iters == 1


def test_a_preset_with_a_conflicting_option_is_refused():
    with pytest.raises(ConfigError, match="preset fast sets iters to 1; iters 5 conflicts") as err:
        FistaOptions(preset="fast", iters=5)
    assert set(err.value.fields) == {"preset", "iters"}


def test_the_command_line_names_both_flags(capsys):
    code = main(["prune", "--model", "x", "--method", "fista", "--fista-preset", "fast", "--fista-warm-start",
                 "wanda", "--out", "/tmp/never-written"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "--fista-preset" in err[0] and "--fista-warm-start" in err[0]


def test_the_dense_pass_only_when_the_target_needs_it():
    assert FistaPruner(FistaOptions()).needs_dense is True
    assert FistaPruner(FistaOptions(correction=0.0)).needs_dense is False


def _problem(m: int = 12, n: int = 24, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(300, n, generator=g, dtype=torch.float64) * torch.exp(
        torch.randn(n, generator=g, dtype=torch.float64))
    W = torch.randn(m, n, generator=g, dtype=torch.float64)
    return W, X.T @ X / 300


def test_cg_stops_on_its_residual_and_says_how_long_it_ran():
    """With ``tol`` the refit stops once the gradient on the support is below ``tol`` of ``C``'s norm there,
    reports the iterations it ran, and ends where the full run ends to that accuracy."""
    W, H = _problem()
    C = W @ H
    mask = W.abs() > W.abs().median()
    used: list[int] = []
    X, XH = refine_cg(W * mask, mask, H, C, Refit(200, tol=1e-6, used=used))
    assert 1 <= used[0] < 200
    grad = (XH - C) * mask
    ref = (C * mask).pow(2).sum()
    assert float(row_dot(grad, grad).sum()) <= 1e-12 * float(ref) * 1.0001
    full = refine_cg(W * mask, mask, H, C, Refit(200))[0]

    def objective(V: torch.Tensor) -> float:
        return float((0.5 * row_dot(V @ H, V) - row_dot(C, V)).sum())

    assert objective(X) - objective(full) <= 1e-6 * abs(objective(full))


def test_tolerance_on_fista_prune_reports_iterations_and_keeps_the_guarantee():
    W, H = _problem(m=20, n=32, seed=1)
    spec = MaskSpec(0.5)
    loose = fista_prune(W, H, spec, fista_options(iters=200, refine_iters=200, tol=1e-2, rounds=1, refine_method="cg",
                                                  precondition=True))
    tight = fista_prune(W, H, spec, fista_options(iters=200, refine_iters=200, tol=0.0, rounds=1, refine_method="cg",
                                                  precondition=True))
    assert loose.fista_iters[0] < tight.fista_iters[0] == 200
    assert 0 < loose.refine_iters_used < tight.refine_iters_used
    assert (loose.error <= loose.start_error * (1 + 1e-9)).all()
    assert sparsity_of(loose.W) == pytest.approx(0.5)


def test_a_diverging_solve_keeps_the_warm_start_and_says_so():
    """Statistics so loud that the products overflow float32 (an input feature of scale 1e19): rows whose
    candidates are not finite keep their warm start rounded, the weights stay finite within the mask,
    and the report carries the count and a warning."""
    g = torch.Generator().manual_seed(0)
    n, m = 16, 6
    X = torch.randn(200, n, generator=g)
    X[:, 0] *= 1e19
    H = (X.double().T @ X.double() / 200).float()
    assert torch.isfinite(H).all()
    W = torch.randn(m, n, generator=g)
    start = W * (torch.rand(m, n, generator=g) > 0.5)
    res = fista_prune(W, H, MaskSpec(0.5), FistaOptions(iters=10, refine=5), FistaProblem(W_start=start),
                      low_dtype=torch.bfloat16)
    assert torch.isfinite(res.W).all()
    assert ((res.W != 0).sum(1) <= n // 2).all()  # the mask holds (a fallback row keeps its start's zeros too)
    assert res.fallback_rows > 0
    report = FistaPruner._report(res, torch.bfloat16)
    assert report["fallback_rows"] == res.fallback_rows and "warm start" in report["warning"]
