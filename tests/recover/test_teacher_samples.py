"""``leanml recover --teacher-samples``: the CLI's mix of teacher samples and corpus windows, kept for a
resumed run."""

from __future__ import annotations

import json

import pytest
import torch

from builders import tiny_llama
from leanml.cli import main
from leanml.errors import LeanmlError
from recover.helpers import save_dir, text, tiny_tokenizer


def test_cli_mixes_teacher_samples_into_training(tmp_path, capsys):
    tok = tiny_tokenizer()
    save_dir(tiny_llama(vocab=len(tok)), tok, tmp_path / "dense")
    (tmp_path / "text.txt").write_text(text())
    pruned = tmp_path / "pruned"
    assert main(["prune", "--model", str(tmp_path / "dense"), "--method", "magnitude", "--sparsity", "0.5",
                 "--calib", str(tmp_path / "text.txt"), "--nsamples", "4", "--seqlen", "32", "--no-eval",
                 "--out", str(pruned)]) == 0
    base = ["recover", "--model", str(pruned), "--data", str(tmp_path / "text.txt"), "--seqlen", "32",
            "--steps", "4", "--batch-size", "2", "--memory", "none", "--no-eval"]
    assert main([*base, "--teacher-samples", "0.5", "--out", str(tmp_path / "x")]) == 2
    assert "pass --teacher too" in capsys.readouterr().err
    assert main([*base, "--teacher", str(tmp_path / "dense"), "--teacher-samples", "1.5",
                 "--out", str(tmp_path / "x")]) == 2
    assert "--teacher-samples" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    assert main([*base, "--teacher", str(tmp_path / "dense"), "--kd-weight", "1", "--teacher-samples", "0.5",
                 "--out", str(tmp_path / "mix")]) == 0
    info = json.loads((tmp_path / "mix" / "report.json").read_text())["data"]["teacher_samples"]
    assert info["windows"] == 4 and info["corpus_windows"] == 4 and info["seqlen"] == 32
    assert info["seconds"] > 0 and not info["reused_from_checkpoint"]
    assert not (tmp_path / "mix.ckpt").exists()


def _mixer(corpus: torch.Tensor, teacher, tok):
    """``mix(name, cfg, share, ckpt, cache=None)``: :func:`mix_teacher_samples` of ``corpus`` on the CPU."""
    from leanml.recover.teacher import TeacherSampling, mix_teacher_samples

    def mix(name, cfg, share, ckpt, cache=None):
        return mix_teacher_samples(corpus, teacher, name, tok, cfg, TeacherSampling(share, ckpt, cache), "cpu")

    return mix


def test_mixed_windows_are_kept_for_a_resumed_run(tmp_path):
    from leanml.recover import RecoverConfig, recover_training

    torch.manual_seed(0)
    tok = tiny_tokenizer()
    teacher = tiny_llama(vocab=len(tok))
    corpus = torch.arange(40 * 8).view(40, 8) % len(tok)
    mix = _mixer(corpus, teacher, tok)
    cfg = RecoverConfig(train=recover_training(steps=5, batch_size=2, seed=3))
    first, info = mix("t", cfg, 0.3, tmp_path / "ckpt")
    assert first.shape == (10, 8) and info["windows"] == 3 and info["corpus_windows"] == 7
    assert not info["reused_from_checkpoint"]
    rows = {tuple(r) for r in corpus.tolist()}
    assert all(tuple(r) in rows for r in first[3:].tolist())  # the rest are corpus windows
    again, info2 = mix("t", cfg, 0.3, tmp_path / "ckpt")
    assert info2["reused_from_checkpoint"] and torch.equal(first, again)
    _, info3 = mix("another", cfg, 0.3, tmp_path / "ckpt")
    assert not info3["reused_from_checkpoint"]  # another teacher's samples are never reused
    with pytest.raises(LeanmlError, match="corpus has 40"):
        mix("t", RecoverConfig(train=recover_training(steps=50)), 0.1, tmp_path / "c2")


def test_samples_are_cached_across_runs_with_the_same_teacher(tmp_path):
    """A second run with the same teacher weights and settings reads the first run's samples from the cache
    (the same windows a fresh sampling gives) and reports the first run's sampling time; another teacher
    (one weight changed), another count or another seed samples again."""
    from leanml.recover import RecoverConfig, recover_training

    torch.manual_seed(0)
    tok = tiny_tokenizer()
    teacher = tiny_llama(vocab=len(tok))
    corpus = torch.arange(40 * 8).view(40, 8) % len(tok)
    mix = _mixer(corpus, teacher, tok)
    cfg = RecoverConfig(train=recover_training(steps=5, batch_size=2, seed=3))
    cache = tmp_path / "cache"
    first, info = mix("t", cfg, 0.3, tmp_path / "a", cache)
    assert info["reused_from_cache"] is None and info["sampling_seconds"] > 0 and len(list(cache.iterdir())) == 1
    fresh, _ = mix("t", cfg, 0.3, tmp_path / "b")  # no cache
    again, info2 = mix("other name", cfg, 0.3, tmp_path / "c", cache)
    assert torch.equal(first, fresh) and torch.equal(first, again)
    assert info2["reused_from_cache"] and not info2["reused_from_checkpoint"]
    assert info2["sampling_seconds"] == info["sampling_seconds"]  # the time the sampling took, where it was done
    # the reused samples went into the run's checkpoint: a resumed run keeps them without the cache
    _, info3 = mix("other name", cfg, 0.3, tmp_path / "c")
    assert info3["reused_from_checkpoint"] and info3["sampling_seconds"] == info["sampling_seconds"]
    for changed_cfg, share in ((RecoverConfig(train=recover_training(steps=5, batch_size=2, seed=4)), 0.3), (cfg, 0.5)):
        _, info4 = mix("t", changed_cfg, share, tmp_path / f"d{share}", cache)
        assert info4["reused_from_cache"] is None
    with torch.no_grad():
        next(teacher.parameters()).view(-1)[0] += 1.0
    _, info5 = mix("t", cfg, 0.3, tmp_path / "e", cache)
    assert info5["reused_from_cache"] is None and len(list(cache.iterdir())) == 4


def test_cache_option_needs_samples_and_a_directory(tmp_path, capsys):
    tok = tiny_tokenizer()
    save_dir(tiny_llama(vocab=len(tok)), tok, tmp_path / "dense")
    (tmp_path / "text.txt").write_text(text())
    (tmp_path / "afile").write_text("x")
    base = ["recover", "--model", str(tmp_path / "dense"), "--no-mask", "--data", str(tmp_path / "text.txt"),
            "--seqlen", "32", "--steps", "4", "--batch-size", "2", "--memory", "none", "--no-eval",
            "--out", str(tmp_path / "x")]
    assert main([*base, "--teacher-samples-cache", str(tmp_path / "c")]) == 2
    assert "pass --teacher-samples too" in capsys.readouterr().err
    assert main([*base, "--teacher", str(tmp_path / "dense"), "--teacher-samples", "0.5",
                 "--teacher-samples-cache", str(tmp_path / "afile")]) == 2
    assert "is a file" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "c").exists()
