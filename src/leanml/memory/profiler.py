"""Profiling: measure what each activation group costs to keep, recompute or compress, block by block.

:func:`profile_step` records into a :class:`~leanml.memory.costs.Profile`, per group (decoder layer x
child module, plus ``_self``, ``pre``, ``post``): the bytes autograd saves (distinct storages, parameters
skipped, each storage attributed to the first group that saves it in model order), the bytes a
checkpoint of the group would have to hold (its inputs not saved elsewhere), the forward time (= the
time to recompute it), what a selective checkpoint keeps and recomputes, and for every compressor the
payload bytes, pack and unpack time, relative error and outlier ratio of its saved tensors; optionally,
per layer, the same for the block compiled at several recomputation budgets of the compiler.

It never runs an unoptimized step: the model runs forward with every block checkpointed, then each
block runs alone on its recorded inputs, so profiling needs no more memory than full checkpointing
(plus one block's saved tensors), and the unoptimized peak is the sum of what the groups save.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from tqdm.auto import tqdm

from leanml.errors import LeanmlError
from leanml.memory.compiled import compile_module_forward
from leanml.memory.compressors import (
    FLOAT_COMPRESSORS,
    bitpack,
    compressible,
    make_compressor,
    mask_scale,
    outlier_ratio,
    relative_error,
)
from leanml.memory.costs import (
    CompiledStat,
    CompressStat,
    GroupStats,
    Profile,
    copy_unmeasured,
    copy_unmeasured_compiled,
)
from leanml.memory.meter import ActivationMeter, note, param_tensors
from leanml.memory.runtime import SAC_SAVE_OPS, dense_order, wrap_checkpoint
from leanml.memory.structure import SELF, GroupKey, ScopeTracker, kind_of, param_storage_ptrs, tensors_in
from leanml.memory.timing import CPU_TIMER, DeviceTimer

log = logging.getLogger(__name__)


def _tensor_key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))


def _fresh_inputs(captured: tuple[tuple, dict]) -> tuple[tuple, dict]:
    """A block's captured inputs as new autograd leaves (same storages, same ``requires_grad``)."""
    def leaf(t: object) -> object:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            return t.detach().requires_grad_(True)
        return t

    args, kwargs = captured
    return tree_map(leaf, args), tree_map(leaf, kwargs)


def _forward_backward(fn: Callable, block: nn.Module, args: tuple, kwargs: dict) -> None:
    """One forward and backward of a block on its own (gradients returned, not accumulated)."""
    out = fn(*args, **kwargs)
    outs = [t for t in tensors_in(out) if t.requires_grad]
    if not outs:
        return
    ins = [t for t in tensors_in((args, kwargs)) if t.requires_grad]
    ins += [p for p in block.parameters() if p.requires_grad]
    torch.autograd.grad(outs, ins, grad_outputs=[torch.ones_like(o) for o in outs], allow_unused=True)


def _timed(fn: Callable[[], object], reps: int, timer: DeviceTimer) -> float:
    """Smallest time of ``reps`` runs (device work included)."""
    return min(timer.time(fn)[0] for _ in range(reps))


