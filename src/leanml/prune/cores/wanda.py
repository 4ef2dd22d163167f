"""Wanda (Sun et al., 2023): keep the largest ``|W_ij| * ||X_j||``."""

from __future__ import annotations

import torch

from leanml.prune.masks import MaskSpec, keep_mask


def wanda_prune(W: torch.Tensor, sq_norms: torch.Tensor, spec: MaskSpec) -> torch.Tensor:
    """Zero the weights with the smallest ``|W_ij| * ||X_j||``; ``sq_norms[j]`` is ``||X_j||^2`` (any scale)."""
    if sq_norms.shape != (W.shape[1],):
        raise ValueError(f"sq_norms must have shape ({W.shape[1]},), got {tuple(sq_norms.shape)}")
    scores = W.float().abs() * sq_norms.float().clamp_min(0).sqrt().unsqueeze(0)
    return W * keep_mask(scores, spec)
