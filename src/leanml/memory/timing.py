"""Timing device work: the host clock read only once the device has finished.

CUDA kernels run asynchronously: ``time.perf_counter()`` around a launch measures the launch, not the
kernel. A :class:`DeviceTimer` waits for the device (``torch.cuda.synchronize``; the same call of the
device's torch module for other accelerators) before every read of the host clock, so an interval covers
the work queued inside it. On CPU there is nothing to wait for and it is the plain host clock.

Every time in :mod:`leanml.memory` goes through one: the profiler's group, op, compressor and compiled
block times (which the planner prices its options with), Adacc's planning and step times, and the
training loop's step and compile times. The synchronizing call and the clock can be handed in, so a test
can stand in a device and check that nothing reads the clock before the device was waited for::

    timer = DeviceTimer("cuda")                  # synchronize, then perf_counter
    seconds, out = timer.time(lambda: block(x))  # device work included
    with timer.measure() as t:
        loss.backward()
    t.seconds
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn

T = TypeVar("T")


def device_synchronizer(device: torch.device | str) -> Callable[[], None] | None:
    """The call that waits for ``device``'s queued work (None on CPU, or for a device type whose torch
    module has no ``synchronize``)."""
    device = torch.device(device)
    if device.type == "cpu" or device.type == "meta":
        return None
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    module = getattr(torch, device.type, None)
    sync = getattr(module, "synchronize", None)
    return sync if callable(sync) else None


@dataclass
class Elapsed:
    """Seconds of one :meth:`DeviceTimer.measure` block (set when the block ends)."""

    seconds: float = 0.0


class DeviceTimer:
    """Host clock reads that wait for ``device`` first.

    ``sync``: the waiting call (default: :func:`device_synchronizer` of ``device``; nothing on CPU);
    ``clock``: the host clock (default ``time.perf_counter``). ``syncs`` counts the waits."""

    def __init__(self, device: torch.device | str = "cpu", *, sync: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.device = torch.device(device)
        self._sync = sync if sync is not None else device_synchronizer(self.device)
        self._clock = clock
        self.syncs = 0

    @classmethod
    def for_module(cls, module: nn.Module) -> DeviceTimer:
        """A timer for the device of ``module``'s first parameter or buffer (CPU when it has none)."""
        for t in (*module.parameters(), *module.buffers()):
            return cls(t.device)
        return cls("cpu")

    @property
    def synchronizes(self) -> bool:
        """Whether this timer waits for a device (False on CPU)."""
        return self._sync is not None

    def synchronize(self) -> None:
        """Wait for the device's queued work."""
        if self._sync is not None:
            self._sync()
            self.syncs += 1

    def now(self) -> float:
        """The host clock, read after the device finished everything queued so far."""
        self.synchronize()
        return self._clock()

    def time(self, fn: Callable[[], T]) -> tuple[float, T]:
        """``(seconds, fn())``, the device work ``fn`` queued included."""
        t0 = self.now()
        out = fn()
        return self.now() - t0, out

    @contextlib.contextmanager
    def measure(self) -> Iterator[Elapsed]:
        """``with timer.measure() as t: ...`` sets ``t.seconds`` to the block's time, device work included."""
        out = Elapsed()
        t0 = self.now()
        try:
            yield out
        finally:
            out.seconds = self.now() - t0


CPU_TIMER = DeviceTimer("cpu")
