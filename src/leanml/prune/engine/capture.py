"""Statistics capture: the passes over one decoder layer that gather its groups' input statistics.

Forward hooks (:class:`Capture`) keep the inputs of chosen linears during a pass; :class:`Moments`
sums them into a group's :class:`~leanml.prune.base.GroupStats`. Three ways to run the passes:

- :func:`one_pass` -- every group at once from passes of the still dense layer (no intra-layer
  correction), plus the dense stream when the method has a dense target;
- :func:`group_stats_intra` -- one group from the partially pruned layer, stopped at its first linear
  (intra-layer correction), its dense target from :func:`dense_pass`'s cache or a dense copy;
- :func:`dense_pass` -- one pass of the dense layer keeping every group's dense input (or, for groups
  in :func:`cross_by_output`, its linears' dense outputs).

:func:`forward_stream` runs a layer over a whole activation stream; :func:`find_groups` discovers a
layer's groups from the linears it calls on the first batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from leanml.models.layerwise import StopForward, first, forward_layer
from leanml.models.layout import Group, group_calls, layer_linears
from leanml.prune.base import GroupStats
from leanml.prune.engine.finished import FinishedParts
from leanml.prune.engine.placement import LayerFeed, Place, batch_ranges

#: key prefix of a linear's dense outputs in :func:`dense_pass`'s cache (its input is keyed by the name)
OUT_PREFIX = "out:"


class Moments:
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


def flat_tokens(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).float()


class Capture:
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
                    raise StopForward

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
        except StopForward:
            return None
        finally:
            for h in self.handles:
                h.remove()


def one_pass(
    layer: nn.Module, groups: list[Group] | None, feed: LayerFeed, needs_dense: bool, model_type: str,
) -> tuple[list[Group], dict[str, GroupStats], torch.Tensor, torch.Tensor | None]:
    """Statistics of every group from passes of the still dense layer over ``feed``, all groups at once.

    Returns the groups (discovered on the first batch when ``groups`` is None), their statistics by
    group name, the dense layer's output on the pruned stream (the reference of the error report) and,
    with a dense stream, its output on the dense stream (the next dense stream)."""
    streams, kw, batch_size, place = feed.streams, feed.kw, feed.batch_size, feed.place
    moments: dict[str, Moments] = {}
    device = place.device
    n = streams.pruned.shape[0]
    ref_out, dense_out = place.sink(n), place.sink(n)
    dense_feed = place.feed(streams.dense, batch_size) if needs_dense and streams.dense is not None else None
    for b, s, e, xb in place.feed(streams.pruned, batch_size):
        cap = Capture(layer, None if groups is None else [g.leader for g in groups])
        ref_out.put(s, e, cap.run(layer, xb, kw[b]))
        if groups is None:
            groups = [Group(name, {n: layer.get_submodule(n) for n in names})
                      for name, names in group_calls(layer_linears(layer), cap.calls, model_type)]
        dense_in: dict[str, torch.Tensor] = {}
        out_sq: dict[str, torch.Tensor] = {}
        if dense_feed is not None:
            dcap = Capture(layer, [g.leader for g in groups], energies=[n for g in groups for n in g.linears])
            dense_out.put(s, e, dcap.run(layer, next(dense_feed)[3], kw[b]))
            dense_in, out_sq = dcap.inputs, dcap.out_sq
        for g in groups:
            xs = flat_tokens(cap.inputs[g.leader])
            m = moments.get(g.name)
            if m is None:
                m = moments[g.name] = Moments(xs.shape[1], device, needs_dense, hd=False)
            m.add(xs, flat_tokens(dense_in[g.leader]) if g.leader in dense_in else None,
                  {n: out_sq[n] for n in g.linears if n in out_sq})
        del cap
    assert groups is not None
    stats = {name: m.stats() for name, m in moments.items()}
    return groups, stats, ref_out.result(), (dense_out.result() if dense_feed is not None else None)


def dense_pass(
    layer: nn.Module, groups: list[Group], src: torch.Tensor, kw: list[dict[str, Any]], batch_size: int,
    place: Place, by_output: set[str] = frozenset(),
) -> tuple[dict[str, list[torch.Tensor]], list[dict[str, torch.Tensor]], torch.Tensor]:
    """One pass of the still dense ``layer`` over ``src`` that keeps, per batch and at home, every
    group's input (for the groups named in ``by_output``: the outputs of its linears, bias excluded,
    under ``"out:" + name``) and its linears' squared outputs per row; returns both, per batch, and
    the layer's outputs."""
    leaders = [g.leader for g in groups if g.name not in by_output]
    outputs = [n for g in groups if g.name in by_output for n in g.linears]
    cache: dict[str, list[torch.Tensor]] = {n: [] for n in leaders + [OUT_PREFIX + n for n in outputs]}
    energies: list[dict[str, torch.Tensor]] = []
    outs = place.sink(src.shape[0])
    for b, s, e, xb in place.feed(src, batch_size):
        cap = Capture(layer, leaders, energies=[n for g in groups for n in g.linears], keep_outputs=outputs)
        outs.put(s, e, cap.run(layer, xb, kw[b]))
        for name in leaders:
            x = cap.inputs[name]
            cache[name].append(place.keep(x.reshape(-1, x.shape[-1])))
        for name in outputs:
            cache[OUT_PREFIX + name].append(place.keep(cap.outputs[name]))
        energies.append(cap.out_sq)
    return cache, energies, outs.result()


