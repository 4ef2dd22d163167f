"""Numeric core of structured pruning of interlinked layer pairs (FASP and its baselines).

A *pair* is a producer linear (or several, e.g. LLaMA's gate and up projections) whose output rows
feed, elementwise, the input columns of a consumer linear (down projection, attention output
projection). Removing a *unit* -- a set of producer rows and the consumer columns they feed -- is exact
for the rest of the network. Everything here is a pure function of tensors:

- unit scores: :func:`fasp_scores` (``S_j = sum_i |W_ij| * ||X_j||``, summed over a unit's columns),
  :func:`magnitude_scores` (consumer column norms), :func:`flap_scores` (FLAP's fluctuation
  ``Var(X_j) * ||W_:,j||^2``);
- selection: :func:`num_kept` (the rounding rule) and :func:`select_units`;
- consumer updates: :func:`restore_least_squares` (FASP), :func:`zero_columns` (magnitude-sp,
  wanda-sp), :func:`bias_compensation` (FLAP).

Notation: ``W`` is the consumer weight (out x n); ``H = E[x* x*^T]`` the second moment of its input on
the pruned path, ``G = E[x x*^T]`` the cross moment with the dense model's input ``x``, ``mean = E[x*]``;
``columns`` a (units x cols_per_unit) long tensor of consumer columns per unit.
"""

from __future__ import annotations

import torch

from leanml.config import ConfigError
from leanml.errors import LeanmlError


