"""Perplexity: the layer-by-layer path (for models larger than the device) equals the in-memory one."""

from __future__ import annotations

import math

import pytest
import torch

from builders import tiny_family
from leanml.eval.perplexity import perplexity

WINDOWS = torch.randint(0, 256, (5, 40), generator=torch.Generator().manual_seed(0))


def _direct(model, windows):
    with torch.no_grad():
        logits = model(windows).logits[:, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))
    return math.exp(float(nll))


# gemma2 has sliding-window layers (window 16 < 40 tokens): each layer needs its own attention mask
@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma3_text", "opt", "gpt_neox", "phi3"])
def test_layer_by_layer_equals_in_memory(family):
    model = tiny_family(family)
    params = {n: p.clone() for n, p in model.named_parameters()}
    in_memory = perplexity(model, WINDOWS, batch_size=2, progress=False, layerwise=False)
    layerwise = perplexity(model, WINDOWS, batch_size=2, progress=False, layerwise=True)
    assert in_memory == pytest.approx(_direct(model, WINDOWS), rel=1e-5)
    assert layerwise == pytest.approx(in_memory, rel=1e-5)
    for n, p in model.named_parameters():  # nothing moved or changed
        assert p.device.type == "cpu" and torch.equal(p, params[n]), n


def test_auto_mode_runs_layer_by_layer_when_the_model_is_elsewhere(monkeypatch):
    """A model not on the evaluation device is evaluated layer by layer, never by sending the ids to
    a device the weights are not on."""
    import leanml.models.layerwise as lw

    model = tiny_family("llama")
    calls = []
    real = lw.layerwise_logits
    monkeypatch.setattr(lw, "layerwise_logits", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr("leanml.eval.perplexity.on_device", lambda m, d: False)
    assert perplexity(model, WINDOWS, progress=False, device="cpu") == pytest.approx(_direct(model, WINDOWS), rel=1e-5)
    assert calls == [1]


def test_bfloat16_weights_evaluate_close_to_float32():
    model = tiny_family("qwen3")
    ref = perplexity(model, WINDOWS, progress=False)
    half = perplexity(model.to(torch.bfloat16), WINDOWS, progress=False, layerwise=True)
    assert half == pytest.approx(ref, rel=0.02)