class _Owners:
    """Which group owns each saved storage: the group that saves it first in model order (pre, layer 0,
    ..., layer L-1, post), as in an unoptimized step."""

    def __init__(self, n_layers: int, groups: dict[GroupKey, GroupStats], params: set[int]) -> None:
        self.n_layers = n_layers
        self.groups = groups
        self.params = params
        self._owner: dict[int, tuple[StorageWeakRef, GroupKey]] = {}
        self.saved: dict[GroupKey, dict[tuple, torch.Tensor]] = {}

    def owner_of(self, t: torch.Tensor) -> GroupKey | None:
        """The group owning ``t``'s storage while that storage is alive (a freed address may be reused)."""
        entry = self._owner.get(t.untyped_storage().data_ptr())
        return None if entry is None or entry[0].expired() else entry[1]

    def rank(self, key: GroupKey) -> int:
        if key.layer is not None:
            return key.layer
        return -1 if key.child == "pre" else self.n_layers

    def group(self, key: GroupKey) -> GroupStats:
        if key not in self.groups:
            kind = kind_of(key.child) if key.layer is not None else key.child
            self.groups[key] = GroupStats(key.layer, key.child, kind)
        self.saved.setdefault(key, {})
        return self.groups[key]

    def add(self, key: GroupKey, t: torch.Tensor) -> None:
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.params:
            return
        g = self.group(key)
        prev = self.owner_of(t)
        if prev is not None and self.rank(prev) <= self.rank(key):
            return
        nb = t.untyped_storage().nbytes()
        if prev is not None:  # seen first outside the blocks (profiled earlier), but a block saves it first
            old = self.groups[prev]
            old.bytes -= nb
            old.n_tensors -= 1
            if prev in self.saved:
                self.saved[prev] = {k: v for k, v in self.saved[prev].items() if k[0] != ptr}
        self._owner[ptr] = (StorageWeakRef(t.untyped_storage()), key)
        # detached: a tensor with its graph, held where the pack hook can reach, would be a reference cycle
        self.saved[key].setdefault(_tensor_key(t), t.detach())
        g.bytes += nb
        g.n_tensors += 1
        g.max_tensor_bytes = max(g.max_tensor_bytes, nb)
        if t.dtype == torch.bool or mask_scale(t) is not None:
            g.mask_bytes += nb

    def release(self, keys: list[GroupKey]) -> dict[GroupKey, list[torch.Tensor]]:
        """Hand over (and forget) the saved tensors of ``keys``."""
        return {k: list(self.saved.pop(k, {}).values()) for k in keys}


@dataclass(frozen=True)
class ProfileOptions:
    """What :func:`profile_step` measures: the ``compressors`` (with ``outlier_frac``) on the layers
    ``compress_layers`` (None: all) and, with ``measure_outside``, on ``pre``/``post``; compiled variants
    at ``compile_budgets``; and, with ``selective``, the selective-checkpoint pass."""

    compressors: tuple[str, ...] = FLOAT_COMPRESSORS
    outlier_frac: float = 0.01
    compress_layers: list[int] | None = None
    measure_outside: bool = True
    compile_budgets: tuple[float, ...] = ()
    selective: bool = True


@dataclass(frozen=True)
class _Measure:
    """What every pass measures with: the groups' owners, the compressors (with their outlier share) and
    the timer."""

    owners: _Owners
    compressors: tuple[str, ...]
    outlier_frac: float
    timer: DeviceTimer = CPU_TIMER


