"""``leanml demo``: a short run of every system on the embedded defaults."""

from __future__ import annotations

import argparse
import importlib
import time
from dataclasses import dataclass

from leanml.config import Form, option, require
from leanml.flags import add_command, flag_of
from leanml.machine import apply_threads, cores_available

# Each module provides ``run_demo(fast: bool) -> None`` and prints its own short table.
#: the systems the demo runs, in order; each has a ``leanml.<part>.demo`` module
PARTS = ("prune", "memory", "ctr", "features")
DEMO_PARTS = [f"leanml.{part}.demo" for part in PARTS]

# Where each part's full benchmark lives (the demo is a short tour; these are the measured comparisons).
FULL_BENCH = {
    "prune": "bench/results/prune.md, prune_fista.md, fasp.md, arch.md, recover.md",
    "memory": "bench/results/memory.md",
    "ctr": "bench/results/ctr.md",
    "features": "bench/results/features.md",
}


@dataclass(frozen=True)
class DemoJob:
    """The options of ``leanml demo``."""

    only: str | None = option(None, "run one part only", form=Form(choices=PARTS))
    threads: int | None = option(None, "torch threads (default: the cores this process may use); lower it when "
                                       "other jobs share the machine", form=Form(metavar="N"))

    def __post_init__(self) -> None:
        require(self, self.threads is None or self.threads >= 1, "threads", f"must be at least 1, got {self.threads}")
        require(self, self.only is None or self.only in PARTS, "only",
                f"must be one of {', '.join(PARTS)}, got {self.only!r}")


def register(sub: argparse._SubParsersAction) -> None:
    add_command(sub, "demo", DemoJob, run,
                help="run every system briefly on the bundled model and data",
                description="Runs each system on the embedded defaults and prints its comparison table.",
                epilog=f"examples:\n  leanml demo\n  leanml demo {flag_of(DemoJob, 'only')} prune")


def run(job: DemoJob) -> int:
    """Run every part (or ``job.only``) and print how long each took."""
    cores = cores_available()
    threads = apply_threads(job.threads)
    print(f"leanml demo: {threads} torch threads ({flag_of(DemoJob, 'threads')}; this process may use "
          f"{cores['cores']:g} cores); "
          "parts with small models use 1")
    took: list[tuple[str, float]] = []
    for name in DEMO_PARTS:
        part = name.split(".")[-2]
        if job.only and part != job.only:
            continue
        apply_threads(threads)  # a part may have lowered it
        t0 = time.perf_counter()
        importlib.import_module(name).run_demo()
        took.append((part, time.perf_counter() - t0))
        print(f"[{part}] took {took[-1][1]:.0f} s; full benchmark: {FULL_BENCH[part]}")
    print("\ndemo parts: " + ", ".join(f"{p} {s:.0f} s" for p, s in took) +
          f"; total {sum(s for _, s in took):.0f} s with {threads} threads. Docs per system: docs/*.md; "
          "benchmarks: bench/*.py.")
    return 0
