"""Every job's options refuse bad numbers in one line, or take them: drawn, not listed.

The option classes are collected from the command line itself (every dataclass whose fields a
subcommand's flags set, nested option groups and method options included), so a new job is covered
when it gets its flags. Each numeric field is drawn from {nan, inf, -inf, 0, -1, huge, a wrong type};
making the class must give an instance or a :class:`ConfigError`, never another exception. The
command-line cases then check the reported holes through the real ``leanml`` (exit 2, one line, nothing
written), and the options that would silently override another are refused when both are given.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import typing
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cli.conftest import assert_unchanged, assert_user_error, run_cli, snapshot
from leanml.config import ConfigError, _field_types, _unwrap_optional
from leanml.flags import parser_flags


def _option_classes() -> list[type]:
    """Every options dataclass a subcommand's flags set (in the order the parser meets them)."""
    from leanml.cli import build_parser

    owners: dict[type, None] = {}

    def walk(parser: argparse.ArgumentParser) -> None:
        for flag in parser_flags(parser):
            owners.setdefault(flag.owner)
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    walk(sub)

    walk(build_parser())
    return list(owners)


def _numeric(tp: typing.Any) -> type | None:
    """int or float for a (possibly Optional) numeric field type, else None."""
    inner, _ = _unwrap_optional(tp)
    return inner if inner in (int, float) else None


CLASSES = _option_classes()
NUMERIC = {cls: [(f.name, _numeric(tp)) for f, tp in _field_types(cls) if _numeric(tp)] for cls in CLASSES}
BAD = {int: [0, -1, 10**30, 2.5, "2", None, True],
       float: [math.nan, math.inf, -math.inf, 0.0, -1.0, 1e300, "0.5", None, True]}


def _required(cls: type) -> dict[str, typing.Any]:
    """A plain value for each field without a default (a path or name: every required field is one)."""
    return {f.name: "x" for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}  # type: ignore[misc]


def test_the_cli_reaches_every_job_and_its_numeric_fields() -> None:
    names = {cls.__name__ for cls in CLASSES}
    # one job per command family, and the method options that ride on `leanml prune`
    assert {"PruneJob", "PruneConfig", "EvalJob", "SpeedJob", "RecoverJob", "RecoverConfig", "TrainConfig",
            "SparseGPTOptions", "FaspOptions", "OwlOptions", "CTRConfig", "GenerateJob"} <= names
    assert sum(len(v) for v in NUMERIC.values()) >= 60


@pytest.mark.parametrize("cls", [c for c in CLASSES if NUMERIC[c]], ids=lambda c: f"{c.__module__}.{c.__name__}")
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_numeric_field_is_taken_or_refused_in_one_line(cls: type, data: st.DataObject) -> None:
    values = dict(_required(cls))
    for name, kind in NUMERIC[cls]:
        value = data.draw(st.one_of(st.none().map(lambda _: dataclasses.MISSING), st.sampled_from(BAD[kind])),
                          label=name)
        if value is not dataclasses.MISSING:
            values[name] = value
    try:
        made = cls(**values)
    except ConfigError as exc:
        message = str(exc)
        assert "\n" not in message and message, message
        assert exc.fields and all(f in message for f in exc.fields), message
        return
    for name, kind in NUMERIC[cls]:  # what was taken is of its type and finite
        got = getattr(made, name)
        assert got is None or (isinstance(got, kind) and not isinstance(got, bool)), (name, got)
        assert got is None or math.isfinite(got), (name, got)


