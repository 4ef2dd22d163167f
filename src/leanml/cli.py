"""The ``leanml`` command line: one subcommand per job.

Each subsystem registers its own subcommands through a ``register(subparsers)`` function in its
``cli`` module; this file only wires them together and turns :class:`LeanmlError` into a one-line
message with exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from leanml.utils import LeanmlError

# Modules that provide ``register(subparsers)``; order is the order shown in --help.
SUBSYSTEMS = [
    "leanml.prune.cli",  # prune, eval
    "leanml.eval.speed_cli",  # speed
    "leanml.memory.cli",  # train
    "leanml.recover.cli",  # recover
    "leanml.ctr.cli",  # ctr
    "leanml.features.cli",  # features
    "leanml.demo",  # demo
]

EPILOG = """examples:
  leanml eval --model smollm2-135m --data shakespeare --seqlen 512
  leanml prune --model smollm2-135m --method sparsegpt --sparsity 0.5 --out out/sgpt50
  leanml train --model smollm2-135m --data shakespeare --memory adacc --memory-budget 0.5
  leanml ctr train --model deepfm --features id,visual --out out/ctr
  leanml features train --graph movielens
  leanml demo
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="leanml",
        description="Cheaper, better industrial deep learning.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBSYSTEMS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:  # a subsystem not present in this checkout
            if exc.name is not None and name.startswith(exc.name):
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        result = args.func(args)
    except LeanmlError as exc:
        print(f"leanml: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("leanml: interrupted", file=sys.stderr)
        return 130
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
