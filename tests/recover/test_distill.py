"""The recovery objective against hand computations and Hugging Face's own loss."""

from __future__ import annotations

import math

import pytest
import torch

from builders import tiny_llama
from leanml.recover.distill import Objective, distill_kl, next_token_ce


def _kl_by_hand(student: list[list[float]], teacher: list[list[float]], t: float) -> float:
    """mean over positions of T^2 * sum_v p_v (log p_v - log q_v), with plain floats."""
    total = 0.0
    for zs, zt in zip(student, teacher):
        ls = [z / t for z in zs]
        lt = [z / t for z in zt]
        ns = math.log(sum(math.exp(v) for v in ls))
        nt = math.log(sum(math.exp(v) for v in lt))
        total += sum(math.exp(b - nt) * ((b - nt) - (a - ns)) for a, b in zip(ls, lt))
    return t * t * total / len(student)


@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.5])
def test_kl_matches_a_hand_computation(temperature):
    gen = torch.Generator().manual_seed(1)
    s = torch.randn(2, 3, 7, generator=gen) * 2
    t = torch.randn(2, 3, 7, generator=gen) * 2
    expected = _kl_by_hand(s.reshape(-1, 7).tolist(), t.reshape(-1, 7).tolist(), temperature)
    assert float(distill_kl(s, t, temperature)) == pytest.approx(expected, rel=1e-5)
    assert float(distill_kl(t, t, temperature)) == pytest.approx(0.0, abs=1e-6)


def test_kl_gradient_is_softmax_difference_and_teacher_gets_none():
    s = torch.randn(1, 4, 5, requires_grad=True)
    t = torch.randn(1, 4, 5, requires_grad=True)
    distill_kl(s, t).backward()
    expected = (torch.softmax(s, -1) - torch.softmax(t, -1)) / 4  # d/ds of mean over 4 positions
    assert torch.allclose(s.grad, expected.detach(), atol=1e-6)
    assert t.grad is None


def test_next_token_ce_equals_the_model_loss():
    model = tiny_llama()
    x = torch.randint(0, 256, (2, 12))
    out = model(input_ids=x, labels=x)
    ce = next_token_ce(torch.log_softmax(out.logits.float(), -1), x)
    assert ce.item() == pytest.approx(out.loss.item(), rel=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_objective_mixes_ce_and_kl_with_the_weight(temperature):
    model, teacher = tiny_llama(seed=0), tiny_llama(seed=1)
    x = torch.randint(0, 256, (2, 10))
    with torch.no_grad():
        tl = teacher(input_ids=x).logits
    obj = Objective(kd_weight=0.3, temperature=temperature)
    obj.set_batch(x, tl)
    out = model(input_ids=x, labels=x)
    loss = obj(out)
    kl = distill_kl(out.logits, tl, temperature)
    assert loss.item() == pytest.approx(0.7 * out.loss.item() + 0.3 * kl.item(), rel=1e-5)
    assert obj.last["ce"] == pytest.approx(out.loss.item(), rel=1e-6)
    obj.set_batch(x)  # no teacher: plain CE
    assert obj(out).item() == pytest.approx(out.loss.item(), rel=1e-6) and obj.last["kl"] is None
