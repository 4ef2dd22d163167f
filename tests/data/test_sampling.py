"""Windows sampled from a model: the KV-cached sampler against a full-recompute reference, seeds, the
sample distribution, bad settings."""

from __future__ import annotations

import pytest
import torch

from builders import tiny_llama
from leanml.data.sampling import Sampling, sample_windows, start_token
from leanml.errors import LeanmlError
from recover.helpers import tiny_tokenizer


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
    got = sample_windows(model, 5, 12, Sampling(3, seed=7, batch_size=2), progress=False)
    assert got.shape == (5, 12) and got.dtype == torch.long and int(got.max()) < 64
    assert torch.equal(got, _reference(model, 5, 12, 3, 7, 2))
    assert torch.equal(got, sample_windows(model, 5, 12, Sampling(3, seed=7, batch_size=2), progress=False))
    assert not torch.equal(got, sample_windows(model, 5, 12, Sampling(3, seed=8, batch_size=2), progress=False))
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
    got = sample_windows(model, 50, 40, Sampling(0, seed=0, batch_size=25), progress=False)
    freq = torch.bincount(got.flatten(), minlength=8).double() / got.numel()
    assert torch.allclose(freq, probs.double(), atol=0.02) and int(freq[6:].sum()) == 0


def test_bad_sampling_settings_raise():
    model = tiny_llama(vocab=16)
    for n, seqlen, extra in ((0, 4, {}), (2, 0, {}), (2, 4, {"temperature": 0.0}), (2, 4, {"batch_size": 0})):
        with pytest.raises(LeanmlError):
            sample_windows(model, n, seqlen, Sampling(0, **extra), progress=False)
    assert start_token(tiny_tokenizer()) == tiny_tokenizer().eos_token_id
    with pytest.raises(LeanmlError, match="drop --calib-samples"):
        start_token(object(), "--calib-samples")


def test_calibration_with_samples_is_samples_then_corpus_windows(smollm2_dir):
    """Against its two independent parts: the first windows are exactly what the sampler draws with the
    seed, the rest exactly the seeded corpus windows; share 0 is the plain calibration."""
    from transformers import AutoTokenizer

    from leanml.data.sampling import CalibrationSet, calibration_with_samples
    from leanml.data.text import calibration_windows

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    torch.manual_seed(0)
    model = tiny_llama(vocab=len(tok)).eval()
    ids, info = calibration_with_samples(model, tok, CalibrationSet("shakespeare", 5, 16, 0.4, seed=3), progress=False)
    assert ids.shape == (5, 16) and info["sampled_windows"] == 2 and info["corpus_windows"] == 3
    start = start_token(tok)
    assert info["start_token"] == start and info["sampling_seconds"] > 0
    assert torch.equal(ids[:2], sample_windows(model, 2, 16, Sampling(start, seed=3), progress=False))
    assert torch.equal(ids[2:], calibration_windows(tok, "shakespeare", 3, 16, seed=3))
    plain, info0 = calibration_with_samples(model, tok, CalibrationSet("shakespeare", 5, 16, 0.0, seed=3))
    assert torch.equal(plain, calibration_windows(tok, "shakespeare", 5, 16, seed=3))
    assert info0["sampled_windows"] == 0 and info0["sampling_seconds"] == 0.0
    every, _ = calibration_with_samples(model, tok, CalibrationSet("shakespeare", 3, 16, 1.0, seed=3), progress=False)
    assert torch.equal(every, sample_windows(model, 3, 16, Sampling(start, seed=3), progress=False))
    with pytest.raises(LeanmlError, match="in \\[0, 1\\]"):
        calibration_with_samples(model, tok, CalibrationSet("shakespeare", 5, 16, 1.2))