def profile_step(
    model: nn.Module,
    blocks: list[nn.Module],
    run_step: Callable[[], torch.Tensor],
    options: ProfileOptions | None = None,
    *,
    progress: bool = False,
    timer: DeviceTimer | None = None,
) -> Profile:
    """Profile one step block by block, never holding more than full checkpointing does.

    ``run_step()`` runs the model's forward and returns the loss (no backward is run). First the model
    runs forward with every block checkpointed, which records the block inputs and what the code
    outside the blocks saves (``pre``/``post``); then each block runs alone on its recorded inputs with
    everything retained, to size, time and compress its groups, and once more for what a selective
    checkpoint would keep. Live activations never exceed the block inputs plus one block's saved
    tensors (measured: ``profile_peak_bytes``).

    ``options`` (:class:`ProfileOptions`, default its defaults): ``compress_layers``: layers whose
    compressors (and compiled variants) are measured (default all); other layers copy the stats of the
    nearest measured layer, scaled by bytes. ``measure_outside=False`` skips the compressors on
    ``pre``/``post``. ``compile_budgets``: also run each measured layer as a compiled block at these
    recomputation budgets of the compiler (:mod:`leanml.memory.compiled`). ``selective=False`` skips the
    selective-checkpoint pass. ``timer``: how device work is timed (default:
    :class:`~leanml.memory.timing.DeviceTimer` of the model's device, which waits for the device before
    every clock read, so the planner prices options with compute times, not launch times).
    """
    o = ProfileOptions() if options is None else options
    compressors, compress_layers, compile_budgets = o.compressors, o.compress_layers, o.compile_budgets
    timer = timer if timer is not None else DeviceTimer.for_module(model)
    t_start = timer.now()
    params = param_storage_ptrs(model)
    n_layers = len(blocks)
    groups: dict[GroupKey, GroupStats] = {}
    owners = _Owners(n_layers, groups, params)
    ctx = _Measure(owners, compressors, o.outlier_frac, timer)
    measured = set(range(n_layers)) if compress_layers is None else set(compress_layers) & set(range(n_layers))
    meter = ActivationMeter(param_tensors(model))
    with meter:
        captured = _outside_pass(model, blocks, run_step, owners)
        outside = owners.release([GroupKey(None, "pre"), GroupKey(None, "post")])
        for key in list(outside):
            tensors = outside.pop(key)
            if o.measure_outside and key in groups:
                _measure_compression(groups[key], tensors, compressors, o.outlier_frac, timer)
            del tensors
        layer_input_bytes: list[int] = []
        layer_eager_s: list[float] = [0.0] * n_layers
        compiled: dict[int, list[CompiledStat]] = {}
        compile_error = None
        for i, block in enumerate(tqdm(blocks, desc="adacc: profile", disable=not progress, leave=False)):
            if captured[i] is None:
                raise LeanmlError(f"block {i} of {n_layers} did not run in the forward pass; pass the blocks that run "
                                  "(blocks=[...]) to Adacc")
            args, kwargs = _fresh_inputs(captured[i])
            layer_input_bytes.append(_layer_input_bytes(args, kwargs, params))
            _block_pass(block, i, args, kwargs, ctx, i in measured, o.selective)
            if compile_budgets and i in measured and compile_error is None:
                try:
                    layer_eager_s[i], compiled[i] = _compiled_pass(block, i, args, kwargs, ctx, compile_budgets)
                except Exception as exc:  # noqa: BLE001 - a model the compiler cannot take keeps its eager options
                    compile_error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                    log.warning("adacc: compiling block %d failed (%s); planning without compiled options", i,
                                compile_error)
                    compiled.clear()
            del args, kwargs
            captured[i] = None  # the block input is no longer needed: free it as full checkpointing would
    copy_unmeasured(groups, measured)
    if compiled:
        copy_unmeasured_compiled(compiled, layer_eager_s, n_layers, groups)
    layer_fwd = _split_self_time(groups, n_layers)
    peak = sum(g.bytes for g in groups.values())
    return Profile(groups, n_layers, layer_input_bytes, layer_fwd, peak, tuple(compressors), meter.peak,
                   timer.now() - t_start, compiled, layer_eager_s, compile_error,
                   measured_layers=sorted(measured), layer_kinds=[type(b).__qualname__ for b in blocks])


def unoptimized_peak(model: nn.Module, blocks: list[nn.Module], run_step: Callable[[], torch.Tensor]) -> int:
    """Peak saved-activation bytes of an unoptimized training step, computed block by block (the sum
    :func:`profile_step` reports as ``peak_bytes``) without ever running that step."""
    options = ProfileOptions(compressors=(), measure_outside=False, selective=False)
    return profile_step(model, blocks, run_step, options).peak_bytes


