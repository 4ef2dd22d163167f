"""Magnitude pruning: keep the largest ``|W|``."""

from __future__ import annotations

import torch

from leanml.prune.masks import MaskSpec, keep_mask


def magnitude_prune(W: torch.Tensor, spec: MaskSpec) -> torch.Tensor:
    """Zero the smallest-magnitude weights."""
    return W * keep_mask(W.float().abs(), spec)
