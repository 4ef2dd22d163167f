"""Where the engine's activation streams live between layers, and its resume checkpoints.

:class:`Place` decides and moves: the streams stay on the compute device while its free memory allows
(:func:`stream_home`), else in (pinned) host memory with each batch's copy issued one batch ahead.
:class:`Checkpointer` writes finished layers and stream snapshots on a background thread.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from leanml.utils import LeanmlError, atomic_file


def batch_ranges(n: int, batch_size: int) -> list[tuple[int, int, int]]:
    return [(b, s, min(s + batch_size, n)) for b, s in enumerate(range(0, n, batch_size))]



def settings_fingerprint(meta: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(meta, sort_keys=True, default=str).encode()).hexdigest()[:16]


def atomic_save(obj: Any, path: Path) -> None:
    with atomic_file(path) as tmp:
        torch.save(obj, tmp)


class Streams:
    """Pruned and dense activations entering the current layer (one row per window), on the streams'
    home device (:class:`Place`)."""

    def __init__(self, pruned: torch.Tensor, dense: torch.Tensor | None) -> None:
        self.pruned = pruned
        self.dense = dense  # None: no separate dense stream (dense-input mode, or nothing needs it)

    def dense_or_pruned(self) -> torch.Tensor:
        return self.pruned if self.dense is None else self.dense


# --------------------------------------------------------------------------------------------------
# where the activation streams live


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


class Checkpointer:
    """Writes resume checkpoints on a background thread, off the layer walk's critical path.

    Each finished layer's weights are snapshotted to the host at once and written behind the walk; the
    activation streams (the big part) are snapshotted after the first layer, then every ``interval``
    seconds (0: after every layer), and always after the last layer. Files are written in order, each atomically, so a kill leaves a
    consistent checkpoint: ``state.pt`` names the next layer only after the layers before it are on
    disk. :meth:`close` waits for every pending write and raises the first error one raised."""

    def __init__(self, ckpt: Path, interval: float) -> None:
        from concurrent.futures import ThreadPoolExecutor

        ckpt.mkdir(parents=True, exist_ok=True)
        self.ckpt = ckpt
        self.interval = interval
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="leanml-ckpt")
        self.pending: list[Any] = []
        self.last_state = float("-inf")  # the first finished layer is always snapshotted

    def layer(self, idx: int, layer: nn.Module) -> None:
        sd = {k: v.detach().to("cpu", copy=True) for k, v in layer.state_dict().items()}
        self.pending.append(self.pool.submit(atomic_save, sd, self.ckpt / f"layer_{idx:03d}.pt"))

    def state(self, make: Any, last: bool) -> None:
        """Snapshot the state ``make()`` returns when due (``last``: always)."""
        now = time.perf_counter()
        if not last and now - self.last_state < self.interval:
            return
        self.last_state = now
        self._wait()  # at most one stream snapshot in flight: bounded memory
        state = make()

        def write() -> None:
            atomic_save({k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in state.items()},
                         self.ckpt / "state.pt")

        self.pending.append(self.pool.submit(write))

    def _wait(self) -> None:
        done, self.pending = self.pending, []
        for f in done:
            f.result()

    def close(self) -> None:
        try:
            self._wait()
        finally:
            self.pool.shutdown(wait=True)
