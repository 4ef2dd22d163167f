"""The ``leanml`` command line: one subcommand per job.

Each subsystem registers its own subcommands through a ``register(subparsers)`` function in its
``cli`` module; this file only wires them together and decides how a command ends:

- a user error (:class:`LeanmlError`, a bad option, an unreadable or unwritable file) prints one line
  ``leanml: error: ...`` (for a bad option it ends by pointing to ``--help``) and exits with code 2;
- an unexpected exception (a bug) prints one line naming it and exits with code 1;
- Ctrl-C and SIGTERM print the same line ("interrupted", and the command that resumes the run when it
  left a checkpoint) and exit with code 130 or 143; temporary folders are removed on the way out.

``LEANML_DEBUG=1`` prints the traceback as well.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import shlex
import sys
import traceback
from pathlib import Path

from leanml import extras
from leanml.errors import LeanmlError
from leanml.flags import cli_message
from leanml.locks import output_lock
from leanml.processes import SigtermInterrupt, interrupt_on_sigterm

#: command -> (the module whose ``register(subparsers)`` adds it, its line in ``leanml --help``), in the order
#: shown. The lines are here, not only in the modules, so that ``leanml --help`` imports no subsystem (and so no
#: torch), and ``leanml COMMAND ...`` imports only COMMAND's; tests/test_house.py checks that they match.
COMMANDS: dict[str, tuple[str, str]] = {
    "prune": ("leanml.prune.cli", "prune an LLM post-training (magnitude, wanda, sparsegpt, fista, fasp, ...)"),
    "eval": ("leanml.prune.cli", "perplexity of a causal LM (SparseGPT protocol)"),
    "speed": ("leanml.eval.speed_cli", "prefill/decode tokens/s, peak memory and disk size of models"),
    "train": ("leanml.memory.cli", "fine-tune a causal LM under a training-memory strategy (Adacc)"),
    "recover": ("leanml.recover.cli",
                "fine-tune a pruned model keeping its sparsity, with optional distillation, under a memory budget"),
    "ctr": ("leanml.ctr.cli", "visual content IDs and CTR models (new-ad cold start)"),
    "features": ("leanml.features.cli", "FeatureBox: raw logs -> feature ops pipelined into CTR training"),
    "demo": ("leanml.demo", "run every system briefly on the bundled model and data"),
}
#: ``build_parser(ALL)``: every command registered by its module
ALL = "*"

EPILOG = """examples:
  leanml eval --model smollm2-135m --data shakespeare --seqlen 512
  leanml prune --model smollm2-135m --method sparsegpt --sparsity 0.5 --out out/sgpt50
  leanml train --model smollm2-135m --data shakespeare --memory adacc --memory-budget 0.5
  leanml ctr train --model deepfm --features id,visual --out out/ctr
  leanml features train --graph movielens
  leanml demo
