"""CTR metrics against scikit-learn and a brute-force per-user loop."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import log_loss, roc_auc_score

from leanml.ctr.metrics import auc, bootstrap_auc_diff_se, ctr_metrics, gauc, logloss, weighted_auc


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


@pytest.mark.parametrize("seed", range(3))
def test_weighted_auc_matches_sklearn_sample_weight_and_repeated_rows(seed: int) -> None:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, 300)
    s = np.round(rng.random(300), 1)  # many ties
    w = rng.integers(0, 4, (3, 300))
    got = weighted_auc(y, s, w)
    for i in range(3):
        assert got[i] == pytest.approx(roc_auc_score(y, s, sample_weight=w[i]), abs=1e-12)
        assert got[i] == pytest.approx(auc(np.repeat(y, w[i]), np.repeat(s, w[i])), abs=1e-12)
    assert weighted_auc(y, s, np.ones(300))[0] == pytest.approx(auc(y, s), abs=1e-12)


def test_weighted_auc_bad_input() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        weighted_auc(np.ones(3), np.ones(3), np.ones(4))
    with pytest.raises(ValueError, match="non-negative"):
        weighted_auc(np.array([0, 1]), np.array([0.1, 0.2]), np.array([1.0, -1.0]))
    assert np.isnan(weighted_auc(np.array([0, 1]), np.array([0.1, 0.2]), np.array([1.0, 0.0]))[0])


def _delong_diff_se(y: np.ndarray, a: np.ndarray, b: np.ndarray) -> float:
    """DeLong's standard error of AUC(a) - AUC(b) on the same rows, from pairwise placement values."""
    pos, neg = y == 1, y == 0

    def placements(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        cmp = (s[pos][:, None] > s[neg][None, :]) + 0.5 * (s[pos][:, None] == s[neg][None, :])
        return cmp.mean(axis=1), cmp.mean(axis=0)

    va, wa = placements(a)
    vb, wb = placements(b)
    s10 = np.cov(np.vstack([va, vb]))
    s01 = np.cov(np.vstack([wa, wb]))
    var = (s10[0, 0] + s10[1, 1] - 2 * s10[0, 1]) / pos.sum() + (s01[0, 0] + s01[1, 1] - 2 * s01[0, 1]) / neg.sum()
    return float(np.sqrt(var))


def test_bootstrap_auc_diff_se_matches_delong() -> None:
    rng = np.random.default_rng(7)
    n = 1500
    y = (rng.random(n) < 0.3).astype(int)
    signal = rng.normal(size=n) + 0.8 * y
    a = signal + 0.5 * rng.normal(size=n)  # two models that share most of their signal: correlated errors
    b = signal + 0.5 * rng.normal(size=n) + 0.2 * y
    ref = _delong_diff_se(y, a, b)
    got = bootstrap_auc_diff_se(y, [a], [b], n_boot=2000, seed=1)
    assert got == pytest.approx(ref, rel=0.12)
    # the paired error is far below what two independent AUC errors would give
    single = bootstrap_auc_diff_se(y, [a], [np.zeros(n)], n_boot=2000, seed=1)  # AUC(b) = 0.5 on every sample
    assert got < 0.8 * np.sqrt(2) * single
    # identical runs differ by nothing on any sample
    assert bootstrap_auc_diff_se(y, [a, b], [a, b], n_boot=50) == 0.0


def test_bootstrap_auc_diff_se_bad_input() -> None:
    y = np.array([0, 1, 0, 1])
    with pytest.raises(ValueError, match="rows"):
        bootstrap_auc_diff_se(y, [np.ones(3)], [np.ones(4)])
    with pytest.raises(ValueError, match="at least one"):
        bootstrap_auc_diff_se(y, [], [np.ones(4)])


def test_bootstrap_auc_diff_se_groups_resamples_whole_groups() -> None:
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(3)
    n_groups, per = 60, 8
    g = np.repeat(np.arange(n_groups) * 7 + 100, per)  # group labels need not be 0..G-1
    y = (rng.random(g.size) < 0.4).astype(int)
    # a per-group effect that helps model a on some groups and hurts it on others: the rows of one group
    # move together, which a row bootstrap treats as independent
    effect = np.repeat(rng.normal(size=n_groups), per)
    a = y + rng.normal(size=g.size) + 1.5 * effect * (2 * y - 1)
    b = y + rng.normal(size=g.size)
    # one label per row is the row bootstrap, draw for draw
    rows = bootstrap_auc_diff_se(y, [a], [b], n_boot=200, seed=5)
    assert bootstrap_auc_diff_se(y, [a], [b], n_boot=200, seed=5, groups=np.arange(g.size)) == rows
    # brute force on the same draws: repeat each group's rows as often as it was drawn, score with sklearn
    got = bootstrap_auc_diff_se(y, [a], [b], n_boot=40, seed=9, groups=g)
    counts = np.random.default_rng(9).multinomial(n_groups, np.full(n_groups, 1.0 / n_groups), size=40)
    ref = []
    for c in counts:
        idx = np.concatenate([np.flatnonzero(g == lab) for lab, k in zip(np.unique(g), c) for _ in range(k)])
        ref.append(roc_auc_score(y[idx], a[idx]) - roc_auc_score(y[idx], b[idx]))
    assert got == pytest.approx(np.std(ref, ddof=1), rel=1e-9)
    # the group effect makes the cluster error clearly larger than the row error
    clustered = bootstrap_auc_diff_se(y, [a], [b], n_boot=1000, seed=5, groups=g)
    assert clustered > 1.5 * rows
    with pytest.raises(ValueError, match="groups"):
        bootstrap_auc_diff_se(y, [a], [b], groups=g[:-1])
