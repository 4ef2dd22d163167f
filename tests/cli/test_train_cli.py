"""``leanml train`` through the real CLI: bad inputs refused before the model is loaded, with one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from cli.conftest import assert_unchanged, assert_user_error
from cli.llm_cases import readonly, resolve, setup_readonly, setup_truncated, with_option
from cli.parallel import Case, run_cases


def train(*extra: str, model: str = "model", data: str = "text.txt", out: str = "out"):
    def args(d: Path, shared: Path) -> list[str]:
        return ["train", "--model", resolve(model, d, shared), "--data", resolve(data, d, shared),
                "--seqlen", "32", "--batch-size", "2", "--steps", "2", "--out", str(d / out), *extra]
    return args


def _out_exists(d: Path, shared: Path) -> None:
    (d / "out").mkdir()


CASES = [
    Case("batch-size-0", train("--batch-size", "0"), ("--batch-size",)),
    Case("steps-negative", train("--steps", "-1"), ("--steps",)),
    Case("seqlen-1", train("--seqlen", "1"), ("--seqlen",)),
    Case("lr-0", train("--lr", "0"), ("--lr",)),
    Case("max-error-2", train("--max-error", "2"), ("--max-error",)),
    Case("threads-0", train("--threads", "0"), ("--threads",)),
    Case("budget-word", train("--memory-budget", "lots"), ("memory budget", "lots")),
    Case("budget-2.0-no-unit", train("--memory-budget", "2.0"), ("2.0", "unit")),
    Case("budget-0", train("--memory-budget", "0"), ("memory budget",)),
    Case("unknown-memory", train("--memory", "magic"), ("--memory",)),
    Case("truncated-safetensors", train(model="cut"), ("model.safetensors", "truncated"), setup=setup_truncated),
    Case("bert-encoder", train(model="bert"), ("encoder",)),
    Case("latin1-data", train(data="latin1.txt"), ("--data", "not UTF-8")),
    Case("seqlen-above-model", train("--seqlen", "1024"), ("--seqlen", "maximum")),
    Case("out-read-only", with_option(train(), "--out", lambda d, s: readonly(d) / "out"), ("--out", "cannot write"),
         setup=setup_readonly),
    Case("out-exists", train(), ("already exists",), setup=_out_exists),
]


@pytest.fixture(scope="module")
def outcomes(llm_inputs, tmp_path_factory):
    return run_cases(CASES, tmp_path_factory.mktemp("train-cases"), llm_inputs)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_and_writes_nothing(case: Case, outcomes) -> None:
    out = outcomes[case.id]
    assert_user_error(out.result, *case.needles)
    assert_unchanged(out.before, *out.roots)
