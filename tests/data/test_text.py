"""The real bundled SmolLM2-135M and the real Shakespeare corpus."""

from __future__ import annotations

import pytest
import torch

from leanml.data.text import (
    SHAKESPEARE_CALIB,
    SHAKESPEARE_TEST,
    SHAKESPEARE_VAL,
    calibration_windows,
    load_text,
    shakespeare_plays,
    token_windows,
)
from leanml.errors import LeanmlError


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    from leanml.models import load_model

    return load_model("smollm2-135m")


def test_splits_are_disjoint_by_play():
    plays = shakespeare_plays()
    assert len(plays) > 30
    assert set(SHAKESPEARE_TEST) <= set(plays) and set(SHAKESPEARE_CALIB) <= set(plays)
    assert not set(SHAKESPEARE_TEST) & set(SHAKESPEARE_CALIB)
    test = load_text("shakespeare", "test")
    assert "HAMLET" in test[:200] and test not in load_text("shakespeare", "train")
    val = set(SHAKESPEARE_VAL)
    assert val <= set(plays) and not val & (set(SHAKESPEARE_TEST) | set(SHAKESPEARE_CALIB))
    assert load_text("shakespeare", "val") not in load_text("shakespeare", "calib")


def test_reviews_splits_are_disjoint_and_ordered():
    from leanml.data.text import REVIEWS_TEST, REVIEWS_VAL, review_texts

    texts = review_texts()
    cut = len(texts) - REVIEWS_TEST
    assert load_text("reviews", "test") == "\n\n".join(texts[cut:])
    assert load_text("reviews", "val") == "\n\n".join(texts[cut - REVIEWS_VAL : cut])
    assert load_text("reviews", "calib") == "\n\n".join(texts[: cut - REVIEWS_VAL])
    assert load_text("reviews", "train") == load_text("reviews", "calib")
    with pytest.raises(LeanmlError, match="split"):
        load_text("reviews", "dev")


def test_calibration_windows_are_seeded(smollm2):
    _, tok = smollm2
    a = calibration_windows(tok, "shakespeare", 4, 64, seed=1)
    b = calibration_windows(tok, "shakespeare", 4, 64, seed=1)
    c = calibration_windows(tok, "shakespeare", 4, 64, seed=2)
    assert a.shape == (4, 64) and torch.equal(a, b) and not torch.equal(a, c)
    with pytest.raises(LeanmlError, match="more than the"):
        calibration_windows(tok, "shakespeare", 10**6, 512)


def test_local_text_and_hub_corpora(smollm2, tmp_path):
    _, tok = smollm2
    path = tmp_path / "t.txt"
    path.write_text("word " * 5000)
    assert token_windows(tok, load_text(str(path), "test"), 32).shape[1] == 32
    with pytest.raises(LeanmlError, match="unknown corpus"):
        load_text("no-such-corpus", "test")
    with pytest.raises(LeanmlError, match="offline"):
        load_text("wikitext2", "test")


def test_smollm2_perplexity_and_one_pruned_layer(smollm2):
    from leanml.eval.perplexity import perplexity
    from leanml.prune.engine import prune_model
    from leanml.prune.masks import MaskSpec
    from leanml.prune.methods.baselines import SparseGPTPruner

    model, tok = smollm2
    assert model.config.num_hidden_layers == 30 and model.config.num_key_value_heads == 3
    test = token_windows(tok, load_text("shakespeare", "test"), 256)[:4]
    dense = perplexity(model, test, progress=False)
    assert 15 < dense < 120  # about 43 on 20 x 512 tokens
    calib = calibration_windows(tok, "shakespeare", 4, 256)
    report = prune_model(model, calib, SparseGPTPruner(), MaskSpec(0.5, scope="layer"), layers=[0, 1],
                         progress=False)
    assert model.model.layers[0].mlp.up_proj.weight.eq(0).float().mean().item() == pytest.approx(0.5, abs=1e-3)
    assert model.model.layers[2].mlp.up_proj.weight.eq(0).float().mean().item() < 0.01
    pruned = perplexity(model, test, progress=False)
    assert dense < pruned < dense * 1.25
    assert all(lay["rel_output_error"] < 0.2 for lay in report["layers"])
