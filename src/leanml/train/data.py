"""Training batches: windows in a seeded shuffled order, one batch per step (a function of the seed and
the step, so a resumed run reads the same batches), and a vocabulary remap for small models."""

from __future__ import annotations

import torch

from leanml.config import ConfigError


def remap_vocab(windows: torch.Tensor, vocab: int) -> torch.Tensor:
    """Map the ``vocab - 1`` most frequent token ids to ``0..vocab-2`` and every other id to ``vocab-1``
    (lets a small model with a small output layer train on real tokenized text)."""
    counts = torch.bincount(windows.flatten())
    top = torch.argsort(counts, descending=True)[: vocab - 1]
    table = torch.full((counts.numel(),), vocab - 1, dtype=torch.long)
    table[top] = torch.arange(top.numel())
    return table[windows]


def batches(windows: torch.Tensor, batch_size: int, steps: int, seed: int) -> list[torch.Tensor]:
    """``steps`` batches of windows in a seeded shuffled order (cycling when the data runs out)."""
    if windows.shape[0] < batch_size:
        raise ConfigError(f"only {windows.shape[0]} windows of text for a batch of {batch_size}; lower batch_size or "
                          "seqlen", None, ("batch_size", "seqlen"))
    gen = torch.Generator().manual_seed(seed)
    order: list[int] = []
    while len(order) < steps * batch_size:
        order += torch.randperm(windows.shape[0], generator=gen).tolist()
    return [windows[order[i * batch_size : (i + 1) * batch_size]] for i in range(steps)]