# the reported holes: each must be one line, exit 2, before any work, nothing written
INF_CASES = [
    (["prune", "--model", "m", "--method", "sparsegpt", "--sparsegpt-damp", "inf"], "--sparsegpt-damp"),
    (["prune", "--model", "m", "--method", "fasp", "--sparsity", "0.2", "--fasp-damp", "inf"], "--fasp-damp"),
    (["prune", "--model", "m", "--owl-lambda", "nan"], "--owl-lambda"),
    (["prune", "--model", "m", "--sparsity", "nan"], "--sparsity"),
    (["recover", "--model", "m", "--lr", "inf"], "--lr"),
    (["recover", "--model", "m", "--weight-decay", "inf"], "--weight-decay"),
    (["recover", "--model", "m", "--teacher", "source", "--kd-temperature", "inf"], "--kd-temperature"),
    (["recover", "--model", "m", "--max-grad-norm", "nan"], "--max-grad-norm"),
    (["train", "--model", "m", "--lr", "inf"], "--lr"),
    (["features", "train", "--lr", "inf"], "--lr"),
    (["features", "train", "--lr", "nan"], "--lr"),
]


@pytest.mark.parametrize("argv,flag", INF_CASES, ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_non_finite_options_are_refused_through_the_cli(argv: list[str], flag: str, tmp_path: Path) -> None:
    if argv[0] in ("prune", "recover"):
        argv = [*argv, "--out", str(tmp_path / "out")]
    if argv[0] == "features":
        argv = [*argv, "--report", str(tmp_path / "report.json")]
    before = snapshot(tmp_path)
    line = assert_user_error(run_cli(argv, cwd=tmp_path), flag)
    assert "finite" in line or "must be" in line, line
    assert_unchanged(before, tmp_path)


CONFLICTS = [
    (["prune", "--pattern", "2:4", "--sparsity", "0.7"], ("--pattern 2:4", "--sparsity 0.7")),
    (["prune", "--pattern", "2:4", "--scope", "row"], ("--scope row", "--pattern 2:4")),
    (["prune", "--no-eval", "--eval-windows", "3"], ("--eval-windows", "without --eval")),
    (["prune", "--stream", "--eval-windows", "3"], ("--eval-windows", "--stream")),
    (["recover", "--no-eval", "--eval-windows", "3"], ("--eval-windows", "--no-eval")),
    (["recover", "--kd-weight", "0.9"], ("--kd-weight", "--teacher")),
    (["recover", "--kd-temperature", "2"], ("--kd-temperature", "--teacher")),
    (["ctr", "train", "--content-ids", "c", "--visual-ids", "v.parquet"], ("--visual-ids", "--content-ids")),
    (["ctr", "train", "--content-ids", "c", "--seed-content", "3"], ("--seed-content", "--content-ids")),
]


@pytest.mark.parametrize("argv,needles", CONFLICTS, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_an_option_that_would_override_another_is_refused(argv: list[str], needles: tuple[str, ...],
                                                          tmp_path: Path) -> None:
    argv = [*argv, "--model", "m", "--out", str(tmp_path / "out")] if argv[0] in ("prune", "recover") else \
        [*argv, "--out", str(tmp_path / "out")]
    before = snapshot(tmp_path)
    assert_user_error(run_cli(argv, cwd=tmp_path), *needles)
    assert_unchanged(before, tmp_path)


def test_the_overridden_options_keep_their_defaults_working() -> None:
    from leanml.cli import build_parser
    from leanml.prune.cli import prune_job
    from leanml.recover.job import RecoverJob

    parser = build_parser()
    for argv, sparsity in ((["--pattern", "2:4"], 0.5), (["--pattern", "1:4"], 0.75),
                           (["--pattern", "1:4", "--sparsity", "0.75"], 0.75), (["--sparsity", "0.7"], 0.7)):
        job = prune_job(parser.parse_args(["prune", "--model", "m", "--out", "o", *argv]))
        assert job.config.spec.target_sparsity == pytest.approx(sparsity)
    args = parser.parse_args(["recover", "--model", "m", "--out", "o", "--teacher", "t", "--kd-weight", "0.9"])
    from leanml.flags import from_args

    assert from_args(RecoverJob, args).recover.kd_weight == 0.9
    assert from_args(RecoverJob, parser.parse_args(["recover", "--model", "m", "--out", "o"])).teacher is None
