"""A per-batch memory arena: one preallocated buffer, bump allocation, reset at the end of a batch.

Operators ask the arena for their (variable-size) output arrays instead of allocating fresh ones.
Within a batch the arena hands out disjoint, 64-byte aligned slices of one buffer; ``reset()`` at
the end of the batch makes the whole buffer available again, so the same warm pages are reused
batch after batch instead of being mapped and faulted in again by the allocator.

Growth policy: a request that does not fit is served from a separate *spill* block (still disjoint
from everything live). At the next ``reset()`` the main buffer grows to
``max(capacity * growth, peak * growth)`` so that steady-state batches never spill.

Only intermediates live in the arena: the collate step copies a batch's final feature tensors out
before ``reset()``, so tensors handed to training never alias arena memory.
"""

from __future__ import annotations

import math
import threading
from dataclasses import asdict, dataclass

import numpy as np

ALIGN = 64


@dataclass
class ArenaStats:
    """Counters since the arena was created."""

    capacity_bytes: int = 0
    peak_bytes: int = 0  # most bytes handed out within one batch (buffer + spill)
    allocations: int = 0
    bytes_allocated: int = 0  # total bytes handed out
    bytes_reused: int = 0  # bytes served from buffer memory that an earlier batch had already used
    spill_allocations: int = 0
    spill_bytes: int = 0
    grows: int = 0
    resets: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class Arena:
    """Bump allocator over one ``uint8`` numpy buffer; thread-safe ``alloc``.

    >>> a = Arena(1 << 20)
    >>> x = a.alloc(1000, np.int64); y = a.alloc((10, 3), np.float32)
    >>> np.shares_memory(x, y)
    False
    >>> a.reset()
    """

    def __init__(self, capacity: int = 8 << 20, growth: float = 1.5) -> None:
        if capacity < 0 or growth < 1.0:
            raise ValueError("arena capacity must be >= 0 and growth >= 1")
        self.growth = growth
        self._buf = np.empty(capacity, dtype=np.uint8)
        self._offset = 0
        self._high_water = 0  # buffer bytes touched by earlier batches (for the reuse statistic)
        self._batch_bytes = 0
        self._spills: list[np.ndarray] = []
        self._lock = threading.Lock()
        self.stats = ArenaStats(capacity_bytes=capacity)
        self.live: list[tuple[int, int]] = []  # (start, end) of this batch's buffer slices (for checks)
        self.track = False

    @property
    def capacity(self) -> int:
        return len(self._buf)

    def alloc(self, shape: int | tuple[int, ...], dtype: np.dtype | type = np.float64) -> np.ndarray:
        """An uninitialised array of ``shape``/``dtype`` valid until the next :meth:`reset`."""
        dtype = np.dtype(dtype)
        if isinstance(shape, int | np.integer):
            shape = (int(shape),)
        else:
            shape = tuple(int(s) for s in shape)
        nbytes = math.prod(shape) * dtype.itemsize
        size = (nbytes + ALIGN - 1) // ALIGN * ALIGN
        with self._lock:
            st = self.stats
            st.allocations += 1
            st.bytes_allocated += nbytes
            self._batch_bytes += size
            st.peak_bytes = max(st.peak_bytes, self._batch_bytes)
            start = self._offset
            if start + size <= len(self._buf):
                self._offset = start + size
                st.bytes_reused += max(0, min(start + size, self._high_water) - start)
                if self.track:
                    self.live.append((start, start + size))
                raw = self._buf[start : start + nbytes]
            else:
                st.spill_allocations += 1
                st.spill_bytes += nbytes
                raw = np.empty(max(nbytes, 1), dtype=np.uint8)[:nbytes]
                self._spills.append(raw)
        out = raw.view(dtype)
        return out if len(shape) == 1 else out.reshape(shape)

    def reset(self) -> None:
        """End of batch: everything handed out becomes free; grow if this batch spilled."""
        with self._lock:
            st = self.stats
            self._high_water = max(self._high_water, self._offset)
            if self._spills:
                new_cap = int(max(len(self._buf) * self.growth, self._batch_bytes * self.growth))
                new_cap = (new_cap + ALIGN - 1) // ALIGN * ALIGN
                self._buf = np.empty(new_cap, dtype=np.uint8)
                self._high_water = 0
                st.grows += 1
                st.capacity_bytes = new_cap
                self._spills.clear()
            self._offset = 0
            self._batch_bytes = 0
            self.live.clear()
            st.resets += 1

    def used(self) -> int:
        """Bytes of the buffer handed out in the current batch."""
        return self._offset


class NoArena:
    """Plain allocation with the same interface (the baseline of the micro-benchmark)."""

    def __init__(self) -> None:
        self.stats = ArenaStats()

    def alloc(self, shape: int | tuple[int, ...], dtype: np.dtype | type = np.float64) -> np.ndarray:
        out = np.empty(shape, dtype=dtype)
        self.stats.allocations += 1
        self.stats.bytes_allocated += out.nbytes
        return out

    def reset(self) -> None:
        self.stats.resets += 1
