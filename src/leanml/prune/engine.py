"""The layer-wise pruning engine.

The inputs of every decoder layer are captured once (:mod:`leanml.models.layerwise`); then decoder
layers are processed one at a time, each visiting ``device`` for its work while the model stays where
it is, so memory holds one layer and its activations whatever the model size. Activations between
layers live on the CPU.

Per layer the engine finds the groups to prune: for unstructured and N:M methods the linears grouped
by the input they read, found on the first calibration batch (no per-architecture code); for
structured methods the pairs declared by the model's family adapter. Statistics are gathered in one of
two ways:

- **one pass** (``intra_layer=False``; the default of magnitude, Wanda and SparseGPT, as in their
  papers): one forward of the still dense layer over the calibration batches with hooks on every
  group's first linear gathers all groups' statistics at once (plus one pass on the dense stream for
  methods that compare with the dense model); then every group is pruned.
- **intra-layer cumulative error correction** (``intra_layer=True``; FISTA's and the structured
  methods' default): groups are pruned in forward order and each group's statistics come from running
  the *partially pruned* layer, so later groups see and correct the error of earlier ones; the dense
  target (``G``/``Hd``) comes from an untouched copy of the layer on the dense stream.

Between layers: ``sequential=True`` (the default, SparseGPT's choice) feeds the pruned layer's outputs
to the next layer, and keeps a second, dense activation stream only for methods that need dense
targets (``needs_dense``); ``sequential=False`` gives every layer the dense model's inputs, which
makes layers independent (so they can be pruned in parallel by several processes).

Every pruned layer reports ``rel_output_error``, the relative squared error of its output against the
reference the method aims at, from passes the engine runs anyway: with a dense stream (methods with a
dense target in sequential mode) the dense model's activations, otherwise the dense layer's output on
the same (pruned-path) inputs.
Embeddings and ``lm_head`` are never touched.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from leanml.models.layerwise import (
    _Stop,
    capture_layer_inputs,
    first,
    forward_layer,
    layer_on,
    to_device,
)
from leanml.models.layout import DecoderAdapter, Group, get_adapter, group_calls, layer_linears
from leanml.models.shards import LayerStore
from leanml.models.surgery import load_layer_state
from leanml.prune.base import GroupStats, LinearSpecs, Pruner, output_error
from leanml.prune.finished import FinishedParts, nbytes
from leanml.prune.masks import MaskSpec, sparsity_of
from leanml.prune.placement import (
    Checkpointer,
    Place,
    Streams,
    batch_ranges,
    settings_fingerprint,
    stream_home,
    sync_device,
)
from leanml.utils import EtaBar, LeanmlError

#: out of device memory (``torch.OutOfMemoryError`` where torch has it)
_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
_CPU = torch.device("cpu")
#: with intra-layer correction, reuse the outputs of a layer's finished parts in its later passes
#: (identical results; a switch for the test that checks it)
REUSE_FINISHED_PARTS = True
#: bumped when the checkpoint layout changes, so an old checkpoint is refused instead of misread
CHECKPOINT_VERSION = 2


# --------------------------------------------------------------------------------------------------
# per-linear exact sparsity


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


# --------------------------------------------------------------------------------------------------
# statistics


class _Moments:
    """Running sums of one group's input statistics on ``device``.

    ``dense``: also the cross moment and the dense target's energy. The cross moment is ``G`` (n x n),
    or, with ``cross="C"``, per linear ``C = W G`` accumulated from the dense outputs ``y`` of the
    linear (``y x*^T``; cheaper when the linears' outputs are narrower than their input). The energy is
    ``Hd`` (n x n), or, when the dense outputs of the group's linears are given (``out_sq``), only
    their squared norms per row."""

    def __init__(self, n: int, device: torch.device, dense: bool, hd: bool = True, cross: str = "G") -> None:
        self.H = torch.zeros(n, n, device=device)
        self.total = torch.zeros(n, device=device)
        self.G = torch.zeros(n, n, device=device) if dense and cross == "G" else None
        self.C: dict[str, torch.Tensor] = {}
        self.Hd = torch.zeros(n, n, device=device) if dense and hd else None
        self.out_sq: dict[str, torch.Tensor] = {}
        self.ntokens = 0

    def add(
        self, xs: torch.Tensor, x: torch.Tensor | None, out_sq: dict[str, torch.Tensor] | None = None,
        ys: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.H.addmm_(xs.T, xs)
        self.total += xs.sum(0)
        if self.G is not None:
            same = x is None
            x = xs if same else x
            self.G.addmm_(x.T, xs)
            if self.Hd is not None:
                if same:
                    self.Hd.copy_(self.H)  # dense input = pruned-path input
                else:
                    self.Hd.addmm_(x.T, x)
        for name, y in (ys or {}).items():
            if name in self.C:
                self.C[name].addmm_(y.T, xs)
            else:
                self.C[name] = y.T @ xs
        for name, v in (out_sq or {}).items():
            self.out_sq[name] = self.out_sq[name] + v if name in self.out_sq else v
        self.ntokens += xs.shape[0]

    def stats(self) -> GroupStats:
        n = max(self.ntokens, 1)
        return GroupStats(
            H=self.H / n,
            G=None if self.G is None else self.G / n,
            Hd=None if self.Hd is None else self.Hd / n,
            ntokens=self.ntokens,
            mean=self.total / n,
            out_sq={k: v / n for k, v in self.out_sq.items()} or None,
            C={k: v / n for k, v in self.C.items()} or None,
        )


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).float()


class _Capture:
    """Forward pre-hooks that keep the inputs of chosen linears during one forward pass.

    ``names=None`` records every linear of the layer in call order (to discover the groups)."""

    def __init__(
        self, layer: nn.Module, names: Sequence[str] | None, stop_at: str | None = None,
        energies: Sequence[str] = (), keep_outputs: Sequence[str] = (),
    ) -> None:
        self.calls: list[tuple[str, torch.Tensor]] = []
        self.inputs: dict[str, torch.Tensor] = {}
        #: per linear in ``energies``: sum over tokens of its squared output per row, bias excluded
        self.out_sq: dict[str, torch.Tensor] = {}
        #: per linear in ``keep_outputs`` (a subset of ``energies``): its outputs, bias excluded
        self.outputs: dict[str, torch.Tensor] = {}
        keep = set(keep_outputs)
        self.handles = []
        targets = layer_linears(layer) if names is None else {n: layer.get_submodule(n) for n in names}
        for name, mod in targets.items():
            def hook(module: nn.Module, args: tuple[Any, ...], name: str = name) -> None:
                self.calls.append((name, args[0]))
                self.inputs.setdefault(name, args[0])
                if name == stop_at:
                    raise _Stop

            self.handles.append(mod.register_forward_pre_hook(hook))
        for name in energies:
            def out_hook(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor, name: str = name) -> None:
                y = out.reshape(-1, out.shape[-1]).float()
                if module.bias is not None:
                    y = y - module.bias.float()
                self.out_sq[name] = torch.linalg.vecdot(y, y, dim=0)  # no tokens x outputs temporary
                if name in keep:
                    self.outputs[name] = y

            self.handles.append(layer.get_submodule(name).register_forward_hook(out_hook))

    def run(self, layer: nn.Module, x: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor | None:
        """Run the layer; its output, or ``None`` when stopped early."""
        try:
            return first(forward_layer(layer, x, kwargs))
        except _Stop:
            return None
        finally:
            for h in self.handles:
                h.remove()


def _one_pass(
    layer: nn.Module,
    groups: list[Group] | None,
    streams: Streams,
    kw: list[dict[str, Any]],
    needs_dense: bool,
    batch_size: int,
    place: Place,
    model_type: str,
) -> tuple[list[Group], dict[str, GroupStats], torch.Tensor, torch.Tensor | None]:
    """Statistics of every group from passes of the still dense layer, all groups at once.

    Returns the groups (discovered on the first batch when ``groups`` is None), their statistics by
    group name, the dense layer's output on the pruned stream (the reference of the error report) and,
    with a dense stream, its output on the dense stream (the next dense stream)."""
    moments: dict[str, _Moments] = {}
    device = place.device
    n = streams.pruned.shape[0]
    ref_out, dense_out = place.sink(n), place.sink(n)
    dense_feed = place.feed(streams.dense, batch_size) if needs_dense and streams.dense is not None else None
    for b, s, e, xb in place.feed(streams.pruned, batch_size):
        cap = _Capture(layer, None if groups is None else [g.leader for g in groups])
        ref_out.put(s, e, cap.run(layer, xb, kw[b]))
        if groups is None:
            groups = [Group(name, {n: layer.get_submodule(n) for n in names})
                      for name, names in group_calls(layer_linears(layer), cap.calls, model_type)]
        dense_in: dict[str, torch.Tensor] = {}
        out_sq: dict[str, torch.Tensor] = {}
        if dense_feed is not None:
            dcap = _Capture(layer, [g.leader for g in groups], energies=[n for g in groups for n in g.linears])
            dense_out.put(s, e, dcap.run(layer, next(dense_feed)[3], kw[b]))
            dense_in, out_sq = dcap.inputs, dcap.out_sq
        for g in groups:
            xs = _flat(cap.inputs[g.leader])
            m = moments.get(g.name)
            if m is None:
                m = moments[g.name] = _Moments(xs.shape[1], device, needs_dense, hd=False)
            m.add(xs, _flat(dense_in[g.leader]) if g.leader in dense_in else None,
                  {n: out_sq[n] for n in g.linears if n in out_sq})
        del cap
    assert groups is not None
    stats = {name: m.stats() for name, m in moments.items()}
    return groups, stats, ref_out.result(), (dense_out.result() if dense_feed is not None else None)


def _dense_pass(
    layer: nn.Module, groups: list[Group], src: torch.Tensor, kw: list[dict[str, Any]], batch_size: int,
    place: Place, by_output: set[str] = frozenset(),
) -> tuple[dict[str, list[torch.Tensor]], list[dict[str, torch.Tensor]], torch.Tensor]:
    """One pass of the still dense ``layer`` over ``src`` that keeps, per batch and at home, every
    group's input (for the groups named in ``by_output``: the outputs of its linears, bias excluded,
    under ``"out:" + name``) and its linears' squared outputs per row; returns both, per batch, and
    the layer's outputs."""
    leaders = [g.leader for g in groups if g.name not in by_output]
    outputs = [n for g in groups if g.name in by_output for n in g.linears]
    cache: dict[str, list[torch.Tensor]] = {n: [] for n in leaders + [_OUT + n for n in outputs]}
    energies: list[dict[str, torch.Tensor]] = []
    outs = place.sink(src.shape[0])
    for b, s, e, xb in place.feed(src, batch_size):
        cap = _Capture(layer, leaders, energies=[n for g in groups for n in g.linears], keep_outputs=outputs)
        outs.put(s, e, cap.run(layer, xb, kw[b]))
        for name in leaders:
            x = cap.inputs[name]
            cache[name].append(place.keep(x.reshape(-1, x.shape[-1])))
        for name in outputs:
            cache[_OUT + name].append(place.keep(cap.outputs[name]))
        energies.append(cap.out_sq)
    return cache, energies, outs.result()


