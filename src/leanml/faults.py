"""Faults of the machine named in one line: a full disk, a read-only or full cache, a permission error.

Each message names the path, the bytes a write needs (estimated before it starts where the size is
known: :func:`check_space`) and the bytes free there. Problems of the cache name ``LEANML_CACHE``
(:func:`check_cache`), which is how a user moves it. :func:`write_fault` turns the error a writer
raised (``OSError``, or safetensors' ``SafetensorError``, which carries the OS error in its text) into
that line.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

from leanml.errors import LeanmlError


def size(n: int | None) -> str:
    """``n`` bytes for a message: ``1.23 GB`` (decimal units, as ``df -H`` shows them)."""
    if n is None:
        return "an unknown amount"
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n} bytes"


def existing(path: str | os.PathLike) -> Path:
    """``path`` or its nearest existing ancestor (where a file under ``path`` would land)."""
    p = Path(path).expanduser().absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def free_bytes(path: str | os.PathLike) -> int | None:
    """Bytes free to this user on the file system that holds ``path`` (``None`` where unknown)."""
    try:
        return shutil.disk_usage(existing(path)).free
    except OSError:
        return None


def check_space(folder: str | os.PathLike, need: int, what: str, fix: str = "free space there",
                fields: tuple[str, ...] = ()) -> None:
    """Refuse (one line) to write ``what`` of about ``need`` bytes into ``folder`` when its file system
    has less free. ``fields``: the options ``fix`` names (the command line shows them as flags)."""
    free = free_bytes(folder)
    if free is not None and need > free:
        raise LeanmlError(f"not enough disk space for {what} in {existing(folder)}: it needs about {size(need)}, "
                          f"{size(free)} free; {fix}", fields=fields)


def cache_root() -> Path:
    """Where the cache is (``$LEANML_CACHE`` or ``~/.cache/leanml``), without creating it."""
    return Path(os.environ.get("LEANML_CACHE") or Path.home() / ".cache" / "leanml").expanduser()


def check_cache(need: int | None = None, what: str = "the cache") -> Path:
    """The cache folder, checked writable (probed with a real file) and, with ``need``, holding about
    that many free bytes; a problem is one line naming ``LEANML_CACHE``."""
    root = cache_root()
    fix = "set LEANML_CACHE to a writable folder with room"
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=".leanml-probe-", dir=root)
        os.close(fd)
        os.unlink(name)
    except OSError as exc:
        raise LeanmlError(f"the cache {root} (LEANML_CACHE) cannot be written ({exc.strerror or exc}), so {what} "
                          f"cannot be stored; {fix}") from exc
    if need is not None:
        check_space(root, need, f"{what} (the cache, LEANML_CACHE)", fix)
    return root


def gguf_dense_bytes(path: str | os.PathLike) -> int | None:
    """Bytes of a ``.gguf`` file's tensors once converted to float32 (from its header; ``None`` where it
    cannot be read)."""
    try:
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
        return sum(int(t.n_elements) * 4 for t in reader.tensors)
    except Exception:  # no gguf package or an unreadable file: the conversion reports the file itself
        return None


def check_model_cache(spec: str) -> None:
    """Before a command converts the bundled model into the cache (first use), check the cache can take
    it: writable, with room for the float32 copy (read from the GGUF header)."""
    from leanml.models import BUNDLED

    if spec not in BUNDLED:
        return
    if (cache_root() / "models" / spec / "config.json").exists():
        return  # converted already: read only
    from leanml.data.offline import smollm2_gguf

    check_cache(gguf_dense_bytes(smollm2_gguf()), f"the converted {spec}")


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` is a full disk (``ENOSPC``/``EDQUOT``, also inside a ``SafetensorError``'s text)."""
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    text = str(exc)
    return "No space left" in text or "StorageFull" in text or "os error 28" in text or "QuotaExceeded" in text


def write_fault(exc: BaseException, path: str | os.PathLike, need: int | None = None, what: str = "the output",
                ) -> LeanmlError:
    """The one-line error for a write of ``what`` into ``path`` that raised ``exc``: a full disk names
    the bytes needed and free; a permission or read-only error names the path."""
    path = Path(path)
    if is_disk_full(exc):
        return LeanmlError(f"disk full while writing {what} to {path}: it needs about {size(need)}, "
                           f"{size(free_bytes(path))} free; free space there or choose another folder")
    strerror = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0][:200]
    return LeanmlError(f"cannot write {what} to {path} ({strerror}); check its permissions, or choose another "
                       "folder")
