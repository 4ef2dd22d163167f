"""The one training runner against hand-written loops: with the plain LM objective it takes the steps of
an AdamW loop on ``model(input_ids=x, labels=x).loss``; with recovery's distillation objective, clipping,
a schedule and a post-step hook it takes the steps of a loop written from the formula
``(1 - w) * CE + w * T^2 * KL(teacher || student)`` with torch's own cross-entropy and KL."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from builders import tiny_llama
from leanml.recover.teacher import TeacherObjective
from leanml.train import StepOptions, StrategyRunner, TrainConfig


def _batches(n: int = 4, seqlen: int = 16, vocab: int = 256) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (2, seqlen), generator=gen) for _ in range(n)]


def test_lm_objective_takes_the_steps_of_a_plain_adamw_loop() -> None:
    torch.manual_seed(0)
    model = tiny_llama(seed=0)
    ref = copy.deepcopy(model)
    runner = StrategyRunner(model, TrainConfig(strategy="none", lr=1e-3, steps=4, progress=False))
    runner.setup(_batches()[0])
    got = [runner.step(x) for x in _batches()]
    runner.close()
    ref.train()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    want = []
    for x in _batches():
        loss = ref(input_ids=x, labels=x, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        want.append(loss.item())
    assert got == want
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values()))
    assert runner.measured_steps == [0, 1, 2, 3] and len(runner.peaks) == 4


def test_distillation_objective_clipping_schedule_and_hook_match_a_hand_written_loop() -> None:
    w, t, clip, lr = 0.4, 2.0, 0.5, 2e-3
    teacher = tiny_llama(seed=1).eval().requires_grad_(False)
    model = tiny_llama(seed=0)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    calls: list[int] = []
    runner = StrategyRunner(model, TrainConfig(strategy="checkpoint", lr=lr, steps=4, progress=False), optimizer=opt,
                            options=StepOptions(objective=TeacherObjective(teacher, w, t), max_grad_norm=clip,
                                                scheduler=sched, after_update=lambda: calls.append(1), measure_every=2))
    runner.setup(_batches()[0])
    got = [runner.step(x) for x in _batches()]
    runner.close()

    ref.train()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1.0 / (s + 1))
    want = []
    for x in _batches():
        logits = ref(input_ids=x, use_cache=False).logits.float()
        with torch.no_grad():
            target = teacher(input_ids=x, use_cache=False).logits.float()
        ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        kl = F.kl_div(F.log_softmax(logits / t, -1).flatten(0, 1), F.log_softmax(target / t, -1).flatten(0, 1),
                      log_target=True, reduction="batchmean") * t**2
        loss = (1 - w) * ce + w * kl
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(ref.parameters()), clip)
        ref_opt.step()
        ref_sched.step()
        ref_opt.zero_grad(set_to_none=True)
        want.append(loss.item())
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-5
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert len(calls) == 4 and runner.lrs == [lr, lr / 2, lr / 3, lr / 4]
    assert runner.measured_steps == [0, 2] and runner.unoptimized_peak is not None
    assert len(runner.target_times) == 4 and runner.replans == []
