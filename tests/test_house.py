"""House rules checked over the whole source: the command line starts without torch, the library's messages
name no flag the command line lacks, functions stay short, and the command table matches its modules."""

from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap

from leanml.cli import ALL, COMMANDS, build_parser

#: commands whose ``--help`` still imports torch, with the import that does it (remove one when it is fixed)
TORCH_HELP_PENDING = {
    "prune": "prune.config imports prune.engine.allocation (OwlOptions, check_profile), masks and methods",
    "eval": "registered by prune.cli with prune (the same imports)",
    "train": "memory.job imports leanml.train, whose config imports memory.adacc (AdaccOptions)",
    "recover": "recover.job imports eval.job (check_seqlen), which imports torch",
}

HELP_SCRIPT = """
import argparse, contextlib, io, sys
import leanml.cli

def commands(parser, prefix=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*prefix, name)
                yield from commands(sub, (*prefix, name))

argv = sys.argv[1:]
parser = leanml.cli.build_parser(leanml.cli.command_of(argv))
words = [()] if not argv else [c for c in commands(parser) if c[0] == argv[0]]
for words in words:
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):
        leanml.cli.main([*words, "--help"])
    assert "usage: leanml" in out.getvalue(), (words, out.getvalue()[:200])
heavy = [m for m in ("torch", "transformers", "numpy", "scipy") if m in sys.modules]
assert not heavy, f"leanml {' '.join(argv)} --help imported {heavy}"
print(len(words))
"""


def _help_imports(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", HELP_SCRIPT, *argv], capture_output=True, text=True, timeout=120)


def test_top_level_help_imports_no_torch() -> None:
    proc = _help_imports()
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_command_help_imports_no_torch() -> None:
    """Every command's ``--help`` and its subcommands' (``ctr train --help``), each in a fresh interpreter."""
    failed = []
    for command in COMMANDS:
        if command in TORCH_HELP_PENDING:
            continue
        proc = _help_imports(command)
        if proc.returncode != 0:
            failed.append(f"{command}: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    assert not failed, failed


def test_the_help_check_fails_on_an_import_of_torch() -> None:
    """The check above can fail: a command whose help imports torch is caught."""
    pending = next(iter(TORCH_HELP_PENDING), None)
    if pending is None:  # none left: plant one
        script = HELP_SCRIPT.replace("argv = sys.argv[1:]", "import torch\nargv = sys.argv[1:]")
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    else:
        proc = _help_imports(pending)
    assert proc.returncode != 0 and "imported ['torch'" in proc.stderr, proc.stderr[-500:]


def test_command_lines_match_their_modules() -> None:
    """The lines ``leanml --help`` shows without importing a module are the ones each module registers."""
    registered = {}
    for action in build_parser(ALL)._actions:
        if isinstance(action, argparse._SubParsersAction):
            registered = {a.dest: a.help for a in action._choices_actions}
    assert registered == {name: line for name, (_, line) in COMMANDS.items()}
    assert list(registered) == list(COMMANDS)


def test_ctr_model_names_match_the_models() -> None:
    from leanml.ctr.models import MODELS
    from leanml.ctr.options import CTR_MODELS

    assert sorted(CTR_MODELS) == sorted(MODELS)


def test_an_unknown_command_imports_nothing() -> None:
    script = textwrap.dedent("""
        import sys
        import leanml.cli
        assert leanml.cli.main(["prnue", "--help"]) == 2
        assert not [m for m in sys.modules if m.startswith("leanml.") and m.endswith("cli") and m != "leanml.cli"]
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-1000:]
    assert "invalid choice: 'prnue'" in proc.stderr
