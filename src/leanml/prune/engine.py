"""The layer-wise pruning engine.

The first decoder layer's inputs are captured once; then decoder layers are processed one at a time,
so memory holds one layer's activations whatever the model size. Two activation streams run side by
side: the *dense* stream (inputs of the unpruned model) and the *pruned* stream.

Within a layer, groups are pruned in forward order (attention input projections, attention output,
MLP input, MLP output). With **intra-layer cumulative error correction** (``intra_layer=True``, the
default) each group's statistics come from running the *partially pruned* layer on the pruned
stream, so later groups see and correct the error of earlier ones; the dense target (``G``/``Hd``,
for methods that ask for it) comes from an untouched copy of the layer on the dense stream.

Between layers: ``sequential=True`` (the default, SparseGPT's choice) feeds the pruned layer's outputs
to the next layer; ``sequential=False`` gives every layer the dense model's inputs, which makes layers
independent (so they can be pruned in parallel by several processes).

Embeddings and ``lm_head`` are never touched.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from leanml.models.adapters import DecoderAdapter, get_adapter
from leanml.prune.base import Group, GroupStats, Pruner, output_error
from leanml.prune.masks import MaskSpec, sparsity_of
from leanml.utils import LeanmlError, atomic_file

ENGINE_READY = True


class _Stop(Exception):
    """Raised by a capture hook to skip the rest of a layer's forward pass."""


