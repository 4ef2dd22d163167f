"""CTR fields from content IDs: prefix n-grams, unseen rows, ID dropout, validation splits, bytes per ad."""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
import pytest
import torch

from leanml.ctr.content import ItemFeatures, bytes_per_ad
from leanml.ctr.data import CTRData, fashion_ads, validation_split
from leanml.ctr.fields import FieldBuilder, content_fields, prefix_ids, seen_remap
from leanml.ctr.metrics import auc
from leanml.ctr.models import build_model
from leanml.ctr.options import CTRConfig
from leanml.ctr.train import predict, run_ctr, train_ctr_model, zero_unseen_rows
from leanml.errors import LeanmlError

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_data(n_items: int = 6, new: tuple[int, ...] = (4, 5)) -> CTRData:
    """Users 0..2 (user 2 only in test), items 0..5 (4 and 5 new), one context."""
    train = pd.DataFrame({"user": [0, 1, 0, 1, 0, 1, 0, 1], "item": [0, 1, 2, 3, 0, 1, 2, 3],
                          "context": 0, "label": [1, 0, 1, 0, 0, 1, 1, 0], "day": 0})
    test = pd.DataFrame({"user": [2, 0, 1, 2], "item": [4, 5, 0, 3], "context": 0, "label": [1, 0, 1, 0], "day": 1})
    is_new = np.zeros(n_items, dtype=bool)
    is_new[list(new)] = True
    return CTRData("tiny", np.arange(n_items) + 100, torch.zeros(n_items, 4), "mlp", ["c"] * n_items, is_new,
                   train, test, n_users=3, n_contexts=1)


def test_prefix_ids_match_brute_force() -> None:
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 5, (200, 3))
    ids, vocabs = prefix_ids(codes, 5, buckets=1000)
    assert vocabs == [5, 25, 125]
    for lvl in range(3):
        brute = sum(codes[:, j] * 5 ** (lvl - j) for j in range(lvl + 1))
        assert np.array_equal(ids[lvl], brute)
    # beyond the bucket budget the id is hashed: in range, and equal prefixes still share an id
    hashed, vocabs = prefix_ids(codes, 5, buckets=7)
    assert vocabs == [5, 7, 7] and all(h.max() < 7 for h in hashed)
    for a, b in itertools.combinations(range(50), 2):
        if (codes[a, :2] == codes[b, :2]).all():
            assert hashed[1][a] == hashed[1][b]


def test_content_fields_per_mode() -> None:
    items = ItemFeatures(np.array([[1, 2], [3, 0]]), None, 2, 4)
    names = {mode: [(n, v, b) for n, _, v, b in content_fields(items, mode)] for mode in
             ("codes", "prefix", "codes+prefix", "bag")}
    assert names["codes"] == [("visual0", 4, False), ("visual1", 4, False)]
    assert names["prefix"] == [("visual_p1", 4, False), ("visual_p2", 16, False)]
    assert names["codes+prefix"] == [("visual0", 4, False), ("visual1", 4, False), ("visual_p2", 16, False)]
    assert names["bag"] == [("visual", 8, True)]
    bag = content_fields(items, "bag")[0][1]
    assert bag.tolist() == [[1, 6], [3, 4]]  # one shared table: position m owns [m*K, (m+1)*K)


