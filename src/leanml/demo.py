"""``leanml demo``: a short run of every system on the embedded defaults."""

from __future__ import annotations

import argparse
import importlib
import time

from leanml.utils import add_threads_arg, apply_threads, cores_available

# Each module provides ``run_demo(fast: bool) -> None`` and prints its own short table.
DEMO_PARTS = [
    "leanml.prune.demo",
    "leanml.memory.demo",
    "leanml.ctr.demo",
    "leanml.features.demo",
]

# Where each part's full benchmark lives (the demo is a short tour; these are the measured comparisons).
FULL_BENCH = {
    "prune": "bench/results/prune.md, prune_fista.md, fasp.md, arch.md, recover.md",
    "memory": "bench/results/memory.md",
    "ctr": "bench/results/ctr.md",
    "features": "bench/results/features.md",
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="run every system briefly on the bundled model and data",
        description="Runs each system on the embedded defaults and prints its comparison table.",
        epilog="examples:\n  leanml demo\n  leanml demo --only prune",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--only", choices=[m.split(".")[-2] for m in DEMO_PARTS], help="run one part only")
    add_threads_arg(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cores = cores_available()
    threads = apply_threads(args.threads)
    print(f"leanml demo: {threads} torch threads (--threads; this process may use {cores['cores']:g} cores); "
          "parts with small models use 1")
    took: list[tuple[str, float]] = []
    for name in DEMO_PARTS:
        part = name.split(".")[-2]
        if args.only and part != args.only:
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
