"""CTR metrics: AUC, logloss and gAUC, overall and split into new and old ads (GUIDE section 3).

All functions take NumPy arrays (labels in {0, 1}, scores as probabilities or logits for AUC) and do
no I/O. ``auc`` uses the rank-sum (Mann-Whitney) formula with average ranks for ties, so it equals
``sklearn.metrics.roc_auc_score``.
"""

from __future__ import annotations

import numpy as np
from scipy.stats import rankdata


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve; ``nan`` when only one class is present."""
    y = np.asarray(labels).astype(bool).ravel()
    s = np.asarray(scores, dtype=np.float64).ravel()
    n_pos = int(y.sum())
    n_neg = y.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    ranks = rankdata(s)
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def logloss(labels: np.ndarray, probs: np.ndarray, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy of probabilities (clipped to ``[eps, 1 - eps]``)."""
    y = np.asarray(labels, dtype=np.float64).ravel()
    p = np.clip(np.asarray(probs, dtype=np.float64).ravel(), eps, 1.0 - eps)
    if y.size == 0:
        return float("nan")
    return float(-np.mean(y * np.log(p) + (1.0 - y) * np.log(1.0 - p)))


def gauc(labels: np.ndarray, scores: np.ndarray, groups: np.ndarray) -> float:
    """Group AUC: per-group (per-user) AUC weighted by the group's impressions.

    Groups whose labels are all 0 or all 1 are skipped (their AUC is undefined); ``nan`` if all are.
    """
    y = np.asarray(labels).astype(bool).ravel()
    s = np.asarray(scores, dtype=np.float64).ravel()
    g = np.asarray(groups).ravel()
    order = np.argsort(g, kind="stable")
    g_sorted = g[order]
    bounds = np.flatnonzero(np.diff(g_sorted)) + 1
    total, weight = 0.0, 0
    for idx in np.split(order, bounds):
        yy = y[idx]
        n_pos = int(yy.sum())
        if n_pos == 0 or n_pos == yy.size:
            continue
        total += auc(yy, s[idx]) * yy.size
        weight += yy.size
    return float(total / weight) if weight else float("nan")


def ctr_metrics(
    labels: np.ndarray, probs: np.ndarray, users: np.ndarray, is_new: np.ndarray | None = None
) -> dict[str, float]:
    """AUC, gAUC and logloss overall, and on new / old ads when ``is_new`` (bool per row) is given.

    Keys: ``auc``, ``gauc``, ``logloss`` and, with ``is_new``, the same with ``_new`` / ``_old`` suffixes,
    plus ``n``, ``n_new``, ``n_old`` (row counts).
    """
    labels, probs, users = np.asarray(labels), np.asarray(probs), np.asarray(users)
    out = {
        "n": int(labels.size),
        "auc": auc(labels, probs),
        "gauc": gauc(labels, probs, users),
        "logloss": logloss(labels, probs),
    }
    if is_new is not None:
        is_new = np.asarray(is_new, dtype=bool)
        for suffix, mask in (("new", is_new), ("old", ~is_new)):
            out[f"n_{suffix}"] = int(mask.sum())
            out[f"auc_{suffix}"] = auc(labels[mask], probs[mask])
            out[f"gauc_{suffix}"] = gauc(labels[mask], probs[mask], users[mask])
            out[f"logloss_{suffix}"] = logloss(labels[mask], probs[mask])
    return out


def weighted_auc(labels: np.ndarray, scores: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """AUC of rows counted ``weights`` times each (ties count one half, as in :func:`auc`).

    ``weights``: one row of non-negative weights per replicate, shape ``(n,)`` or ``(b, n)``; integer
    weights equal :func:`auc` on the rows repeated that often. Returns one AUC per replicate (``nan``
    where a replicate has no positive or no negative weight).
    """
    y = np.asarray(labels).astype(bool).ravel()
    s = np.asarray(scores, dtype=np.float64).ravel()
    w = np.atleast_2d(np.asarray(weights, dtype=np.float64))
    if w.shape[1] != s.size or y.size != s.size:
        raise ValueError(f"labels ({y.size}), scores ({s.size}) and weights ({w.shape[1]} per replicate) differ in "
                         "length")
    if (w < 0).any():
        raise ValueError("weights must be non-negative")
    order = np.argsort(s, kind="stable")
    s_sorted, y_sorted = s[order], y[order]
    starts = np.flatnonzero(np.r_[True, s_sorted[1:] != s_sorted[:-1]])  # first row of each tie group
    ws = w[:, order]
    pos = np.add.reduceat(ws * y_sorted, starts, axis=1)
    neg = np.add.reduceat(ws * ~y_sorted, starts, axis=1)
    below = np.cumsum(neg, axis=1) - neg  # negative weight strictly below each tie group
    n_pos, n_neg = pos.sum(axis=1), neg.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = (pos * (below + 0.5 * neg)).sum(axis=1) / (n_pos * n_neg)
    return np.where((n_pos > 0) & (n_neg > 0), out, np.nan)


def bootstrap_auc_diff_se(labels: np.ndarray, scores_a: list[np.ndarray], scores_b: list[np.ndarray],
                          n_boot: int = 1000, seed: int = 0, chunk: int = 100,
                          groups: np.ndarray | None = None) -> float:
    """Standard error, over test rows (or whole ``groups`` of them), of ``mean(AUC(a_i)) - mean(AUC(b_j))``.

    ``scores_a`` / ``scores_b``: the scores of one or more runs (seeds) of two models on the SAME rows.
    Each of ``n_boot`` replicates resamples the rows with replacement once and evaluates every run on
    that sample, so the correlation between the two models' errors (same rows) is kept, and so is the
    fact that every seed was tested on the same rows (the part of the row error the seeds share does not
    average out over seeds; the part that differs from seed to seed does).
    ``groups``: one label per row (e.g. the ad); a replicate then resamples whole groups with replacement
    and every row counts as often as its group was drawn (a cluster bootstrap: rows of one ad share its
    content, so their errors are not independent and a row bootstrap understates the error).
    Returns the replicates' standard deviation.
    """
    y = np.asarray(labels).astype(bool).ravel()
    if not scores_a or not scores_b:
        raise ValueError("pass at least one score vector for each side")
    for s in (*scores_a, *scores_b):
        if np.asarray(s).size != y.size:
            raise ValueError(f"a score vector has {np.asarray(s).size} rows, the labels {y.size}")
    if n_boot < 2:
        raise ValueError("n_boot must be at least 2")
    if groups is None:
        inverse, n_groups = np.arange(y.size), y.size
    else:
        g = np.asarray(groups).ravel()
        if g.size != y.size:
            raise ValueError(f"groups has {g.size} rows, the labels {y.size}")
        labels_seen, inverse = np.unique(g, return_inverse=True)
        n_groups = labels_seen.size
    rng = np.random.default_rng(seed)
    diffs = []
    for start in range(0, n_boot, chunk):
        b = min(chunk, n_boot - start)
        counts = rng.multinomial(n_groups, np.full(n_groups, 1.0 / n_groups), size=b).astype(np.float64)
        w = counts[:, inverse]  # a row counts as often as its group was drawn
        a = np.mean([weighted_auc(y, s, w) for s in scores_a], axis=0)
        c = np.mean([weighted_auc(y, s, w) for s in scores_b], axis=0)
        diffs.append(a - c)
    d = np.concatenate(diffs)
    return float(np.nanstd(d, ddof=1))
