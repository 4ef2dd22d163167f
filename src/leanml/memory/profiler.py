"""One instrumented training step: what each activation group costs to keep, recompute or compress.

:func:`profile_step` runs forward and backward once with every activation retained and records, per
group (decoder layer x child module, plus ``_self``, ``pre``, ``post``): the bytes autograd saves
(distinct storages, parameters skipped, each storage attributed to the first group that saved it),
the bytes a checkpoint of the group would have to hold (its inputs not saved elsewhere), the forward
time (= the time to recompute it), and for every compressor the payload bytes, pack and unpack time,
relative error and outlier ratio of its saved tensors.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from leanml.memory.compressors import (
    FLOAT_COMPRESSORS,
    bitpack,
    compressible,
    make_compressor,
    mask_scale,
    outlier_ratio,
    relative_error,
)
from leanml.memory.meter import ActivationMeter, note, param_tensors
from leanml.memory.runtime import SAC_SAVE_OPS, dense_order
from leanml.memory.structure import SELF, GroupKey, ScopeTracker, kind_of, param_storage_ptrs, tensors_in


@dataclass
class CompressStat:
    """What one compressor does to one group: bytes kept, time added, error."""

    payload_bytes: int
    pack_s: float
    unpack_s: float
    error: float  # largest relative error over the group's tensors
    max_out_bytes: int  # largest decompressed tensor (transient in backward)


@dataclass
class GroupStats:
    """Profile of one activation group."""

    layer: int | None
    child: str
    kind: str
    bytes: int = 0
    n_tensors: int = 0
    max_tensor_bytes: int = 0
    mask_bytes: int = 0
    input_bytes: int = 0
    fwd_s: float = 0.0
    sel_saved_bytes: int = 0  # outputs a selective checkpoint keeps (matmuls, attention)
    sel_recompute_s: float = 0.0  # time of the ops it recomputes (pointwise)
    outlier_ratio: float = 0.0
    compress: dict[str, CompressStat] = field(default_factory=dict)

    @property
    def key(self) -> GroupKey:
        return GroupKey(self.layer, self.child)

    @property
    def label(self) -> str:
        return self.key.label()


@dataclass
class Profile:
    """Result of :func:`profile_step`."""

    groups: dict[GroupKey, GroupStats]
    n_layers: int
    layer_input_bytes: list[int]
    layer_fwd_s: list[float]
    peak_bytes: int  # measured peak saved-activation bytes with everything retained
    step_s: float
    compressors: tuple[str, ...]

    def layer_groups(self, layer: int) -> list[GroupStats]:
        return [g for k, g in self.groups.items() if k.layer == layer]

    def to_json(self) -> dict:
        return {
            "n_layers": self.n_layers,
            "peak_bytes": self.peak_bytes,
            "step_s": self.step_s,
            "layer_input_bytes": self.layer_input_bytes,
            "layer_fwd_s": self.layer_fwd_s,
            "groups": [asdict(g) | {"label": g.label} for g in self.groups.values()],
        }


def _tensor_key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))


def _time(fn: Callable[[], object]) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def profile_step(
    model: nn.Module,
    blocks: list[nn.Module],
    run_step: Callable[[], torch.Tensor],
    compressors: tuple[str, ...] = FLOAT_COMPRESSORS,
    outlier_frac: float = 0.01,
    compress_layers: list[int] | None = None,
    measure_outside: bool = True,
) -> Profile:
    """Profile one step. ``run_step()`` runs the forward and returns the loss; this calls backward.

    ``compress_layers``: layers whose compressors are timed and measured (default all); other layers
    copy the stats of the nearest measured layer, scaled by bytes. ``measure_outside=False`` skips the
    compressors on the ``pre``/``post`` groups (when they will not be compressed anyway).
    """
    params = param_storage_ptrs(model)
    groups: dict[GroupKey, GroupStats] = {}
    saved: dict[GroupKey, dict[tuple, torch.Tensor]] = {}
    owner: dict[int, GroupKey] = {}  # storage ptr -> first group saving it
    inputs: dict[GroupKey, list[torch.Tensor]] = {}
    starts: dict[GroupKey, float] = {}
    n_layers = len(blocks)
    layer_inputs: list[list[torch.Tensor]] = [[] for _ in range(n_layers)]

    def group(key: GroupKey) -> GroupStats:
        if key not in groups:
            groups[key] = GroupStats(key.layer, key.child, kind_of(key.child) if key.layer is not None else key.child)
            saved[key] = {}
        return groups[key]

    def on_enter(key: GroupKey, mod: nn.Module, args: tuple, kwargs: dict) -> None:
        group(key)
        ins = [t for t in tensors_in((args, kwargs)) if t.untyped_storage().data_ptr() not in params]
        if key.child == SELF:
            layer_inputs[key.layer] = ins
        else:
            inputs[key] = ins
        starts[key] = time.perf_counter()

    def on_exit(key: GroupKey, mod: nn.Module, output: object) -> None:
        dt = time.perf_counter() - starts.pop(key, time.perf_counter())
        group(key).fwd_s += dt

    tracker = ScopeTracker(model, blocks, on_enter, on_exit)

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr in params:
            return t
        note(t)
        key = tracker.current()
        g = group(key)
        if ptr not in owner:
            saved[key].setdefault(_tensor_key(t), t)
            owner[ptr] = key
            nb = t.untyped_storage().nbytes()
            g.bytes += nb
            g.n_tensors += 1
            g.max_tensor_bytes = max(g.max_tensor_bytes, nb)
            if t.dtype == torch.bool or mask_scale(t) is not None:
                g.mask_bytes += nb
        return t

    meter = ActivationMeter(param_tensors(model))
    try:
        t0 = time.perf_counter()
        with meter, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = run_step()
        loss.backward()
        step_s = time.perf_counter() - t0
    finally:
        tracker.remove()

    # the block's own time excludes its children
    layer_fwd = [groups[GroupKey(i, SELF)].fwd_s if GroupKey(i, SELF) in groups else 0.0 for i in range(n_layers)]
    for key, g in groups.items():
        if key.child == SELF and key.layer is not None:
            g.fwd_s = max(0.0, g.fwd_s - sum(c.fwd_s for k, c in groups.items() if k.layer == key.layer and k.child != SELF))

    # bytes a checkpoint of a group holds: its inputs not saved by any other group
    for key, ins in inputs.items():
        seen: set[int] = set()
        for t in ins:
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen or (ptr in owner and owner[ptr] != key):
                continue
            seen.add(ptr)
            groups[key].input_bytes += t.untyped_storage().nbytes()
    layer_input_bytes = []
    for ins in layer_inputs:
        uniq = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in ins}
        layer_input_bytes.append(sum(uniq.values()))

    measured = set(range(n_layers)) if compress_layers is None else set(compress_layers)
    for key, g in groups.items():
        if (key.layer is None and measure_outside) or key.layer in measured:
            _measure_compression(g, list(saved[key].values()), compressors, outlier_frac)
    for key, g in groups.items():
        if key.layer is not None and key.layer not in measured:
            ref = min(measured, key=lambda m: abs(m - key.layer)) if measured else None
            src = groups.get(GroupKey(ref, key.child)) if ref is not None else None
            if src is not None and src.bytes > 0:
                scale = g.bytes / src.bytes
                g.outlier_ratio = src.outlier_ratio
                g.compress = {
                    n: CompressStat(int(s.payload_bytes * scale), s.pack_s * scale, s.unpack_s * scale, s.error,
                                    s.max_out_bytes)
                    for n, s in src.compress.items()
                }
            else:
                _measure_compression(g, list(saved[key].values()), compressors, outlier_frac)
    saved.clear()
    _selective_costs(model, blocks, run_step, groups)
    return Profile(groups, n_layers, layer_input_bytes, layer_fwd, meter.peak, step_s, tuple(compressors))


class _OpTimer(TorchDispatchMode):
    """Times every op and sizes matmul/attention outputs, per group (for selective recomputation)."""

    def __init__(self, tracker: ScopeTracker) -> None:
        super().__init__()
        self.tracker = tracker
        self.saved: dict[GroupKey, dict[int, int]] = {}
        self.other_s: dict[GroupKey, float] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        dt = time.perf_counter() - t0
        key = self.tracker.current()
        if func in SAC_SAVE_OPS:
            store = self.saved.setdefault(key, {})
            for t in tensors_in(out):
                st = t.untyped_storage()
                store[st.data_ptr()] = st.nbytes()
        else:
            self.other_s[key] = self.other_s.get(key, 0.0) + dt
        return out


def _selective_costs(model: nn.Module, blocks: list[nn.Module], run_step: Callable[[], torch.Tensor],
                     groups: dict[GroupKey, GroupStats]) -> None:
    """One extra forward that fills ``sel_saved_bytes`` / ``sel_recompute_s`` of every group."""
    tracker = ScopeTracker(model, blocks)
    timer = _OpTimer(tracker)
    try:
        with timer:
            loss = run_step()
        del loss
    finally:
        tracker.remove()
    for key, g in groups.items():
        g.sel_saved_bytes = sum(timer.saved.get(key, {}).values())
        g.sel_recompute_s = timer.other_s.get(key, 0.0)


def _measure_compression(g: GroupStats, tensors: list[torch.Tensor], compressors: tuple[str, ...],
                         outlier_frac: float) -> None:
    """Fill ``g.compress`` by compressing every saved tensor of the group once with each compressor."""
    seen: set[int] = set()
    uniq: list[torch.Tensor] = []
    for t in tensors:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:  # one tensor per storage (views share the storage)
            seen.add(ptr)
            uniq.append(t)
    ratios = [outlier_ratio(t) for t in uniq if compressible(t)]
    g.outlier_ratio = max(ratios) if ratios else 0.0
    options = list(compressors) + (["bitpack"] if g.mask_bytes else [])
    for name in options:
        comp = make_compressor(name, outlier_frac) if name != "bitpack" else None
        payload = 0
        pack_s = unpack_s = 0.0
        err = 0.0
        max_out = 0
        for t in uniq:
            nb = t.untyped_storage().nbytes()
            scale = mask_scale(t) if t.dtype != torch.bool else None
            if t.dtype == torch.bool or scale is not None:
                dt, p = _time(lambda t=t, scale=scale: bitpack(t, scale))
                payload += p.nbytes
                pack_s += dt
                max_out = max(max_out, nb)
            elif comp is not None and compressible(t):
                perm = dense_order(t)  # as the runtime: whole storage in memory order when possible
                src = t.permute(perm) if perm is not None else t
                dt, p = _time(lambda src=src, comp=comp: comp.pack(src))
                du, y = _time(lambda p=p, comp=comp: comp.unpack(p))
                payload += p.nbytes
                pack_s += dt
                unpack_s += du
                err = max(err, relative_error(src, y))
                max_out = max(max_out, nb)
            else:
                payload += nb
        if not math.isfinite(err):
            err = 1.0
        g.compress[name] = CompressStat(payload, pack_s, unpack_s, err, max_out)
