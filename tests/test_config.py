"""Options declared once: the generated command line and the library agree on names, defaults and errors."""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from typing import Literal

import pytest

from leanml.config import Bounds, ConfigError, Form, option, require
from leanml.flags import add_options, cli_message, flags_of, from_args, parser_flags


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
    inner: Inner = option(default_factory=Inner, form=Form(prefix="fista-"))


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


def test_a_nested_field_named_by_its_parent_gets_its_unique_flag() -> None:
    p = _parser()
    err = ConfigError("iters 0 needs mode b", Outer, ("iters", "mode"))
    assert cli_message(err, parser_flags(p)) == "--fista-iters 0 needs --mode b"


def test_a_bool_option_may_name_its_negative_flag() -> None:
    @dataclasses.dataclass(frozen=True)
    class Opts:
        precondition: bool = option(True, "rescale", form=Form(negative="--fista-no-precondition"))

    p = argparse.ArgumentParser()
    add_options(p, Opts, prefix="fista-")
    assert from_args(Opts, p.parse_args([]), prefix="fista-") == Opts()
    assert from_args(Opts, p.parse_args(["--fista-no-precondition"]), prefix="fista-") == Opts(precondition=False)
    assert from_args(Opts, p.parse_args(["--fista-precondition"]), prefix="fista-") == Opts(precondition=True)


@dataclasses.dataclass(frozen=True)
class Paths:
    source: str = option("a", "positional source", flag="source")
    log: tuple[str, ...] = option((), "repeatable log", form=Form(show_default=False, repeat=True))


def test_repeated_flags_make_a_tuple_and_a_positional_is_a_field() -> None:
    p = argparse.ArgumentParser()
    flags = add_options(p, Paths)
    assert [f.flag for f in flags] == ["source", "--log"]
    assert from_args(Paths, p.parse_args([])) == Paths()
    assert from_args(Paths, p.parse_args(["b", "--log", "x", "--log", "y"])) == Paths(source="b", log=("x", "y"))
    # a second parse starts from the default again (the appended list is not shared)
    assert from_args(Paths, p.parse_args(["--log", "z"])) == Paths(log=("z",))


@dataclasses.dataclass(frozen=True)
class Size:
    """A value read from one string (a dataclass, but not options to expand)."""

    n: int

    @classmethod
    def parse(cls, text: str) -> Size:
        if not text.isdigit():
            from leanml.errors import LeanmlError

            raise LeanmlError(f"cannot read size {text!r}; give a whole number")
        return cls(int(text))


@dataclasses.dataclass(frozen=True)
class Job:
    size: Size | None = option(None, "a size", parse=Size.parse)
    levels: tuple[float, ...] = option((), "levels", parse=lambda t: tuple(map(float, t.split(","))),
                                       form=Form(nargs="?", const="1,0"))
    outer: Outer = option(default_factory=lambda: Outer(sparsity=0.3, inner=Inner(iters=7)),
                          form=Form(prefix=""))


def test_parsed_values_bare_flags_and_nested_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    p = argparse.ArgumentParser()
    add_options(p, Job)
    assert from_args(Job, p.parse_args([])) == Job() and Job().outer.inner.iters == 7
    assert "(default 0.3)" in p.format_help()
    got = from_args(Job, p.parse_args(["--size", "5", "--levels", "--fista-iters", "3"]))
    assert got == Job(size=Size(5), levels=(1.0, 0.0), outer=Outer(sparsity=0.3, inner=Inner(iters=3)))
    assert from_args(Job, p.parse_args(["--levels", "0.5"])).levels == (0.5,)
    with pytest.raises(SystemExit):
        p.parse_args(["--size", "x"])
    assert "cannot read size 'x'" in capsys.readouterr().err


def test_to_argv_is_the_inverse_of_the_generated_parser() -> None:
    from leanml.cli import build_parser
    from leanml.flags import from_args, to_argv
    from leanml.memory.budget import Budget
    from leanml.prune.cli import prune_job
    from leanml.prune.config import PruneConfig, PruneJob
    from leanml.prune.methods.fista import FistaOptions
    from leanml.recover.config import RecoverConfig, recover_training
    from leanml.recover.job import RecoverJob

    parser = build_parser()
    for budget in (Budget.parse(0.35), Budget.parse("2GB")):
        job = RecoverJob(model="m", out="o", teacher="source", seqlen=128, evaluate=False, overwrite=True,
                         teacher_samples=0.25,
                         recover=RecoverConfig(train=recover_training(steps=7, lr=3e-4, budget=budget),
                                               kd_weight=0.9, keep_masks=False))
        argv = to_argv(job)
        assert "--no-eval" in argv and "--no-mask" in argv and "--steps" in argv and "--batch-size" not in argv
        assert from_args(RecoverJob, parser.parse_args(["recover", *argv])) == job
    job = PruneJob(out="o", config=PruneConfig(method="fista", pattern="2:4", seed=3,
                                               options=FistaOptions(iters=5, precondition=False)))
    argv = [*to_argv(job), *to_argv(job.config.options, FistaOptions.prefix)]  # method options: their own flags
    assert "--fista-no-precondition" in argv and "--pattern" in argv and "--fista-iters" in argv
    assert prune_job(parser.parse_args(["prune", *argv])) == job
    assert to_argv(RecoverJob(model="m", out="o")) == ["--model", "m", "--out", "o"]
    assert to_argv(RecoverJob(model="m", out="o"), always=("steps", "teacher")) == ["--model", "m", "--out", "o",
                                                                                  "--steps", "200"]


