"""The shared command-line plumbing in-process: stale temporary folders, writability probes, option types,
``--device``, the estimate line, the interrupted line."""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from leanml.cli import interrupted_line
from leanml.device import parse_device
from leanml.errors import LeanmlError
from leanml.outputs import atomic_dir, check_output_dir, clean_stale, clean_stale_in
from leanml.progress import EtaBar, announce_eta


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_clean_stale_removes_dead_runs_leftovers_keeps_live_ones_and_restores_an_old_output(tmp_path) -> None:
    dead = dead_pid()
    (tmp_path / f".out.tmp-{dead}-x1").mkdir()
    (tmp_path / f".out.tmp-{os.getpid()}-x2").mkdir()  # this (live) process
    (tmp_path / ".out.tmp-abcdefgh").mkdir()  # an older leanml's name without a PID
    (tmp_path / f".other.tmp-{dead}-x3").mkdir()  # another output's: not ours to clean
    old = tmp_path / f".out.old-{dead}"
    old.mkdir()
    (old / "weights").write_text("the previous output")
    removed = {p.name for p in clean_stale(tmp_path / "out")}
    assert removed == {f".out.tmp-{dead}-x1", ".out.tmp-abcdefgh"}
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([f".out.tmp-{os.getpid()}-x2", f".other.tmp-{dead}-x3", "out"])
    assert (tmp_path / "out" / "weights").read_text() == "the previous output"


def test_clean_stale_in_a_checkpoint_folder(tmp_path) -> None:
    dead = dead_pid()
    (tmp_path / f".state.pt.tmp-{dead}").write_bytes(b"half")
    (tmp_path / "state.pt").write_bytes(b"whole")
    assert [p.name for p in clean_stale_in(tmp_path)] == [f".state.pt.tmp-{dead}"]
    assert [p.name for p in tmp_path.iterdir()] == ["state.pt"]


def test_atomic_dir_removes_its_folder_on_an_interrupt(tmp_path) -> None:
    with pytest.raises(KeyboardInterrupt), atomic_dir(tmp_path / "out") as tmp:
        (tmp / "part").write_text("x")
        assert tmp.name.startswith(f".out.tmp-{os.getpid()}-")
        raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


def test_output_checks_name_the_flag_and_create_nothing(tmp_path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(LeanmlError, match="out .* is a file"):
        check_output_dir(tmp_path / "file", overwrite=True)
    with pytest.raises(LeanmlError, match="is a file, so .* cannot be created"):
        check_output_dir(tmp_path / "file" / "sub" / "out", overwrite=False)
    assert check_output_dir(tmp_path / "new" / "deeper" / "out", overwrite=False) == tmp_path / "new" / "deeper" / "out"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_parse_device() -> None:
    assert parse_device("cpu") == torch.device("cpu")
    with pytest.raises(LeanmlError, match="unknown device 'foo'"):
        parse_device("foo")
    with pytest.raises(LeanmlError, match="cpu or cuda"):
        parse_device("meta")
    if not torch.cuda.is_available():
        with pytest.raises(LeanmlError, match="no CUDA GPU"):
            parse_device("cuda:1")
    if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        with pytest.raises(LeanmlError, match="no Apple MPS GPU") as exc:
            parse_device("mps")
        assert "--dtype" not in str(exc.value)


def test_the_estimate_line_comes_once_after_the_first_unit(monkeypatch) -> None:
    expected = "prune: 1 layer took 2.0 s; estimated 58 s for the rest (29 layers)"
    assert announce_eta("prune", 1, 30, 2.0, "layer") == expected
    assert announce_eta("x", 5, 5, 1.0, "step") is None
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    bar = EtaBar(total=4, desc="recover", unit="step", file=io.StringIO(), mininterval=0)
    for _ in range(4):
        bar.update(1)
    bar.close()
    lines = [ln for ln in err.getvalue().splitlines() if "estimated" in ln]
    assert len(lines) == 1 and lines[0].startswith("recover: 1 step took") and "(3 steps)" in lines[0]


def test_interrupted_line_names_the_resume_command_only_when_a_checkpoint_exists(tmp_path) -> None:
    args = argparse.Namespace(out=str(tmp_path / "o"), resume=False)
    argv = ["prune", "--out", str(tmp_path / "o"), "--nsamples", "2"]
    assert interrupted_line(args, argv) == "leanml: interrupted; no output was written"
    (tmp_path / "o.ckpt").mkdir()
    assert interrupted_line(args, argv) == f"leanml: interrupted; resume with: leanml prune --out {tmp_path / 'o'} " \
                                          "--nsamples 2 --resume"
    assert interrupted_line(args, [*argv, "--resume"]).count("--resume") == 1


def test_a_path_of_a_file_for_the_output_parent(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(LeanmlError, match="--json"):
        from leanml.eval.job import check_json_out

        check_json_out(str(tmp_path / "f" / "x.json"), "--json")