def _outside_pass(model: nn.Module, blocks: list[nn.Module], run_step: Callable[[], torch.Tensor],
                  owners: _Owners) -> list[tuple[tuple, dict] | None]:
    """Forward with every block checkpointed: record block inputs and the ``pre``/``post`` saves."""
    captured: list[tuple[tuple, dict] | None] = [None] * len(blocks)

    def capture(i: int) -> Callable:
        def hook(mod: nn.Module, args: tuple, kwargs: dict) -> None:
            if torch.is_grad_enabled() and captured[i] is None:
                captured[i] = (args, kwargs)
        return hook

    handles = [b.register_forward_pre_hook(capture(i), with_kwargs=True) for i, b in enumerate(blocks)]
    undo = [wrap_checkpoint(b) for b in blocks]
    tracker = ScopeTracker(model, blocks, skip_children=frozenset(range(len(blocks))))

    def pack(t: torch.Tensor) -> torch.Tensor:
        note(t)
        key = tracker.current()
        if key.layer is None:
            owners.add(key, t)
        return t.detach()  # no backward runs: a saved output must not hold its own graph node

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = run_step()
        del loss
    finally:
        tracker.remove()
        for u in undo:
            u()
        for h in handles:
            h.remove()
    return captured


def _layer_input_bytes(args: tuple, kwargs: dict, params: set[int]) -> int:
    uniq = {}
    for t in tensors_in((args, kwargs)):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            uniq[st.data_ptr()] = st.nbytes()
    return sum(uniq.values())


def _block_pass(block: nn.Module, layer: int, args: tuple, kwargs: dict, ctx: _Measure, measure: bool,
                selective: bool) -> None:
    """Run one block with everything retained: bytes, inputs and forward time per group; compression
    stats (when ``measure``); then the selective-checkpoint costs."""
    owners, timer = ctx.owners, ctx.timer
    inputs: dict[GroupKey, list[torch.Tensor]] = {}
    starts: dict[GroupKey, float] = {}

    def on_enter(key: GroupKey, mod: nn.Module, a: tuple, kw: dict) -> None:
        owners.group(key)
        if key.child != SELF:
            inputs[key] = [t.detach() for t in tensors_in((a, kw))
                           if t.untyped_storage().data_ptr() not in owners.params]
        starts[key] = timer.now()

    def on_exit(key: GroupKey, mod: nn.Module, output: object) -> None:
        now = timer.now()
        owners.groups[key].fwd_s += now - starts.pop(key, now)

    tracker = ScopeTracker(None, [block], on_enter, on_exit, layers=[layer])

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in owners.params:
            note(t)
            owners.add(tracker.current(), t)
        return t.detach()

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = block(*args, **kwargs)
        del out
    finally:
        tracker.remove()
    keys = [k for k in owners.groups if k.layer == layer]
    for key, ins in inputs.items():  # bytes a checkpoint of the group holds: inputs no other group saved
        seen: set[int] = set()
        for t in ins:
            ptr = t.untyped_storage().data_ptr()
            owner = owners.owner_of(t)
            if ptr in seen or (owner is not None and owner != key):
                continue
            seen.add(ptr)
            owners.groups[key].input_bytes += t.untyped_storage().nbytes()
    released = owners.release(keys)
    for key in keys:
        tensors = released.pop(key, [])
        if measure:
            _measure_compression(owners.groups[key], tensors, ctx.compressors, ctx.outlier_frac, timer)
        del tensors  # each group's tensors die once measured
    if selective:
        _selective_costs(block, layer, args, kwargs, owners.groups, timer)


def _compiled_pass(block: nn.Module, layer: int, args: tuple, kwargs: dict, ctx: _Measure,
                   budgets: tuple[float, ...], reps: int = 3) -> tuple[float, list[CompiledStat]]:
    """Eager forward+backward time of the block, then per compile budget: what the compiled block saves,
    its forward+backward time, and its compressors."""
    owners, timer = ctx.owners, ctx.timer
    eager_s = _timed(lambda: _forward_backward(block, block, args, kwargs), reps, timer)
    stats = []
    for budget in budgets:
        undo = compile_module_forward(block, budget)
        try:
            saved, pack = _save_collector(owners, layer)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                compile_s, _ = timer.time(lambda: _forward_backward(block, block, args, kwargs))
            nbytes = sum(t.untyped_storage().nbytes() for t in saved.values())
            biggest = max((t.untyped_storage().nbytes() for t in saved.values()), default=0)
            stat = CompiledStat(budget, nbytes, biggest, _timed(lambda: _forward_backward(block, block, args, kwargs),
                                                               reps, timer) - eager_s, compile_s)
            g = GroupStats(layer, f"compiled@{budget:g}", "compiled")
            _measure_compression(g, list(saved.values()), ctx.compressors, ctx.outlier_frac, timer)
            stat.compress = {k: v for k, v in g.compress.items() if k != "bitpack"}
            saved.clear()
            stats.append(stat)
        finally:
            undo()
    return eager_s, stats


