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