_OUT = "out:"


def _by_output(groups: list[Group]) -> set[str]:
    """Groups whose cross statistics are cheaper from their linears' dense outputs (``C = y x*^T`` per
    linear) than from their dense input (``G = x x*^T``): total output width below the input width."""
    out = set()
    for g in groups:
        n = next(iter(g.linears.values())).in_features
        if not g.producers and sum(lin.out_features for lin in g.linears.values()) < n:
            out.add(g.name)
    return out


def _dense_cache_bytes(groups: list[Group], src: torch.Tensor, by_output: set[str] = frozenset()) -> int:
    tokens = src.shape[0] * src.shape[1]
    width = sum(sum(lin.out_features for lin in g.linears.values()) if g.name in by_output
                else next(iter(g.linears.values())).in_features for g in groups)
    return tokens * width * 4


def _group_stats_intra(
    layer: nn.Module,
    dense_layer: nn.Module | None,
    group: Group,
    streams: Streams,
    kw: list[dict[str, Any]],
    needs_dense: bool,
    batch_size: int,
    place: Place,
    dense_cache: tuple[dict[str, list[torch.Tensor]], list[dict[str, torch.Tensor]]] | None = None,
    finished: FinishedParts | None = None,
) -> GroupStats:
    """One group's statistics from the partially pruned ``layer`` (stopped at the group's first linear),
    paired with the dense layer's input on the dense stream when ``needs_dense`` (from ``dense_cache``
    when given, else from the dense copy stopped at the same linear). ``finished`` reuses the outputs
    of the layer's finished parts."""
    m: _Moments | None = None
    device = place.device
    dense_in = streams.dense_or_pruned()
    batches = batch_ranges(streams.pruned.shape[0], batch_size)
    part = finished.finishes(group) if finished is not None else None
    dense_feed = place.feed(dense_in, batch_size) if needs_dense and dense_cache is None else None
    for b, _s, _e, xb in place.feed(streams.pruned, batch_size):
        cap = _Capture(layer, [group.leader], stop_at=group.leader)
        with finished.batch(b, device) if finished is not None else contextlib.nullcontext():
            cap.run(layer, xb, kw[b])
        if part is not None:
            assert finished is not None
            if not finished.keep_input(part, group.leader, b, cap.inputs[group.leader]):
                part = None
        xs = _flat(cap.inputs[group.leader])
        x = None
        out_sq = None
        ys = None
        if needs_dense and dense_cache is not None:
            if group.leader in dense_cache[0]:
                x = dense_cache[0][group.leader][b].to(device).float()
            else:  # cached by output: C = y x*^T per linear
                ys = {n: dense_cache[0][_OUT + n][b].to(device) for n in group.linears}
            out_sq = {n: dense_cache[1][b][n] for n in group.linears}
        elif needs_dense:
            assert dense_layer is not None and dense_feed is not None
            dcap = _Capture(dense_layer, [group.leader], stop_at=group.leader)
            dcap.run(dense_layer, next(dense_feed)[3], kw[b])
            x = _flat(dcap.inputs[group.leader])
        if m is None:
            m = _Moments(xs.shape[1], device, needs_dense, hd=dense_cache is None, cross="C" if ys else "G")
        m.add(xs, x, out_sq, ys)
    assert m is not None
    if finished is not None:
        finished.end_pass(len(batches))
    return m.stats()


