"""Faults through the real CLI (fresh ``python -m leanml`` processes): SIGTERM and Ctrl-C print the same
"interrupted; resume with: ..." line, leave no temporary folder, and the printed command resumes the run;
SIGKILL during the save leaves a stale temporary folder that the next start removes."""

from __future__ import annotations

import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from cli.conftest import assert_no_traceback, assert_user_error, run_cli, save_tiny_llama, start_cli


@pytest.fixture(scope="module")
def deep_model(tmp_path_factory) -> Path:
    """A 12-layer tiny LLaMA: pruning it takes a few seconds, time enough to interrupt it."""
    return save_tiny_llama(tmp_path_factory.mktemp("deep") / "model", layers=12)


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory) -> Path:
    """A 4-layer LLaMA of hidden size 512 (about 40 MB): saving it takes long enough to be killed midway."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from cli.conftest import save_tiny_tokenizer

    path = tmp_path_factory.mktemp("wide") / "model"
    cfg = LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=4, vocab_size=256, max_position_embeddings=128)
    LlamaForCausalLM(cfg).save_pretrained(path)
    save_tiny_tokenizer(path)
    return path


def prune_args(model: Path, text: Path, out: Path, method: str = "fista") -> list[str]:
    return ["prune", "--model", str(model), "--method", method, "--calib", str(text), "--seqlen", "64",
            "--nsamples", "16", "--no-eval", "--threads", "1", "--out", str(out)]


def wait_for(cond, proc: subprocess.Popen, timeout: float = 120, poll: float = 0.01) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert proc.poll() is None, f"the command ended first (exit {proc.returncode}): {proc.communicate()}"
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(poll)


def interrupt(args: list[str], ready, sig: int) -> tuple[int, str]:
    """Start ``leanml *args``, send ``sig`` once ``ready()``, return the exit code and stderr."""
    proc = start_cli(args)
    try:
        wait_for(ready, proc)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err


def resume_command(err: str) -> list[str]:
    line = err.strip().splitlines()[-1]
    assert line.startswith("leanml: interrupted; resume with: leanml "), err
    return shlex.split(line.split("resume with: leanml ", 1)[1])


def test_sigterm_and_ctrl_c_print_the_same_resume_line_and_the_run_resumes(deep_model, cli_text, tmp_path) -> None:
    lines = {}
    for sig, code in ((signal.SIGTERM, 143), (signal.SIGINT, 130)):
        out = tmp_path / "out"
        args = prune_args(deep_model, cli_text, out)
        rc, err = interrupt(args, lambda: (tmp_path / "out.ckpt" / "state.pt").exists(), sig)
        assert rc == code and "Traceback" not in err, err
        lines[sig] = err.strip().splitlines()[-1]
        again = resume_command(err)
        assert again == [*args, "--resume"]
        assert not out.exists() and not list(tmp_path.glob(".out.*"))
        if sig == signal.SIGINT:
            break
        # other settings: the message names fixes that the next checks accept (not "run without --resume")
        result = run_cli([*again, "--seed", "1"], timeout=300)
        line = assert_user_error(result, "other settings", "--resume", "delete", before_work=False)
        assert "without --resume" not in line
        result = run_cli(again, timeout=300)
        assert result.code == 0, str(result)
        assert (out / "report.json").is_file() and not (tmp_path / "out.ckpt").exists()
        shutil.rmtree(out)
    assert lines[signal.SIGTERM] == lines[signal.SIGINT]


def test_sigkill_during_the_save_then_a_rerun(wide_model, cli_text, tmp_path) -> None:
    out = tmp_path / "out"
    args = prune_args(wide_model, cli_text, out, method="sparsegpt")
    proc = start_cli(args)
    try:
        wait_for(lambda: any(tmp_path.glob(".out.tmp-*")), proc, poll=0.002)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    if out.exists():  # the rename won the race: then the output is whole
        pytest.skip("the save finished before SIGKILL landed")
    assert list(tmp_path.glob(".out.tmp-*")), "a killed save leaves its temporary folder"
    # the next start removes it, then refuses to start over on top of the finished layers
    result = run_cli(args)
    assert_user_error(result, "add --resume", str(tmp_path / "out.ckpt"))
    assert not list(tmp_path.glob(".out.tmp-*"))
    result = run_cli([*args, "--resume"], timeout=300)
    assert result.code == 0, str(result)
    assert_no_traceback(result)
    assert (out / "report.json").is_file() and not (tmp_path / "out.ckpt").exists()
    assert not list(tmp_path.glob(".out.*"))


def test_sigterm_during_recover_prints_the_resume_line_and_resumes(llm_inputs, tmp_path) -> None:
    out = tmp_path / "out"
    args = ["recover", "--model", str(llm_inputs / "pruned"), "--data", str(llm_inputs / "text.txt"), "--no-eval",
            "--seqlen", "64", "--batch-size", "2", "--steps", "400", "--checkpoint-every", "5", "--memory", "none",
            "--threads", "1", "--out", str(out)]
    rc, err = interrupt(args, lambda: (tmp_path / "out.ckpt" / "state.pt").exists(), signal.SIGTERM)
    assert rc == 143 and "Traceback" not in err, err
    again = resume_command(err)
    assert not out.exists() and not list(tmp_path.glob(".out.*"))
    assert again == [*args, "--resume"]
    result = run_cli(again, timeout=300)
    assert result.code == 0, str(result)
    assert (out / "report.json").is_file() and not (tmp_path / "out.ckpt").exists()


# ---- faults named: encodings, the cache, a full disk, a report of the wrong shape -------------------------


def test_a_utf16_file_gets_the_utf16_hint_and_the_hint_converts_it(llm_inputs, tmp_path) -> None:
    text = "To be, or not to be, that is the question. " * 50
    for encoding, named in (("utf-16", "UTF-16"), ("utf-32", "UTF-32"), ("utf-16-le", "UTF-16LE")):
        path = tmp_path / f"{encoding}.txt"
        path.write_bytes(text.encode(encoding))
        result = run_cli(prune_args(llm_inputs / "model", path, tmp_path / "out"))
        line = assert_user_error(result, "not UTF-8", f"iconv -f {named} ")
        assert "latin1" not in line
        assert path.read_bytes().decode(named.lower().replace("utf-", "utf_")).lstrip("\ufeff") == text


def test_eval_with_a_read_only_cache_names_leanml_cache_before_converting(llm_inputs, tmp_path) -> None:
    from cli.parallel import readonly_dir

    cache = readonly_dir(tmp_path / "ro-cache")
    t0 = time.perf_counter()
    result = run_cli(["eval", "--model", "smollm2-135m", "--data", str(llm_inputs / "text.txt"), "--seqlen", "32"],
                     env={"LEANML_CACHE": str(cache)})
    line = assert_user_error(result, "LEANML_CACHE", str(cache))
    assert "--out" not in line and time.perf_counter() - t0 < 20, line


def test_a_full_cache_names_the_bytes_needed_and_free(monkeypatch, tmp_path) -> None:
    from leanml import faults
    from leanml.errors import LeanmlError

    monkeypatch.setenv("LEANML_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(faults, "free_bytes", lambda path: 999)
    with pytest.raises(LeanmlError, match=r"LEANML_CACHE.*needs about 538.06 MB, 999 bytes free"):
        faults.check_model_cache("smollm2-135m")  # 134.5M parameters as float32


def _prune_in_process(model: Path, text: Path, out: Path) -> list[str]:
    return ["prune", "--model", str(model), "--method", "magnitude", "--calib", str(text), "--seqlen", "32",
            "--nsamples", "2", "--no-eval", "--threads", "1", "--out", str(out)]


@pytest.mark.parametrize("kind", ["oserror", "safetensors"])
def test_disk_full_while_saving_is_one_line_with_the_bytes(llm_inputs, tmp_path, monkeypatch, capsys, kind) -> None:
    import errno

    import leanml.models
    from leanml.cli import main

    def full(*args, **kwargs):
        if kind == "oserror":
            raise OSError(errno.ENOSPC, "No space left on device")
        from safetensors import SafetensorError

        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                              '"No space left on device" })')

    monkeypatch.setattr(leanml.models, "save_model", full)
    out = tmp_path / "out"
    assert main(_prune_in_process(llm_inputs / "model", llm_inputs / "text.txt", out)) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("leanml: error:")]
    assert len(lines) == 1 and f"disk full while writing the pruned model to {out}" in lines[0], lines
    assert " needs about " in lines[0] and " free" in lines[0] and "unknown" not in lines[0], lines
    assert not out.exists() and not list(tmp_path.glob(".out.*"))


def test_too_little_space_is_refused_before_the_work(llm_inputs, tmp_path, monkeypatch, capsys) -> None:
    from leanml import faults
    from leanml.cli import main

    monkeypatch.setattr(faults, "free_bytes", lambda path: 999)
    out = tmp_path / "out"
    assert main(_prune_in_process(llm_inputs / "model", llm_inputs / "text.txt", out)) == 2
    err = capsys.readouterr().err
    assert "prune magnitude" not in err  # no layer was pruned
    line = [ln for ln in err.splitlines() if ln.startswith("leanml: error:")][-1]
    assert "not enough disk space for the pruned model" in line and "999 bytes free" in line, line


def test_an_unhandled_full_disk_names_the_path_and_the_free_bytes(tmp_path) -> None:
    import errno

    from leanml.cli import os_error_line

    line = os_error_line(OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x")))
    assert line.startswith(f"disk full: {tmp_path / 'x'}, ") and " free there" in line


@pytest.mark.parametrize("report,named", [
    ([1, 2], "not a leanml report"),
    ({"mask": "2:4"}, "field mask is"),
    ({"mask": {"sparsity": "half"}}, "field mask.sparsity is"),
    ({"model": {"params_after": "many"}}, "field model.params_after is"),
])
def test_a_report_of_the_wrong_shape_is_one_line(llm_inputs, tmp_path, report, named) -> None:
    import json

    model = Path(shutil.copytree(llm_inputs / "pruned", tmp_path / "pruned"))
    (model / "report.json").write_text(json.dumps(report))
    result = run_cli(["recover", "--model", str(model), "--data", str(llm_inputs / "text.txt"), "--no-eval",
                      "--seqlen", "32", "--steps", "1", "--threads", "1", "--out", str(tmp_path / "out")])
    assert_user_error(result, "report.json", named)
    assert not (tmp_path / "out").exists()
