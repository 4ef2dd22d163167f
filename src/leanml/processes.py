"""Child processes and signals: a child's whole process group ends with its parent, and SIGTERM cleans up
like Ctrl-C."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any


def run_child(cmd: list[str], *, check: bool = True, grace_s: float = 10.0, **kw: Any) -> int:
    """Run ``cmd`` in its own process group and wait for it; if this process stops waiting for any reason
    (an exception, Ctrl-C, or SIGTERM once :func:`exit_on_sigterm` is installed) the whole group gets
    SIGTERM, then SIGKILL after ``grace_s``, so no grandchild (``flock``'s command, a worker) outlives it.
    Returns the exit code; ``check`` raises ``subprocess.CalledProcessError`` on a non-zero one."""
    proc = subprocess.Popen(cmd, start_new_session=True, **kw)
    try:
        rc = proc.wait()
    except BaseException:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout=grace_s)
                break
            except subprocess.TimeoutExpired:
                continue
        raise
    if check and rc != 0:
        raise subprocess.CalledProcessError(rc, cmd)
    return rc


def exit_on_sigterm() -> None:
    """Turn SIGTERM into ``SystemExit(143)`` so ``finally`` blocks and :func:`run_child` clean up."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


class SigtermInterrupt(KeyboardInterrupt):
    """SIGTERM, raised as a ``KeyboardInterrupt`` so a killed command cleans up and reports like Ctrl-C."""


@contextlib.contextmanager
def interrupt_on_sigterm() -> Iterator[None]:
    """Inside the block, SIGTERM raises :class:`SigtermInterrupt` (a ``KeyboardInterrupt``): temporary
    folders are removed and the command prints the same "interrupted" line as after Ctrl-C. The previous
    handler comes back afterwards; outside the main thread this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise SigtermInterrupt()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
