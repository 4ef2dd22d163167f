"""Applying a memory plan to a live model.

* **Recompute** a group or a whole layer: the module's ``forward`` is wrapped in non-reentrant
  ``torch.utils.checkpoint`` (RNG state preserved, so dropout masks are replayed exactly).
* **Compress** a group: one ``saved_tensors_hooks`` pair, pushed for the model's forward, packs every
  tensor autograd saves while that group runs with the group's compressor and unpacks it in backward.
  Repeated saves of one tensor share one payload; one payload is decompressed once per backward use.
* **Compiled** layers (``compiled@b``): the block's ``forward`` is compiled with the compiler's own
  recomputation at budget ``b`` (:mod:`leanml.memory.compiled`); ``compiled@b+X`` also compresses what
  the compiled graph saves with compressor ``X``.
* **Retain** otherwise.

Baseline strategies for comparison share the same machinery: ``checkpoint`` (every layer),
``sac`` (every layer with torch's selective checkpointing: save matmul and attention outputs,
recompute pointwise ops).
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from leanml.memory.compiled import compile_module_forward, parse_compiled_option
from leanml.memory.compressors import (
    Compressor,
    Packed,
    bitpack,
    bitunpack,
    make_compressor,
    mask_scale,
    outlier_ratio,
    relative_error,
)
from leanml.memory.meter import active_meter, note, track_outputs
from leanml.memory.structure import SELF, GroupKey, ScopeTracker, param_storage_ptrs

RETAIN = "retain"
RECOMPUTE = "recompute"
SELECTIVE = "selective"  # recompute the group's pointwise ops, keep its matmul and attention outputs
BITPACK = "bitpack"



def _aten_ops(*names: str) -> set:
    """The default overloads of these aten ops that this torch has (attention kernels come and go)."""
    ops = set()
    for name in names:
        packet = getattr(torch.ops.aten, name, None)
        op = getattr(packet, "default", None) if packet is not None else None
        if op is not None:
            ops.add(op)
    return ops


SAC_SAVE_OPS = _aten_ops("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention_for_cpu",
                         "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
                         "_scaled_dot_product_cudnn_attention")


def _sac_context_has_output() -> bool:
    """Whether torch hands the op's output to selective-checkpoint policies (``ctx.op_output``: newer
    releases call the policy after the op ran; older ones before, with ``is_recompute`` only)."""
    cls = getattr(torch.utils.checkpoint, "SelectiveCheckpointContext", None)
    try:
        return cls is not None and "op_output" in inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return False


SAC_CTX_HAS_OUTPUT = _sac_context_has_output()
# newer torch asks whether the surrounding saved_tensors_hooks see what selective checkpointing saves (and
# warns that the default will flip): here they must not (the meter notes those outputs itself, and a
# selective group's kept outputs are not compressed), as on every torch before the question existed
SAC_HOOKS_KWARGS = ({"respect_saved_tensors_hooks": False}
                    if "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters else {})


def sac_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:  # noqa: ANN001
    """The standard selective-checkpointing policy: save matmuls and attention, recompute the rest.

    Reads only ``ctx.is_recompute`` (every torch has it). Where the context also carries the op's output
    (``op_output``), the output is reported to the active meter here; elsewhere :func:`_sac_context`
    stacks :class:`_NoteSaved` to report it."""
    if func in SAC_SAVE_OPS:
        if not getattr(ctx, "is_recompute", False):
            out = getattr(ctx, "op_output", None)
            if out is not None:
                note(out)
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class _NoteSaved(TorchDispatchMode):
    """Reports the outputs of the ops :func:`sac_policy` saves to the active meter (for a torch whose
    selective-checkpoint context has no ``op_output``). Entered above torch's caching mode, it sees each
    op first and its output as that mode returns it."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        if func in SAC_SAVE_OPS:
            note(out)
        return out


def _plain_context() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    return contextlib.nullcontext(), track_outputs()


@contextlib.contextmanager
def _stack(*cms: contextlib.AbstractContextManager) -> Iterator[None]:
    with contextlib.ExitStack() as es:
        for cm in cms:
            es.enter_context(cm)
        yield


def _sac_context() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    fwd, rec = create_selective_checkpoint_contexts(sac_policy)
    if not SAC_CTX_HAS_OUTPUT and active_meter() is not None:
        if hasattr(fwd, "respect_saved_tensors_hooks"):  # checkpoint sets it only on torch's own mode
            fwd.respect_saved_tensors_hooks = False
        fwd = _stack(fwd, _NoteSaved())
    return fwd, _stack(rec, track_outputs())


def wrap_checkpoint(module: nn.Module, selective: bool = False) -> Callable[[], None]:
    """Make ``module`` recompute its forward in backward; returns a function that undoes it."""
    orig = module.forward
    context_fn = _sac_context if selective else _plain_context
    extra = SAC_HOOKS_KWARGS if selective else {}

    def forward(*args, **kwargs):  # noqa: ANN202
        if not torch.is_grad_enabled():
            return orig(*args, **kwargs)
        # checkpoint keeps keyword inputs (Hugging Face passes hidden states, masks and position
        # embeddings to attention by keyword) in a closure, not as saved tensors: count them here
        note(kwargs)
        return checkpoint(orig, *args, use_reentrant=False, context_fn=context_fn, **extra, **kwargs)

    module.forward = forward

    def undo() -> None:
        if module.__dict__.get("forward") is forward:
            del module.forward

    return undo


