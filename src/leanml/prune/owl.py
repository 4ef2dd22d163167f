"""OWL: outlier-weighted layerwise sparsity (Yin et al., 2024).

Layers whose Wanda scores ``|W_ij| * ||X_j||`` hold more outliers keep more weights. Per decoder layer
``l`` the *outlier ratio* ``D_l`` is the fraction of all its linears' scores above ``M`` times their
mean (M = 5 in the paper). The ratios are min-max scaled to ``[0, 2 * lambda]`` (lambda = 0.08 in the
paper), centred, and subtracted from the target, so layer sparsities stay within ``target +- lambda``
and their parameter-weighted mean is the target:

    a_l = 2 * lambda * (D_l - min D) / (max D - min D)
    s_l = target - (a_l - sum_k w_k a_k),     w_k = numel_k / sum numel

(the paper centres with the plain mean: the same when all layers have one size, as in LLaMA). The
engine then turns the layer sparsities into exact per-linear counts
(:func:`leanml.prune.engine.linear_specs`), so the total over all pruned linears is exact.

:func:`owl_allocation` is the pure allocation; :func:`outlier_ratio` the pure per-layer statistic;
:func:`owl_layer_sparsities` the dense pre-pass that walks the layers with the models API.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from leanml.utils import LeanmlError

#: the paper's defaults
OWL_M = 5.0
OWL_LAMBDA = 0.08


def outlier_ratio(scores: Sequence[torch.Tensor], m: float = OWL_M) -> float:
    """Fraction of the entries of all ``scores`` (one tensor per linear) above ``m`` times their mean."""
    flat = torch.cat([s.reshape(-1).float() for s in scores])
    return float((flat > m * flat.mean()).float().mean())


def owl_allocation(
    ratios: Sequence[float], target: float, lam: float = OWL_LAMBDA, sizes: Sequence[int] | None = None
) -> list[float]:
    """Per-layer sparsities from outlier ratios (see the module docstring); ``sizes`` are the layers'
    pruned parameter counts (default: all equal). All ratios equal gives the uniform profile.

    Raises :class:`LeanmlError` when a layer's sparsity would leave (0, 1)."""
    if not 0.0 < target < 1.0:
        raise LeanmlError(f"sparsity must be in (0, 1), got {target}")
    if not lam >= 0:
        raise LeanmlError(f"--owl-lambda must be >= 0, got {lam}")
    D = torch.tensor([float(r) for r in ratios], dtype=torch.float64)
    w = torch.ones_like(D) if sizes is None else torch.tensor([float(s) for s in sizes], dtype=torch.float64)
    if w.shape != D.shape:
        raise ValueError(f"{len(ratios)} ratios but {len(w)} sizes")
    w = w / w.sum()
    span = float(D.max() - D.min())
    a = torch.zeros_like(D) if span == 0 else 2.0 * lam * (D - D.min()) / span
    s = target - (a - float((w * a).sum()))
    if bool((s <= 0).any() or (s >= 1).any()):
        raise LeanmlError(
            f"OWL with lambda {lam} at sparsity {target} gives layer sparsities outside (0, 1) "
            f"({float(s.min()):.3f}..{float(s.max()):.3f}); lower --owl-lambda"
        )
    return [float(v) for v in s]


@torch.no_grad()
def owl_layer_sparsities(
    model: nn.Module,
    calib_ids: torch.Tensor,
    target: float,
    *,
    adapter: Any = None,
    batch_size: int = 8,
    device: str | torch.device | None = None,
    progress: bool = True,
    m: float = OWL_M,
    lam: float = OWL_LAMBDA,
) -> tuple[list[float], dict[str, Any]]:
    """OWL's dense pre-pass: walk the dense model layer by layer on the calibration ids (each layer
    visits ``device``), compute every layer's outlier ratio from its linears' Wanda scores, and
    allocate. Returns the per-layer sparsities and a record for the report."""
    from leanml.models.layerwise import capture_layer_inputs, layer_on, outer_on, run_layer, to_device
    from leanml.models.layout import get_adapter, layer_linears

    adapter = adapter or get_adapter(model)
    device = torch.device(device) if device is not None else next(model.parameters()).device
    with outer_on(model, adapter, device):
        hidden, kwargs = capture_layer_inputs(model, adapter, calib_ids, batch_size)
    ratios, sizes = [], []
    layers = adapter.layers()
    for i in tqdm(range(len(layers)), desc="owl statistics", unit="layer", disable=not progress):
        layer = layers[i]
        linears = layer_linears(layer)
        sq: dict[str, torch.Tensor] = {}
        handles = []
        for name, lin in linears.items():
            def hook(module: nn.Module, args: tuple[Any, ...], name: str = name, sq: dict = sq) -> None:
                x = args[0].reshape(-1, args[0].shape[-1]).float()
                sq[name] = sq.get(name, 0) + (x * x).sum(0)

            handles.append(lin.register_forward_pre_hook(hook))
        try:
            with layer_on(layer, device):
                hidden = run_layer(layer, hidden, [to_device(k, device) for k in kwargs[i]], batch_size, device)
                scores = [lin.weight.detach().float().abs() * sq[name].sqrt().unsqueeze(0)
                          for name, lin in linears.items()]
                ratios.append(outlier_ratio(scores, m))
        finally:
            for h in handles:
                h.remove()
        sizes.append(sum(lin.weight.numel() for lin in linears.values()))
    sparsities = owl_allocation(ratios, target, lam, sizes)
    return sparsities, {"name": "owl", "m": m, "lambda": lam, "outlier_ratios": ratios, "layer_sparsity": sparsities}
