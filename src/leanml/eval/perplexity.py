"""Perplexity with SparseGPT's protocol, in memory or layer by layer.

The whole test text is tokenised once and cut into non-overlapping windows of ``seqlen`` tokens;
each window's mean cross-entropy over its shifted tokens is its nll, and
``ppl = exp(sum(nll_i * n_i) / sum(n_i))``.

When the model's parameters are not on the evaluation device (a model larger than the GPU stays on
the CPU), the model runs layer by layer (:func:`leanml.models.layerwise.layerwise_logits`): each
decoder layer visits the device in turn, so any model that prunes also evaluates.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from tqdm.auto import tqdm


def _nll(logits: torch.Tensor, ids: torch.Tensor) -> tuple[float, int]:
    shift_logits = logits[:, :-1, :].float()
    shift_labels = ids[:, 1:].to(logits.device)
    nll = nn.functional.cross_entropy(
        shift_logits.reshape(-1, shift_logits.shape[-1]), shift_labels.reshape(-1), reduction="sum"
    )
    return float(nll), shift_labels.numel()


def on_device(model: nn.Module, device: torch.device) -> bool:
    """Whether every parameter of ``model`` is on ``device``."""
    return all(p.device == device for p in model.parameters())


@torch.no_grad()
def perplexity(
    model: nn.Module,
    windows: torch.Tensor,
    batch_size: int = 4,
    device: str | torch.device | None = None,
    progress: bool = True,
    layerwise: bool | None = None,
) -> float:
    """Perplexity of ``model`` over ``windows`` (shape ``(n, seqlen)``) computed on ``device``.

    ``device`` defaults to the device of the model's first parameter. ``layerwise``: ``None`` (default)
    runs in memory when the whole model is on ``device`` and layer by layer otherwise (the model's
    parameters are left where they are); ``True`` forces the layer-by-layer path (same result up to
    float rounding), ``False`` forces one in-memory forward (the model must then be on ``device``).
    """
    device = torch.device(device) if device is not None else next(model.parameters()).device
    if layerwise is None:
        layerwise = not on_device(model, device)
    was_training = model.training
    model.eval()
    total = [0.0, 0]

    def consume(start: int, logits: torch.Tensor) -> None:
        nll, n = _nll(logits, windows[start : start + logits.shape[0]])
        total[0] += nll
        total[1] += n

    try:
        if layerwise:
            from leanml.models.layerwise import layerwise_logits
            from leanml.models.layout import get_adapter

            bar = (lambda it: tqdm(it, desc="perplexity (layer by layer)", unit="layer", leave=False)) \
                if progress else (lambda it: it)
            layerwise_logits(model, get_adapter(model), windows, batch_size, device, consume, progress=bar)
        else:
            batches = range(0, windows.shape[0], batch_size)
            for start in tqdm(batches, desc="perplexity", unit="batch", disable=not progress, leave=False):
                ids = windows[start : start + batch_size].to(device)
                consume(start, model(input_ids=ids, use_cache=False).logits)
    finally:
        model.train(was_training)
    return math.exp(total[0] / total[1])