def dense_order(t: torch.Tensor) -> list[int] | None:
    """A permutation making ``t`` contiguous when ``t`` covers its whole storage densely (possibly
    transposed), else None. Such a tensor is compressed in memory order, once per storage."""
    if t.dim() == 0 or t.storage_offset() != 0 or t.numel() * t.element_size() != t.untyped_storage().nbytes():
        return None
    perm = sorted(range(t.dim()), key=lambda d: -t.stride(d))
    return perm if t.permute(perm).is_contiguous() else None


@dataclass
class DriftStats:
    """Errors and outlier ratios sampled at run time, per group label."""

    error: dict[str, float] = field(default_factory=dict)
    outlier: dict[str, float] = field(default_factory=dict)


class CompressionHooks:
    """One pack/unpack pair that compresses what each group saves with that group's compressor."""

    def __init__(self, tracker: ScopeTracker, compressors: dict[GroupKey, Compressor | None],
                 params: set[int], mask_groups: set[GroupKey] | None = None) -> None:
        self.tracker = tracker
        self.mask_groups = mask_groups or set()
        self.compressors = compressors
        self.params = params
        self._cache: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._owners: dict[int, tuple[StorageWeakRef, GroupKey]] = {}
        self._owners_clean = 256
        self.sample = False  # when True, measure error and outliers of the next packs (drift tracking)
        self.drift = DriftStats()

    def pack(self, t: torch.Tensor) -> object:
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.params:
            return t
        key = self._owner(ptr, t)
        comp = self.compressors.get(key)
        if comp is None:
            note(t)
            return t.detach()  # not ``t``: a saved output would hold its own graph node (a reference cycle)
        scale = mask_scale(t) if key in self.mask_groups and t.dtype != torch.bool else None
        if t.dtype == torch.bool or scale is not None:
            ck = ("b", ptr, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t._version)
            p = self._lookup(ck)
            if p is None:
                p = bitpack(t, scale)
                self._store(ck, p, t)
                note(p.tensors)
            return p
        if comp.name == BITPACK or not comp.applies(t):
            note(t)
            return t.detach()
        perm = dense_order(t)
        if perm is not None:  # one payload per storage, in memory order; each view rebuilt with as_strided
            ck = (comp.name, ptr, t.dtype, t._version)
            src = t.permute(perm)
        else:
            ck = (comp.name, ptr, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t._version)
            src = t
        p = self._lookup(ck)
        if p is None:
            p = comp.pack(src)
            p.__dict__["_comp"] = comp
            self._store(ck, p, t)
            note(p.tensors)
            if self.sample:
                label = key.label()
                err = relative_error(src, comp.unpack(p))
                self.drift.error[label] = max(self.drift.error.get(label, 0.0), err)
                self.drift.outlier[label] = max(self.drift.outlier.get(label, 0.0), outlier_ratio(src))
        if perm is not None:
            return (p, tuple(t.shape), tuple(t.stride()))
        return p

    def _owner(self, ptr: int, t: torch.Tensor) -> GroupKey:
        """The group that first saved this (still alive) storage decides how it is stored, as in the
        profile's attribution: a tensor retained by one group is not compressed again by another."""
        entry = self._owners.get(ptr)
        if entry is not None and not entry[0].expired():
            return entry[1]
        key = self.tracker.current()
        self._owners[ptr] = (StorageWeakRef(t.untyped_storage()), key)
        if len(self._owners) > 4 * self._owners_clean:
            self._owners = {k: v for k, v in self._owners.items() if not v[0].expired()}
            self._owners_clean = max(256, len(self._owners))
        return key

    def _lookup(self, key: tuple) -> Packed | None:
        """A payload already made for this very tensor: same storage, still alive (a freed storage's
        address may be reused by a different tensor)."""
        p = self._cache.get(key)
        if p is not None and p.__dict__["_src"].expired():
            return None
        return p

    def _store(self, key: tuple, p: Packed, t: torch.Tensor) -> None:
        p.__dict__["_src"] = StorageWeakRef(t.untyped_storage())
        self._cache[key] = p

    def unpack(self, obj: object) -> torch.Tensor:
        if isinstance(obj, tuple):
            p, shape, stride = obj
            return self._decompress(p).as_strided(shape, stride)
        if not isinstance(obj, Packed):
            return obj  # type: ignore[return-value]
        return self._decompress(obj)

    def _decompress(self, obj: Packed) -> torch.Tensor:
        ref = obj.__dict__.get("_out")
        out = ref() if ref is not None else None
        if out is None:
            out = bitunpack(obj) if obj.method == BITPACK else obj.__dict__["_comp"].unpack(obj)
            obj.__dict__["_out"] = weakref.ref(out)
            note(out)
        return out


