"""Where the engine's activation streams live between layers.

:class:`Place` decides and moves: the streams stay on the compute device while its free memory allows
(:func:`stream_home`), else in (pinned) host memory with each batch's copy issued one batch ahead.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from leanml.errors import LeanmlError


def batch_ranges(n: int, batch_size: int) -> list[tuple[int, int, int]]:
    """``(b, start, end)`` of every batch of ``n`` rows."""
    return [(b, s, min(s + batch_size, n)) for b, s in enumerate(range(0, n, batch_size))]


class Streams:
    """Pruned and dense activations entering the current layer (one row per window), on the streams'
    home device (:class:`Place`)."""

    def __init__(self, pruned: torch.Tensor, dense: torch.Tensor | None) -> None:
        self.pruned = pruned
        self.dense = dense  # None: no separate dense stream (dense-input mode, or nothing needs it)

    def dense_or_pruned(self) -> torch.Tensor:
        return self.pruned if self.dense is None else self.dense


@dataclass
class LayerFeed:
    """What one decoder layer's calibration passes read: the activation streams entering it, each
    batch's keyword arguments (on the compute device), the batch size and where the streams live."""

    streams: Streams
    kw: list[dict[str, Any]]
    batch_size: int
    place: Place


def sync_device(device: torch.device) -> None:
    """Wait for ``device``'s queued work, so a host clock read after it measures that work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Place:
    """Where layers compute (``device``) and where the activation streams live between layers
    (``home``): the compute device itself while its free memory allows (no copies at all), otherwise
    the host, in pinned memory when the device is a GPU, each batch's copy to the device issued one
    batch ahead on a side stream so it overlaps the current batch's compute, and the outputs copied
    back without blocking."""

    def __init__(self, device: torch.device, home: torch.device) -> None:
        self.device = device
        self.home = home
        self.pinned = home.type == "cpu" and device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(device) if self.pinned else None

    def adopt(self, x: torch.Tensor | None) -> torch.Tensor | None:
        """``x`` moved to the streams' home (pinned there when the device is a GPU)."""
        if x is None:
            return None
        if self.pinned:
            return x if x.is_pinned() else x.cpu().pin_memory()
        return x.to(self.home)

    def keep(self, x: torch.Tensor) -> torch.Tensor:
        """A device tensor kept at home until a later pass (a copy when home is elsewhere)."""
        return x.detach().to(self.home, copy=x.device != self.home)

    def feed(self, x: torch.Tensor, batch_size: int) -> Iterator[tuple[int, int, int, torch.Tensor]]:
        """``(b, start, end, x[start:end] on the device)`` for every batch of ``x``."""
        batches = batch_ranges(x.shape[0], batch_size)
        if x.device == self.device or not (self.pinned and x.is_pinned()):
            for b, s, e in batches:
                yield b, s, e, x[s:e].to(self.device)
            return
        stream = self._copy_stream
        assert stream is not None

        def start(s: int, e: int) -> tuple[torch.Tensor, torch.cuda.Event]:
            with torch.cuda.stream(stream):
                t = x[s:e].to(self.device, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
            return t, ev

        nxt = start(*batches[0][1:])
        for i, (b, s, e) in enumerate(batches):
            cur, ev = nxt
            if i + 1 < len(batches):
                nxt = start(*batches[i + 1][1:])
            torch.cuda.current_stream(self.device).wait_event(ev)
            cur.record_stream(torch.cuda.current_stream(self.device))
            yield b, s, e, cur

    def sink(self, n: int) -> Sink:
        return Sink(n, self)


class Sink:
    """Collects a pass's per-batch device outputs into one tensor of ``n`` rows at home."""

    def __init__(self, n: int, place: Place) -> None:
        self.n = n
        self.place = place
        self.buf: torch.Tensor | None = None

    def put(self, s: int, e: int, y: torch.Tensor) -> None:
        if self.buf is None:
            self.buf = torch.empty((self.n, *y.shape[1:]), dtype=y.dtype, device=self.place.home,
                                   pin_memory=self.place.pinned)
        self.buf[s:e].copy_(y, non_blocking=self.place.pinned)

    def result(self) -> torch.Tensor:
        assert self.buf is not None
        if self.place.pinned:  # the copies back were not waited for
            torch.cuda.current_stream(self.place.device).synchronize()
        return self.buf


def stream_home(device: torch.device, stream_bytes: int, stream_device: str = "auto") -> torch.device:
    """Where the activation streams live: ``"cpu"`` (host), ``"device"`` (the compute device), or
    ``"auto"``: the compute device when it is a GPU whose free memory holds the streams twice over
    (each layer's input and output) with half the free memory to spare, else the host."""
    if stream_device not in ("auto", "device", "cpu"):
        raise LeanmlError(f"stream_device must be auto, device or cpu, got {stream_device!r}")
    if device.type == "cpu" or stream_device == "cpu":
        return torch.device("cpu")
    if stream_device == "device":
        return device
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return device if 2 * stream_bytes <= free // 2 else torch.device("cpu")
    return torch.device("cpu")