def test_unseen_ids_go_to_row_zero() -> None:
    assert seen_remap(np.array([3, 1, 3, 2]), np.array([0, 1]), 4).tolist() == [4, 2, 4, 0]
    data = tiny_data()
    # item 5 (new) shares code 1 with old item 0; item 4 (new) has code 3 that no old item has
    codes = np.array([[1, 0], [2, 0], [0, 1], [2, 1], [3, 1], [1, 2]])
    items = ItemFeatures(codes, np.ones((6, 3), np.float32), 2, 4)
    b = FieldBuilder(data, items, CTRConfig(features="id+raw+visual"))
    sparse, dense, labels = b.tensors(data.test)
    assert sparse["user"].tolist() == [0, 1, 2, 0]  # user 2 never trained
    assert sparse["ad"].tolist() == [0, 0, 1, 4]  # new ads 4, 5 -> row 0
    assert sparse["visual0"].tolist() == [0, 2, 2, 3]  # code 3 unseen -> 0, code 1 seen -> 2
    assert sparse["visual1"].tolist() == [2, 0, 1, 2]  # code 2 only on a new ad -> 0
    assert dense["raw"].shape == (4, 3) and labels.tolist() == [1, 0, 1, 0]
    model = build_model("deepfm", b.specs, b.dense_dims)
    zero_unseen_rows(model, b.unseen_rows)
    for name in b.unseen_rows:
        assert (model.embeddings.emb[name].weight[0] == 0).all() and model.embeddings.lin[name].weight[0].item() == 0


def test_id_dropout_trains_the_unseen_ad_row() -> None:
    data = tiny_data()
    rows = []
    for dropout in (0.0, 0.5):
        cfg = CTRConfig(model="dnn", features="id", id_dropout=dropout, epochs=20, batch_size=4)
        b = FieldBuilder(data, None, cfg)
        model = build_model("dnn", b.specs, b.dense_dims)
        zero_unseen_rows(model, b.unseen_rows)
        train_ctr_model(model, *b.tensors(data.train), cfg, device=torch.device("cpu"), progress=False)
        rows.append(model.embeddings.emb["ad"].weight[0].abs().sum().item())
    assert rows[0] == 0 and rows[1] > 0
    with pytest.raises(LeanmlError, match="id_dropout"):
        CTRConfig(id_dropout=1.0)


def test_bytes_per_ad() -> None:
    items = ItemFeatures(np.zeros((2, 4), np.int64), np.zeros((2, 32), np.float32), 4, 256)
    assert bytes_per_ad("visual", items) == 4.0
    assert bytes_per_ad("raw", items) == 128.0
    assert bytes_per_ad("id+raw+visual", items) == 132.0
    assert bytes_per_ad("id", items) == 0.0
    assert bytes_per_ad("visual", ItemFeatures(np.zeros((2, 4), np.int64), None, 4, 16)) == 2.0


def test_validation_split_holds_out_ads_and_days_without_leaks() -> None:
    data = fashion_ads(n_ads=300, n_users=30, per_day=600, seed=5)
    val = validation_split(data, val_frac=0.3, new_frac=0.25, seed=1)
    val.check_split()
    assert val.train["day"].max() < val.test["day"].min() == 5
    assert val.test["day"].max() == data.info["launch_day"] - 1  # validation lies inside the training days
    assert set(val.test.index) <= set(range(len(data.train)))
    new_rows = val.test_is_new
    assert 0 < new_rows.sum() < len(val.test)
    # validation new ads are old ads of the real split (never a test-time new ad), absent from its train
    val_new_items = np.unique(val.test["item"].to_numpy()[new_rows])
    assert not data.is_new_item[val_new_items].any()
    assert not np.isin(val_new_items, val.train["item"].to_numpy()).any()
    # the real test log is untouched by validation
    assert len(val.train) + len(val.test) < len(data.train)


def test_run_ctr_reports_bytes_and_new_old_metrics() -> None:
    data = fashion_ads(n_ads=200, n_users=20, per_day=500, seed=2)
    rng = np.random.default_rng(0)
    items = ItemFeatures(rng.integers(0, 8, (200, 4)), rng.normal(size=(200, 16)).astype(np.float32), 4, 8,
                         decoded=rng.normal(size=(200, 16)).astype(np.float32))
    model, b, rep = run_ctr(data, items, CTRConfig(model="dcnv2", features="id+visual", epochs=1,
                                                   visual_fields="codes+prefix", codeword_vector=True),
                            progress=False, keep_test_probs=True)
    assert rep["bytes_per_ad"] == 1.5 and "codeword" in b.dense_dims
    assert {"auc_new", "auc_old", "gauc_new", "logloss_old"} <= set(rep["metrics"])
    # the kept probabilities are the ones the metrics came from, one per test row
    sparse, dense, labels = b.tensors(data.test)
    assert np.array_equal(rep["test_probs"], predict(model, sparse, dense))
    new = data.test_is_new
    assert auc(labels.numpy()[new], rep["test_probs"][new]) == rep["metrics"]["auc_new"]