@dataclass(frozen=True)
class Compression:
    """How :class:`AppliedPlan` compresses: the share of outliers the compressors keep exact
    (``outlier_frac``), and the groups whose saved masks are bit-packed (``mask_groups``)."""

    outlier_frac: float = 0.01
    mask_groups: frozenset[GroupKey] | set[GroupKey] = frozenset()


class AppliedPlan:
    """Hooks and wrappers installed on a model; :meth:`remove` restores it.

    ``layer_checkpoint[l]``: recompute layer ``l`` as a whole; ``layer_modes[l]`` (optional) may instead
    name a compiled mode (``compiled@0.5`` or ``compiled@0.5+int8-token``) for the layer. ``options``
    maps groups to ``retain`` / ``recompute`` / ``selective`` / a compressor name, compressed as
    ``compression`` says (:class:`Compression`; default its defaults). With
    ``model_hooks=False`` the caller drives the compression scope with :meth:`enter` / :meth:`exit`
    around each forward of the model (Adacc does, from its own model hooks).
    """

    def __init__(self, model: nn.Module, blocks: list[nn.Module], layer_checkpoint: list[bool],
                 options: dict[GroupKey, str], compression: Compression | None = None, selective: bool = False,
                 layer_modes: list[str] | None = None, model_hooks: bool = True) -> None:
        compression = Compression() if compression is None else compression
        outlier_frac = compression.outlier_frac
        self.model = model
        self.blocks = blocks
        disable_kv_cache(model)
        self.layer_checkpoint = list(layer_checkpoint)
        self.options = dict(options)
        self.layer_modes = list(layer_modes) if layer_modes is not None else [""] * len(blocks)
        self._undo: list[Callable[[], None]] = []
        children = [dict(b.named_children()) for b in blocks]
        comps: dict[GroupKey, Compressor | None] = {}
        compiled: set[int] = set()
        for i, ck in enumerate(layer_checkpoint):
            mode = parse_compiled_option(self.layer_modes[i]) if self.layer_modes[i] else None
            if mode is not None:
                budget, comp = mode
                self._undo.append(compile_module_forward(blocks[i], budget))
                compiled.add(i)
                if comp is not None:
                    comps[GroupKey(i, SELF)] = make_compressor(comp, outlier_frac)
            elif ck:
                self._undo.append(wrap_checkpoint(blocks[i], selective=selective))
        whole = {i for i, ck in enumerate(layer_checkpoint) if ck} | compiled
        for key, opt in options.items():
            if key.layer is not None and key.layer in whole:
                continue
            if opt in (RECOMPUTE, SELECTIVE):
                if key.layer is None or key.child not in children[key.layer]:
                    raise ValueError(f"group {key.label()} cannot be recomputed (not a module)")
                self._undo.append(wrap_checkpoint(children[key.layer][key.child], selective=opt == SELECTIVE))
            elif opt == BITPACK:
                comps[key] = Compressor(BITPACK, bitpack, bitunpack, lossless=True)
            elif opt != RETAIN:
                comps[key] = make_compressor(opt, outlier_frac)
        self.tracker: ScopeTracker | None = None
        self.hooks: CompressionHooks | None = None
        self._ctx: torch.autograd.graph.saved_tensors_hooks | None = None
        if comps:
            self.tracker = ScopeTracker(model if model_hooks else None, blocks, skip_children=compiled)
            self.hooks = CompressionHooks(self.tracker, comps, param_storage_ptrs(model), set(compression.mask_groups))
            self._undo.append(self.tracker.remove)
            if model_hooks:
                h1 = model.register_forward_pre_hook(lambda module, args: self.enter())
                h2 = model.register_forward_hook(lambda module, args, output: self.exit(), always_call=True)
                self._undo += [h1.remove, h2.remove]

    def enter(self) -> None:
        """Open the compression scope for one forward of the model (no-op without compressed groups)."""
        if self.hooks is None:
            return
        if self._ctx is not None:  # a previous forward raised before its exit hook
            self.exit()
        assert self.tracker is not None
        self.tracker.reset()
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self.hooks.pack, self.hooks.unpack)
        self._ctx.__enter__()

    def exit(self) -> None:
        """Close the compression scope opened by :meth:`enter`."""
        if self._ctx is not None:
            self._ctx.__exit__(None, None, None)
            self._ctx = None

    def remove(self) -> None:
        """Undo every wrapper and hook."""
        self.exit()
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


def disable_kv_cache(model: nn.Module) -> None:
    """Turn off a Hugging Face model's KV cache: recomputation would fill it a second time."""
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        config.use_cache = False


def apply_strategy(model: nn.Module, blocks: list[nn.Module], strategy: str) -> AppliedPlan:
    """Install a baseline: ``none``, ``checkpoint`` (every layer) or ``sac`` (selective, every layer)."""
    n = len(blocks)
    if strategy == "none":
        return AppliedPlan(model, blocks, [False] * n, {})
    if strategy == "checkpoint":
        return AppliedPlan(model, blocks, [True] * n, {})
    if strategy == "sac":
        return AppliedPlan(model, blocks, [True] * n, {}, selective=True)
    raise ValueError(f"unknown strategy {strategy!r}; choose none, checkpoint or sac")
