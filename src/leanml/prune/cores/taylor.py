"""Taylor scores: magnitude times gradient, in one shot.

For one output row ``w`` of a linear and its input second moment ``H = E[x x^T]``, the row's output
energy is ``E(w) = 1/2 w^T H w`` and its gradient is ``g = H w`` (for the whole matrix ``G = W H``).
Removing weight ``w_j`` alone changes the energy by exactly ``-w_j g_j + 1/2 w_j^2 H_jj``; the
first-order Taylor score keeps the weights with the largest ``|w_j g_j|``, the second-order one the
largest ``|-w_j g_j + 1/2 w_j^2 H_jj|`` (the exact change).
"""

from __future__ import annotations

import torch

from leanml.prune.masks import MaskSpec, keep_mask


def taylor_scores(W: torch.Tensor, H: torch.Tensor, second_order: bool = False) -> torch.Tensor:
    """Per weight of ``W`` (out x in), the Taylor score from ``H`` (in x in)."""
    if H.shape != (W.shape[1], W.shape[1]):
        raise ValueError(f"H must be ({W.shape[1]}, {W.shape[1]}) for W with {W.shape[1]} columns, "
                         f"got {tuple(H.shape)}")
    W = W.to(torch.float32)
    H = H.to(torch.float32)
    change = -W * (W @ H)
    if second_order:
        change = change + 0.5 * W**2 * torch.diagonal(H).unsqueeze(0)
    return change.abs()


def taylor_prune(W: torch.Tensor, H: torch.Tensor, spec: MaskSpec, second_order: bool = False) -> torch.Tensor:
    """Zero the weights with the smallest Taylor scores under ``spec``."""
    return W * keep_mask(taylor_scores(W, H, second_order), spec)