def cross_by_output(groups: list[Group]) -> set[str]:
    """Groups whose cross statistics are cheaper from their linears' dense outputs (``C = y x*^T`` per
    linear) than from their dense input (``G = x x*^T``): total output width below the input width."""
    out = set()
    for g in groups:
        n = next(iter(g.linears.values())).in_features
        if not g.producers and sum(lin.out_features for lin in g.linears.values()) < n:
            out.add(g.name)
    return out


def dense_cache_size(groups: list[Group], src: torch.Tensor, by_output: set[str] = frozenset()) -> int:
    """Bytes :func:`dense_pass` keeps for ``groups`` over the stream ``src`` (float32)."""
    tokens = src.shape[0] * src.shape[1]
    width = sum(sum(lin.out_features for lin in g.linears.values()) if g.name in by_output
                else next(iter(g.linears.values())).in_features for g in groups)
    return tokens * width * 4


def group_stats_intra(
    layer: nn.Module,
    dense_layer: nn.Module | None,
    group: Group,
    feed: LayerFeed,
    needs_dense: bool,
    dense_cache: tuple[dict[str, list[torch.Tensor]], list[dict[str, torch.Tensor]]] | None = None,
    finished: FinishedParts | None = None,
) -> GroupStats:
    """One group's statistics from the partially pruned ``layer`` (stopped at the group's first linear)
    over ``feed``, paired with the dense layer's input on the dense stream when ``needs_dense`` (from
    ``dense_cache`` when given, else from the dense copy stopped at the same linear). ``finished``
    reuses the outputs of the layer's finished parts."""
    streams, kw, batch_size, place = feed.streams, feed.kw, feed.batch_size, feed.place
    m: Moments | None = None
    device = place.device
    dense_in = streams.dense_or_pruned()
    batches = batch_ranges(streams.pruned.shape[0], batch_size)
    part = finished.finishes(group) if finished is not None else None
    dense_feed = place.feed(dense_in, batch_size) if needs_dense and dense_cache is None else None
    for b, _s, _e, xb in place.feed(streams.pruned, batch_size):
        cap = Capture(layer, [group.leader], stop_at=group.leader)
        with finished.batch(b, device) if finished is not None else contextlib.nullcontext():
            cap.run(layer, xb, kw[b])
        if part is not None:
            assert finished is not None
            if not finished.keep_input(part, group.leader, b, cap.inputs[group.leader]):
                part = None
        xs = flat_tokens(cap.inputs[group.leader])
        x = None
        out_sq = None
        ys = None
        if needs_dense and dense_cache is not None:
            if group.leader in dense_cache[0]:
                x = dense_cache[0][group.leader][b].to(device).float()
            else:  # cached by output: C = y x*^T per linear
                ys = {n: dense_cache[0][OUT_PREFIX + n][b].to(device) for n in group.linears}
            out_sq = {n: dense_cache[1][b][n] for n in group.linears}
        elif needs_dense:
            assert dense_layer is not None and dense_feed is not None
            dcap = Capture(dense_layer, [group.leader], stop_at=group.leader)
            dcap.run(dense_layer, next(dense_feed)[3], kw[b])
            x = flat_tokens(dcap.inputs[group.leader])
        if m is None:
            m = Moments(xs.shape[1], device, needs_dense, hd=dense_cache is None, cross="C" if ys else "G")
        m.add(xs, x, out_sq, ys)
    assert m is not None
    if finished is not None:
        finished.end_pass(len(batches))
    return m.stats()


def forward_stream(layer: nn.Module, x: torch.Tensor, kw: list[dict[str, Any]], batch_size: int, place: Place,
                   finished: FinishedParts | None = None) -> torch.Tensor:
    """``layer`` on every batch of ``x`` (what the next layer reads), the output at home; ``finished``
    reuses the outputs of a pruned layer's finished parts."""
    outs = place.sink(x.shape[0])
    for b, s, e, xb in place.feed(x, batch_size):
        with finished.batch(b, place.device, record=False) if finished is not None and finished.active \
                else contextlib.nullcontext():
            outs.put(s, e, first(forward_layer(layer, xb, kw[b])))
    return outs.result()


def find_groups(layer: nn.Module, feed: LayerFeed, model_type: str) -> list[Group]:
    """The layer's groups, from a pass over the first batch of ``feed``'s pruned stream."""
    cap = Capture(layer, None)
    cap.run(layer, feed.streams.pruned[: feed.batch_size].to(feed.place.device), feed.kw[0])
    return [Group(name, {n: layer.get_submodule(n) for n in names})
            for name, names in group_calls(layer_linears(layer), cap.calls, model_type)]