def column_to_unit(col_scores: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """Sum per-column scores over each unit's columns -> (units,)."""
    return col_scores[columns.to(col_scores.device)].sum(dim=1)


def fasp_scores(W: torch.Tensor, sq_norms: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """FASP's Wanda-like unit score: ``sum over the unit's columns j of sum_i |W_ij| * ||X_j||_2``.

    ``sq_norms`` is ``diag(H)`` (mean squared input per column); the constant token-count factor of
    ``||X_j||`` does not change the ranking and is left out.
    """
    col = W.abs().sum(dim=0).to(sq_norms.dtype) * sq_norms.clamp_min(0).sqrt()
    return column_to_unit(col, columns)


def magnitude_scores(W: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """Magnitude-structured unit score: the sum of the L2 norms of the unit's consumer columns."""
    return column_to_unit(W.float().norm(dim=0), columns)


def flap_scores(
    W: torch.Tensor, sq_norms: torch.Tensor, mean: torch.Tensor, columns: torch.Tensor
) -> torch.Tensor:
    """FLAP's fluctuation score: ``sum over the unit's columns j of Var(X_j) * ||W_:,j||_2^2``.

    ``Var(X_j) = E[x_j^2] - E[x_j]^2`` over the calibration tokens: a column whose input barely moves
    can be replaced by its mean (see :func:`bias_compensation`), whatever its magnitude.
    """
    var = (sq_norms - mean.to(sq_norms.dtype) ** 2).clamp_min(0)
    col = W.to(sq_norms.dtype).pow(2).sum(dim=0) * var
    return column_to_unit(col, columns)


def num_kept(n_units: int, sparsity: float, multiple: int = 1) -> int:
    """How many of ``n_units`` units to keep at ``sparsity`` (uniform per layer).

    Rounding rule: prune ``round(sparsity * n_units)`` units (Python's round-half-to-even), keep the
    rest; with ``multiple > 1`` the kept count is then rounded to the nearest multiple of ``multiple``
    (never above ``n_units``), which gives matrix sizes fast kernels like. Raises :class:`LeanmlError`
    when the sparsity is outside [0, 1) or would leave no unit.
    """
    if not 0.0 <= sparsity < 1.0:
        raise ConfigError(f"structured sparsity must be in [0, 1), got {sparsity}", None, ("sparsity",))
    if multiple < 1:
        raise LeanmlError(f"the kept-unit multiple must be >= 1, got {multiple}")
    keep = n_units - int(round(sparsity * n_units))
    if multiple > 1:
        keep = min(n_units, int(round(keep / multiple)) * multiple)
    if keep <= 0:
        raise LeanmlError(
            f"sparsity {sparsity} would remove all {n_units} units of a layer pair; use a smaller sparsity",
            fields=("sparsity",))
    return keep


def select_units(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """Indices (ascending) of the ``keep`` highest-scoring units; ties go to the lower index."""
    if not 0 < keep <= scores.numel():
        raise ValueError(f"keep must be in [1, {scores.numel()}], got {keep}")
    # stable descending sort so equal scores keep the lower index (deterministic across runs)
    order = torch.sort(scores, descending=True, stable=True).indices
    return order[:keep].sort().values


def unit_columns(columns: torch.Tensor, units: torch.Tensor) -> torch.Tensor:
    """The sorted consumer columns belonging to ``units``."""
    return columns[units.to(columns.device)].flatten().sort().values


def complement(index: torch.Tensor, n: int) -> torch.Tensor:
    """Sorted indices in ``range(n)`` that are not in ``index``."""
    mask = torch.ones(n, dtype=torch.bool, device=index.device)
    mask[index] = False
    return mask.nonzero().flatten()


def zero_columns(W: torch.Tensor, keep_cols: torch.Tensor) -> torch.Tensor:
    """A copy of ``W`` with every column outside ``keep_cols`` set to exactly zero."""
    out = torch.zeros_like(W)
    out[:, keep_cols] = W[:, keep_cols]
    return out


def restore_least_squares(
    W: torch.Tensor,
    H: torch.Tensor,
    keep_cols: torch.Tensor,
    G: torch.Tensor | None = None,
    damp: float = 0.01,
) -> torch.Tensor:
    """FASP's restoration: refit the consumer on the kept columns by (damped) least squares.

    Returns ``W_new`` (same shape as ``W``, zeros outside ``keep_cols``) with
    ``W_new[:, S] = (W G[:, S] + W[:, S] D) (H[S, S] + D)^-1``, the minimiser of
    ``E ||W_new[:, S] x*_S - W x||^2 + sum_j D_jj ||W_new[:, j] - W[:, j]||^2`` over the calibration
    tokens: the damping pulls towards the original weights (not towards zero), so directions the
    calibration data does not cover keep their dense values instead of being erased. ``D = 0`` gives
    the plain least-squares solution ``W G[:, S] H[S, S]^-1``.
    ``G`` defaults to ``H`` (dense input = pruned-path input). The damping is relative to each
    feature's own scale, ``D = damp * diag(H[S, S])`` (plus ``1e-8 * mean diag`` so dead features stay
    solvable): LLM activations have a few features thousands of times larger than the rest, and a damping
    relative to the *mean* diagonal would shrink the weights of all ordinary features. If the damped
    matrix is still not positive definite the damping is raised tenfold (up to 4 times).
    Computed in ``H``'s dtype; returned in ``W``'s.
    """
    dtype = H.dtype
    cross = (G if G is not None else H)[:, keep_cols]
    Hs = H[keep_cols][:, keep_cols]
    Wd = W.to(dtype)
    diag = torch.diagonal(Hs).clamp_min(0)
    floor = 1e-8 * diag.mean().clamp_min(torch.finfo(dtype).tiny)
    d = damp
    for _ in range(5):
        D = d * diag + floor
        L, info = torch.linalg.cholesky_ex(Hs + torch.diag(D))
        if int(info) == 0:
            break
        d = max(d * 10, 1e-6)
    else:
        raise LeanmlError("least-squares restoration failed: the input statistics are not positive definite")
    # W_S (Hs + D) = rhs  ->  (Hs + D) W_S^T = rhs^T
    rhs = Wd @ cross + Wd[:, keep_cols] * D  # (out, |S|)
    W_S = torch.cholesky_solve(rhs.T, L).T
    out = torch.zeros_like(W)
    out[:, keep_cols] = W_S.to(W.dtype)
    return out


def bias_compensation(W: torch.Tensor, mean: torch.Tensor, prune_cols: torch.Tensor) -> torch.Tensor:
    """FLAP's bias compensation: the bias change ``W[:, P] E[x_P]`` that keeps the removed columns'
    mean contribution (add it to the consumer's bias)."""
    return W[:, prune_cols].to(mean.dtype) @ mean[prune_cols]


def normalize_layer_scores(att: torch.Tensor | None, mlp: torch.Tensor | None) -> tuple[torch.Tensor | None,
                                                                                       torch.Tensor | None]:
    """Divide each layer's unit scores by that layer's total over both pairs, so every layer's attention
    groups and MLP units share one scale (a layer's scores sum to 1) and no layer outvotes the others by
    its activation size. ``att`` is (layers, groups), ``mlp`` (layers, units); either may be ``None``."""
    att = None if att is None else att.detach()
    mlp = None if mlp is None else mlp.detach()
    parts = [t.double() for t in (att, mlp) if t is not None]
    total = sum(p.sum(dim=1, keepdim=True) for p in parts).clamp_min(torch.finfo(torch.float64).tiny)
    return (None if att is None else att.double() / total), (None if mlp is None else mlp.double() / total)


def allocate(
    att: torch.Tensor | None,
    mlp: torch.Tensor | None,
    group_cost: int,
    unit_cost: int,
    budget: int,
    multiple: int = 1,
    groups: int | None = None,
) -> dict[str, float | int]:
    """Split a parameter budget between attention groups and MLP units by score.

    ``att``: (layers, groups) group scores, ``mlp``: (layers, units) MLP unit scores, on one scale (see
    :func:`normalize_layer_scores`); ``None`` for a pair that is not pruned. ``group_cost`` /
    ``unit_cost``: parameters one group / one MLP unit holds in one layer; ``budget``: parameters to
    remove in all. Every layer removes the same counts (stock configs have one head count and one MLP
    width), so the choice is ``k`` groups and ``m`` units per layer: for each ``k`` from 0 to
    ``groups - 1`` (never the last group; ``groups`` forces ``k``) whose groups alone stay within the
    budget, ``m`` is the fewest units that complete it (the kept count rounded down to ``multiple``),
    and the lost score is the sum over layers of the ``k`` lowest group scores and the ``m`` lowest unit
    scores. The ``k`` with the least lost score wins (ties: fewer groups). Attention alone removes the
    ``k`` whose parameters come closest to the budget.

    Returns ``{"groups_removed": k, "units_removed": m, "params_removed": ..., "score_lost": ...}``.
    Raises :class:`LeanmlError` when no choice meets the budget without removing every group or every
    unit of a layer.
    """
    if multiple < 1:
        raise LeanmlError(f"the kept-unit multiple must be >= 1, got {multiple}")
    n_layers = (att if att is not None else mlp).shape[0]  # type: ignore[union-attr]
    n_groups = 0 if att is None else int(att.shape[1])
    n_units = 0 if mlp is None else int(mlp.shape[1])
    att_cum = (None if att is None
               else torch.cat([att.new_zeros(n_layers, 1), att.sort(dim=1).values.cumsum(1)], 1).sum(0))
    mlp_cum = (None if mlp is None
               else torch.cat([mlp.new_zeros(n_layers, 1), mlp.sort(dim=1).values.cumsum(1)], 1).sum(0))
    if att is None:
        ks = [0]
    elif groups is not None:
        if not 0 <= groups < n_groups:
            raise ConfigError(f"groups {groups} must leave at least one of the {n_groups} key/value groups "
                              f"of a layer: use 0..{n_groups - 1}", None, ("groups",))
        ks = [groups]
    elif mlp is None:  # attention alone: the group count closest to the budget
        k = int(round(budget / (n_layers * group_cost)))
        if k >= n_groups:
            raise LeanmlError(f"this sparsity would remove every one of the {n_groups} key/value groups of a layer; "
                              "use a smaller sparsity or pairs attention,mlp", fields=("sparsity", "pairs"))
        if k == 0:
            raise LeanmlError("this sparsity is too small to remove one key/value group per layer from attention "
                              "alone; raise sparsity or use pairs attention,mlp", fields=("sparsity", "pairs"))
        ks = [k]
    else:
        ks = [k for k in range(n_groups) if n_layers * k * group_cost <= budget] or [0]
    best: dict[str, float | int] | None = None
    for k in ks:
        rest = budget - n_layers * k * group_cost
        m = 0
        if mlp is not None and rest > 0:
            m = -(-rest // (n_layers * unit_cost))  # ceil
            kept = (n_units - m) // multiple * multiple
            m = n_units - kept
            if kept <= 0:
                continue
        lost = (0.0 if att_cum is None else float(att_cum[k])) + (0.0 if mlp_cum is None else float(mlp_cum[m]))
        if best is None or lost < best["score_lost"]:
            best = {"groups_removed": k, "units_removed": m, "score_lost": lost,
                    "params_removed": n_layers * (k * group_cost + m * unit_cost)}
    if best is None:
        most = f" (with at most {n_groups - 1} key/value groups per layer)" if n_groups else ""
        raise LeanmlError(f"removing {budget:,} parameters would take every MLP unit of a layer{most}; "
                          "use a smaller sparsity", fields=("sparsity",))
    return best
