"""``leanml demo``: a short run of every system on the embedded defaults."""

from __future__ import annotations

import argparse
import importlib

# Each module provides ``run_demo(fast: bool) -> None`` and prints its own short table.
DEMO_PARTS = [
    "leanml.prune.demo",
    "leanml.memory.demo",
    "leanml.ctr.demo",
    "leanml.features.demo",
]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="run every system briefly on the bundled model and data",
        description="Runs each system on the embedded defaults and prints its comparison table.",
        epilog="examples:\n  leanml demo\n  leanml demo --only prune",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--only", choices=[m.split(".")[-2] for m in DEMO_PARTS], help="run one part only")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    for name in DEMO_PARTS:
        if args.only and name.split(".")[-2] != args.only:
            continue
        module = importlib.import_module(name)
        module.run_demo()
    return 0
