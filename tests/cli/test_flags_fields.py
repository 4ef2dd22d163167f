"""Every flag of every ``leanml`` subcommand is generated from exactly one config field, and back."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from leanml.cli import build_parser
from leanml.config import parser_flags


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
