"""One writer per output: :func:`output_lock` holds ``.NAME.lock`` beside an output ``NAME`` (which
covers its checkpoint ``NAME.ckpt`` too) for the length of a command.

The lock is an exclusive ``flock`` on that file, which also holds the owner's pid: a second run on the
same output is refused in one line naming the first one's pid, and the kernel drops the lock when its
process dies, so a stale lock file (a killed run's, its pid dead) is simply taken over. Every command
with an ``--out`` takes it in :func:`leanml.cli.main`; library callers may take it themselves.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from leanml.errors import LeanmlError, option_fields


def lock_path(out: str | os.PathLike) -> Path:
    """The lock file of the output ``out``: ``.NAME.lock`` in the same folder."""
    out = Path(out).expanduser().absolute()
    return out.with_name(f".{out.name}.lock")


def _owner(path: Path) -> str:
    try:
        text = path.read_text().strip()
    except OSError:
        return "unknown"
    return text if text.isdigit() else "unknown"


@contextlib.contextmanager
def output_lock(out: str | os.PathLike | None, flag: str | None = None) -> Iterator[Path | None]:
    """Hold the lock of ``out`` (``None``: nothing to lock) while the block runs; another live holder
    is a :class:`LeanmlError` naming its pid. Folders made for the lock file and the file itself are
    removed on the way out. Where no lock file can be made (a read-only folder), the block runs
    unlocked: the output's own checks report that folder. ``flag``: the option the error names, a field
    name (default ``out``, shown as its flag on the command line) or a flag."""
    if out is None:
        yield None
        return
    path = lock_path(out)
    made = [p for p in [path.parent, *path.parent.parents] if not p.exists()]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = _acquire(path, flag)
    except OSError:
        _remove_empty(made)
        yield None
        return
    try:
        yield path
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
        os.close(fd)
        _remove_empty(made)


def _acquire(path: Path, flag: str | None) -> int:
    """Lock ``path`` (created if missing) and write this pid in it; the descriptor holds the lock."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            out = path.with_name(path.name[1 : -len(".lock")])
            name = flag or "out"
            raise LeanmlError(f"another leanml run (pid {_owner(path)}) is writing {out}; wait for it to end or "
                              f"choose another {name}", fields=option_fields(name)) from None
        except BaseException:
            os.close(fd)
            raise
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:  # its holder removed it between our open and our lock
            same = False
        if same:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            return fd
        os.close(fd)


def _remove_empty(folders: list[Path]) -> None:
    for folder in folders:  # deepest first
        with contextlib.suppress(OSError):
            folder.rmdir()
