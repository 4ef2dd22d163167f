"""Small shared helpers: user-facing errors, cache dir, atomic outputs, JSON reports, machine facts."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch


class LeanmlError(Exception):
    """An error caused by the user's input. The CLI prints its message on one line and exits with code 2.

    The message must say what was wrong and what to do about it.
    """


def cache_dir() -> Path:
    """The cache directory: ``$LEANML_CACHE`` or ``~/.cache/leanml``. Created on first use."""
    path = Path(os.environ.get("LEANML_CACHE") or Path.home() / ".cache" / "leanml").expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


def default_device() -> torch.device:
    """``cuda`` when a GPU is present, else ``cpu``."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def check_output_dir(out: str | os.PathLike, overwrite: bool) -> Path:
    """Refuse an existing output directory unless ``overwrite`` (raises :class:`LeanmlError`)."""
    path = Path(out)
    if path.exists() and not overwrite:
        raise LeanmlError(f"output directory {path} already exists; choose another --out or pass --overwrite")
    return path


@contextlib.contextmanager
def atomic_dir(out: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success rename it to ``out`` (replacing it if ``overwrite``).

    On an exception the temporary directory is removed, so ``out`` never appears half-written.
    """
    final = check_output_dir(out, overwrite)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
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


def write_json(path: str | os.PathLike, obj: Any) -> Path:
    """Write ``obj`` as indented JSON atomically (temp file + rename)."""
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, default=_json_default) + "\n")
    return Path(path)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "item"):
        return obj.item()
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def machine_info() -> dict[str, Any]:
    """Facts about this machine for benchmark tables and reports."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    info: dict[str, Any] = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    with contextlib.suppress(ImportError):
        import transformers

        info["transformers"] = transformers.__version__
    return info


def machine_line() -> str:
    """One line naming the machine, for the top of a benchmark table."""
    m = machine_info()
    gpu = f", GPU {m['gpu']}" if m["gpu"] else ", no GPU"
    return f"{m['cpu']}, {m['cores']} cores{gpu}, torch {m['torch']}"


class Timer:
    """``with Timer() as t: ...; t.seconds``"""

    def __enter__(self) -> Timer:
        self.start = time.perf_counter()
        self.seconds = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.start


def cores_available(root: str | os.PathLike = "/") -> dict[str, Any]:
    """The CPU cores this process may really use: the smaller of its affinity mask and its cgroup CPU quota.

    Reads the quota of this process's cgroup and of every ancestor (the smallest wins): cgroup v2
    ``cpu.max`` (``"max 100000"`` = unlimited, ``"150000 100000"`` = 1.5 cores) or cgroup v1
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (quota ``-1`` = unlimited). ``root`` replaces ``/``
    for ``proc/self/cgroup`` and ``sys/fs/cgroup`` (tests point it at a fake tree). Returns
    ``{"cores": float, "affinity": int, "quota": float | None, "quota_file": str | None, "cpu_count": int}``;
    ``cores`` is what a benchmark should record (the quota may be fractional). It says nothing about
    other processes competing for those cores: record ``os.getloadavg()`` and measured utilisation beside it.
    """
    base = Path(root)
    try:
        affinity = len(os.sched_getaffinity(0)) if str(root) == "/" else (os.cpu_count() or 1)
    except (AttributeError, OSError):
        affinity = os.cpu_count() or 1
    quota, quota_file = None, None
    for path, q in _cgroup_quotas(base):
        if q is not None and (quota is None or q < quota):
            quota, quota_file = q, str(path)
    cores = float(affinity) if quota is None else min(float(affinity), quota)
    return {"cores": round(cores, 3), "affinity": affinity, "quota": None if quota is None else round(quota, 3),
            "quota_file": quota_file, "cpu_count": os.cpu_count() or 1}


def _cgroup_quotas(base: Path) -> Iterator[tuple[Path, float | None]]:
    """(file, quota in cores or None when unlimited) for this process's cgroup and its ancestors, v2 and v1."""
    try:
        lines = (base / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return
    sysfs = base / "sys/fs/cgroup"
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        rel = rel.strip().lstrip("/")
        if controllers == "":  # cgroup v2 (unified) hierarchy
            mounts = [sysfs, sysfs / "unified"]
            names = ("cpu.max",)
        elif "cpu" in controllers.split(","):
            mounts = [sysfs / controllers, sysfs / "cpu", sysfs / "cpu,cpuacct"]
            names = ("cpu.cfs_quota_us", "cpu.cfs_period_us")
        else:
            continue
        for mount in mounts:
            if not (mount / names[0]).exists() and not (mount / rel / names[0]).exists():
                continue
            dirs = [mount / rel] + [mount / p for p in Path(rel).parents] if rel else [mount]
            seen = set()
            for d in dirs:
                if d in seen or not (d / names[0]).exists():
                    continue
                seen.add(d)
                yield d / names[0], _read_quota(d, names)
            break


def _read_quota(d: Path, names: tuple[str, ...]) -> float | None:
    try:
        if names == ("cpu.max",):
            q, _, period = (d / "cpu.max").read_text().strip().partition(" ")
            return None if q == "max" else int(q) / int(period or 100000)
        q = int((d / names[0]).read_text().strip())
        period = int((d / names[1]).read_text().strip())
        return None if q < 0 or period <= 0 else q / period
    except (OSError, ValueError):
        return None


def run_child(cmd: list[str], *, check: bool = True, grace_s: float = 10.0, **kw: Any) -> int:
    """Run ``cmd`` in its own process group and wait for it; if this process stops waiting for any reason
    (an exception, Ctrl-C, or SIGTERM once :func:`exit_on_sigterm` is installed) the whole group gets
    SIGTERM, then SIGKILL after ``grace_s``, so no grandchild (``flock``'s command, a worker) outlives it.
    Returns the exit code; ``check`` raises ``subprocess.CalledProcessError`` on a non-zero one."""
    import signal
    import subprocess

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
    import signal
    import sys

    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
