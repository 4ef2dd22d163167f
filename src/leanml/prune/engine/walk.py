"""The layer walk: :func:`prune_model` checks the settings, allocates, captures the inputs of the first
decoder layer, then prunes the layers one at a time (:func:`~leanml.prune.engine.layer.prune_layer`),
each visiting ``device`` for its work while the model stays where it is, with resume checkpoints
(:mod:`.checkpoint`) and the activation streams placed by :mod:`.placement`."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from leanml.config import ConfigError
from leanml.models.layerwise import capture_layer_inputs, layer_on, to_device
from leanml.models.layout import DecoderAdapter, Group, get_adapter, layer_linears
from leanml.models.shards import LayerStore
from leanml.prune.base import Pruner
from leanml.prune.engine.allocation import check_profile, layer_sparsities, linear_specs
from leanml.prune.engine.capture import forward_stream
from leanml.prune.engine.checkpoint import (
    CHECKPOINT_VERSION,
    Checkpointer,
    restore_layers,
    resume_state,
    weights_fingerprint,
    windows_fingerprint,
)
from leanml.prune.engine.finished import nbytes
from leanml.prune.engine.layer import prune_layer
from leanml.prune.engine.placement import LayerFeed, Place, Streams, stream_home, sync_device
from leanml.prune.masks import MaskSpec
from leanml.utils import EtaBar, LeanmlError
from leanml.utils import fingerprint as settings_fingerprint  # the walk has a fingerprint parameter

#: out of device memory (``torch.OutOfMemoryError`` where torch has it)
OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


def check_spec(pruner: Pruner | type[Pruner], spec: MaskSpec) -> None:
    """Settings no layer can take: a pattern for a structured method or one the method refuses (reads
    only class attributes, so a pruner class does too)."""
    if pruner.structured and spec.pattern is not None:
        raise ConfigError(f"{pruner.name} removes whole units and takes no N:M mask: drop pattern", None, ("pattern",))
    if spec.pattern is not None and not pruner.supports_pattern:
        raise ConfigError(f"{pruner.name} does not support N:M masks: drop pattern", None, ("pattern",))


def check_layers(adapter: DecoderAdapter, todo: Sequence[int], pruner: Pruner, spec: MaskSpec) -> None:
    """Fail before any calibration pass: patterns the linears cannot take, pairs a method cannot cut."""
    for idx in sorted(todo):
        layer = adapter.layers()[idx]
        if pruner.structured:
            pruner.check_layer(adapter.pairs(layer), spec)
            continue
        linears = layer_linears(layer)
        if spec.pattern is not None:
            n, m = spec.pattern
            bad = [f"{name} ({lin.in_features} inputs)" for name, lin in linears.items() if lin.in_features % m]
            if bad:
                raise LeanmlError(
                    f"the {n}:{m} pattern needs input widths divisible by {m}; layer {idx} has {', '.join(bad[:3])}"
                )
        pruner.check_layer([Group(name, {name: lin}) for name, lin in linears.items()], spec)


@torch.no_grad()
def prune_model(
    model: nn.Module,
    calib_ids: torch.Tensor,
    pruner: Pruner,
    spec: MaskSpec,
    *,
    adapter: DecoderAdapter | None = None,
    sequential: bool = True,
    intra_layer: bool | None = None,
    layers: Sequence[int] | None = None,
    batch_size: int = 8,
    checkpoint_dir: str | os.PathLike | None = None,
    fingerprint: dict[str, Any] | None = None,
    device: str | torch.device | None = None,
    progress: bool = True,
    finalize: bool = True,
    sparsity_profile: str | Sequence[float] = "uniform",
    owl: dict[str, float] | None = None,
    dense_cache_bytes: int = 2**31,
    stream_device: str = "auto",
    checkpoint_interval: float = 0.0,
    layer_store: LayerStore | None = None,
    checked: bool = False,
) -> dict[str, Any]:
    """Prune ``model`` in place, layer by layer; return the report (per-layer and per-linear stats).

    ``calib_ids``: ``(nsamples, seqlen)`` token ids. ``spec``: the mask; an open scope
    (``MaskSpec(0.5)``) is resolved by ``pruner.resolve_spec`` (the same choice as the CLI's).
    ``intra_layer``: ``None`` uses the method's default (``pruner.default_intra_layer``).
    ``layers``: prune only these indices (the layers before them are forwarded unchanged; the walk ends
    after the last one). ``device``: where each
    layer does its work (default: where the model's first parameter is); the model's parameters stay
    where they are. ``checkpoint_dir``: save each finished layer and the activation streams there and
    resume from them when present (the checkpoint must match ``fingerprint``).
    ``sparsity_profile``: ``"uniform"`` (every layer at ``spec.sparsity``), ``"owl"`` (outlier-weighted
    layer sparsities, :mod:`leanml.prune.engine.allocation`, options in ``owl``: ``m``, ``lam``) or one sparsity per
    decoder layer; unstructured methods only, without an N:M pattern. For unstructured masks the total
    over all pruned linears is exact: ``round(sum_l s_l * numel_l)`` weights (see :func:`linear_specs`).
    ``dense_cache_bytes``: with intra-layer correction and a dense target, the dense inputs of a layer's
    groups are kept beside the streams when they fit in this many bytes (one dense pass instead of one
    partial pass per group); larger layers fall back to the partial passes.
    ``stream_device``: where the activation streams live between layers (:func:`stream_home`):
    ``"auto"`` keeps them on a GPU while its free memory allows, else in pinned host memory.
    ``checkpoint_interval``: with ``checkpoint_dir``, every finished layer is written at once and the
    activation streams at most every this many seconds (0: after every layer); all writes run on a
    background thread (:class:`Checkpointer`).
    ``layer_store``: streamed runs (:mod:`leanml.prune.stream`): the model is a meta-device skeleton and
    the store materializes the outer modules around the input capture and each layer for its turn, then
    writes and frees it; ``None``: the weights are in ``model``.
    ``checked``: ``spec`` is resolved and it and ``sparsity_profile`` are checked already (a
    :class:`~leanml.prune.config.PruneConfig` checks itself once, when made; :func:`leanml.prune` passes
    True), so the walk does not check them again.

    Timing: every layer record carries ``solver_seconds`` (the method's own work: its statistics
    passes, its solves and the pass of the pruned layer that feeds the next one, read after waiting
    for the device) and ``engine_seconds`` (the rest of the layer's wall time: moving the layer and its
    inputs, copies, reports, checkpoints); the report sums both.
    """
    if calib_ids.dim() != 2:
        raise LeanmlError(f"calibration ids must be (nsamples, seqlen), got shape {tuple(calib_ids.shape)}")
    intra_layer = pruner.resolve_intra_layer(intra_layer)
    if not checked:
        spec = pruner.resolve_spec(spec)
        check_spec(pruner, spec)
        check_profile(sparsity_profile, spec, pruner)
    adapter = adapter or get_adapter(model)
    all_layers = adapter.layers()
    n_layers = len(all_layers)
    todo = set(range(n_layers)) if layers is None else set(layers)
    if not todo:
        raise LeanmlError("no layers to prune: pass at least one layer index")
    if not todo <= set(range(n_layers)):
        raise LeanmlError(f"layer indices must be in [0, {n_layers}), got {sorted(todo)}")
    check_layers(adapter, sorted(todo), pruner, spec)
    device = torch.device(device) if device is not None else next(model.parameters()).device
    t_start = time.perf_counter()

    layer_sparsity, profile_info = layer_sparsities(
        sparsity_profile, model, calib_ids, spec.sparsity, adapter=adapter, batch_size=batch_size, device=device,
        progress=progress, owl=owl,
    )
    per_linear = None
    if spec.pattern is None and not pruner.structured:
        # over all layers, so a run on a subset of layers (a rank of a layer-parallel run) gives every
        # linear the count it gets in a run over the whole model
        per_linear = linear_specs(adapter, range(n_layers), spec, layer_sparsity)
    requested = {i: (spec.sparsity if layer_sparsity is None else layer_sparsity[i]) for i in todo}

    keep_dense = sequential and pruner.needs_dense and pruner.needs_stats
    meta = {
        "version": CHECKPOINT_VERSION,
        "method": pruner.name,
        "method_config": pruner.config(),
        "sparsity": spec.sparsity,
        "pattern": spec.describe() if spec.pattern is not None else None,
        "scope": spec.scope,
        "profile": layer_sparsity,
        "sequential": sequential,
        "intra_layer": intra_layer,
        "batch_size": batch_size,
        "layers": sorted(todo),
        **(fingerprint or {}),
        # after the caller's settings, so a caller's key of the same name (a corpus name) never hides them
        "calib_windows": windows_fingerprint(calib_ids),
        "weights": weights_fingerprint(model, layer_store.index.dir if layer_store is not None else None),
    }
    ckpt = Path(checkpoint_dir) if checkpoint_dir is not None else None
    start_layer = 0
    capture_seconds = 0.0
    layer_reports: list[dict[str, Any]] = []
    seconds_before = 0.0  # wall seconds the interrupted runs spent, when resuming
    prepare_seconds = 0.0  # a method's own pass over the whole model before the walk (FASP's allocation)
    state = resume_state(ckpt, meta)
    if state is not None:
        assert ckpt is not None
        start_layer = state["next_layer"]
        layer_reports = state["reports"]
        seconds_before = float(state.get("seconds", 0.0))
        streams = Streams(state["pruned"], state["dense"])
        kwargs = state["kwargs"]
        restore_layers(ckpt, all_layers, start_layer if layer_store is None else 0)  # streamed: already written
        if "pruner" in state:
            pruner.load_state_dict(state["pruner"])
    else:
        from leanml.models.layerwise import outer_on

        if layer_store is None and pruner.structured:  # structured methods' allocation pre-pass (dense model)
            t = time.perf_counter()
            pruner.prepare(  # type: ignore[attr-defined]
                model, adapter, calib_ids, batch_size=batch_size, device=device, spec=spec,
                           progress=progress)
            sync_device(device)
            prepare_seconds = time.perf_counter() - t
        t = time.perf_counter()
        if layer_store is not None:
            layer_store.load_outer(model)
        with outer_on(model, adapter, device):
            inps, kwargs = capture_layer_inputs(model, adapter, calib_ids, batch_size)
        if layer_store is not None:
            layer_store.release_outer(model)
        capture_seconds = time.perf_counter() - t
        streams = Streams(inps, inps.clone() if keep_dense else None)
    stream_bytes = sum(nbytes(x) for x in (streams.pruned, streams.dense) if x is not None)
    place = Place(device, stream_home(device, stream_bytes, stream_device))
    streams = Streams(place.adopt(streams.pruned), place.adopt(streams.dense))
    writer = Checkpointer(ckpt, checkpoint_interval) if ckpt is not None else None

    # layers after the last one to prune change nothing: the walk stops there
    # updated by hand after each layer: the bar prints the estimated time for the rest after the first one
    bar = EtaBar(total=max(todo) + 1 - start_layer, desc=f"prune {pruner.name}", unit="layer", disable=not progress)
    try:
        for idx in range(start_layer, max(todo) + 1):
            t_layer = time.perf_counter()
            layer = all_layers[idx]
            if layer_store is not None:
                layer_store.load(idx, layer)
            kw = [to_device(k, device) for k in kwargs[idx]]
            with layer_on(layer, device):
                if idx in todo:
                    lspec = per_linear[idx] if per_linear is not None else spec
                    report, pruned_next, dense_next, dense_out = prune_layer(
                        layer, adapter, LayerFeed(streams, kw, batch_size, place), pruner, lspec, intra_layer,
                        dense_cache_bytes,
                    )
                    report["layer"] = idx
                    report["sparsity_requested"] = requested[idx]
                    layer_reports.append(report)
                    bar.set_postfix(err=f"{report['rel_output_error']:.2e}")
                else:
                    report = None
                    pruned_next = dense_out = forward_stream(layer, streams.pruned, kw, batch_size, place)
                    dense_next = (forward_stream(layer, streams.dense, kw, batch_size, place)
                                  if streams.dense is not None else None)
            # dense-input mode: every layer sees the dense model's activations (here the pruned stream
            # holds them, so the dense layer's output on it is the next input)
            streams = Streams(pruned_next, dense_next) if sequential else Streams(dense_out, None)
            if layer_store is not None:
                streams = Streams(*layer_store.spill(idx, streams.pruned, streams.dense))
            if writer is not None:
                writer.layer(idx, layer)
                writer.state(lambda idx=idx, streams=streams: {
                    "settings": meta, "fingerprint": settings_fingerprint(meta), "next_layer": idx + 1,
                    "reports": list(layer_reports),
                    "pruned": streams.pruned, "dense": streams.dense, "kwargs": kwargs,
                    "pruner": pruner.state_dict(), "seconds": seconds_before + time.perf_counter() - t_start,
                }, last=idx == max(todo))
            if layer_store is not None:  # after its checkpoint snapshot: written out, then freed
                layer_store.release(idx, layer)
            bar.update(1)
            if report is not None:
                sync_device(device)
                report["seconds"] = time.perf_counter() - t_layer
                report["solver_seconds"] = report["stats_seconds"] + report["prune_seconds"] + report["forward_seconds"]
                report["engine_seconds"] = report["seconds"] - report["solver_seconds"]
    except OOM as exc:
        raise LeanmlError(
            f"out of memory on {device} while pruning: lower the batch size (batch_size={batch_size}, "
            "--batch-size) or keep the activation streams on the host (stream_device='cpu', --stream-device cpu)"
        ) from exc
    finally:
        bar.close()
        if writer is not None:
            if sys.exc_info()[0] is None:
                writer.close()
            else:  # already failing: finish what was queued, keep the first error
                with contextlib.suppress(Exception):
                    writer.close()
    final_info = pruner.finalize(model, adapter) if finalize else {}
    sync_device(device)
    # over every layer, the ones pruned before a resume included
    prune_seconds = seconds_before + time.perf_counter() - t_start
    solver_seconds = prepare_seconds + sum(lay.get("solver_seconds", 0.0) for lay in layer_reports)
    return {
        "engine": {
            "sequential": sequential,
            "intra_layer": intra_layer,
            "batch_size": batch_size,
            "device": str(device),
            "resumed_from_layer": start_layer,
            "dense_stream": keep_dense,
            "capture_seconds": capture_seconds,
            "prepare_seconds": prepare_seconds,
            "stream_device": str(place.home),
            "checkpoint_interval": checkpoint_interval if ckpt is not None else None,
        },
        "method": pruner.name,
        "method_config": pruner.config(),
        "mask": {"sparsity": spec.target_sparsity, "pattern": spec.describe(), "scope": spec.scope,
                 "profile": profile_info},
        "layers": layer_reports,
        "finalize": final_info,
        "prune_seconds": prune_seconds,
        "solver_seconds": solver_seconds,
        "engine_seconds": prune_seconds - solver_seconds,
    }
