"""Sparsity specifications and mask selection (unstructured per row / per layer, and N:M)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from leanml.utils import LeanmlError


@dataclass(frozen=True)
class MaskSpec:
    """What the final weights must satisfy.

    ``pattern`` None means unstructured at ``sparsity`` with ``scope`` "row" (every output row keeps
    the same count) or "layer" (one threshold for the whole matrix). With ``pattern = (n, m)`` every
    ``m`` consecutive weights along the input dimension keep their ``n`` largest scores; sparsity is
    then ``1 - n/m``.
    """

    sparsity: float = 0.5
    pattern: tuple[int, int] | None = None
    scope: str = "row"

    def __post_init__(self) -> None:
        if self.pattern is None and not (0.0 < self.sparsity < 1.0):
            raise LeanmlError(f"sparsity must be in (0, 1), got {self.sparsity}; e.g. --sparsity 0.5")
        if self.scope not in ("row", "layer"):
            raise LeanmlError(f"mask scope must be 'row' or 'layer', got {self.scope!r}")

    @property
    def target_sparsity(self) -> float:
        if self.pattern is not None:
            n, m = self.pattern
            return 1.0 - n / m
        return self.sparsity

    def describe(self) -> str:
        return f"{self.pattern[0]}:{self.pattern[1]}" if self.pattern else "unstructured"


def parse_pattern(text: str | None) -> tuple[int, int] | None:
    """Parse ``"2:4"`` into ``(2, 4)``; ``None``/``"unstructured"`` gives ``None``.

    Raises :class:`LeanmlError` for anything that is not two positive integers ``N:M`` with ``N < M``.
    """
    if text is None or text.lower() in ("", "unstructured", "none"):
        return None
    match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text)
    if not match:
        raise LeanmlError(f"malformed pattern {text!r}: use N:M with integers 0 < N < M, e.g. 2:4 or 4:8")
    n, m = int(match.group(1)), int(match.group(2))
    if not 0 < n < m:
        raise LeanmlError(f"malformed pattern {text!r}: need 0 < N < M, e.g. 2:4 or 4:8")
    return n, m


def keep_mask(scores: torch.Tensor, spec: MaskSpec) -> torch.Tensor:
    """Boolean mask of the weights to KEEP, choosing the largest ``scores`` under ``spec``.

    Exact: per row keeps ``n_in - round(sparsity * n_in)`` weights; per layer keeps
    ``numel - round(sparsity * numel)``; N:M keeps exactly ``n`` of every ``m``.
    """
    if scores.dim() != 2:
        raise ValueError(f"scores must be 2-D (out, in), got shape {tuple(scores.shape)}")
    rows, cols = scores.shape
    if spec.pattern is not None:
        n, m = spec.pattern
        if cols % m:
            raise LeanmlError(f"input dimension {cols} is not divisible by M={m} of the {n}:{m} pattern")
        blocks = scores.reshape(rows, cols // m, m)
        idx = blocks.topk(n, dim=-1).indices
        mask = torch.zeros_like(blocks, dtype=torch.bool).scatter_(-1, idx, True)
        return mask.reshape(rows, cols)
    if spec.scope == "row":
        n_prune = int(round(spec.sparsity * cols))
        mask = torch.ones_like(scores, dtype=torch.bool)
        if n_prune:
            idx = scores.topk(n_prune, dim=1, largest=False).indices
            mask.scatter_(1, idx, False)
        return mask
    n_prune = int(round(spec.sparsity * scores.numel()))
    mask = torch.ones(scores.numel(), dtype=torch.bool, device=scores.device)
    if n_prune:
        idx = scores.flatten().topk(n_prune, largest=False).indices
        mask[idx] = False
    return mask.reshape(rows, cols)


def sparsity_of(weight: torch.Tensor) -> float:
    """Fraction of exact zeros."""
    return float((weight == 0).sum()) / weight.numel()


def satisfies_nm(weight: torch.Tensor, n: int, m: int) -> bool:
    """True when every ``m`` consecutive weights along the input dimension hold at most ``n`` non-zeros."""
    rows, cols = weight.shape
    if cols % m:
        return False
    return bool(((weight.reshape(rows, cols // m, m) != 0).sum(-1) <= n).all())
