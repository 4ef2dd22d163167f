"""``recover()`` on tiny models: exact masks, structured models, distillation, memory budget, resumption."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from builders import tiny_llama
from leanml.errors import LeanmlError
from leanml.memory import Budget
from leanml.recover import (
    MaskKeeper,
    RecoverConfig,
    linear_sparsity,
    lr_factor,
    masked_linears,
    recover,
    recover_training,
)
from leanml.train import TrainConfig
from recover.helpers import sparse_llama


def _windows(n: int = 24, seqlen: int = 16, seed: int = 0) -> torch.Tensor:
    """Token windows with structure a tiny model can learn: a repeating ramp plus noise tokens."""
    gen = torch.Generator().manual_seed(seed)
    base = (torch.arange(seqlen) * 7) % 50
    noise = torch.randint(0, 256, (n, seqlen), generator=gen)
    keep = torch.rand(n, seqlen, generator=gen) < 0.8
    return torch.where(keep, base.expand(n, -1) + torch.randint(0, 3, (n, 1), generator=gen), noise)


def _zeros(model) -> dict[str, torch.Tensor]:
    return {name: lin.weight.detach() == 0 for name, lin in masked_linears(model)}


@pytest.mark.parametrize("pattern", [None, (2, 4)], ids=["unstructured", "2:4"])
def test_masks_are_kept_exactly_while_the_loss_falls(pattern):
    model = sparse_llama(pattern=pattern)
    before = _zeros(model)
    weights = {n: lin.weight.detach().clone() for n, lin in masked_linears(model)}
    cfg = RecoverConfig(train=recover_training(steps=12, batch_size=4, lr=3e-3, strategy="none"), warmup=2)
    report = recover(model, _windows(), cfg, teacher=tiny_llama(seed=1), progress=False)
    assert report["sparsity"]["in"] == report["sparsity"]["out"] == pytest.approx(0.5)
    for name, lin in masked_linears(model):
        w = lin.weight.detach()
        assert torch.equal(w == 0, before[name]), name
        assert not torch.equal(w, weights[name]), name  # the kept weights did train
        if pattern is not None:  # every group of 4 inputs still holds exactly 2 weights, at the same places
            assert ((w != 0).reshape(w.shape[0], -1, 4).sum(-1) == 2).all(), name
    losses = report["losses"]
    assert len(losses["loss"]) == 12 and all(k is not None for k in losses["kl"])
    assert sum(losses["ce"][-3:]) < sum(losses["ce"][:3])
    mem = report["memory"]
    assert mem["peak_bytes"] > 0 and mem["unoptimized_peak_bytes"] == mem["peak_bytes"]
    assert not model.training and report["teacher"]["params"] > 0


def _structured_llama() -> LlamaForCausalLM:
    """A FASP-shaped model: MLP width 96 (physically shrunk) and pruned attention value/output dimensions
    left as exact zeros (value rows, output-projection columns)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.v_proj.weight[:5] = 0  # value dims 0..4 of kv head 0 ...
            for h in (0, 1):  # ... feed output columns of query heads 0 and 1 (head_dim 16)
                layer.self_attn.o_proj.weight[:, h * 16 : h * 16 + 5] = 0
    return model


def test_a_structured_model_trains_at_its_smaller_size(tmp_path):
    model = _structured_llama()
    params = sum(p.numel() for p in model.parameters())
    before = _zeros(model)
    cfg = RecoverConfig(train=recover_training(steps=4, batch_size=2, lr=1e-3, strategy="checkpoint"))
    report = recover(model, _windows(), cfg, progress=False)
    assert sum(p.numel() for p in model.parameters()) == params and model.config.intermediate_size == 96
    assert all(torch.equal(lin.weight.detach() == 0, before[n]) for n, lin in masked_linears(model))
    assert report["memory"]["peak_bytes"] < report["memory"]["unoptimized_peak_bytes"]  # checkpointing saved memory
    model.save_pretrained(tmp_path / "m")
    again = LlamaForCausalLM.from_pretrained(tmp_path / "m")
    assert linear_sparsity(again) == report["sparsity"]["out"] == report["sparsity"]["in"]


