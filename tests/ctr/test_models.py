"""CTR models: FM and cross layers against brute force, bag pooling, learning a planted signal."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from leanml.ctr.metrics import auc
from leanml.ctr.models import MODELS, CrossLayer, FieldSpec, build_model, fm_interaction
from leanml.errors import LeanmlError

# single-threaded torch: faster and fairer on a shared 2-core machine
pytestmark = pytest.mark.usefixtures("one_thread")


def test_fm_interaction_matches_pairwise_sum() -> None:
    torch.manual_seed(0)
    emb = torch.randn(5, 4, 3, dtype=torch.float64)
    brute = sum((emb[:, i] * emb[:, j]).sum(-1) for i in range(4) for j in range(i + 1, 4))
    assert torch.allclose(fm_interaction(emb), brute)


def test_cross_layer_formula() -> None:
    torch.manual_seed(0)
    layer = CrossLayer(6)
    x0, x = torch.randn(3, 6), torch.randn(3, 6)
    expected = x0 * (x @ layer.proj.weight.T + layer.proj.bias) + x
    assert torch.allclose(layer(x0, x), expected, atol=1e-6)


def test_bag_field_mean_pools_and_ignores_padding() -> None:
    torch.manual_seed(0)
    model = build_model("dnn", [FieldSpec("v", 10, bag=True)], embed_dim=4)
    table = model.embeddings.emb["v"].weight
    ids = torch.tensor([[1, 2, -1], [3, -1, -1]])
    emb, _ = model.embeddings({"v": ids})
    assert torch.allclose(emb[0, 0], table[[1, 2]].mean(0))
    assert torch.allclose(emb[1, 0], table[3])


def test_shape_and_name_errors() -> None:
    model = build_model("deepfm", [FieldSpec("u", 5), FieldSpec("v", 8, bag=True)])
    with pytest.raises(ValueError, match="missing inputs"):
        model({"u": torch.zeros(2, dtype=torch.long)})
    with pytest.raises(ValueError, match="bag field 'v'"):
        model({"u": torch.zeros(2, dtype=torch.long), "v": torch.zeros(2, dtype=torch.long)})
    with pytest.raises(LeanmlError, match="unknown CTR model"):
        build_model("xgboost", [FieldSpec("u", 5)])


@pytest.mark.parametrize("name", sorted(MODELS))
def test_models_learn_a_planted_interaction(name: str) -> None:
    """Clicks depend on user x item-group (an interaction) plus an item bias; every model must beat
    chance clearly on held-out rows, and the interaction models must beat LR."""
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    n_users, n_items, n = 20, 30, 5000
    group = rng.integers(0, 4, n_items)
    pref = rng.normal(0, 2.5, (n_users, 4))
    bias = rng.normal(0, 0.5, n_items)
    u, i = rng.integers(0, n_users, n), rng.integers(0, n_items, n)
    logit = pref[u, group[i]] + bias[i]
    y = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    fields = [FieldSpec("user", n_users), FieldSpec("item", n_items), FieldSpec("group", 4, bag=True)]
    sparse = {"user": torch.as_tensor(u), "item": torch.as_tensor(i), "group": torch.as_tensor(group[i])[:, None]}
    dense = {"x": torch.as_tensor(rng.normal(size=(n, 3)), dtype=torch.float32)}
    model = build_model(name, fields, {"x": 3}, embed_dim=8)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    tr, te = slice(0, 4000), slice(4000, n)
    labels = torch.as_tensor(y)
    for _ in range(3):
        for s in range(0, 4000, 250):
            idx = slice(s, s + 250)
            batch = {k: v[tr][idx] for k, v in sparse.items()}
            loss = torch.nn.functional.binary_cross_entropy_with_logits(
                model(batch, {"x": dense["x"][tr][idx]}), labels[tr][idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    probs = model.predict_proba({k: v[te] for k, v in sparse.items()}, {"x": dense["x"][te]}).numpy()
    score = auc(y[te], probs)
    oracle = auc(y[te], logit[te])  # about 0.91
    assert score > 0.6, (score, oracle)
    if name != "lr":  # models with interactions pick up the user x group signal
        assert score > 0.68, (score, oracle)