def _run_layer(layer: nn.Module, x: torch.Tensor, kw: list[dict[str, Any]], batch_size: int, place: Place,
               finished: FinishedParts | None = None) -> torch.Tensor:
    """``layer`` on every batch of ``x`` (what the next layer reads), the output at home; ``finished``
    reuses the outputs of a pruned layer's finished parts."""
    outs = place.sink(x.shape[0])
    for b, s, e, xb in place.feed(x, batch_size):
        with finished.batch(b, place.device, record=False) if finished is not None and finished.active \
                else contextlib.nullcontext():
            outs.put(s, e, first(forward_layer(layer, xb, kw[b])))
    return outs.result()


def _discover(
    layer: nn.Module, streams: Streams, kw: list[dict[str, Any]], batch_size: int, device: torch.device,
    model_type: str,
) -> list[Group]:
    """The layer's groups, from a pass over its first batch."""
    cap = _Capture(layer, None)
    cap.run(layer, streams.pruned[:batch_size].to(device), kw[0])
    return [Group(name, {n: layer.get_submodule(n) for n in names})
            for name, names in group_calls(layer_linears(layer), cap.calls, model_type)]


# --------------------------------------------------------------------------------------------------
# one layer


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b) ** 2).sum() / (b**2).sum().clamp_min(1e-30))


