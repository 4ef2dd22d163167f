"""``leanml recover`` through the real CLI: bad inputs refused before the model is loaded, with one line;
a run refused later (a budget below the smallest plan) leaves nothing, so the next run is not taken for
an interrupted one; a finished run says how long the rest will take after its first step."""

from __future__ import annotations

from pathlib import Path

import pytest

from cli.conftest import assert_no_traceback, assert_unchanged, assert_user_error, run_cli, snapshot
from cli.llm_cases import readonly, resolve, setup_readonly, setup_truncated, with_option
from cli.parallel import Case, run_cases


def recover(*extra: str, model: str = "pruned", data: str = "text.txt", out: str = "out"):
    def args(d: Path, shared: Path) -> list[str]:
        evals = [] if "--no-eval" in extra else ["--eval-data", str(shared / "text.txt"), "--eval-seqlen", "32"]
        return ["recover", "--model", resolve(model, d, shared), "--data", resolve(data, d, shared), *evals,
                "--seqlen", "32", "--steps", "4", "--batch-size", "2", "--out", str(d / out), *extra]
    return args


def _ckpt_left(d: Path, shared: Path) -> None:
    (d / "out.ckpt").mkdir()


def _cache_is_file(d: Path, shared: Path) -> None:
    (d / "cache").write_text("not a folder")


CASES = [
    Case("device-foo", recover("--device", "foo"), ("--device", "foo")),
    Case("steps-0", recover("--steps", "0"), ("--steps",)),
    Case("batch-size-negative", recover("--batch-size", "-1"), ("--batch-size",)),
    Case("lr-negative", recover("--lr", "-0.1"), ("--lr",)),
    Case("kd-weight-2", recover("--kd-weight", "2"), ("--kd-weight",)),
    Case("teacher-samples-1.5", recover("--teacher-samples", "1.5"), ("--teacher-samples",)),
    Case("eval-windows-0", recover("--eval-windows", "0"), ("--eval-windows",)),
    Case("checkpoint-every-0", recover("--checkpoint-every", "0"), ("--checkpoint-every",)),
    Case("threads-0", recover("--threads", "0"), ("--threads",)),
    Case("budget-2.0-no-unit", recover("--memory-budget", "2.0"), ("2.0", "unit")),
    Case("budget-with-checkpoint", recover("--memory", "checkpoint", "--memory-budget", "0.5"), ("--memory-budget",)),
    Case("truncated-model", recover(model="cut"), ("model.safetensors", "truncated"), setup=setup_truncated),
    Case("truncated-teacher", lambda d, s: recover("--teacher", str(d / "cut"))(d, s),
         ("model.safetensors", "truncated"), setup=setup_truncated),
    Case("bert-encoder", recover(model="bert"), ("encoder",)),
    Case("latin1-data", recover(data="latin1.txt"), ("--data", "not UTF-8")),
    Case("missing-eval-data", recover("--eval-data", "/no/such.txt"), ("--eval-data", "no such file")),
    Case("samples-without-teacher", recover("--teacher-samples", "0.5"), ("--teacher",)),
    Case("samples-cache-is-a-file",
         lambda d, s: recover("--teacher", str(s / "model"), "--teacher-samples", "0.5",
                              "--teacher-samples-cache", str(d / "cache"))(d, s),
         ("--teacher-samples-cache", "directory"), setup=_cache_is_file),
    Case("out-read-only", with_option(recover(), "--out", lambda d, s: readonly(d) / "out"), ("--out", "cannot write"),
         setup=setup_readonly),
    Case("checkpoint-left", recover(), ("--resume", "delete"), setup=_ckpt_left),
]


@pytest.fixture(scope="module")
def outcomes(llm_inputs, tmp_path_factory):
    return run_cases(CASES, tmp_path_factory.mktemp("recover-cases"), llm_inputs)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_and_writes_nothing(case: Case, outcomes) -> None:
    out = outcomes[case.id]
    assert_user_error(out.result, *case.needles)
    assert_unchanged(out.before, *out.roots)


def test_a_refused_budget_leaves_nothing_and_the_next_run_is_not_called_interrupted(llm_inputs, tmp_path) -> None:
    args = recover("--teacher", str(llm_inputs / "model"), "--teacher-samples", "0.5", "--memory-budget", "1KB",
                   "--no-eval")(tmp_path, llm_inputs)
    before = snapshot(tmp_path)
    for _ in range(2):
        result = run_cli(args)
        assert_user_error(result, "smallest feasible plan", before_work=False)
        assert "interrupted" not in result.stderr
        assert_unchanged(before, tmp_path)


def test_a_run_prints_its_estimate_after_the_first_step(llm_inputs, tmp_path) -> None:
    result = run_cli(recover("--no-eval", "--memory", "none", "--threads", "1")(tmp_path, llm_inputs))
    assert result.code == 0, str(result)
    assert_no_traceback(result)
    assert "recover: 1 step took" in result.stderr and "for the rest (3 steps)" in result.stderr
    assert (tmp_path / "out" / "report.json").is_file() and not (tmp_path / "out.ckpt").exists()
    assert not list(tmp_path.glob(".out.*"))
