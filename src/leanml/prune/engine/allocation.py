"""Allocation: how much of each decoder layer and linear to prune.

A *sparsity profile* gives every decoder layer its target: ``"uniform"`` (the same everywhere),
``"owl"`` (outlier-weighted, below) or a custom list with one value per layer. :func:`linear_specs`
turns the layer targets into exact per-linear counts, so the total over all pruned linears is exact.

OWL, outlier-weighted layerwise sparsity (Yin et al., 2024): layers whose Wanda scores
``|W_ij| * ||X_j||`` hold more outliers keep more weights. Per decoder layer ``l`` the *outlier
ratio* ``D_l`` is the fraction of all its linears' scores above ``M`` times their mean (M = 5 in the
paper). The ratios are min-max scaled to ``[0, 2 * lambda]`` (lambda = 0.08 in the paper), centred,
and subtracted from the target, so layer sparsities stay within ``target +- lambda`` and their
parameter-weighted mean is the target:

    a_l = 2 * lambda * (D_l - min D) / (max D - min D)
    s_l = target - (a_l - sum_k w_k a_k),     w_k = numel_k / sum numel

(the paper centres with the plain mean: the same when all layers have one size, as in LLaMA).
:func:`owl_allocation` is the pure allocation; :func:`outlier_ratio` the pure per-layer statistic;
:func:`owl_layer_sparsities` the dense pre-pass that walks the layers with the models API.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from leanml.config import Bounds, ConfigError, option
from leanml.errors import LeanmlError
from leanml.models.layout import DecoderAdapter, layer_linears
from leanml.prune.base import Pruner
from leanml.prune.masks import MaskSpec


def linear_specs(
    adapter: DecoderAdapter, layers: Sequence[int], spec: MaskSpec, layer_sparsity: Sequence[float] | None = None
) -> dict[int, dict[str, MaskSpec]]:
    """Per layer and linear, the unstructured spec that makes the total exact.

    ``layer_sparsity[i]`` (default: ``spec.sparsity`` everywhere) is layer ``i``'s target. Linears are
    taken layer by layer in registration order and their prune counts are cumulatively rounded:
    ``count_j = round(T_j) - round(T_{j-1})`` with ``T_j`` the running sum of ``sparsity * numel``, so
    over all pruned linears exactly ``round(sum sparsity_l * numel_l)`` weights go, and each linear is
    within one weight of its own target. Each linear's spec carries ``count / numel`` as its sparsity.
    """
    out: dict[int, dict[str, MaskSpec]] = {}
    running = 0.0
    done = 0
    for i in sorted(layers):
        s = spec.sparsity if layer_sparsity is None else float(layer_sparsity[i])
        per: dict[str, MaskSpec] = {}
        for name, lin in layer_linears(adapter.layers()[i]).items():
            numel = lin.weight.numel()
            running += s * numel
            count = int(round(running)) - done
            done += count
            if not 0 < count < numel:
                raise LeanmlError(
                    f"{name} of layer {i} would lose {count} of its {numel} weights; choose a sparsity "
                    "(or profile) that keeps every linear's share inside (0, 1)"
                )
            per[name] = spec.with_sparsity(count / numel)
        out[i] = per
    return out


def check_profile(sparsity_profile: str | Sequence[float], spec: MaskSpec, pruner: Pruner | type[Pruner]) -> None:
    """Refuse an unknown profile name, per-layer values outside (0, 1), and a non-uniform profile with an
    N:M pattern or a structured method (reads only class attributes, so a pruner class does too)."""
    if isinstance(sparsity_profile, str):
        if sparsity_profile not in ("uniform", "owl"):
            raise ConfigError(f"sparsity_profile {sparsity_profile!r} is unknown; choose uniform or owl (or one "
                              "sparsity per layer)", None, ("sparsity_profile",))
    elif not (len(sparsity_profile) > 0 and all(0.0 < float(s) < 1.0 for s in sparsity_profile)):
        raise ConfigError("sparsity_profile needs one sparsity in (0, 1) per decoder layer", None,
                          ("sparsity_profile",))
    if sparsity_profile != "uniform" and (spec.pattern is not None or pruner.structured):
        name = sparsity_profile if isinstance(sparsity_profile, str) else "custom"
        what = f"the {spec.describe()} pattern" if spec.pattern is not None else f"structured {pruner.name}"
        raise ConfigError(f"sparsity_profile {name} sets unstructured per-layer sparsities; it does not apply to "
                          f"{what}: drop sparsity_profile", None, ("sparsity_profile",))


def layer_sparsities(
    sparsity_profile: str | Sequence[float],
    model: nn.Module,
    calib_ids: torch.Tensor,
    target: float,
    *,
    adapter: DecoderAdapter,
    **owl_pass: Any,
) -> tuple[list[float] | None, dict[str, Any]]:
    """Every decoder layer's sparsity under the profile (``None``: ``target`` everywhere) and a record
    for the report; ``"owl"`` runs :func:`owl_layer_sparsities` with ``owl_pass``, its keywords (the
    pass's ``batch_size``, ``device``, ``progress`` and the options ``m``, ``lam``)."""
    name = sparsity_profile if isinstance(sparsity_profile, str) else "custom"
    if name == "uniform":
        return None, {"name": "uniform"}
    if name == "owl":
        return owl_layer_sparsities(model, calib_ids, target, adapter=adapter, **owl_pass)
    n_layers = len(adapter.layers())
    layer_sparsity = [float(s) for s in sparsity_profile]
    if len(layer_sparsity) != n_layers:
        raise LeanmlError(f"a sparsity profile needs one value per decoder layer ({n_layers}), "
                          f"got {len(layer_sparsity)}")
    return layer_sparsity, {"name": "custom"}


#: the paper's defaults
OWL_M = 5.0
OWL_LAMBDA = 0.08


@dataclass(frozen=True)
class OwlOptions:
    """Outlier-weighted layer sparsities (Yin et al. 2024; this module's docstring)."""

    m: float = option(OWL_M, "owl: outlier threshold M on |W|*||X||", bounds=Bounds(gt=0))
    lam: float = option(OWL_LAMBDA, "owl: largest deviation of a layer's sparsity from the target",
                        flag="--owl-lambda", bounds=Bounds(ge=0, le=1))


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
        raise ConfigError(f"sparsity must be in (0, 1), got {target}", None, ("sparsity",))
    if not lam >= 0:
        raise ConfigError(f"owl lam must be >= 0, got {lam}", OwlOptions, ("lam",))
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
            f"({float(s.min()):.3f}..{float(s.max()):.3f}); lower lam", owner=OwlOptions, fields=("lam",)
        )
    return [float(v) for v in s]


@torch.no_grad()
def owl_layer_sparsities(
    model: nn.Module,
    calib_ids: torch.Tensor,
    target: float,
    *,
    adapter: DecoderAdapter,
    batch_size: int = 8,
    device: str | torch.device | None = None,
    progress: bool = True,
    **owl: float,
) -> tuple[list[float], dict[str, Any]]:
    """OWL's dense pre-pass: walk the dense model layer by layer on the calibration ids (each layer
    visits ``device``), compute every layer's outlier ratio from its linears' Wanda scores, and
    allocate. ``owl``: the options ``m`` (outlier threshold, default :data:`OWL_M`) and ``lam``
    (largest deviation from the target, default :data:`OWL_LAMBDA`). Returns the per-layer sparsities
    and a record for the report."""
    from leanml.models.layerwise import capture_layer_inputs, layer_on, outer_on, run_layer, to_device

    unknown = sorted(set(owl) - {"m", "lam"})
    if unknown:
        raise TypeError(f"owl_layer_sparsities takes the owl options m and lam, not {', '.join(unknown)}")
    m, lam = owl.get("m", OWL_M), owl.get("lam", OWL_LAMBDA)
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