def test_adacc_keeps_the_peak_within_the_budget_with_a_teacher():
    model = sparse_llama()
    train = recover_training(steps=3, batch_size=4, strategy="adacc", budget=Budget.parse(0.6))
    report = recover(model, _windows(seqlen=32), RecoverConfig(train=train, measure_every=1),
                     teacher=tiny_llama(seed=1), progress=False)
    mem = report["memory"]
    assert mem["within_budget"] and mem["peak_bytes"] <= mem["budget_bytes"]
    # the student's activations are counted, not only the teacher's targets (4 x 32 x 256 float32)
    assert mem["peak_bytes"] > max(4 * 32 * 256 * 4, 0.3 * mem["unoptimized_peak_bytes"])
    assert mem["budget_bytes"] == pytest.approx(0.6 * mem["unoptimized_peak_bytes"])
    assert mem["measured_steps"] == [0, 1, 2] and report["sparsity"]["out"] == report["sparsity"]["in"]


def test_an_interrupted_run_resumes_to_the_uninterrupted_result(tmp_path):
    cfg = RecoverConfig(train=recover_training(steps=7, batch_size=2, lr=2e-3, strategy="checkpoint"), warmup=2,
                        checkpoint_every=2)
    teacher = tiny_llama(seed=1)
    full = sparse_llama()
    ref = recover(full, _windows(), cfg, teacher=teacher, checkpoint_dir=tmp_path / "a", progress=False)

    def interrupt(step: int, log: dict) -> None:
        if step == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        recover(sparse_llama(), _windows(), cfg, teacher=teacher, checkpoint_dir=tmp_path / "b",
                on_step=interrupt, progress=False)
    resumed = sparse_llama()  # a fresh process would reload the pruned model
    report = recover(resumed, _windows(), cfg, teacher=teacher, checkpoint_dir=tmp_path / "b", progress=False)
    assert report["resumed_from_step"] == 4
    assert report["losses"]["loss"] == ref["losses"]["loss"]
    a, b = full.state_dict(), resumed.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(LeanmlError, match="other settings"):
        recover(sparse_llama(), _windows(),
                RecoverConfig(train=recover_training(steps=8, strategy="none"), checkpoint_every=2),
                checkpoint_dir=tmp_path / "b", progress=False)


def test_dense_fine_tune_is_allowed_only_without_masks():
    with pytest.raises(LeanmlError, match="no pruned weights"):
        recover(tiny_llama(), _windows(), RecoverConfig(train=recover_training(steps=1, strategy="none")),
                progress=False)
    model = tiny_llama()
    report = recover(model, _windows(),
                     RecoverConfig(train=recover_training(steps=2, strategy="none", lr=1e-3), keep_masks=False),
                     progress=False)
    assert report["sparsity"]["kept_exactly"] is False


def test_budget_below_the_feasible_minimum_fails_before_training():
    model = sparse_llama()
    w0 = {k: v.clone() for k, v in model.state_dict().items()}
    train = recover_training(steps=2, strategy="adacc", budget=Budget.parse(0.01))
    with pytest.raises(LeanmlError, match="smallest feasible plan"):
        recover(model, _windows(), RecoverConfig(train=train), progress=False)
    assert all(torch.equal(w0[k], v) for k, v in model.state_dict().items())


def test_explicit_masks_and_bad_settings():
    model = sparse_llama()
    keep = {n: torch.zeros_like(lin.weight, dtype=torch.bool) for n, lin in masked_linears(model)}
    first = next(iter(keep))
    keep[first][0, 0] = True
    report = recover(model, _windows(), RecoverConfig(train=recover_training(steps=1, strategy="none")),
                     masks=MaskKeeper(model, keep), progress=False)
    assert report["sparsity"]["masked_fraction"] < 1e-3
    with pytest.raises(LeanmlError, match="not a linear"):
        MaskKeeper(model, {"lm_head": torch.zeros(256, 64, dtype=torch.bool)})
    for bad in (lambda: recover_training(strategy="zip"), lambda: RecoverConfig(kd_weight=1.5),
                lambda: recover_training(steps=0), lambda: Budget.parse("lots"),
                lambda: RecoverConfig(train=recover_training(strategy="compile")),
                lambda: RecoverConfig(train=recover_training(strategy="none", budget=Budget.parse(0.5))),
                lambda: TrainConfig(budget=0.5)):
        with pytest.raises(LeanmlError):
            bad()


def test_learning_rate_schedule():
    cfg = RecoverConfig(train=recover_training(steps=20), warmup=4, min_lr_ratio=0.1)
    f = [lr_factor(s, cfg) for s in range(20)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0] and f[4] == 1.0
    assert f[-1] == pytest.approx(0.1) and all(a >= b for a, b in zip(f[4:], f[5:]))