def _save_collector(owners: _Owners, layer: int) -> tuple[dict[int, torch.Tensor], Callable]:
    """A pack hook keeping one tensor per saved storage that no other layer owns (params skipped)."""
    saved: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr in owners.params:
            return t
        note(t)
        owner = owners.owner_of(t)
        if owner is None or owner.layer == layer:
            saved.setdefault(ptr, t.detach())
        return t.detach()

    return saved, pack


def _split_self_time(groups: dict[GroupKey, GroupStats], n_layers: int) -> list[float]:
    """Per layer forward time; each block's own (``_self``) time then excludes its children."""
    layer_fwd = [groups[GroupKey(i, SELF)].fwd_s if GroupKey(i, SELF) in groups else 0.0 for i in range(n_layers)]
    for key, g in groups.items():
        if key.child == SELF and key.layer is not None:
            g.fwd_s = max(0.0, g.fwd_s - sum(c.fwd_s for k, c in groups.items()
                                             if k.layer == key.layer and k.child != SELF))
    return layer_fwd


class _OpTimer(TorchDispatchMode):
    """Times every op (device work included) and sizes matmul/attention outputs, per group (for selective
    recomputation)."""

    def __init__(self, tracker: ScopeTracker, timer: DeviceTimer = CPU_TIMER) -> None:
        super().__init__()
        self.tracker = tracker
        self.timer = timer
        self.saved: dict[GroupKey, dict[int, int]] = {}
        self.other_s: dict[GroupKey, float] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        dt, out = self.timer.time(lambda: func(*args, **(kwargs or {})))
        key = self.tracker.current()
        if func in SAC_SAVE_OPS:
            store = self.saved.setdefault(key, {})
            for t in tensors_in(out):
                st = t.untyped_storage()
                store[st.data_ptr()] = st.nbytes()
        else:
            self.other_s[key] = self.other_s.get(key, 0.0) + dt
        return out


def _selective_costs(block: nn.Module, layer: int, args: tuple, kwargs: dict,
                     groups: dict[GroupKey, GroupStats], timer: DeviceTimer = CPU_TIMER) -> None:
    """One extra forward of the block that fills ``sel_saved_bytes`` / ``sel_recompute_s`` of its groups."""
    tracker = ScopeTracker(None, [block], layers=[layer])
    op_timer = _OpTimer(tracker, timer)

    def pack(t: torch.Tensor) -> torch.Tensor:
        note(t)
        return t.detach()

    try:
        with op_timer, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = block(*args, **kwargs)
        del out
    finally:
        tracker.remove()
    for key, g in groups.items():
        if key.layer == layer:
            g.sel_saved_bytes = sum(op_timer.saved.get(key, {}).values())
            g.sel_recompute_s = op_timer.other_s.get(key, 0.0)


def _measure_compression(g: GroupStats, tensors: list[torch.Tensor], compressors: tuple[str, ...],
                         outlier_frac: float, timer: DeviceTimer = CPU_TIMER) -> None:
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
                dt, p = timer.time(lambda t=t, scale=scale: bitpack(t, scale))
                payload += p.nbytes
                pack_s += dt
                max_out = max(max_out, nb)
            elif comp is not None and comp.applies(t):
                perm = dense_order(t)  # as the runtime: whole storage in memory order when possible
                src = t.permute(perm) if perm is not None else t
                dt, p = timer.time(lambda src=src, comp=comp: comp.pack(src))
                note(p.tensors)
                du, y = timer.time(lambda p=p, comp=comp: comp.unpack(p))
                note(y)
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

