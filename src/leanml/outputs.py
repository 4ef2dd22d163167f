"""Outputs: the cache folder, output-folder checks, atomic folders and files, JSON reports, fingerprints.

Every output is written to a temporary sibling and renamed into place, so a killed run never leaves a
half-written one; the temporary names carry the writer's PID, so the next run can tell a killed run's
leftovers from a live run's and remove them (:func:`clean_stale`).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from leanml.errors import LeanmlError, option_fields


def cache_dir() -> Path:
    """The cache directory: ``$LEANML_CACHE`` or ``~/.cache/leanml``. Created on first use."""
    path = Path(os.environ.get("LEANML_CACHE") or Path.home() / ".cache" / "leanml").expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LeanmlError(f"the cache {path} (LEANML_CACHE) cannot be created ({exc.strerror or exc}); set "
                          "LEANML_CACHE to a writable folder") from exc
    return path


def _named(flag: str | None) -> tuple[str, tuple[str, ...]]:
    """The option a message names (``flag``: a flag, or a field name the command line shows as its flag;
    default the field ``out``) and the fields to give the error."""
    name = flag or "out"
    return name, option_fields(name)


def check_output_dir(out: str | os.PathLike, overwrite: bool, flag: str | None = None) -> Path:
    """Check an output directory before any work: refuse an existing one unless ``overwrite``, refuse a
    path that is a file or whose folder cannot be written, and remove temporary folders left beside it
    by a killed run (see :func:`clean_stale`). Raises :class:`LeanmlError`; creates nothing. ``flag``: the
    option the error names, a field name (default ``out``, shown as its flag on the command line) or a flag."""
    path = Path(out).expanduser()
    name, fields = _named(flag)
    shown = path.absolute()  # an absolute path: a relative one named like the option would read as its flag
    if path.exists() and not path.is_dir():
        raise LeanmlError(f"{name} {shown} is a file, not a directory; choose another {name}", fields=fields)
    if path.exists() and not overwrite:
        raise LeanmlError(f"output directory {shown} already exists; choose another {name} or pass overwrite",
                          fields=(*fields, "overwrite"))
    check_writable(path.parent, flag)
    clean_stale(path)
    return path


def check_writable(folder: str | os.PathLike, flag: str | None = None) -> None:
    """Raise :class:`LeanmlError` unless a file can be created in ``folder`` (or, when it does not exist
    yet, in its nearest existing ancestor). Probes with a real temporary file, so read-only mounts and
    immutable folders are found too; nothing is left behind. ``flag`` as in :func:`check_output_dir`."""
    option, fields = _named(flag)
    folder = Path(folder).expanduser().absolute()
    probe_dir = folder
    while not probe_dir.exists():
        probe_dir = probe_dir.parent
    if not probe_dir.is_dir():
        raise LeanmlError(f"{option}: {probe_dir} is a file, so {folder} cannot be created; choose another {option}",
                          fields=fields)
    try:
        fd, name = tempfile.mkstemp(prefix=".leanml-probe-", dir=probe_dir)
    except OSError as exc:
        raise LeanmlError(f"{option}: cannot write in {probe_dir} ({exc.strerror}); choose a writable {option}",
                          fields=fields) from exc
    os.close(fd)
    os.unlink(name)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def clean_stale(out: str | os.PathLike) -> list[Path]:
    """Remove temporary siblings of ``out`` left by a killed run: ``.NAME.tmp-PID-*`` and ``.NAME.old-PID``
    (from :func:`atomic_dir`) and ``.NAME.tmp-PID*`` files (from :func:`atomic_file`) whose process PID is
    gone, and legacy ``.NAME.tmp-XXXXXXXX`` folders without a PID. An ``.old`` folder whose output is
    missing (a run killed between the two renames of an overwrite) is put back. Returns what was removed."""
    out = Path(out).expanduser()
    if not out.parent.is_dir():
        return []
    removed = []
    for prefix in (f".{out.name}.tmp-", f".{out.name}.old-"):
        for cand in out.parent.glob(glob.escape(prefix) + "*"):
            rest = cand.name[len(prefix):]
            digits = rest.split("-", 1)[0].split(".", 1)[0]
            pid = int(digits) if digits.isdigit() else None
            if pid is not None and (pid == os.getpid() or _pid_alive(pid)):
                continue
            if prefix.endswith(".old-") and cand.is_dir() and not out.exists():
                cand.rename(out)  # killed between the two renames of an overwrite: the old output comes back
                continue
            if cand.is_dir() and not cand.is_symlink():
                shutil.rmtree(cand, ignore_errors=True)
            else:
                cand.unlink(missing_ok=True)
            removed.append(cand)
    return removed


def clean_stale_in(folder: str | os.PathLike) -> list[Path]:
    """Remove the temporary files a killed run left inside ``folder`` (``.NAME.tmp-PID*`` of a dead PID),
    e.g. in a checkpoint folder before resuming from it. Returns what was removed."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    names = {p.name.split(".tmp-", 1)[0][1:] for p in folder.glob(".*.tmp-*")}
    return [r for name in sorted(names) for r in clean_stale(folder / name)]


@contextlib.contextmanager
def atomic_dir(out: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success rename it to ``out`` (replacing it if ``overwrite``).

    On an exception (Ctrl-C and SIGTERM under the CLI included) the temporary directory is removed, so
    ``out`` never appears half-written; one left by SIGKILL is removed by the next run's
    :func:`check_output_dir`.
    """
    final = check_output_dir(out, overwrite)
    final.parent.mkdir(parents=True, exist_ok=True)
    # the PID in the name lets a later run tell a killed run's leftovers from a live run's folder
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-{os.getpid()}-", dir=final.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary sibling of ``path`` to write; on success it replaces ``path`` in one rename.

    On an exception the temporary file is removed, so ``path`` is never half-written. ``suffix`` is
    appended to the temporary name for writers that pick the format from it (``.npy``, ``.png``).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}{suffix}")
    try:
        yield tmp
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def fingerprint(obj: Any) -> str:
    """A short hash of a JSON-able object (settings, data summaries, keys sorted): what keys checkpoints
    and caches."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def write_json(path: str | os.PathLike, obj: Any) -> Path:
    """Write ``obj`` as indented JSON atomically (temp file + rename)."""
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, default=_json_default) + "\n")
    return Path(path)


def _json_default(obj: Any) -> Any:
    """Paths as strings; tensors and numpy arrays or scalars as (nested) lists or numbers."""
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "tolist"):  # torch tensors, numpy arrays and numpy scalars
        return obj.tolist()
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")
