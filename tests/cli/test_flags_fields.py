"""Every flag of every ``leanml`` subcommand is generated from exactly one config field, and back."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from leanml.cli import build_parser
from leanml.config import ConfigError
from leanml.flags import cli_message, parser_flags


def _commands(parser: argparse.ArgumentParser, prefix: str = "leanml") -> list[tuple[str, argparse.ArgumentParser]]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.append((f"{prefix} {name}", sub))
                found.extend(_commands(sub, f"{prefix} {name}"))
    return found


COMMANDS = _commands(build_parser())
LEAVES = [(name, p) for name, p in COMMANDS
          if not any(isinstance(a, argparse._SubParsersAction) for a in p._actions)]


def test_there_are_commands_to_check() -> None:
    names = {name for name, _ in LEAVES}
    assert {"leanml prune", "leanml eval", "leanml train", "leanml recover"} <= names
    assert any(n.startswith("leanml ctr ") for n in names) and any(n.startswith("leanml features ") for n in names)


@pytest.mark.parametrize("name,parser", LEAVES, ids=[n for n, _ in LEAVES])
def test_every_flag_maps_to_one_field_and_back(name: str, parser: argparse.ArgumentParser) -> None:
    generated = parser_flags(parser)
    by_flag = {f.flag: f for f in generated}
    assert len(by_flag) == len(generated), f"{name}: a flag generated twice"
    fields = [(f.owner, f.field) for f in generated]
    assert len(set(fields)) == len(fields), f"{name}: a field behind two flags"
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        flags = [s for s in action.option_strings if s.startswith("--")] or [action.dest]  # or a positional
        owner = next((by_flag[f] for f in flags if f in by_flag), None)
        assert owner is not None, f"{name}: {flags[0]} is not generated from a config field"
        assert dataclasses.is_dataclass(owner.owner)
        assert owner.field in {f.name for f in dataclasses.fields(owner.owner)}


def _flags(command: str) -> list:
    return parser_flags(dict(COMMANDS)[command])


def _raised(call) -> ConfigError:
    with pytest.raises(ConfigError) as exc:
        call()
    return exc.value


def test_library_refusals_name_fields_and_the_command_line_shows_flags(tmp_path) -> None:
    import torch

    from leanml.features.read.readers import LogReader
    from leanml.models import check_dtype, parse_dtype
    from leanml.prune.cores.fasp import num_kept
    from leanml.prune.engine.allocation import owl_allocation
    from leanml.prune.masks import MaskSpec
    from leanml.train import batches

    cases = [
        (lambda: MaskSpec(1.5), "leanml prune", "sparsity must be in (0, 1), got 1.5", "--sparsity must be"),
        (lambda: num_kept(8, 1.0), "leanml prune", "structured sparsity must be in [0, 1)", "structured --sparsity"),
        (lambda: owl_allocation([0.1, 0.2], 0.5, lam=-1.0), "leanml prune", "owl lam must be >= 0",
         "owl --owl-lambda must"),
        (lambda: parse_dtype("int3"), "leanml prune", "unknown dtype 'int3'", "unknown --dtype 'int3'"),
        (lambda: check_dtype(torch.bfloat16, "meta"), "leanml eval", "use dtype float32", "use --dtype float32"),
        (lambda: batches(torch.zeros(2, 8, dtype=torch.long), 4, 1, 0), "leanml train",
         "lower batch_size or seqlen", "lower --batch-size or --seqlen"),
        (lambda: LogReader([], None), "leanml features train", "pass at least one log PATH",
         "pass at least one --log PATH"),
    ]
    for call, command, library, cli in cases:
        exc = _raised(call)
        assert library in str(exc) and "--" not in str(exc), str(exc)
        assert cli in cli_message(exc, _flags(command)), (command, cli_message(exc, _flags(command)))


def test_any_error_naming_fields_reads_as_flags_on_the_command_line(tmp_path) -> None:
    import pickle

    from leanml.errors import LeanmlError
    from leanml.flags import flag_of
    from leanml.prune.job import PruneJob

    exc = LeanmlError("disk full; free space and rerun with resume", fields=("resume",))
    assert str(exc).endswith("rerun with resume")  # Python callers read the field
    assert cli_message(exc, _flags("leanml prune")).endswith("rerun with --resume")
    assert pickle.loads(pickle.dumps(exc)).fields == ("resume",)  # from a worker process too
    assert flag_of(PruneJob, "resume") == "--resume"
    with pytest.raises(ValueError, match="no_such"):
        flag_of(PruneJob, "no_such")


def test_flag_of_names_the_negative_flag_of_a_boolean_field() -> None:
    from leanml.flags import flag_of
    from leanml.prune.methods.fista import FistaOptions
    from leanml.recover.job import RecoverJob

    assert flag_of(RecoverJob, "evaluate", negative=True) == "--no-eval"
    assert flag_of(FistaOptions, "precondition", "fista-", negative=True) == "--fista-no-precondition"  # declared


def test_a_field_name_inside_a_file_name_is_not_rewritten() -> None:
    from leanml.errors import LeanmlError

    exc = LeanmlError("cannot write /tmp/a.out or out.bin or model/out; choose another out.", fields=("out",))
    assert cli_message(exc, _flags("leanml prune")) == (
        "cannot write /tmp/a.out or out.bin or model/out; choose another --out.")
