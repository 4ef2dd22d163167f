"""Teacher samples for distillation: the KV-cached sampler against a full-recompute reference, seeds, and
the CLI's mix of samples and corpus windows."""

from __future__ import annotations

import json

import pytest
import torch

from builders import tiny_llama
from leanml.cli import main
from leanml.recover.sampling import sample_windows, start_token
from leanml.utils import LeanmlError
from recover.helpers import save_dir, text, tiny_tokenizer


def _reference(model: torch.nn.Module, n: int, seqlen: int, start: int, seed: int, batch_size: int) -> torch.Tensor:
    """Sampling without a KV cache: the whole prefix goes through the model at every step."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for lo in range(0, n, batch_size):
        ids = torch.full((min(batch_size, n - lo), 1), start, dtype=torch.long)
        for _ in range(seqlen):
            with torch.no_grad():
                logits = model(input_ids=ids, use_cache=False).logits[:, -1].float()
            ids = torch.cat([ids, torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)], 1)
        rows.append(ids[:, 1:])
    return torch.cat(rows)


def test_cached_sampling_equals_full_recompute():
    torch.manual_seed(0)
    model = tiny_llama(vocab=64).double().eval()
    got = sample_windows(model, 5, 12, start_id=3, seed=7, batch_size=2, progress=False)
    assert got.shape == (5, 12) and got.dtype == torch.long and int(got.max()) < 64
    assert torch.equal(got, _reference(model, 5, 12, 3, 7, 2))
    assert torch.equal(got, sample_windows(model, 5, 12, start_id=3, seed=7, batch_size=2, progress=False))
    assert not torch.equal(got, sample_windows(model, 5, 12, start_id=3, seed=8, batch_size=2, progress=False))
    assert model.training is False


def test_samples_follow_the_teacher_distribution():
    """A model whose head is replaced by fixed logits, so every next-token distribution is ``probs``:
    sample frequencies over 2,000 tokens match it."""
    torch.manual_seed(0)
    model = tiny_llama(vocab=8).eval()
    probs = torch.tensor([0.4, 0.3, 0.1, 0.1, 0.05, 0.05, 0.0, 0.0])

    class Fixed(torch.nn.Module):
        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return torch.log(probs.clamp_min(1e-30)).expand(*h.shape[:-1], 8)

    model.lm_head = Fixed()
    got = sample_windows(model, 50, 40, start_id=0, seed=0, batch_size=25, progress=False)
    freq = torch.bincount(got.flatten(), minlength=8).double() / got.numel()
    assert torch.allclose(freq, probs.double(), atol=0.02) and int(freq[6:].sum()) == 0


def test_bad_sampling_settings_raise():
    model = tiny_llama(vocab=16)
    for kwargs in ({"n": 0, "seqlen": 4}, {"n": 2, "seqlen": 0}, {"n": 2, "seqlen": 4, "temperature": 0.0},
                   {"n": 2, "seqlen": 4, "batch_size": 0}):
        with pytest.raises(LeanmlError):
            sample_windows(model, start_id=0, progress=False, **kwargs)
    assert start_token(tiny_tokenizer()) == tiny_tokenizer().eos_token_id


def test_cli_mixes_teacher_samples_into_training(tmp_path, capsys):
    tok = tiny_tokenizer()
    save_dir(tiny_llama(vocab=len(tok)), tok, tmp_path / "dense")
    (tmp_path / "text.txt").write_text(text())
    pruned = tmp_path / "pruned"
    assert main(["prune", "--model", str(tmp_path / "dense"), "--method", "magnitude", "--sparsity", "0.5",
                 "--calib", str(tmp_path / "text.txt"), "--nsamples", "4", "--seqlen", "32", "--no-eval",
                 "--out", str(pruned)]) == 0
    base = ["recover", "--model", str(pruned), "--data", str(tmp_path / "text.txt"), "--seqlen", "32",
            "--steps", "4", "--batch-size", "2", "--memory", "none", "--no-eval"]
    assert main([*base, "--teacher-samples", "0.5", "--out", str(tmp_path / "x")]) == 2
    assert "pass --teacher too" in capsys.readouterr().err
    assert main([*base, "--teacher", str(tmp_path / "dense"), "--teacher-samples", "1.5",
                 "--out", str(tmp_path / "x")]) == 2
    assert "--teacher-samples" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    assert main([*base, "--teacher", str(tmp_path / "dense"), "--kd-weight", "1", "--teacher-samples", "0.5",
                 "--out", str(tmp_path / "mix")]) == 0
    info = json.loads((tmp_path / "mix" / "report.json").read_text())["data"]["teacher_samples"]
    assert info["windows"] == 4 and info["corpus_windows"] == 4 and info["seqlen"] == 32
    assert info["seconds"] > 0 and not info["reused_from_checkpoint"]
    assert not (tmp_path / "mix.ckpt").exists()


def test_mixed_windows_are_kept_for_a_resumed_run(tmp_path):
    from leanml.recover.api import RecoverConfig
    from leanml.recover.cli import _mix_teacher_samples

    torch.manual_seed(0)
    tok = tiny_tokenizer()
    teacher = tiny_llama(vocab=len(tok))
    corpus = torch.arange(40 * 8).view(40, 8) % len(tok)
    cfg = RecoverConfig(steps=5, batch_size=2, seed=3)
    first, info = _mix_teacher_samples(corpus, teacher, "t", tok, cfg, 0.3, tmp_path / "ckpt", "cpu")
    assert first.shape == (10, 8) and info["windows"] == 3 and info["corpus_windows"] == 7
    assert not info["reused_from_checkpoint"]
    rows = {tuple(r) for r in corpus.tolist()}
    assert all(tuple(r) in rows for r in first[3:].tolist())  # the rest are corpus windows
    again, info2 = _mix_teacher_samples(corpus, teacher, "t", tok, cfg, 0.3, tmp_path / "ckpt", "cpu")
    assert info2["reused_from_checkpoint"] and torch.equal(first, again)
    _, info3 = _mix_teacher_samples(corpus, teacher, "another", tok, cfg, 0.3, tmp_path / "ckpt", "cpu")
    assert not info3["reused_from_checkpoint"]  # another teacher's samples are never reused
    with pytest.raises(LeanmlError, match="corpus has 40"):
        _mix_teacher_samples(corpus, teacher, "t", tok, RecoverConfig(steps=50, batch_size=2), 0.1,
                             tmp_path / "c2", "cpu")
