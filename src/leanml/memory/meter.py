"""Honest peak saved-activation memory on any device.

:class:`ActivationMeter` counts, at every moment of a training step, the bytes of the distinct storages
that hold activations:

* everything autograd saves (a ``saved_tensors_hooks`` pack hook), de-duplicated by storage and
  skipping parameters and buffers;
* what a compression hook stores instead (payloads, reported by the runtime through :func:`note`);
* inputs held by checkpointed regions (checkpoint saves them through autograd, so the hook sees them);
* outputs kept by selective checkpointing policies;
* the transient recompute workspace: every tensor created while a checkpointed region is recomputed
  during backward, and every tensor rebuilt by decompression, for as long as it is alive.

Liveness is tracked with weak references to the storages, polled at every event, so the peak is exact
at event granularity. On CUDA, ``torch.cuda.max_memory_allocated`` is reported alongside.

:class:`AllocatorPeak` measures something else, for a cross-check: every byte the device allocator hands
out during a region, above what was allocated when it began (activations, gradients, optimizer state,
and the workspace inside compiled kernels that no saved-tensors hook sees). On CUDA it reads
``torch.cuda.max_memory_allocated``; on CPU it replays the allocation events of the torch profiler
(``profile_memory=True``), which slows the region down, so it is meant for one extra, untimed step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_ACTIVE: list[ActivationMeter] = []
# the storage-expiry check in C (private; StorageWeakRef.expired, public, wraps it when it is missing)
_EXPIRED = getattr(torch.UntypedStorage, "_expired", None)


def active_meter() -> ActivationMeter | None:
    """The innermost active meter, or None."""
    return _ACTIVE[-1] if _ACTIVE else None


def note(obj: object) -> None:
    """Report tensors (any nesting of tensors) that are now held as activations to the active meter."""
    if _ACTIVE:
        _ACTIVE[-1].track(obj)


class ActivationMeter:
    """Tracks live activation storages and their peak total. Use as a context manager around a step."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = 0  # bytes of tracked storages, dead ones included until the next sweep
        self.peak = 0
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._cuda_start = 0
        self._cuda_peak: int | None = None
        self.cuda_max_allocated: int | None = None  # CUDA: max_memory_allocated over the region, absolute

    # ------------------------------------------------------------------ bookkeeping
    def _sweep(self) -> None:
        expired = _EXPIRED
        if expired is not None:  # the C check, without StorageWeakRef's Python wrapper
            dead = [k for k, (ref, _) in self._live.items() if expired(ref.cdata)]
        else:
            dead = [k for k, (ref, _) in self._live.items() if ref.expired()]
        for k in dead:
            self.current -= self._live.pop(k)[1]

    def track(self, obj: object) -> None:
        """Count every tensor in ``obj`` whose storage is not yet counted (and not a parameter)."""
        added = False
        for t in tree_leaves(obj):
            if not isinstance(t, torch.Tensor) or t.is_meta:
                continue
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            key = st.data_ptr()
            if key in self._exclude or st.nbytes() == 0:
                continue
            entry = self._live.get(key)
            if entry is not None:
                if not entry[0].expired():
                    continue
                self.current -= self._live.pop(key)[1]  # a freed address reused by a new storage
            self._live[key] = (StorageWeakRef(st), st.nbytes())
            self.current += st.nbytes()
            added = True
        # ``current`` only over-counts (storages freed since the last sweep), so the peak can only move
        # when it exceeds the peak: sweep then, and the peak stays exact at event granularity
        if added and self.current > self.peak:
            self._sweep()
            self.peak = max(self.peak, self.current)

    # ------------------------------------------------------------------ context
    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.track(t)
        return t.detach()  # the tensor itself would make a cycle with the node saving its own output

    def __enter__(self) -> ActivationMeter:
        _ACTIVE.append(self)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            self._cuda_start = torch.cuda.memory_allocated()
        self._cuda_peak = self.cuda_max_allocated = None
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(*exc)
        _ACTIVE.remove(self)
        if torch.cuda.is_available():  # frozen here: what runs after the region (an optimizer step) is not in it
            self.cuda_max_allocated = torch.cuda.max_memory_allocated()
            self._cuda_peak = self.cuda_max_allocated - self._cuda_start

    @property
    def cuda_peak(self) -> int | None:
        """Peak CUDA bytes allocated above the start of the region (``max_memory_allocated``, read when the
        region ends or, inside it, now; None on CPU). The allocator's counters are kept on the host at
        allocation time, so no device synchronization is needed to read them."""
        if not torch.cuda.is_available():
            return None
        if self._cuda_peak is not None:
            return self._cuda_peak
        return torch.cuda.max_memory_allocated() - self._cuda_start


class _TrackOutputs(TorchDispatchMode):
    """Reports every op output to the active meter (recompute workspace)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        note(out)
        return out


@contextlib.contextmanager
def track_outputs() -> Iterator[None]:
    """Inside, every tensor created is counted by the active meter (no-op without a meter)."""
    if not _ACTIVE:
        yield
        return
    with _TrackOutputs():
        yield


class AllocatorPeak:
    """Peak bytes allocated on ``device`` above the start of the ``with`` region (``self.peak``).

    CUDA: ``max_memory_allocated`` after ``reset_peak_memory_stats``, minus ``memory_allocated`` at the
    start (an :class:`ActivationMeter` entered inside resets the peak again; nothing is lost as long as
    nothing is allocated between the two, as in a training step). CPU: the running sum of the torch
    profiler's allocation and free events, in time order (the CPU allocator reports every allocation,
    including buffers of compiled kernels). The profiler drops frees of memory allocated before the
    region, so on CPU ``peak`` is an upper bound: memory handed back from earlier allocations is not
    credited. ``events``: allocation and free events seen (CPU)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.peak = 0
        self.events = 0
        self._start = 0
        self._prof: torch.profiler.profile | None = None

    def __enter__(self) -> AllocatorPeak:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = max(0, torch.cuda.max_memory_allocated(self.device) - self._start)
            return
        assert self._prof is not None
        self._prof.__exit__(*exc)
        events = [e for e in self._prof.profiler.kineto_results.events()
                  if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
        events.sort(key=lambda e: e.start_ns())
        total = peak = 0
        for e in events:
            total += e.nbytes()
            peak = max(peak, total)
        self.peak, self.events = peak, len(events)
        self._prof = None


def param_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """Parameters and buffers of a module (what a meter must not count)."""
    return [p for p in module.parameters()] + [b for b in module.buffers()]
