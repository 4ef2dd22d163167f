"""Pruning one decoder layer: statistics, the method's solve per group, the pruned layer's outputs, its report.

Statistics come from one pass of the dense layer (``intra_layer=False``) or, with intra-layer
cumulative error correction, group by group from the partially pruned layer (:mod:`.capture`);
with correction the outputs of the layer's finished parts are reused (:mod:`.finished`).
:func:`prune_layer` runs the steps of a :class:`LayerPruning`: one way to gather the statistics and
prune the groups (:meth:`~LayerPruning.without_stats`, :meth:`~LayerPruning.one_pass`,
:meth:`~LayerPruning.intra_layer`), then :meth:`~LayerPruning.finish`.
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
from leanml.prune.engine.placement import LayerFeed, sync_device
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


class LayerPruning:
    """The steps of pruning one decoder layer, and what they share: the groups, the dense references
    (a dense copy of the layer, or the dense outputs a statistics pass computed anyway), the reports of
    the linears and the phase clocks.

    Phase times (``stats_seconds``, ``prune_seconds``, ``forward_seconds``) are read after waiting for
    the device, so on a GPU they measure the work, not its launch."""

    def __init__(self, layer: nn.Module, adapter: DecoderAdapter, feed: LayerFeed, pruner: Pruner,
                 spec: LinearSpecs, dense_cache_bytes: int = 2**31) -> None:
        self.layer, self.adapter, self.feed, self.pruner, self.spec = layer, adapter, feed, pruner, spec
        self.dense_cache_bytes = dense_cache_bytes
        self.device = feed.place.device
        self.t0 = self.clock()
        self.needs_dense = pruner.needs_dense and pruner.needs_stats
        self.groups: list[Group] | None = adapter.pairs(layer) if pruner.structured else None
        self.dense_layer: nn.Module | None = None
        self.ref_out: torch.Tensor | None = None  # the dense layer on the pruned stream
        self.dense_next: torch.Tensor | None = None  # the dense layer on the dense stream
        self.finished: FinishedParts | None = None
        self.linear_reports: dict[str, dict[str, Any]] = {}
        self.t_stats = self.t_prune = self.t_report = 0.0

    def clock(self) -> float:
        sync_device(self.device)
        return time.perf_counter()

    def prune_group(self, group: Group, stats: GroupStats | None) -> None:
        """The method's solve on ``group`` (timed), then the reports of its linears (and of other
        linears the method changed, e.g. the producers of a structured pair)."""
        dense_w = {n: lin.weight.data.clone() for n, lin in group.linears.items()}
        t = self.clock()
        extra = self.pruner.prune_group(group, stats, self.spec) or {}
        self.t_prune += self.clock() - t
        for n, fields in extra.items():
            if n not in group.linears:
                lin = self.layer.get_submodule(n)
                self.linear_reports[n] = {"group": group.name, "shape": list(lin.weight.shape), **fields}
        t = self.clock()
        for n, lin in group.linears.items():
            self.linear_reports[n] = {**linear_report(group, n, dense_w[n], lin.weight.data, stats),
                                      **extra.get(n, {})}
        self.t_report += self.clock() - t

    def without_stats(self) -> None:
        """A method without statistics (magnitude): every linear its own group, pruned as it is; a
        dense copy of the layer gives the reference outputs."""
        if self.groups is None:
            self.groups = [Group(name, {name: lin}) for name, lin in layer_linears(self.layer).items()]
        self.dense_layer = copy.deepcopy(self.layer)
        self.t_stats = self.clock() - self.t0
        for g in self.groups:
            if self.pruner.touches(g):
                self.prune_group(g, None)

    def one_pass(self) -> None:
        """Every group's statistics from passes of the still dense layer, then every group pruned."""
        self.groups, stats, self.ref_out, self.dense_next = one_pass(
            self.layer, self.groups, self.feed, self.needs_dense, self.adapter.model_type)
        self.t_stats = self.clock() - self.t0
        for g in self.groups:
            if self.pruner.touches(g):
                self.prune_group(g, stats[g.name])

    def intra_layer(self) -> None:
        """Intra-layer correction: groups pruned in forward order, each one's statistics from the
        partially pruned layer."""
        if self.groups is None:
            self.groups = find_groups(self.layer, self.feed, self.adapter.model_type)
        touched = [g for g in self.groups if self.pruner.touches(g)]
        cache = self.dense_targets(touched)
        self.t_stats = self.clock() - self.t0
        for g in touched:
            t = self.clock()
            st = group_stats_intra(self.layer, self.dense_layer, g, self.feed, self.needs_dense, cache,
                                   self.finished)
            self.t_stats += self.clock() - t
            self.prune_group(g, st)
            if self.finished is not None:
                self.finished.pruned([*g.linears, *g.producers])

    def dense_targets(self, touched: list[Group]) -> tuple[dict, list] | None:
        """Where the intra-layer passes find the dense target: with a dense target that fits in
        ``dense_cache_bytes``, one pass of the dense layer keeps every group's dense input or outputs
        (and gives the layer's dense output); else a dense copy of the layer. Also sets up the reuse of
        finished parts in what the cache leaves of the budget."""
        feed = self.feed
        cache = None
        src = feed.streams.dense_or_pruned()
        by_output = cross_by_output(touched) if self.pruner.accepts_cross else set()
        if self.needs_dense and dense_cache_size(touched, src, by_output) <= self.dense_cache_bytes:
            inputs, energies, out = dense_pass(self.layer, touched, src, feed.kw, feed.batch_size, feed.place,
                                               by_output)
            cache = (inputs, energies)
            if feed.streams.dense is not None:
                self.dense_next = out
            else:
                self.ref_out = out
        else:
            self.dense_layer = copy.deepcopy(self.layer)
        used = dense_cache_size(touched, src, by_output) if cache is not None else 0
        if REUSE_FINISHED_PARTS:
            self.finished = FinishedParts(self.layer, {n for g in touched for n in [*g.linears, *g.producers]},
                                          self.dense_cache_bytes - used, feed.place.home)
        return cache

    def report_untouched(self, groups: list[Group]) -> None:
        """Linears the method left alone (no statistics, so no error to report) and the final
        sparsity of structured pairs' producers."""
        for g in groups:
            if not self.pruner.touches(g):
                for n, lin in g.linears.items():
                    self.linear_reports.setdefault(n, {"group": g.name, "shape": list(lin.weight.shape),
                                                       "sparsity": sparsity_of(lin.weight.data)})
            for n, lin in g.producers.items():
                if n in self.linear_reports:
                    self.linear_reports[n]["sparsity"] = sparsity_of(lin.weight.data)

    def outputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The pruned layer's output on the pruned stream (the next layer's input) and the reference
        it is measured against: with a dense stream the dense model's activations (what a dense-target
        method aims at), else the dense layer on the same (pruned-path) input."""
        feed = self.feed
        pruned_next = forward_stream(self.layer, feed.streams.pruned, feed.kw, feed.batch_size, feed.place,
                                     self.finished)
        if feed.streams.dense is not None:
            if self.dense_next is None:
                assert self.dense_layer is not None
                self.dense_next = forward_stream(self.dense_layer, feed.streams.dense, feed.kw, feed.batch_size,
                                                 feed.place)
            return pruned_next, self.dense_next
        if self.ref_out is None:
            assert self.dense_layer is not None
            self.ref_out = forward_stream(self.dense_layer, feed.streams.pruned, feed.kw, feed.batch_size,
                                          feed.place)
        return pruned_next, self.ref_out

    def finish(self) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The layer's report, its outputs (:func:`prune_layer`'s result)."""
        assert self.groups is not None
        groups = self.groups
        self.report_untouched(groups)
        t = self.clock()
        pruned_next, reference = self.outputs()
        t_forward = self.clock() - t
        changed = {n for g in groups if self.pruner.touches(g) for n in [*g.linears, *g.producers]}
        linears = layer_linears(self.layer)
        zeros = sum(int((lin.weight == 0).sum()) for n, lin in linears.items() if n in changed)
        numel = sum(lin.weight.numel() for n, lin in linears.items() if n in changed)
        report = {
            "linears": self.linear_reports,
            "groups": [list(g.linears) for g in groups if self.pruner.touches(g)],
            "sparsity_measured": zeros / max(numel, 1),
            "stats_seconds": self.t_stats,
            "prune_seconds": self.t_prune,
            "forward_seconds": t_forward,
            "report_seconds": self.t_report,
            "rel_output_error": rel_error(pruned_next, reference),
        }
        return report, pruned_next, self.dense_next, self.ref_out


def prune_layer(
    layer: nn.Module, adapter: DecoderAdapter, feed: LayerFeed, pruner: Pruner, spec: LinearSpecs,
    intra_layer: bool, dense_cache_bytes: int = 2**31,
) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Prune one decoder layer on ``feed``; return its report, the pruned layer's output on the pruned
    stream, (with a dense stream) the dense layer's output on the dense stream, and (where a pass
    computed it: always without a dense stream) the dense layer's output on the pruned stream (see
    :class:`LayerPruning`)."""
    step = LayerPruning(layer, adapter, feed, pruner, spec, dense_cache_bytes)
    if not pruner.needs_stats:
        step.without_stats()
    elif not intra_layer:
        step.one_pass()
    else:
        step.intra_layer()
    return step.finish()