def test_residual_id_mode_leaves_new_ads_exactly_to_the_content_model() -> None:
    data = fashion_ads(n_ads=200, n_users=20, per_day=500, seed=4)
    rng = np.random.default_rng(1)
    items = ItemFeatures(rng.integers(0, 8, (200, 2)), None, 2, 8)
    runs = {}
    for features, mode in (("visual", "dropout"), ("id+visual", "residual"), ("id+visual", "dropout")):
        cfg = CTRConfig(model="deepfm", features=features, id_mode=mode, epochs=2, seed=3)
        model, b, rep = run_ctr(data, items, cfg, progress=False)
        sparse, dense, _ = b.tensors(data.test)
        runs[(features, mode)] = (predict(model, sparse, dense), rep["metrics"])
    new = data.test_is_new
    base, resid, drop = runs[("visual", "dropout")], runs[("id+visual", "residual")], runs[("id+visual", "dropout")]
    assert np.array_equal(base[0][new], resid[0][new])  # new ads: the content model's prediction, bit for bit
    assert resid[1]["auc_new"] == base[1]["auc_new"]
    assert not np.array_equal(base[0][~new], resid[0][~new])  # old ads get their correction
    assert not np.array_equal(base[0][new], drop[0][new])
    with pytest.raises(LeanmlError, match="id_mode"):
        CTRConfig(id_mode="gate")


def test_content_tower_joins_raw_and_codeword_into_one_field(tmp_path) -> None:
    from leanml.ctr.runs import load_ctr_run, save_ctr_run

    data = fashion_ads(n_ads=200, n_users=20, per_day=500, seed=5)
    rng = np.random.default_rng(2)
    raw, decoded = rng.normal(size=(200, 16)).astype(np.float32), rng.normal(size=(200, 8)).astype(np.float32)
    items = ItemFeatures(rng.integers(0, 8, (200, 2)), raw, 2, 8, decoded=decoded)
    common = dict(model="deepfm", features="raw+visual", visual_fields="none", codeword_vector=True, epochs=1)
    _, apart, _ = run_ctr(data, items, CTRConfig(**common), progress=False)
    model, tower, rep = run_ctr(data, items, CTRConfig(**common, content_tower=True), progress=False)
    assert apart.dense_dims == {"raw": 16, "codeword": 8} and tower.dense_dims == {"content": 24}
    assert model.embeddings.num_fields == 3  # user, context, content: no second field of the same ad
    _, dense, _ = tower.tensors(data.test)
    items_of_rows = data.test["item"].to_numpy()
    assert np.array_equal(dense["content"].numpy(), np.concatenate([raw, decoded], 1)[items_of_rows])
    # the run reloads with the tower: same predictions
    save_ctr_run(tmp_path / "run", model, tower, rep)
    again, b2, _ = load_ctr_run(tmp_path / "run", data)
    s1, d1, _ = tower.tensors(data.test)
    s2, d2, _ = b2.tensors(data.test)
    assert np.allclose(predict(model, s1, d1), predict(again, s2, d2))
    for bad in (dict(common, features="visual"), dict(common, codeword_vector=False, visual_fields="codes")):
        with pytest.raises(LeanmlError, match="content_tower"):
            run_ctr(data, items, CTRConfig(**{**bad, "content_tower": True}), progress=False)
