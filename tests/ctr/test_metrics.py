"""CTR metrics against scikit-learn and a brute-force per-user loop."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import log_loss, roc_auc_score

from leanml.ctr.metrics import auc, ctr_metrics, gauc, logloss


@pytest.mark.parametrize("seed", range(5))
def test_auc_matches_sklearn_with_ties(seed: int) -> None:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, 500)
    s = np.round(rng.random(500), 1)  # many ties
    assert auc(y, s) == pytest.approx(roc_auc_score(y, s), abs=1e-12)


def test_auc_single_class_is_nan() -> None:
    assert np.isnan(auc(np.ones(5), np.arange(5)))


def test_logloss_matches_sklearn() -> None:
    rng = np.random.default_rng(1)
    y = rng.integers(0, 2, 300)
    p = rng.uniform(0.01, 0.99, 300)
    assert logloss(y, p) == pytest.approx(log_loss(y, p), rel=1e-9)


@pytest.mark.parametrize("seed", range(3))
def test_gauc_matches_bruteforce(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = 2000
    users = rng.integers(0, 60, n)
    y = (rng.random(n) < rng.random(60)[users]).astype(int)
    s = rng.random(n) + 0.3 * y
    num = den = 0.0
    for u in np.unique(users):
        m = users == u
        if 0 < y[m].sum() < m.sum():
            num += roc_auc_score(y[m], s[m]) * m.sum()
            den += m.sum()
    assert gauc(y, s, users) == pytest.approx(num / den, abs=1e-12)


def test_ctr_metrics_splits_new_and_old() -> None:
    rng = np.random.default_rng(3)
    y = rng.integers(0, 2, 400)
    p = rng.uniform(0.05, 0.95, 400)
    users = rng.integers(0, 20, 400)
    new = rng.random(400) < 0.3
    m = ctr_metrics(y, p, users, new)
    assert m["n_new"] + m["n_old"] == m["n"] == 400
    assert m["auc_new"] == pytest.approx(roc_auc_score(y[new], p[new]))
    assert m["auc_old"] == pytest.approx(roc_auc_score(y[~new], p[~new]))
    assert m["logloss_old"] == pytest.approx(log_loss(y[~new], p[~new]))
    assert m["gauc_new"] == pytest.approx(gauc(y[new], p[new], users[new]))