def test_cli_message_leaves_paths_and_quoted_values_alone() -> None:
    from leanml.config import ConfigError
    from leanml.flags import cli_message

    exc = ConfigError("report /tmp/features/report/x.json is a folder; 'report' is taken; set report", None,
                      ("report", "features"))
    flags = {(object, "report"): "--report", (object, "features"): "--features"}
    assert cli_message(exc, flags) == ("--report /tmp/features/report/x.json is a folder; 'report' is taken; "
                                       "set --report")


@dataclasses.dataclass(frozen=True)
class Declared:
    rate: float = option(0.5, "a share", bounds=Bounds(gt=0, le=1))
    steps: int = option(3, "steps", bounds=Bounds(ge=1))
    scale: float = option(1.0, "any finite number")
    cap: float = option(math.inf, "no cap by default", bounds=Bounds(finite=False))
    flag: bool = option(False, "a switch")
    mode: Literal["a", "b"] = option("a", "mode")
    limit: int | None = option(None, "an optional limit")
    levels: tuple[float, ...] = option((), "levels")
    inner: Inner = option(default_factory=Inner)


@pytest.mark.parametrize("changes,message", [
    (dict(rate=0.0), "rate must be in (0, 1], got 0.0"),
    (dict(rate=1.5), "rate must be in (0, 1], got 1.5"),
    (dict(steps=0), "steps must be at least 1, got 0"),
    (dict(rate=math.nan), "rate must be a finite number, got nan"),
    (dict(scale=math.inf), "scale must be a finite number, got inf"),
    (dict(scale=-math.inf), "scale must be a finite number, got -inf"),
    (dict(levels=(0.5, math.nan)), "levels must hold finite numbers, got nan"),
    (dict(steps=2.5), "steps must be an integer, got 2.5 (float)"),
    (dict(steps="2"), "steps must be an integer, got '2' (str)"),
    (dict(steps=True), "steps must be an integer, got True (bool)"),
    (dict(rate="0.5"), "rate must be a number, got '0.5' (str)"),
    (dict(flag=1), "flag must be True or False, got 1 (int)"),
    (dict(mode="c"), "mode must be a or b, got 'c'"),
    (dict(limit=2.0), "limit must be an integer or None, got 2.0 (float)"),
    (dict(levels=("x",)), "levels must be a tuple of a number, got ('x',) (tuple)"),
    (dict(inner={"iters": 3}), "inner must be a Inner, got {'iters': 3} (dict)"),
])
def test_declared_types_ranges_and_finite_floats_are_checked_when_made(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        Declared(**changes)
    assert str(err.value) == message and err.value.fields == (next(iter(changes)),)
    with pytest.raises(ConfigError, match=re.escape(message)):  # a copy with a change is checked again
        dataclasses.replace(Declared(), **changes)


def test_what_the_declarations_allow_is_taken() -> None:
    made = Declared(rate=1, steps=10**30, scale=-1e300, flag=True, mode="b", limit=None, levels=[0.1, 2])
    assert made.rate == 1 and made.steps == 10**30 and made.levels == [0.1, 2]
    assert Declared().cap == math.inf  # declared finite=False
    assert Declared(inner=Inner(iters=4)).inner.iters == 4
    with pytest.raises(ConfigError, match="iters must be >= 1"):  # the class's own checks still run, after
        Declared(inner=Inner(iters=0))


def test_a_subclass_checks_the_fields_it_inherits_and_its_own_hook_runs_once() -> None:
    calls = []

    @dataclasses.dataclass(frozen=True)
    class Child(Declared):
        extra: int = option(1, "one more", bounds=Bounds(ge=0))

        def __post_init__(self) -> None:
            calls.append(self.extra)

    assert Child(extra=2).extra == 2 and calls == [2]
    with pytest.raises(ConfigError, match="rate must be in"):
        Child(rate=2.0)
    with pytest.raises(ConfigError, match="extra must be at least 0"):
        Child(extra=-1)


def test_a_default_tells_a_given_value_apart_from_the_same_number() -> None:
    import json
    import pickle

    from leanml.config import default, given

    @dataclasses.dataclass(frozen=True)
    class Opts:
        share: float = option(default(0.5), "a share", bounds=Bounds(gt=0, lt=1))

    assert not given(Opts().share) and given(Opts(share=0.5).share) and Opts() == Opts(share=0.5)
    assert json.dumps(Opts().share) == "0.5" and repr(Opts().share) == "0.5"
    assert not given(pickle.loads(pickle.dumps(Opts().share)))
    p = argparse.ArgumentParser()
    add_options(p, Opts)
    assert not given(from_args(Opts, p.parse_args([])).share)
    assert given(from_args(Opts, p.parse_args(["--share", "0.5"])).share)


def test_argument_checks_name_the_argument_and_what_it_takes() -> None:
    import torch

    from leanml.config import check_argument, check_token_ids

    check_argument(None, "config", (dict, type(None)), "a dict or None")
    with pytest.raises(TypeError, match=r"^config must be a dict or None, got list; use a dict$"):
        check_argument([], "config", (dict, type(None)), "a dict or None", "use a dict")
    check_token_ids(torch.zeros(2, 3, dtype=torch.long), "ids")
    with pytest.raises(TypeError, match="ids must be a torch.Tensor of token ids"):
        check_token_ids([[1, 2]], "ids")
    with pytest.raises(ValueError, match=r"ids must be token ids \(n, seqlen\) \(2-D\), got shape \(3,\)"):
        check_token_ids(torch.zeros(3, dtype=torch.long), "ids")
    with pytest.raises(ValueError, match="ids must hold integer token ids, got dtype float32"):
        check_token_ids(torch.zeros(2, 3), "ids")
