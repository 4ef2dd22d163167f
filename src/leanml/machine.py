"""Facts about this machine: the CPU cores a process may really use, torch's thread count, and the one
line naming the machine at the top of a benchmark table.

torch is imported by the functions that need it, not by this module, so the command line starts without it.
"""

from __future__ import annotations

import contextlib
import os
import platform
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def machine_info() -> dict[str, Any]:
    """Facts about this machine for benchmark tables and reports."""
    import torch

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


def default_threads() -> int:
    """Torch threads by default: the cores this process may use (affinity mask and cgroup quota)."""
    return max(1, int(cores_available()["cores"]))


def apply_threads(threads: int | None) -> int:
    """Set torch's intra-op thread count (``None``: :func:`default_threads`); returns the count used."""
    import torch

    n = threads or default_threads()
    torch.set_num_threads(n)
    return n
