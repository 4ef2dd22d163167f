"""Progress and timing: a stopwatch, and a progress bar that also logs its first estimate of the time left."""

from __future__ import annotations

import sys
import time
from typing import Any


class Timer:
    """``with Timer() as t: ...; t.seconds``"""

    def __enter__(self) -> Timer:
        self.start = time.perf_counter()
        self.seconds = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.start


def announce_eta(what: str, done: int, total: int, seconds: float, unit: str) -> str | None:
    """The line "estimated N s for the rest" after the first ``done`` of ``total`` units took ``seconds``
    (``None`` when nothing is left)."""
    left = total - done
    if left <= 0 or done <= 0:
        return None
    rest = seconds / done * left
    mins = f" ({rest / 60:.1f} min)" if rest >= 120 else ""
    return f"{what}: {done} {unit}{'s' if done > 1 else ''} took {seconds:.1f} s; " \
           f"estimated {rest:.0f} s{mins} for the rest ({left} {unit}{'s' if left > 1 else ''})"


def _tqdm_base() -> type:
    from tqdm.auto import tqdm

    return tqdm


class EtaBar(_tqdm_base()):  # type: ignore[misc]
    """A tqdm bar that also prints one plain line "estimated N s for the rest" once its first unit of work
    is done (a log file, unlike the bar, keeps it). A drop-in for ``tqdm.auto.tqdm``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._eta_from = (self.n, time.perf_counter())
        self._eta_said = False

    def update(self, n: float | None = 1) -> bool | None:
        out = super().update(n)
        if not self._eta_said and not self.disable and self.total and self.n > self._eta_from[0]:
            self._eta_said = True
            done = int(self.n - self._eta_from[0])
            line = announce_eta(self.desc or "work", done, int(self.total - self._eta_from[0]),
                                time.perf_counter() - self._eta_from[1], self.unit or "it")
            if line:
                self.write(line, file=sys.stderr)
        return out
