"""``leanml eval`` through the real CLI: bad inputs refused before the evaluation with one line; a plain
run prints its perplexity and writes nothing into the working directory (JSON only with ``--json``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cli.conftest import assert_no_traceback, assert_unchanged, assert_user_error, run_cli, snapshot
from cli.llm_cases import readonly, resolve, setup_cut_config, setup_readonly, setup_truncated, with_option
from cli.parallel import Case, run_cases


def evaluate(*extra: str, model: str = "model", data: str = "text.txt"):
    def args(d: Path, shared: Path) -> list[str]:
        return ["eval", "--model", resolve(model, d, shared), "--data", resolve(data, d, shared),
                "--seqlen", "32", *extra]
    return args


def _json_dir(d: Path, shared: Path) -> None:
    (d / "results").mkdir()


CASES = [
    Case("json-is-a-folder", with_option(evaluate("--json", "x"), "--json", lambda d, s: d / "results"),
         ("--json", "folder"), setup=_json_dir),
    Case("json-read-only", with_option(evaluate("--json", "x"), "--json", lambda d, s: readonly(d) / "ppl.json"),
         ("--json", "cannot write"), setup=setup_readonly),
    Case("max-windows-0", evaluate("--max-windows", "0"), ("--max-windows",)),
    Case("batch-size-0", evaluate("--batch-size", "0"), ("--batch-size",)),
    Case("seqlen-word", evaluate("--seqlen", "long"), ("--seqlen",)),
    Case("threads-negative", evaluate("--threads", "-2"), ("--threads",)),
    Case("device-foo", evaluate("--device", "foo"), ("--device",)),
    Case("dtype-int8", evaluate("--dtype", "int8"), ("--dtype",)),
    Case("truncated-safetensors", evaluate(model="cut"), ("model.safetensors", "truncated"), setup=setup_truncated),
    Case("config-cut-mid-line", evaluate(model="cutcfg"), ("config.json",), setup=setup_cut_config),
    Case("bert-encoder", evaluate(model="bert"), ("encoder",)),
    Case("latin1-data", evaluate(data="latin1.txt"), ("--data", "not UTF-8")),
    Case("unknown-corpus", evaluate(data="wikitext3"), ("unknown corpus", "wikitext3")),
    Case("model-is-a-file", evaluate(model="text.txt"), ("is a file",)),
]
if not torch.cuda.is_available():
    CASES.append(Case("device-cuda-absent", evaluate("--device", "cuda"), ("no CUDA",)))


@pytest.fixture(scope="module")
def outcomes(llm_inputs, tmp_path_factory):
    return run_cases(CASES, tmp_path_factory.mktemp("eval-cases"), llm_inputs)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_and_writes_nothing(case: Case, outcomes) -> None:
    out = outcomes[case.id]
    assert_user_error(out.result, *case.needles)
    assert_unchanged(out.before, *out.roots)
    assert "perplexity" not in out.result.stdout  # refused before the evaluation, not after


def test_eval_writes_nothing_into_the_working_directory_unless_asked(llm_inputs, tmp_path) -> None:
    before = snapshot(tmp_path)
    result = run_cli(evaluate("--max-windows", "2", "--threads", "1")(tmp_path, llm_inputs), cwd=tmp_path)
    assert result.code == 0, str(result)
    assert_no_traceback(result)
    assert "perplexity" in result.stdout
    assert_unchanged(before, tmp_path)
    result = run_cli(evaluate("--max-windows", "2", "--json", "ppl.json")(tmp_path, llm_inputs), cwd=tmp_path)
    assert result.code == 0, str(result)
    report = json.loads((tmp_path / "ppl.json").read_text())
    assert report["windows"] == 2 and report["ppl"] > 1 and report["threads"] >= 1
