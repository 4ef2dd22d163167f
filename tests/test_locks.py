"""One writer per output: a second run on the same --out is refused in one line naming the first one's
pid, a stale lock (its process dead) is taken over, and nothing is left behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli.conftest import SAMPLE_TEXT, assert_user_error, cli_env, run_cli, save_tiny_llama
from leanml.errors import LeanmlError
from leanml.locks import lock_path, output_lock

HOLD = """
import sys, time
from leanml.locks import output_lock
with output_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(120)
"""


def hold(out: Path) -> subprocess.Popen:
    """Another process holding the lock of ``out`` until killed."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], env=cli_env(), stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_second_holder_is_refused_naming_the_first_pid(tmp_path) -> None:
    out = tmp_path / "out"
    proc = hold(out)
    try:
        with pytest.raises(LeanmlError, match=rf"another leanml run \(pid {proc.pid}\) is writing {out}"), \
                output_lock(out):
            pass
    finally:
        proc.kill()
        proc.wait()
    with output_lock(out) as path:  # the kernel dropped the dead holder's lock
        assert path == lock_path(out) and path.read_text().strip() == str(os.getpid())
    assert list(tmp_path.iterdir()) == []


def test_a_stale_lock_file_is_taken_over(tmp_path) -> None:
    out = tmp_path / "out"
    lock_path(out).write_text(f"{dead_pid()}\n")
    with output_lock(out):
        pass
    assert not lock_path(out).exists()


def test_folders_made_for_the_lock_are_removed_and_none_locks_nothing(tmp_path) -> None:
    with output_lock(tmp_path / "a" / "b" / "out") as path:
        assert path is not None and path.parent.is_dir()
    assert list(tmp_path.iterdir()) == []
    with output_lock(None) as path:
        assert path is None


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("locks")
    (root / "text.txt").write_text(SAMPLE_TEXT, encoding="utf-8")
    return save_tiny_llama(root / "model"), root / "text.txt"


def prune(model: Path, text: Path, out: Path) -> list[str]:
    return ["prune", "--model", str(model), "--method", "magnitude", "--calib", str(text), "--seqlen", "32",
            "--nsamples", "2", "--no-eval", "--threads", "1", "--out", str(out)]


def test_the_cli_refuses_a_second_run_on_the_same_out_and_takes_over_a_stale_lock(inputs, tmp_path) -> None:
    model, text = inputs
    out = tmp_path / "out"
    proc = hold(out)
    try:
        t0 = time.perf_counter()
        line = assert_user_error(run_cli(prune(model, text, out)), f"pid {proc.pid}", str(out))
        assert time.perf_counter() - t0 < 60, line
        assert not out.exists() and not (tmp_path / "out.ckpt").exists()
    finally:
        proc.kill()
        proc.wait()
    lock_path(out).write_text(f"{dead_pid()}\n")
    result = run_cli(prune(model, text, out))
    assert result.code == 0, str(result)
    assert (out / "report.json").is_file() and not lock_path(out).exists()