def _linear_report(group: Group, name: str, W: torch.Tensor, W_new: torch.Tensor, stats: GroupStats | None) -> dict:
    """One linear's report: sparsity and (with statistics) its relative output error on them."""
    rep: dict[str, Any] = {"group": group.name, "shape": list(W.shape), "sparsity": sparsity_of(W_new)}
    if stats is not None:
        err = output_error(W, W_new, stats, name)
        ref = float(stats.dense_energy(name, W).sum())
        rep["rel_error"] = err / max(ref, 1e-30)
    return rep


def _prune_layer(
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
            linear_reports[n] = {**_linear_report(group, n, dense_w[n], lin.weight.data, st), **extra.get(n, {})}
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
        groups, stats, ref_out, dense_next = _one_pass(
            layer, groups, streams, kw, needs_dense, batch_size, place, adapter.model_type
        )
        t_stats = clock() - t0
        for g in groups:
            if pruner.touches(g):
                dense_w = {n: lin.weight.data.clone() for n, lin in g.linears.items()}
                report_group(g, dense_w, stats[g.name], prune(g, stats[g.name]))
    else:
        if groups is None:
            groups = _discover(layer, streams, kw, batch_size, device, adapter.model_type)
        touched = [g for g in groups if pruner.touches(g)]
        cache = None
        src = streams.dense_or_pruned()
        by_output = _by_output(touched) if pruner.accepts_cross else set()
        if needs_dense and _dense_cache_bytes(touched, src, by_output) <= dense_cache_bytes:
            # one pass of the dense layer gives every group's dense input or outputs (and the layer's
            # dense output)
            inputs, energies, out = _dense_pass(layer, touched, src, kw, batch_size, place, by_output)
            cache = (inputs, energies)
            if streams.dense is not None:
                dense_next = out
            else:
                ref_out = out
        else:
            dense_layer = copy.deepcopy(layer)
        used = _dense_cache_bytes(touched, src, by_output) if cache is not None else 0
        if REUSE_FINISHED_PARTS:
            finished = FinishedParts(layer, {n for g in touched for n in [*g.linears, *g.producers]},
                                      dense_cache_bytes - used, place.home)
        t_stats = clock() - t0
        for g in touched:
            t = clock()
            st = _group_stats_intra(layer, dense_layer, g, streams, kw, needs_dense, batch_size, place, cache,
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
    pruned_next = _run_layer(layer, streams.pruned, kw, batch_size, place, finished)
    if streams.dense is not None:  # the dense model's activations: what a dense-target method aims at
        if dense_next is None:
            assert dense_layer is not None
            dense_next = _run_layer(dense_layer, streams.dense, kw, batch_size, place)
        reference = dense_next
    else:  # the dense layer on the same (pruned-path) input
        if ref_out is None:
            assert dense_layer is not None
            ref_out = _run_layer(dense_layer, streams.pruned, kw, batch_size, place)
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
        "rel_output_error": _rel(pruned_next, reference),
    }
    return report, pruned_next, dense_next, ref_out


# --------------------------------------------------------------------------------------------------
# the model


def check_spec(pruner: Pruner, spec: MaskSpec) -> None:
    """Settings no layer can take: a pattern for a structured method or one the method refuses."""
    if pruner.structured and spec.pattern is not None:
        raise LeanmlError(f"{pruner.name} is structured and takes no N:M pattern; drop --pattern")
    if spec.pattern is not None and not pruner.supports_pattern:
        raise LeanmlError(f"{pruner.name} does not support N:M patterns")


def _check_layers(adapter: DecoderAdapter, todo: Sequence[int], pruner: Pruner, spec: MaskSpec) -> None:
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
    layer sparsities, :mod:`leanml.prune.owl`, options in ``owl``: ``m``, ``lam``) or one sparsity per
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

    Timing: every layer record carries ``solver_seconds`` (the method's own work: its statistics
    passes, its solves and the pass of the pruned layer that feeds the next one, read after waiting
    for the device) and ``engine_seconds`` (the rest of the layer's wall time: moving the layer and its
    inputs, copies, reports, checkpoints); the report sums both.
    """
    if calib_ids.dim() != 2:
        raise LeanmlError(f"calibration ids must be (nsamples, seqlen), got shape {tuple(calib_ids.shape)}")
    spec = pruner.resolve_spec(spec)
    intra_layer = pruner.resolve_intra_layer(intra_layer)
    check_spec(pruner, spec)
    profile_name = sparsity_profile if isinstance(sparsity_profile, str) else "custom"
    if profile_name not in ("uniform", "owl", "custom"):
        raise LeanmlError(f"unknown sparsity profile {sparsity_profile!r}; choose uniform or owl")
    if profile_name != "uniform" and (spec.pattern is not None or pruner.structured):
        raise LeanmlError(
            f"--sparsity-profile {profile_name} sets unstructured per-layer sparsities; it does not apply to "
            f"{'N:M patterns' if spec.pattern is not None else 'structured methods'}: use --sparsity-profile uniform"
        )
    adapter = adapter or get_adapter(model)
    all_layers = adapter.layers()
    n_layers = len(all_layers)
    todo = set(range(n_layers)) if layers is None else set(layers)
    if not todo:
        raise LeanmlError("no layers to prune: pass at least one layer index")
    if not todo <= set(range(n_layers)):
        raise LeanmlError(f"layer indices must be in [0, {n_layers}), got {sorted(todo)}")
    _check_layers(adapter, sorted(todo), pruner, spec)
    device = torch.device(device) if device is not None else next(model.parameters()).device
    t_start = time.perf_counter()

    profile_info: dict[str, Any] = {"name": profile_name}
    layer_sparsity: list[float] | None = None
    if profile_name == "owl":
        from leanml.prune.owl import owl_layer_sparsities

        layer_sparsity, profile_info = owl_layer_sparsities(
            model, calib_ids, spec.sparsity, adapter=adapter, batch_size=batch_size, device=device,
            progress=progress, **(owl or {}),
        )
    elif profile_name == "custom":
        layer_sparsity = [float(s) for s in sparsity_profile]  # type: ignore[union-attr]
        if len(layer_sparsity) != n_layers:
            raise LeanmlError(f"a sparsity profile needs one value per decoder layer ({n_layers}), got {len(layer_sparsity)}")
        if not all(0.0 < s < 1.0 for s in layer_sparsity):
            raise LeanmlError("every per-layer sparsity must be in (0, 1)")
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
        "spec": [spec.sparsity, spec.pattern, spec.scope],
        "profile": layer_sparsity,
        "sequential": sequential,
        "intra_layer": intra_layer,
        "layers": sorted(todo),
        "calib": settings_fingerprint({"ids": calib_ids[:, :8].tolist(), "shape": list(calib_ids.shape)}),
        **(fingerprint or {}),
    }
    ckpt = Path(checkpoint_dir) if checkpoint_dir is not None else None
    start_layer = 0
    capture_seconds = 0.0
    layer_reports: list[dict[str, Any]] = []
    state_path = ckpt / "state.pt" if ckpt else None
    seconds_before = 0.0  # wall seconds the interrupted runs spent, when resuming
    prepare_seconds = 0.0  # a method's own pass over the whole model before the walk (FASP's allocation)
    if state_path is not None and state_path.exists():
        state = torch.load(state_path, weights_only=False)
        if state.get("fingerprint") != settings_fingerprint(meta):
            raise LeanmlError(
                f"checkpoint in {ckpt} was made with different settings; delete it or run without --resume"
            )
        start_layer = state["next_layer"]
        layer_reports = state["reports"]
        seconds_before = float(state.get("seconds", 0.0))
        streams = Streams(state["pruned"], state["dense"])
        kwargs = state["kwargs"]
        for i in range(start_layer if layer_store is None else 0):  # streamed: already in the output
            load_layer_state(all_layers[i], torch.load(ckpt / f"layer_{i:03d}.pt", weights_only=True))
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
                    report, pruned_next, dense_next, dense_out = _prune_layer(
                        layer, adapter, streams, kw, pruner, lspec, intra_layer, batch_size, place, dense_cache_bytes
                    )
                    report["layer"] = idx
                    report["sparsity_requested"] = requested[idx]
                    layer_reports.append(report)
                    bar.set_postfix(err=f"{report['rel_output_error']:.2e}")
                else:
                    report = None
                    pruned_next = dense_out = _run_layer(layer, streams.pruned, kw, batch_size, place)
                    dense_next = (_run_layer(layer, streams.dense, kw, batch_size, place)
                                  if streams.dense is not None else None)
            # dense-input mode: every layer sees the dense model's activations (here the pruned stream
            # holds them, so the dense layer's output on it is the next input)
            streams = Streams(pruned_next, dense_next) if sequential else Streams(dense_out, None)
            if layer_store is not None:
                streams = Streams(*layer_store.spill(idx, streams.pruned, streams.dense))
            if writer is not None:
                writer.layer(idx, layer)
                writer.state(lambda idx=idx, streams=streams: {
                    "fingerprint": settings_fingerprint(meta), "next_layer": idx + 1, "reports": list(layer_reports),
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
    except _OOM as exc:
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
