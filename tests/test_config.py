"""Options declared once: the generated command line and the library agree on names, defaults and errors."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Literal

import pytest

from leanml.config import (
    ConfigError,
    add_options,
    cli_message,
    flags_of,
    from_args,
    option,
    parser_flags,
    require,
)


@dataclasses.dataclass(frozen=True)
class Inner:
    ridge: float = option(0.1, "ridge of the refit", flag="--fista-ridge")
    iters: int = option(20, "iterations per round")

    def __post_init__(self) -> None:
        require(self, self.iters >= 1, "iters", f"must be >= 1, got {self.iters}")
        require(self, not (self.ridge == 0 and self.iters > 50), ("ridge", "iters"),
                "ridge 0 needs iters <= 50")


@dataclasses.dataclass(frozen=True)
class Outer:
    sparsity: float = option(0.5, "share of weights removed")
    mode: Literal["a", "b"] = option("a", "mode")
    verbose: bool = option(False, "print more")
    limit: int | None = option(None, "an optional limit")
    hidden: str = option("x", "not on the command line", cli=False)
    inner: Inner = option(default_factory=Inner, prefix="fista-")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_options(p.add_argument_group("options"), Outer)
    return p


def test_defaults_match_the_dataclass() -> None:
    assert from_args(Outer, _parser().parse_args([])) == Outer()


def test_values_types_and_nesting() -> None:
    args = _parser().parse_args(["--fista-iters", "3", "--mode", "b", "--verbose", "--limit", "4", "--sparsity", "0.7"])
    got = from_args(Outer, args, hidden="y")
    assert got == Outer(sparsity=0.7, mode="b", verbose=True, limit=4, hidden="y", inner=Inner(iters=3))
    with pytest.raises(SystemExit):
        _parser().parse_args(["--mode", "c"])


def test_every_flag_maps_to_one_field_and_back() -> None:
    flags = parser_flags(_parser())
    assert [f.flag for f in flags] == ["--sparsity", "--mode", "--verbose", "--limit", "--fista-ridge", "--fista-iters"]
    assert {(f.owner, f.field): f.flag for f in flags} == flags_of(Outer)


def test_errors_name_fields_in_python_and_flags_on_the_command_line() -> None:
    p = _parser()
    with pytest.raises(ConfigError) as err:
        from_args(Outer, p.parse_args(["--fista-iters", "0"]))
    assert str(err.value) == "iters must be >= 1, got 0"
    assert cli_message(err.value, parser_flags(p)) == "--fista-iters must be >= 1, got 0"
    with pytest.raises(ConfigError) as err:
        Inner(ridge=0, iters=60)
    assert cli_message(err.value, parser_flags(p)) == "--fista-ridge 0 needs --fista-iters <= 50"


def test_the_cli_prints_flags_for_a_refused_option(capsys: pytest.CaptureFixture[str]) -> None:
    from leanml.cli import main

    assert main(["prune", "--model", "x", "--method", "fista", "--fista-iters", "0", "--out", "/tmp/never"]) == 2
    assert "--fista-iters" in capsys.readouterr().err