def _to(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple):
        return tuple(_to(o, device) for o in obj)
    if isinstance(obj, list):
        return [_to(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


@torch.no_grad()
def capture_layer_inputs(
    model: nn.Module, adapter: DecoderAdapter, calib_ids: torch.Tensor, batch_size: int
) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    """Run the model up to the first decoder layer; return its inputs ``(n, seqlen, hidden)`` (on CPU)
    and the keyword arguments it received, one dict per batch of ``batch_size`` windows."""
    layers = adapter.layers()
    first = layers[0]
    inputs: list[torch.Tensor] = []
    kwargs_list: list[dict[str, Any]] = []

    class Catcher(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            inputs.append(hidden_states.detach().cpu())
            kwargs = dict(kwargs)
            if args:
                kwargs["_args"] = args
            kwargs_list.append({k: v for k, v in kwargs.items() if k not in ("cache", "past_key_values")})
            raise _Stop

    layers[0] = Catcher(first)
    device = next(model.parameters()).device
    try:
        for start in range(0, calib_ids.shape[0], batch_size):
            try:
                model(input_ids=calib_ids[start : start + batch_size].to(device), use_cache=False)
            except _Stop:
                pass
    finally:
        layers[0] = first
    return torch.cat(inputs), kwargs_list


def _forward(layer: nn.Module, x: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    kwargs = dict(kwargs)
    args = kwargs.pop("_args", ())
    return _first(layer(x, *args, **kwargs))


def _capture_group_input(
    layer: nn.Module, group_first: str, x: torch.Tensor, kwargs: dict[str, Any]
) -> torch.Tensor:
    """The input of linear ``group_first`` (a qualified name in ``layer``) when ``layer`` runs on ``x``."""
    box: list[torch.Tensor] = []

    def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
        box.append(args[0].detach())
        raise _Stop

    handle = layer.get_submodule(group_first).register_forward_pre_hook(hook)
    try:
        _forward(layer, x, kwargs)
    except _Stop:
        pass
    finally:
        handle.remove()
    if not box:
        raise RuntimeError(f"{group_first} was not called during the layer's forward pass")
    return box[0].reshape(-1, box[0].shape[-1]).float()


class _Streams:
    """Pruned and dense activations entering the current layer (CPU tensors, one row per window)."""

    def __init__(self, pruned: torch.Tensor, dense: torch.Tensor | None) -> None:
        self.pruned = pruned
        self.dense = dense  # None when identical to pruned (dense-input mode)

    def dense_or_pruned(self) -> torch.Tensor:
        return self.pruned if self.dense is None else self.dense


def _fingerprint(meta: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(meta, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _atomic_save(obj: Any, path: Path) -> None:
    with atomic_file(path) as tmp:
        torch.save(obj, tmp)


@torch.no_grad()
def prune_model(
    model: nn.Module,
    calib_ids: torch.Tensor,
    pruner: Pruner,
    spec: MaskSpec,
    *,
    adapter: DecoderAdapter | None = None,
    sequential: bool = True,
    intra_layer: bool = True,
    layers: Sequence[int] | None = None,
    batch_size: int = 8,
    checkpoint_dir: str | os.PathLike | None = None,
    fingerprint: dict[str, Any] | None = None,
    device: str | torch.device | None = None,
    progress: bool = True,
    finalize: bool = True,
) -> dict[str, Any]:
    """Prune ``model`` in place, layer by layer; return the report (per-layer and per-linear stats).

    ``calib_ids``: ``(nsamples, seqlen)`` token ids. ``layers``: prune only these indices (the others
    are forwarded unchanged). ``checkpoint_dir``: save each finished layer and the activation streams
    there and resume from them when present (the checkpoint must match ``fingerprint``).
    """
    if calib_ids.dim() != 2:
        raise LeanmlError(f"calibration ids must be (nsamples, seqlen), got shape {tuple(calib_ids.shape)}")
    if pruner.structured and spec.pattern is not None:
        raise LeanmlError(f"{pruner.name} is structured and takes no N:M pattern; drop --pattern")
    if spec.pattern is not None and not pruner.supports_pattern:
        raise LeanmlError(f"{pruner.name} does not support N:M patterns")
    adapter = adapter or get_adapter(model)
    all_layers = adapter.layers()
    n_layers = len(all_layers)
    todo = set(range(n_layers)) if layers is None else set(layers)
    if not todo <= set(range(n_layers)):
        raise LeanmlError(f"layer indices must be in [0, {n_layers}), got {sorted(todo)}")
    for idx in sorted(todo):  # settings a layer cannot take fail now, not after the calibration passes
        pruner.check_layer(adapter.groups(all_layers[idx]), spec)
    device = torch.device(device) if device is not None else next(model.parameters()).device
    model_device = next(model.parameters()).device
    t_start = time.perf_counter()

    meta = {
        "method": pruner.name,
        "method_config": pruner.config(),
        "spec": [spec.sparsity, spec.pattern, spec.scope],
        "sequential": sequential,
        "intra_layer": intra_layer,
        "layers": sorted(todo),
        "calib": _fingerprint({"ids": calib_ids[:, :8].tolist(), "shape": list(calib_ids.shape)}),
        **(fingerprint or {}),
    }
    ckpt = Path(checkpoint_dir) if checkpoint_dir is not None else None
    start_layer = 0
    layer_reports: list[dict[str, Any]] = []
    state_path = ckpt / "state.pt" if ckpt else None
    if state_path is not None and state_path.exists():
        state = torch.load(state_path, weights_only=False)
        if state["fingerprint"] != _fingerprint(meta):
            raise LeanmlError(
                f"checkpoint in {ckpt} was made with different settings; delete it or run without --resume"
            )
        start_layer = state["next_layer"]
        layer_reports = state["reports"]
        streams = _Streams(state["pruned"], state["dense"])
        kwargs_list = state["kwargs"]
        for i in range(start_layer):
            _load_layer(all_layers[i], torch.load(ckpt / f"layer_{i:03d}.pt", weights_only=True))
        if hasattr(pruner, "load_state_dict") and "pruner" in state:
            pruner.load_state_dict(state["pruner"])
    else:
        inps, kwargs_list = capture_layer_inputs(model, adapter, calib_ids, batch_size)
        streams = _Streams(inps, inps.clone() if sequential else None)

    bar = tqdm(range(start_layer, n_layers), desc=f"prune {pruner.name}", unit="layer", disable=not progress)
    for idx in bar:
        layer = all_layers[idx]
        layer.to(device)
        kw = [_to(k, device) for k in kwargs_list]
        dense_layer = layer
        report = None
        if idx in todo:
            report, dense_layer = _prune_layer(
                layer, adapter, streams, kw, pruner, spec, intra_layer, batch_size, device
            )
            report["layer"] = idx
        # advance the streams: the pruned layer on the pruned stream, the dense copy on the dense one
        pruned_next = _run_layer(layer, streams.pruned, kw, batch_size, device)
        if streams.dense is not None:
            dense_next = _run_layer(dense_layer, streams.dense, kw, batch_size, device)
        elif report is not None:
            dense_next = _run_layer(dense_layer, streams.pruned, kw, batch_size, device)
        else:
            dense_next = pruned_next
        if report is not None:
            err = ((pruned_next - dense_next) ** 2).sum() / (dense_next**2).sum().clamp_min(1e-30)
            report["rel_output_error"] = float(err)
            layer_reports.append(report)
            bar.set_postfix(err=f"{report['rel_output_error']:.2e}")
        # dense-input mode: every layer sees the dense model's activations
        streams = _Streams(pruned_next, dense_next) if streams.dense is not None else _Streams(dense_next, None)
        del dense_layer
        layer.to(model_device)
        if ckpt is not None:
            ckpt.mkdir(parents=True, exist_ok=True)
            _atomic_save(layer.state_dict(), ckpt / f"layer_{idx:03d}.pt")
            state = {
                "fingerprint": _fingerprint(meta),
                "next_layer": idx + 1,
                "reports": layer_reports,
                "pruned": streams.pruned,
                "dense": streams.dense,
                "kwargs": kwargs_list,
            }
            if hasattr(pruner, "state_dict"):
                state["pruner"] = pruner.state_dict()
            _atomic_save(state, state_path)
    bar.close()
    final_info = pruner.finalize(model, adapter) if finalize else {}
    return {
        "engine": {
            "sequential": sequential,
            "intra_layer": intra_layer,
            "batch_size": batch_size,
            "device": str(device),
            "resumed_from_layer": start_layer,
        },
        "method": pruner.name,
        "method_config": pruner.config(),
        "mask": {"sparsity": spec.target_sparsity, "pattern": spec.describe(), "scope": spec.scope},
        "layers": layer_reports,
        "finalize": final_info,
        "prune_seconds": time.perf_counter() - t_start,
    }


def _load_layer(layer: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a checkpointed layer; a linear whose saved state has a bias it lacks (added by bias
    compensation) gets a bias parameter first."""
    own = layer.state_dict()
    for key, value in state.items():
        if key not in own and key.endswith(".bias"):
            module = layer.get_submodule(key[: -len(".bias")])
            if isinstance(module, nn.Linear) and module.bias is None:
                module.bias = nn.Parameter(torch.zeros_like(value, device=module.weight.device))
    layer.load_state_dict(state)


def _run_layer(
    layer: nn.Module, x: torch.Tensor, kwargs_list: list[dict[str, Any]], batch_size: int, device: torch.device
) -> torch.Tensor:
    outs = []
    for b, start in enumerate(range(0, x.shape[0], batch_size)):
        outs.append(_forward(layer, x[start : start + batch_size].to(device), kwargs_list[b]).cpu())
    return torch.cat(outs)


def _prune_layer(
    layer: nn.Module,
    adapter: DecoderAdapter,
    streams: _Streams,
    kwargs_list: list[dict[str, Any]],
    pruner: Pruner,
    spec: MaskSpec,
    intra_layer: bool,
    batch_size: int,
    device: torch.device,
) -> tuple[dict[str, Any], nn.Module]:
    """Prune one decoder layer group by group; return its report (output error filled in by the
    caller) and an untouched copy of the dense layer."""
    dense_layer = copy.deepcopy(layer)
    groups = adapter.groups(layer)
    linear_reports: dict[str, dict[str, Any]] = {}
    t_stats = t_prune = 0.0
    for group in groups:
        if not pruner.touches(group):  # left alone: no statistics, so no error to report
            for name, lin in group.linears.items():
                linear_reports[name] = {"group": group.name, "shape": list(lin.weight.shape),
                                        "sparsity": sparsity_of(lin.weight.data)}
            continue
        t0 = time.perf_counter()
        stats = _group_stats(
            layer, dense_layer, group, streams, kwargs_list, pruner.needs_dense, intra_layer, batch_size, device
        )
        t1 = time.perf_counter()
        dense_w = {name: lin.weight.data.clone() for name, lin in group.linears.items()}
        extra = pruner.prune_group(group, stats, spec) or {}
        t2 = time.perf_counter()
        t_stats += t1 - t0
        t_prune += t2 - t1
        for name, lin in group.linears.items():
            W, W_new = dense_w[name], lin.weight.data
            err = output_error(W, W_new, stats)
            ref = output_error(W, torch.zeros_like(W), stats) if stats.G is None else float(
                torch.einsum("ij,jk,ik->", W.to(stats.H.dtype), stats.Hd, W.to(stats.H.dtype))
            )
            linear_reports[name] = {
                "group": group.name,
                "shape": list(W.shape),
                "sparsity": sparsity_of(W_new),
                "rel_error": err / max(ref, 1e-30),
                **extra.get(name, {}),
            }
        for name, lin in group.producers.items():
            if name in linear_reports:
                linear_reports[name]["sparsity"] = sparsity_of(lin.weight.data)
    report = {
        "linears": linear_reports,
        "stats_seconds": t_stats,
        "prune_seconds": t_prune,
        "rel_output_error": float("nan"),
    }
    return report, dense_layer


def _group_stats(
    layer: nn.Module,
    dense_layer: nn.Module,
    group: Group,
    streams: _Streams,
    kwargs_list: list[dict[str, Any]],
    needs_dense: bool,
    intra_layer: bool,
    batch_size: int,
    device: torch.device,
) -> GroupStats:
    first = next(iter(group.linears))
    src_layer = layer if intra_layer else dense_layer
    H = G = Hd = None
    ntokens = 0
    dense_in = streams.dense_or_pruned()
    for b, start in enumerate(range(0, streams.pruned.shape[0], batch_size)):
        kw = kwargs_list[b]
        xs = _capture_group_input(src_layer, first, streams.pruned[start : start + batch_size].to(device), kw)
        if H is None:
            n = xs.shape[1]
            H = torch.zeros(n, n, device=device)
            total = torch.zeros(n, device=device)
            if needs_dense:
                G = torch.zeros(n, n, device=device)
                Hd = torch.zeros(n, n, device=device)
        H += xs.T @ xs
        total += xs.sum(0)
        if needs_dense:
            same = streams.dense is None and not intra_layer
            x = xs if same else _capture_group_input(dense_layer, first, dense_in[start : start + batch_size].to(device), kw)
            G += x.T @ xs
            Hd += x.T @ x
        ntokens += xs.shape[0]
    assert H is not None
    H /= ntokens
    if needs_dense:
        G /= ntokens
        Hd /= ntokens
    return GroupStats(H=H, G=G, Hd=Hd, ntokens=ntokens, mean=total / ntokens)
