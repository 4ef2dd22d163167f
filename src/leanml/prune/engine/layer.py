"""Pruning one decoder layer: statistics, the method's solve per group, the pruned layer's outputs, its report.

Statistics come from one pass of the dense layer (``intra_layer=False``) or, with intra-layer
cumulative error correction, group by group from the partially pruned layer (:mod:`.capture`);
with correction the outputs of the layer's finished parts are reused (:mod:`.finished`).
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
from torch import nn

from leanml.models.layout import DecoderAdapter, Group, layer_linears
from leanml.prune.base import GroupStats, LinearSpecs, Pruner, output_error
from leanml.prune.engine.capture import (
    cross_by_output,
    dense_cache_size,
    dense_pass,
    find_groups,
    forward_stream,
    group_stats_intra,
    one_pass,
)
from leanml.prune.engine.finished import FinishedParts
from leanml.prune.engine.placement import Place, Streams, sync_device
from leanml.prune.masks import sparsity_of

#: with intra-layer correction, reuse the outputs of a layer's finished parts in its later passes
#: (identical results; a switch for the test that checks it)
REUSE_FINISHED_PARTS = True


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b||^2 / ||b||^2``."""
    return float(((a - b) ** 2).sum() / (b**2).sum().clamp_min(1e-30))


def linear_report(group: Group, name: str, W: torch.Tensor, W_new: torch.Tensor, stats: GroupStats | None) -> dict:
    """One linear's report: sparsity and (with statistics) its relative output error on them."""
    rep: dict[str, Any] = {"group": group.name, "shape": list(W.shape), "sparsity": sparsity_of(W_new)}
    if stats is not None:
        err = output_error(W, W_new, stats, name)
        ref = float(stats.dense_energy(name, W).sum())
        rep["rel_error"] = err / max(ref, 1e-30)
    return rep


