"""The sparsity a model's weights actually have, as ``leanml eval`` reports it beside perplexity.

Measured, not declared: the exact zeros of every linear layer except the output head (the weights a
pruning method prunes; :func:`leanml.recover.masks.linear_sparsity`), and the tightest N:M pattern the
zeros follow, when one holds in every such linear (a 2:4 model reads ``2:4``; a dense or unstructured
model none).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

#: the group sizes M tried, smallest first: a pattern holds in M consecutive inputs of every row
GROUP_SIZES = (4, 8, 16)
#: a pattern is reported only when it accounts for the zeros: the measured sparsity is at most its 1 - N/M
#: plus this (weights that are zero by chance); an unstructured mask follows some loose N:M by accident
EXPLAINED = 0.01


def _most_kept(weight: torch.Tensor, m: int) -> int:
    """The most non-zero weights in any group of ``m`` consecutive inputs of a row of ``weight``."""
    rows, cols = weight.shape
    return int((weight.detach().reshape(rows, cols // m, m) != 0).sum(-1).max())


def nm_pattern(model: nn.Module) -> tuple[int, int] | None:
    """The N:M pattern with the smallest N/M (the smaller M on ties) that the zeros of every linear of
    ``model`` (head excluded) follow, with N < M and its 1 - N/M within :data:`EXPLAINED` of the measured
    sparsity; None when none does (or the model has no such linear)."""
    from leanml.recover.masks import linear_sparsity, masked_linears

    weights = [lin.weight for _, lin in masked_linears(model)]
    best: tuple[int, int] | None = None
    for m in GROUP_SIZES:
        if not weights or any(w.dim() != 2 or w.shape[1] % m for w in weights):
            continue
        n = max(_most_kept(w, m) for w in weights)
        if n < m and (best is None or n / m < best[0] / best[1]):
            best = (n, m)
    if best is not None and linear_sparsity(model) > 1 - best[0] / best[1] + EXPLAINED:
        return None  # some groups keep fewer: the zeros are unstructured
    return best


def model_sparsity(model: nn.Module) -> dict[str, Any]:
    """``{"linear": fraction of exact zeros over the linears (head excluded), "pattern": "N:M" or None,
    "pattern_sparsity": 1 - N/M or None}``, measured on the weights as they are."""
    from leanml.recover.masks import linear_sparsity

    pattern = nm_pattern(model)
    return {"linear": linear_sparsity(model), "pattern": None if pattern is None else f"{pattern[0]}:{pattern[1]}",
            "pattern_sparsity": None if pattern is None else 1 - pattern[0] / pattern[1]}


def sparsity_line(record: dict[str, Any]) -> str:
    """The printed line: ``sparsity 0.500 of the linear weights (2:4 in every linear)``."""
    nm = f" ({record['pattern']} in every linear)" if record["pattern"] else ""
    return f"sparsity {record['linear']:.3f} of the linear weights{nm}"
