"""``leanml prune`` through the real CLI: every bad input is refused before any work with one line, no
traceback and the tree unchanged; a refused checkpoint points to fixes the next check accepts."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from cli.conftest import assert_unchanged, assert_user_error, run_cli, snapshot
from cli.llm_cases import readonly, resolve, setup_cut_config, setup_readonly, setup_truncated, with_option
from cli.parallel import Case, run_cases


def prune(*extra: str, model: str = "model", calib: str = "text.txt", out: str = "out"):
    """The command line of a small prune run in case folder ``d`` on inputs in ``shared``; ``extra`` wins."""
    def args(d: Path, shared: Path) -> list[str]:
        return ["prune", "--model", resolve(model, d, shared), "--calib", resolve(calib, d, shared),
                "--eval-data", str(shared / "text.txt"), "--seqlen", "32", "--nsamples", "2",
                "--out", str(d / out), *extra]
    return args


def _no_config(d: Path, shared: Path) -> None:
    shutil.copytree(shared / "model", d / "nocfg")
    (d / "nocfg" / "config.json").unlink()


def _out_exists(d: Path, shared: Path) -> None:
    (d / "out").mkdir()
    (d / "out" / "keep.txt").write_text("earlier result")


def _out_is_file(d: Path, shared: Path) -> None:
    (d / "out").write_text("a file")


def _ckpt_left(d: Path, shared: Path) -> None:
    (d / "out.ckpt").mkdir()
    (d / "out.ckpt" / "state.pt").write_bytes(b"\0" * 16)


def _empty(d: Path, shared: Path) -> None:
    (d / "empty.txt").write_text("")


CASES = [
    Case("batch-size-0", prune("--batch-size", "0"), ("--batch-size", "at least 1")),
    Case("batch-size-negative", prune("--batch-size", "-1"), ("--batch-size",)),
    Case("eval-windows-0", prune("--eval-windows", "0"), ("--eval-windows",)),
    Case("nsamples-0", prune("--nsamples", "0"), ("--nsamples",)),
    Case("seqlen-1", prune("--seqlen", "1"), ("--seqlen",)),
    Case("seqlen-above-model", prune("--seqlen", "4096"), ("--seqlen", "maximum of 256")),
    Case("sparsity-1.5", prune("--sparsity", "1.5"), ("--sparsity", "(0, 1)")),
    Case("sparsity-word", prune("--sparsity", "half"), ("--sparsity",)),
    Case("threads-0", prune("--threads", "0"), ("--threads",)),
    Case("unknown-flag", prune("--sparsty", "0.5"), ("--sparsty",)),
    Case("unknown-method", prune("--method", "best"), ("--method", "best")),
    Case("device-foo", prune("--device", "foo"), ("--device", "foo")),
    Case("device-mps", prune("--device", "mps"), ("--device mps",)),
    Case("truncated-safetensors", prune(model="cut"), ("model.safetensors", "truncated"), setup=setup_truncated),
    Case("config-cut-mid-line", prune(model="cutcfg"), ("config.json", "not valid JSON"), setup=setup_cut_config),
    Case("no-config", prune(model="nocfg"), ("no config.json",), setup=_no_config),
    Case("missing-model", prune(model="/no/such/model"), ("/no/such/model", "does not exist")),
    Case("hub-id-offline", prune(model="someorg/no-such-model"), ("someorg/no-such-model", "not reachable")),
    Case("bert-encoder", prune(model="bert"), ("bert", "encoder", "decoder-only")),
    Case("latin1-calibration", prune(calib="latin1.txt"), ("--calib", "not UTF-8", "iconv")),
    Case("empty-calibration", prune(calib="empty.txt"), ("is empty",), setup=_empty),
    Case("missing-calibration", prune(calib="/no/such.txt"), ("--calib", "no such file")),
    Case("wikitext2-offline", prune("--calib", "wikitext2"), ("wikitext2", "hub")),
    Case("out-exists", prune(), ("already exists", "--overwrite"), setup=_out_exists),
    Case("out-is-file", prune(), ("is a file",), setup=_out_is_file),
    Case("out-read-only", with_option(prune(), "--out", lambda d, s: readonly(d) / "out"), ("--out", "cannot write"),
         setup=setup_readonly),
    Case("checkpoint-left", prune(), ("--resume", "delete"), setup=_ckpt_left),
]
if not torch.cuda.is_available():
    CASES.append(Case("device-cuda-absent", prune("--device", "cuda"), ("--device cuda", "no CUDA")))


@pytest.fixture(scope="module")
def outcomes(llm_inputs, tmp_path_factory):
    return run_cases(CASES, tmp_path_factory.mktemp("prune-cases"), llm_inputs)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_and_writes_nothing(case: Case, outcomes) -> None:
    out = outcomes[case.id]
    line = assert_user_error(out.result, *case.needles)
    assert_unchanged(out.before, *out.roots)
    if case.id == "eval-windows-0":
        assert "--max-windows" not in line
    if case.id == "device-mps":
        assert "--dtype float32" not in line


def test_argparse_errors_are_one_line_not_the_usage(outcomes) -> None:
    err = outcomes["unknown-flag"].result.stderr
    assert "usage:" not in err and len(err.strip().splitlines()) == 1 and "(see 'leanml prune --help')" in err


def test_offline_hub_calibration_fails_fast(llm_inputs, tmp_path) -> None:
    """An unknown hub corpus with no network must not wait for retries (``HF_HUB_OFFLINE`` unset)."""
    t0 = time.perf_counter()
    env = {"HF_HUB_OFFLINE": "", "TRANSFORMERS_OFFLINE": "", "HF_DATASETS_OFFLINE": ""}
    result = run_cli(prune("--calib", "wikitext2")(tmp_path, llm_inputs), env=env, timeout=120)
    seconds = time.perf_counter() - t0
    assert_user_error(result, "wikitext2")
    assert seconds < 25, f"took {seconds:.0f} s"


def test_overwrite_is_still_refused_for_a_bad_model_and_keeps_the_old_output(llm_inputs, tmp_path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("earlier result")
    before = snapshot(tmp_path)
    result = run_cli(prune("--overwrite", model="bert")(tmp_path, llm_inputs))
    assert_user_error(result, "encoder")
    assert_unchanged(before, tmp_path)


def test_debug_variable_shows_the_traceback(llm_inputs, tmp_path) -> None:
    result = run_cli(prune(model="bert")(tmp_path, llm_inputs), env={"LEANML_DEBUG": "1"})
    assert result.code == 2 and "Traceback" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("leanml: error:")


def test_stale_temporary_folders_of_a_killed_save_are_removed_at_the_next_start(llm_inputs, tmp_path) -> None:
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f".out.tmp-{dead.pid}-abc123"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"\0" * 1024)
    live = tmp_path / f".out.tmp-{os.getpid()}-def456"  # a live process's folder is left alone
    live.mkdir()
    result = run_cli(prune("--batch-size", "0")(tmp_path, llm_inputs))  # refused by the parser: no cleaning
    assert result.code == 2 and stale.exists()
    result = run_cli(prune(model="bert")(tmp_path, llm_inputs))  # refused after the output check
    assert_user_error(result, "encoder")
    assert not stale.exists() and live.exists() and not (tmp_path / "out").exists()
