"""Perplexity with SparseGPT's protocol.

The whole test text is tokenised once and cut into non-overlapping windows of ``seqlen`` tokens;
each window's mean cross-entropy over its shifted tokens is its nll, and
``ppl = exp(sum(nll_i * n_i) / sum(n_i))``.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from tqdm.auto import tqdm


@torch.no_grad()
def perplexity(
    model: nn.Module,
    windows: torch.Tensor,
    batch_size: int = 4,
    device: str | torch.device | None = None,
    progress: bool = True,
) -> float:
    """Perplexity of ``model`` over ``windows`` (shape ``(n, seqlen)``)."""
    device = torch.device(device) if device is not None else next(model.parameters()).device
    was_training = model.training
    model.eval()
    total_nll, total_tokens = 0.0, 0
    batches = range(0, windows.shape[0], batch_size)
    for start in tqdm(batches, desc="perplexity", unit="batch", disable=not progress, leave=False):
        ids = windows[start : start + batch_size].to(device)
        logits = model(input_ids=ids, use_cache=False).logits
        shift_logits = logits[:, :-1, :].float()
        shift_labels = ids[:, 1:]
        nll = nn.functional.cross_entropy(
            shift_logits.reshape(-1, shift_logits.shape[-1]), shift_labels.reshape(-1), reduction="sum"
        )
        total_nll += float(nll)
        total_tokens += shift_labels.numel()
    model.train(was_training)
    return math.exp(total_nll / total_tokens)
