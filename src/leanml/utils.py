"""Small shared helpers: user-facing errors, cache dir, atomic outputs, JSON reports, machine facts."""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import platform
import shutil
import sys
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
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LeanmlError(f"the cache {path} (LEANML_CACHE) cannot be created ({exc.strerror or exc}); set "
                          "LEANML_CACHE to a writable folder") from exc
    return path


def default_device() -> torch.device:
    """``cuda`` when a GPU is present, else ``cpu``."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def check_output_dir(out: str | os.PathLike, overwrite: bool, flag: str = "--out") -> Path:
    """Check an output directory before any work: refuse an existing one unless ``overwrite``, refuse a
    path that is a file or whose folder cannot be written, and remove temporary folders left beside it
    by a killed run (see :func:`clean_stale`). Raises :class:`LeanmlError`; creates nothing."""
    path = Path(out).expanduser()
    if path.exists() and not path.is_dir():
        raise LeanmlError(f"{flag} {path} is a file, not a directory; choose another {flag}")
    if path.exists() and not overwrite:
        raise LeanmlError(f"output directory {path} already exists; choose another {flag} or pass --overwrite")
    check_writable(path.parent, flag)
    clean_stale(path)
    return path


def check_writable(folder: str | os.PathLike, flag: str = "--out") -> None:
    """Raise :class:`LeanmlError` unless a file can be created in ``folder`` (or, when it does not exist
    yet, in its nearest existing ancestor). Probes with a real temporary file, so read-only mounts and
    immutable folders are found too; nothing is left behind."""
    folder = Path(folder).expanduser().absolute()
    probe_dir = folder
    while not probe_dir.exists():
        probe_dir = probe_dir.parent
    if not probe_dir.is_dir():
        raise LeanmlError(f"{flag}: {probe_dir} is a file, so {folder} cannot be created; choose another {flag}")
    try:
        fd, name = tempfile.mkstemp(prefix=".leanml-probe-", dir=probe_dir)
    except OSError as exc:
        raise LeanmlError(f"{flag}: cannot write in {probe_dir} ({exc.strerror}); choose a writable {flag}") from exc
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


class SigtermInterrupt(KeyboardInterrupt):
    """SIGTERM, raised as a ``KeyboardInterrupt`` so a killed command cleans up and reports like Ctrl-C."""


@contextlib.contextmanager
def interrupt_on_sigterm() -> Iterator[None]:
    """Inside the block, SIGTERM raises :class:`SigtermInterrupt` (a ``KeyboardInterrupt``): temporary
    folders are removed and the command prints the same "interrupted" line as after Ctrl-C. The previous
    handler comes back afterwards; outside the main thread this does nothing."""
    import signal
    import threading

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


def default_threads() -> int:
    """Torch threads by default: the cores this process may use (affinity mask and cgroup quota)."""
    return max(1, int(cores_available()["cores"]))


def apply_threads(threads: int | None) -> int:
    """Set torch's intra-op thread count (``None``: :func:`default_threads`); returns the count used."""
    n = threads or default_threads()
    torch.set_num_threads(n)
    return n


def parse_device(arg: str | None, flag: str = "--device") -> torch.device:
    """``--device``: ``None`` (cuda when present, else cpu), ``cpu``, ``cuda``/``cuda:N`` or ``mps``, checked
    against this machine; raises :class:`LeanmlError` with one line naming the fix."""
    if arg is None:
        return default_device()
    try:
        device = torch.device(arg)
    except (RuntimeError, ValueError):
        raise LeanmlError(f"unknown {flag} {arg!r}; use cpu or cuda (or cuda:N)") from None
    if device.type == "cpu":
        return device
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise LeanmlError(f"{flag} {arg}: no CUDA device is available here; use {flag} cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise LeanmlError(f"{flag} {arg}: this machine has {torch.cuda.device_count()} CUDA device(s); "
                              f"use cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
        return device
    if device.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise LeanmlError(f"{flag} mps: no Apple MPS device is available here; use {flag} cpu")
        return device
    raise LeanmlError(f"{flag} {arg}: leanml runs on cpu or cuda, not {device.type}; use {flag} cpu or cuda")


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