def prune_layer(
    layer: nn.Module,
    adapter: DecoderAdapter,
    streams: Streams,
    kw: list[dict[str, Any]],
    pruner: Pruner,
    spec: LinearSpecs,
    intra_layer: bool,
    batch_size: int,
    place: Place,
    dense_cache_bytes: int = 2**31,
) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Prune one decoder layer; return its report, the pruned layer's output on the pruned stream,
    (with a dense stream) the dense layer's output on the dense stream, and the dense layer's output on
    the pruned stream.

    Phase times (``stats_seconds``, ``prune_seconds``, ``forward_seconds``) are read after waiting for
    the device, so on a GPU they measure the work, not its launch."""
    device = place.device

    def clock() -> float:
        sync_device(device)
        return time.perf_counter()

    t0 = clock()
    needs_dense = pruner.needs_dense and pruner.needs_stats
    groups: list[Group] | None = adapter.pairs(layer) if pruner.structured else None
    dense_layer: nn.Module | None = None
    stats: dict[str, GroupStats] = {}
    ref_out: torch.Tensor | None = None
    dense_next: torch.Tensor | None = None
    t_prune = t_report = 0.0
    linear_reports: dict[str, dict[str, Any]] = {}
    finished: FinishedParts | None = None

    def report_group(group: Group, dense_w: dict[str, torch.Tensor], st: GroupStats | None, extra: dict) -> None:
        nonlocal t_report
        t = clock()
        for n, lin in group.linears.items():
            linear_reports[n] = {**linear_report(group, n, dense_w[n], lin.weight.data, st), **extra.get(n, {})}
        t_report += clock() - t

    def prune(group: Group, st: GroupStats | None) -> dict[str, dict[str, Any]]:
        nonlocal t_prune
        t = clock()
        extra = pruner.prune_group(group, st, spec) or {}
        t_prune += clock() - t
        for n, fields in extra.items():  # e.g. the producers of a structured pair
            if n not in group.linears:
                lin = layer.get_submodule(n)
                linear_reports[n] = {"group": group.name, "shape": list(lin.weight.shape), **fields}
        return extra

    if not pruner.needs_stats:
        if groups is None:
            groups = [Group(name, {name: lin}) for name, lin in layer_linears(layer).items()]
        dense_layer = copy.deepcopy(layer)
        t_stats = clock() - t0
        for g in groups:
            if pruner.touches(g):
                dense_w = {n: lin.weight.data.clone() for n, lin in g.linears.items()}
                report_group(g, dense_w, None, prune(g, None))
    elif not intra_layer:
        groups, stats, ref_out, dense_next = one_pass(
            layer, groups, streams, kw, needs_dense, batch_size, place, adapter.model_type
        )
        t_stats = clock() - t0
        for g in groups:
            if pruner.touches(g):
                dense_w = {n: lin.weight.data.clone() for n, lin in g.linears.items()}
                report_group(g, dense_w, stats[g.name], prune(g, stats[g.name]))
    else:
        if groups is None:
            groups = find_groups(layer, streams, kw, batch_size, device, adapter.model_type)
        touched = [g for g in groups if pruner.touches(g)]
        cache = None
        src = streams.dense_or_pruned()
        by_output = cross_by_output(touched) if pruner.accepts_cross else set()
        if needs_dense and dense_cache_size(touched, src, by_output) <= dense_cache_bytes:
            # one pass of the dense layer gives every group's dense input or outputs (and the layer's
            # dense output)
            inputs, energies, out = dense_pass(layer, touched, src, kw, batch_size, place, by_output)
            cache = (inputs, energies)
            if streams.dense is not None:
                dense_next = out
            else:
                ref_out = out
        else:
            dense_layer = copy.deepcopy(layer)
        used = dense_cache_size(touched, src, by_output) if cache is not None else 0
        if REUSE_FINISHED_PARTS:
            finished = FinishedParts(layer, {n for g in touched for n in [*g.linears, *g.producers]},
                                      dense_cache_bytes - used, place.home)
        t_stats = clock() - t0
        for g in touched:
            t = clock()
            st = group_stats_intra(layer, dense_layer, g, streams, kw, needs_dense, batch_size, place, cache,
                                    finished)
            t_stats += clock() - t
            dense_w = {n: lin.weight.data.clone() for n, lin in g.linears.items()}
            report_group(g, dense_w, st, prune(g, st))
            if finished is not None:
                finished.pruned([*g.linears, *g.producers])
    for g in groups:
        if not pruner.touches(g):  # left alone: no statistics, so no error to report
            for n, lin in g.linears.items():
                linear_reports.setdefault(n, {"group": g.name, "shape": list(lin.weight.shape),
                                              "sparsity": sparsity_of(lin.weight.data)})
        for n, lin in g.producers.items():  # producers of structured pairs changed too
            if n in linear_reports:
                linear_reports[n]["sparsity"] = sparsity_of(lin.weight.data)
    t = clock()
    pruned_next = forward_stream(layer, streams.pruned, kw, batch_size, place, finished)
    if streams.dense is not None:  # the dense model's activations: what a dense-target method aims at
        if dense_next is None:
            assert dense_layer is not None
            dense_next = forward_stream(dense_layer, streams.dense, kw, batch_size, place)
        reference = dense_next
    else:  # the dense layer on the same (pruned-path) input
        if ref_out is None:
            assert dense_layer is not None
            ref_out = forward_stream(dense_layer, streams.pruned, kw, batch_size, place)
        reference = ref_out
    t_forward = clock() - t
    changed = {n for g in groups if pruner.touches(g) for n in [*g.linears, *g.producers]}
    zeros = sum(int((lin.weight == 0).sum()) for n, lin in layer_linears(layer).items() if n in changed)
    numel = sum(lin.weight.numel() for n, lin in layer_linears(layer).items() if n in changed)
    report = {
        "linears": linear_reports,
        "groups": [list(g.linears) for g in groups if pruner.touches(g)],
        "sparsity_measured": zeros / max(numel, 1),
        "stats_seconds": t_stats,
        "prune_seconds": t_prune,
        "forward_seconds": t_forward,
        "report_seconds": t_report,
        "rel_output_error": rel_error(pruned_next, reference),
    }
    return report, pruned_next, dense_next, ref_out
