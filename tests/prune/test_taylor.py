"""Taylor pruning against an independent reference at small sizes: the gradient from autograd on explicit
inputs (not from ``H``), each weight's exact energy change by removing it, and the kept set by sorting."""

from __future__ import annotations

import copy

import pytest
import torch

import leanml
from builders import tiny_llama
from leanml.prune.config import PruneConfig
from leanml.prune.cores.taylor import taylor_prune
from leanml.prune.masks import MaskSpec
from leanml.prune.methods.taylor import TaylorOptions


def _problem(seed: int = 0, rows: int = 6, cols: int = 16, tokens: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g, dtype=torch.float64), torch.randn(tokens, cols, generator=g,
                                                                                   dtype=torch.float64)


def _reference_scores(W: torch.Tensor, X: torch.Tensor, second_order: bool) -> torch.Tensor:
    """First order: |w * dE/dw| with E = 1/2 mean ||W x||^2 by autograd; second order: |E(W without w) - E(W)|
    by removing each weight in turn."""
    def energy(M: torch.Tensor) -> torch.Tensor:
        return 0.5 * ((X @ M.T) ** 2).sum() / X.shape[0]

    if not second_order:
        Wg = W.clone().requires_grad_(True)
        energy(Wg).backward()
        return (W * Wg.grad).abs()
    base = energy(W)
    out = torch.empty_like(W)
    for i in range(W.shape[0]):
        for j in range(W.shape[1]):
            M = W.clone()
            M[i, j] = 0
            out[i, j] = (energy(M) - base).abs()
    return out


def _reference_prune(W: torch.Tensor, scores: torch.Tensor, per_row: int | None, nm: tuple[int, int] | None):
    """Zero the lowest scores: ``per_row`` in every row, or ``m - n`` in every block of ``m`` columns."""
    out = W.clone()
    for i in range(W.shape[0]):
        if nm is None:
            out[i, scores[i].argsort()[:per_row]] = 0
            continue
        n, m = nm
        for b in range(0, W.shape[1], m):
            out[i, b + scores[i, b:b + m].argsort()[: m - n]] = 0
    return out


@pytest.mark.parametrize("second_order", [False, True])
@pytest.mark.parametrize("nm", [None, (2, 4), (4, 8)])
def test_taylor_matches_a_brute_force_reference(second_order: bool, nm: tuple[int, int] | None) -> None:
    W, X = _problem(seed=1 + second_order)
    H = X.T @ X / X.shape[0]
    spec = MaskSpec(0.25, nm, "row")  # 4 of 16 per row when unstructured
    got = taylor_prune(W, H, spec, second_order)
    want = _reference_prune(W, _reference_scores(W, X, second_order), 4, nm)
    assert torch.equal(got, want)


def test_taylor_runs_behind_the_engine_and_from_the_command_line_options() -> None:
    model = tiny_llama()
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    first, second = copy.deepcopy(model), copy.deepcopy(model)
    report = leanml.prune(first, ids, PruneConfig(method="taylor", batch_size=2, device="cpu"), progress=False)
    leanml.prune(second, ids, PruneConfig(method="taylor", batch_size=2, device="cpu",
                                          options=TaylorOptions(second_order=True)), progress=False)
    w = first.model.layers[1].mlp.down_proj.weight
    assert float((w == 0).float().mean()) == pytest.approx(0.5, abs=1e-6)
    assert report["method_config"] == {"second_order": False} and report["mask"]["scope"] == "row"
    assert not torch.equal(w, second.model.layers[1].mlp.down_proj.weight)  # the option reaches the core
