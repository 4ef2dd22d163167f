"""Masks read from zeros and kept exactly: pure cores against brute force, and the keeper under AdamW."""

from __future__ import annotations

import itertools

import pytest
import torch

from builders import tiny_llama, tiny_opt_biased
from leanml.recover.masks import (
    MaskKeeper,
    cast_keeping_zeros,
    cast_tensor_keeping_zeros,
    dead_rows,
    linear_sparsity,
    masked_linears,
    nm_violations,
)
from recover.helpers import prune_magnitude


def _nm_brute(dead: torch.Tensor, n: int, m: int) -> int:
    bad = 0
    for r, g in itertools.product(range(dead.shape[0]), range(dead.shape[1] // m)):
        kept = sum(1 for j in range(g * m, (g + 1) * m) if not dead[r, j])
        bad += kept > n
    return bad


@pytest.mark.parametrize("n,m", [(2, 4), (1, 4), (4, 8)])
def test_nm_violations_matches_brute_force(n, m):
    gen = torch.Generator().manual_seed(n * 10 + m)
    dead = torch.rand(6, 4 * m, generator=gen) < 0.5
    assert nm_violations(dead, n, m) == _nm_brute(dead, n, m)
    assert nm_violations(torch.ones(3, 2 * m + 1, dtype=torch.bool), n, m) == 3  # indivisible width


def test_masks_are_the_zeros_of_every_linear_but_the_head():
    model = prune_magnitude(tiny_llama(), 0.5)
    keeper = MaskKeeper.from_zeros(model)
    names = [n for n, _ in masked_linears(model)]
    assert "lm_head" not in names and len(names) == 14 and set(keeper.masks) == set(names)
    assert keeper.fraction() == pytest.approx(0.5) == linear_sparsity(model)
    assert keeper.violations() == 0 and keeper.nm_violations(2, 4)  # per-row masks are not 2:4


def test_adamw_with_weight_decay_keeps_every_zero_and_moves_the_rest():
    torch.manual_seed(0)
    model = prune_magnitude(tiny_llama(), 0.5, pattern=(2, 4))
    before = {n: lin.weight.detach().clone() for n, lin in masked_linears(model)}
    keeper = MaskKeeper.from_zeros(model).attach()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    x = torch.randint(0, 256, (2, 16))
    for _ in range(3):
        model(input_ids=x, labels=x).loss.backward()
        for name, lin in masked_linears(model):  # gradients are masked as soon as they exist
            assert not lin.weight.grad[before[name] == 0].any(), name
        opt.step()
        keeper.enforce()
        opt.zero_grad()
    keeper.detach()
    for name, lin in masked_linears(model):
        w = lin.weight.detach()
        assert torch.equal(w == 0, before[name] == 0), name  # the same positions, not only the same count
        assert not torch.equal(w, before[name])
    assert keeper.nm_violations(2, 4) == {}


def test_enforce_alone_restores_zeros_an_optimizer_moved():
    model = prune_magnitude(tiny_llama(), 0.5)
    keeper = MaskKeeper.from_zeros(model)
    with torch.no_grad():
        for _, lin in masked_linears(model):
            lin.weight.add_(0.01)
    assert keeper.violations() > 0
    keeper.enforce()
    assert keeper.violations() == 0 and linear_sparsity(model) == pytest.approx(0.5)


def test_dead_rows_keep_their_bias_at_zero():
    model = tiny_opt_biased()
    fc1 = model.model.decoder.layers[0].fc1
    with torch.no_grad():
        fc1.weight[:5] = 0
        fc1.bias[:5] = 0
    keeper = MaskKeeper.from_zeros(model).attach()
    name = next(n for n, lin in masked_linears(model) if lin is fc1)
    assert torch.equal(keeper.masks[name].bias, dead_rows(fc1.weight == 0))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randint(0, 256, (2, 8))
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    keeper.enforce()
    assert not fc1.bias[:5].any() and fc1.bias[5:].ne(0).all()


def test_casting_down_keeps_exactly_the_zeros():
    w = torch.tensor([[0.0, 1e-9, -1e-9, 0.5], [0.0, -0.0, 2e-8, 1.0]])
    cast, raised = cast_tensor_keeping_zeros(w, torch.float16)
    assert raised == 3 and cast.dtype == torch.float16  # 1e-9 and 2e-8 underflow in float16
    assert torch.equal(cast == 0, w == 0)
    assert cast[0, 1] == torch.finfo(torch.float16).tiny and cast[0, 2] == -torch.finfo(torch.float16).tiny
    assert cast[0, 3] == 0.5 and cast[1, 3] == 1.0  # representable entries are a plain cast
    assert cast_tensor_keeping_zeros(w, torch.bfloat16)[1] == 0  # bfloat16 has float32's range
    model = prune_magnitude(tiny_llama())
    with torch.no_grad():
        next(masked_linears(model))[1].weight[0, :].mul_(1e-6)  # row 0 below float16's range
    zeros = {n: lin.weight.detach() == 0 for n, lin in masked_linears(model)}
    assert cast_keeping_zeros(model, torch.float16) > 0
    assert all(lin.weight.dtype == torch.float16 and torch.equal(lin.weight == 0, zeros[n])
               for n, lin in masked_linears(model))
    assert model.lm_head.weight.dtype == torch.float16