"""


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line ending with a pointer to ``--help``, not the usage text."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sub = self.prog.split(" ", 1)[1] + ": " if " " in self.prog else ""
        m = re.match(r"argument ([^:]+): (.*)", message, re.S)
        if m:  # "argument --batch-size: must be at least 1" -> "--batch-size must be at least 1"
            flag, rest = m.group(1).split("/")[0], m.group(2)
            message = f"{flag} {rest}" if rest.startswith(("must ", "is ", "expected ")) else f"{flag}: {rest}"
        sys.stderr.write(f"leanml: error: {sub}{message} (see '{self.prog} --help')\n")
        sys.exit(2)


def build_parser(command: str | None = ALL) -> argparse.ArgumentParser:
    """The ``leanml`` parser. ``command`` names the command whose module is imported and registers its
    options (with the other commands of that module); the rest are listed by their line only, so they
    cannot be run from this parser. ``None``: no module is imported; :data:`ALL` (the default): every one."""
    parser = Parser(
        prog="leanml",
        description="Cheaper, better industrial deep learning.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="store_true",
                        help="print the versions of leanml, torch and transformers and the device, then exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = {m for c, (m, _) in COMMANDS.items() if command in (ALL, c)}
    for name, (module_name, line) in COMMANDS.items():
        missing = extras.not_installed(extras.COMMAND_EXTRAS.get(name, ""))
        if missing is not None:
            register_missing(sub, name, ModuleNotFoundError(f"No module named {missing!r}", name=missing))
        elif module_name in wanted:
            wanted.discard(module_name)
            register_module(sub, module_name)
        if name not in sub.choices:
            sub.add_parser(name, help=line, add_help=False)
    return parser


def register_module(sub: argparse._SubParsersAction, name: str) -> None:
    """Import subsystem module ``name`` and let it register its commands; a command whose extra is not
    installed is registered to refuse with one line naming the extra."""
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:  # a subsystem not present in this checkout
        if exc.name is not None and name.startswith(exc.name):
            return
        if extras.missing_extra(exc) is None:
            raise
        for command in (c for c, (m, _) in COMMANDS.items() if m == name):  # its extra is missing: say so when run
            register_missing(sub, command, exc)
        return
    module.register(sub)


def command_of(argv: list[str]) -> str | None:
    """The command ``argv`` runs (its first word that is not an option), or None."""
    return next((a for a in argv if not a.startswith("-")), None)


def register_missing(sub: argparse._SubParsersAction, command: str, exc: ModuleNotFoundError) -> None:
    """``leanml COMMAND ...`` for a subsystem whose extra is not installed: one line naming the extra."""
    error = extras.missing_extra(exc, command)

    def refuse(args: argparse.Namespace) -> int:
        raise error

    # no option prefix: every argument (--help included) is taken as is, and the command refuses them all
    p = sub.add_parser(command, help=f"(needs: pip install 'leanml[{extras.extra_of(exc.name or '', command)}]')",
                       add_help=False, prefix_chars="\0")
    p.add_argument("rest", nargs="*")
    p.set_defaults(func=refuse)


def debug() -> bool:
    """Whether ``LEANML_DEBUG`` asks for tracebacks."""
    return os.environ.get("LEANML_DEBUG", "") not in ("", "0")


def interrupted_line(args: argparse.Namespace, argv: list[str]) -> str:
    """What an interrupted command prints: how to resume it when it left a checkpoint (``OUT.ckpt``)."""
    out = getattr(args, "out", None)
    if out and hasattr(args, "resume"):
        ckpt = Path(out).with_name(Path(out).name + ".ckpt")
        if ckpt.exists():
            again = argv if "--resume" in argv else [*argv, "--resume"]
            return f"leanml: interrupted; resume with: leanml {shlex.join(again)}"
    return "leanml: interrupted; no output was written"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv == ["--version"]:  # quick: no subsystem imported
        from leanml import version_text

        print(version_text())
        return 0
    parser = build_parser(command_of(argv))
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # name the subcommand whose --help lists the options
            sub = f"leanml {args.command}" if getattr(args, "command", None) else "leanml"
            parser.exit(2, f"leanml: error: {sub[7:] + ': ' if sub != 'leanml' else ''}unrecognized arguments: "
                           f"{' '.join(unknown)} (see '{sub} --help')\n")
    except SystemExit as exc:  # --help (0) or a bad option (2, one line already printed)
        return exc.code if isinstance(exc.code, int) else 2
    if args.version:
        from leanml import version_text

        print(version_text())
        return 0
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        # one writer per output: a second run on the same --out (or its checkpoint) is refused, naming the first
        with interrupt_on_sigterm(), output_lock(getattr(args, "out", None)):
            result = args.func(args)
    except LeanmlError as exc:
        if debug():
            traceback.print_exc()
        message = str(exc)
        if exc.fields:  # the library names fields; the user typed flags
            message = cli_message(exc, getattr(args, "_leanml_flags", []))
        print(f"leanml: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        if debug():
            traceback.print_exc()
        print(interrupted_line(args, argv), file=sys.stderr)
        return 143 if isinstance(exc, SigtermInterrupt) else 130
    except OSError as exc:  # a file that cannot be read or written, a full disk: the machine's, not a bug
        if debug():
            traceback.print_exc()
        print(f"leanml: error: {os_error_line(exc)}", file=sys.stderr)
        return 2
    except Exception as exc:  # a bug: one line by default, the traceback on request
        missing = extras.missing_extra(exc, args.command) if isinstance(exc, ModuleNotFoundError) else None
        if missing is not None:  # not a bug: a package of an optional extra, named with the extra
            if debug():
                traceback.print_exc()
            print(f"leanml: error: {missing}", file=sys.stderr)
            return 2
        if debug():
            raise
        first = (str(exc).splitlines() or [""])[0][:300]
        print(f"leanml: error: unexpected {type(exc).__name__}: {first} (a bug: rerun with LEANML_DEBUG=1 and "
              "report the traceback)", file=sys.stderr)
        return 1
    return int(result or 0)


def os_error_line(exc: OSError) -> str:
    """One line for an ``OSError`` no command turned into a message: the path, and for a full disk
    the bytes free there; a path inside the cache names ``LEANML_CACHE``."""
    from leanml.faults import cache_root, free_bytes, is_disk_full, size

    path = exc.filename
    where = f": {path}" if path else ""
    cache = ""
    if path and str(Path(path).expanduser().absolute()).startswith(str(cache_root().absolute())):
        cache = " (the cache, LEANML_CACHE: set it to a writable folder with room)"
    if is_disk_full(exc):
        free = f", {size(free_bytes(path))} free there" if path else ""
        return f"disk full{where}{free}{cache}; free space there or choose another folder"
    return f"{exc.strerror or exc}{where}{cache}; check the path, its permissions and the free space"


if __name__ == "__main__":
    sys.exit(main())
