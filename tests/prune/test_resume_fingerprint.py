"""A resume that checks what it resumes: the checkpoint records the calibration windows, the weights and
every setting that changes the result, and a resume under any other is refused naming them; empty and
corrupt checkpoints are named and cleared with --overwrite; a run that fails on its numbers leaves no
checkpoint in a rerun's way. Runs ``leanml.cli.main`` in this process on a tiny 3-layer LLaMA."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from cli.conftest import SAMPLE_TEXT, save_tiny_llama
from leanml.cli import main
from leanml.errors import LeanmlError
from leanml.prune.engine import checkpoint as ck


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("resume")
    text = root / "text.txt"
    text.write_text(SAMPLE_TEXT, encoding="utf-8")
    return save_tiny_llama(root / "model", layers=3), text


def args(model: Path, text: Path, out: Path, *extra: str) -> list[str]:
    return ["prune", "--model", str(model), "--method", "wanda", "--calib", str(text), "--seqlen", "32",
            "--nsamples", "4", "--batch-size", "2", "--no-eval", "--threads", "1", "--out", str(out), *extra]


def interrupted(monkeypatch, model: Path, text: Path, out: Path, *extra: str, fail_with: BaseException | None = None,
                ) -> int:
    """Run the prune, stopping it with ``fail_with`` (Ctrl-C by default) as its second layer starts."""
    from leanml.prune.engine import walk

    real, calls = walk.prune_layer, []

    def stop_at_second(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise fail_with if fail_with is not None else KeyboardInterrupt
        return real(*a, **k)

    with monkeypatch.context() as m:
        m.setattr(walk, "prune_layer", stop_at_second)
        return main(args(model, text, out, *extra))


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def error_line(capsys) -> str:
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("leanml: error:")]
    assert len(lines) == 1, lines
    return lines[0]


def test_resume_after_changing_nsamples_is_refused_and_the_right_settings_resume(inputs, tmp_path, monkeypatch,
                                                                                capsys) -> None:
    model, text = inputs
    out = tmp_path / "out"
    ckpt = tmp_path / "out.ckpt"
    assert interrupted(monkeypatch, model, text, out) == 130
    assert torch.load(ckpt / "state.pt", weights_only=False)["next_layer"] == 1
    kept = digest(ckpt)
    capsys.readouterr()
    # the old bug: the corpus name overwrote the windows' fingerprint, so this resumed from 4 windows
    assert main([*args(model, text, out), "--resume", "--nsamples", "2"]) == 2
    line = error_line(capsys)
    assert "--nsamples 4 -> 2" in line and "other settings" in line, line
    assert "--sparsity" not in line  # only what differs is named
    assert digest(ckpt) == kept and not out.exists()
    # a run without --resume never touches the checkpoint
    assert main(args(model, text, out)) == 2
    assert "--resume" in error_line(capsys) and digest(ckpt) == kept
    assert main([*args(model, text, out), "--resume"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["engine"]["resumed_from_layer"] == 1 and report["calibration"]["nsamples"] == 4
    assert not ckpt.exists()


@pytest.mark.parametrize("change,named", [(("--sparsity", "0.6"), "--sparsity 0.5 -> 0.6"),
                                          (("--seed", "3"), "--seed 0 -> 3"),
                                          (("--batch-size", "1"), "--batch-size 2 -> 1")])
def test_every_setting_that_changes_the_result_is_named(inputs, tmp_path, monkeypatch, capsys, change, named) -> None:
    model, text = inputs
    out = tmp_path / "out"
    assert interrupted(monkeypatch, model, text, out) == 130
    capsys.readouterr()
    assert main([*args(model, text, out), "--resume", *change]) == 2
    assert named in error_line(capsys)


def test_resume_on_other_weights_is_refused(inputs, tmp_path, monkeypatch, capsys) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    model_src, text = inputs
    model = Path(shutil.copytree(model_src, tmp_path / "model"))
    out = tmp_path / "out"
    assert interrupted(monkeypatch, model, text, out) == 130
    weights = load_file(model / "model.safetensors")
    name = next(n for n in weights if n.endswith("layers.2.mlp.down_proj.weight"))
    weights[name] = weights[name] * 1.5  # same shapes and sizes, other values
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    assert main([*args(model, text, out), "--resume"]) == 2
    assert "weights" in error_line(capsys)


def test_an_empty_checkpoint_is_named_and_cleared_with_overwrite(inputs, tmp_path, capsys) -> None:
    model, text = inputs
    out = tmp_path / "out"
    (tmp_path / "out.ckpt").mkdir()  # a crash before the first layer was saved
    for extra in ((), ("--resume",)):
        assert main(args(model, text, out, *extra)) == 2
        line = error_line(capsys)
        assert "empty" in line and "--overwrite" in line, line
    assert main(args(model, text, out, "--overwrite")) == 0
    assert (out / "report.json").is_file() and not (tmp_path / "out.ckpt").exists()


def test_a_truncated_state_is_named_and_cleared_with_overwrite(inputs, tmp_path, monkeypatch, capsys) -> None:
    model, text = inputs
    out = tmp_path / "out"
    ckpt = tmp_path / "out.ckpt"
    assert interrupted(monkeypatch, model, text, out) == 130
    state = ckpt / "state.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    capsys.readouterr()
    assert main([*args(model, text, out), "--resume"]) == 2
    line = error_line(capsys)
    assert "corrupt or truncated" in line and "--overwrite" in line, line
    assert main(args(model, text, out, "--overwrite")) == 0
    assert not ckpt.exists()


def test_a_solver_failure_mid_run_leaves_no_checkpoint_in_the_rerun_s_way(inputs, tmp_path, monkeypatch,
                                                                           capsys) -> None:
    model, text = inputs
    out = tmp_path / "out"
    failure = torch.linalg.LinAlgError("lstsq: the least squares problem is singular")
    assert interrupted(monkeypatch, model, text, out, fail_with=failure) != 0
    assert not (tmp_path / "out.ckpt").exists()
    refused = LeanmlError("the solver failed on layer 1: lower --wanda-something")
    assert interrupted(monkeypatch, model, text, out, fail_with=refused) == 2
    assert not (tmp_path / "out.ckpt").exists()
    assert main(args(model, text, out)) == 0  # the rerun is not blocked


def test_a_full_disk_keeps_the_checkpoint_for_resume(inputs, tmp_path, monkeypatch) -> None:
    import errno

    model, text = inputs
    out = tmp_path / "out"
    full = LeanmlError("disk full while writing")
    full.__cause__ = OSError(errno.ENOSPC, "No space left on device")
    assert interrupted(monkeypatch, model, text, out, fail_with=full) == 2
    assert (tmp_path / "out.ckpt" / "state.pt").is_file()


def test_differing_settings_names_nested_values() -> None:
    saved = {"method_config": {"damp": 0.01, "blocksize": 128}, "calib_windows": {"nsamples": 4, "seqlen": 32},
             "seed": 0}
    now = {"method_config": {"damp": 0.1, "blocksize": 128}, "calib_windows": {"nsamples": 4, "seqlen": 64},
           "seed": 0}
    assert sorted(ck.differing_settings(saved, now)) == ["damp 0.01 -> 0.1", "seqlen 32 -> 64"]
    assert ck.differing_settings(saved, saved) == []


def test_windows_fingerprint_sees_every_token() -> None:
    ids = torch.arange(64).reshape(2, 32)
    other = ids.clone()
    other[1, 31] = 0  # the last token of the last window
    assert ck.windows_fingerprint(ids) != ck.windows_fingerprint(other)
    assert ck.windows_fingerprint(ids)["nsamples"] == 2


def test_recover_resume_names_the_differing_settings_and_weights(tmp_path) -> None:
    from leanml.recover import RecoverConfig, recover
    from leanml.recover.config import recover_training
    from recover.helpers import sparse_llama

    def _windows() -> torch.Tensor:
        return torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(0))

    def cfg(lr: float) -> RecoverConfig:
        return RecoverConfig(train=recover_training(steps=4, batch_size=2, lr=lr, strategy="none"), warmup=1,
                             checkpoint_every=2)

    def stop(step: int, log: dict) -> None:
        if step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        recover(sparse_llama(), _windows(), cfg(2e-3), checkpoint_dir=tmp_path, on_step=stop, progress=False)
    with pytest.raises(LeanmlError, match=r"other settings: lr 0.002 -> 0.001"):
        recover(sparse_llama(), _windows(), cfg(1e-3), checkpoint_dir=tmp_path, progress=False)
    other = sparse_llama()
    with torch.no_grad():
        other.lm_head.weight.mul_(1.5)
    with pytest.raises(LeanmlError, match=r"other settings: weights"):
        recover(other, _windows(), cfg(2e-3), checkpoint_dir=tmp_path, progress=False)
    state = tmp_path / "state.pt"
    state.write_bytes(state.read_bytes()[:100])
    with pytest.raises(LeanmlError, match="corrupt or truncated"):
        recover(sparse_llama(), _windows(), cfg(2e-3), checkpoint_dir=tmp_path, progress=False)
