"""``leanml prune`` -> ``leanml recover`` end to end on a tiny model with its own tokenizer, every bad
input, and a run killed with SIGKILL then resumed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from builders import tiny_llama
from leanml.cli import main
from leanml.models import load_model
from leanml.models.compressed import is_compressed_dir
from leanml.recover.masks import linear_sparsity, masked_linears
from recover.helpers import save_dir, text, tiny_tokenizer


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A directory with ``dense/`` (a tiny LLaMA and a 300-token tokenizer) and ``text.txt``."""
    root = tmp_path_factory.mktemp("recover-cli")
    tok = tiny_tokenizer()
    save_dir(tiny_llama(vocab=len(tok)), tok, root / "dense")
    (root / "text.txt").write_text(text())
    return root


def _prune(work: Path, name: str, *method: str) -> Path:
    out = work / name
    if not out.exists():
        assert main(["prune", "--model", str(work / "dense"), *method, "--calib", str(work / "text.txt"),
                     "--nsamples", "4", "--seqlen", "32", "--no-eval", "--out", str(out)]) == 0
    return out


def _recover_args(work: Path, model: Path, out: Path, *extra: str) -> list[str]:
    """A short recovery run; the evaluation options only where the run evaluates (``--no-eval`` refuses them)."""
    evals = [] if "--no-eval" in extra else ["--eval-data", str(work / "text.txt"), "--eval-seqlen", "32",
                                              "--eval-windows", "3"]
    return ["recover", "--model", str(model), "--data", str(work / "text.txt"), "--seqlen", "32", "--steps", "6",
            "--batch-size", "2", "--lr", "2e-3", *evals, "--out", str(out), *extra]


def test_prune_2_4_then_recover_with_the_source_teacher(work, tmp_path, capsys):
    pruned = _prune(work, "sgpt24", "--method", "sparsegpt", "--pattern", "2:4")
    out = tmp_path / "rec"
    assert main(_recover_args(work, pruned, out, "--teacher", "source", "--memory", "checkpoint",
                              "--checkpoint-every", "2")) == 0
    before = AutoModelForCausalLM.from_pretrained(pruned)
    after = AutoModelForCausalLM.from_pretrained(out)  # plain from_pretrained
    assert linear_sparsity(after) == linear_sparsity(before) == pytest.approx(0.5)
    for (name, a), (_, b) in zip(masked_linears(after), masked_linears(before)):
        assert torch.equal(a.weight == 0, b.weight == 0) and not torch.equal(a.weight, b.weight), name
    report = json.loads((out / "report.json").read_text())
    assert report["mask"] == {"pattern": "2:4", "sparsity": 0.5, "structured": False, "kept": True}
    assert report["teacher_model"] == str(work / "dense") and report["teacher"]["kd_weight"] == 0.5
    corpus = str(work / "text.txt")
    assert report["perplexity_before"][corpus]["ppl"] > 1 and report["perplexity_after"][corpus]["ppl"] > 1
    assert report["timings"]["teacher_seconds"] > 0 and len(report["losses"]["loss"]) == 6
    assert (out / "losses.csv").read_text().count("\n") == 7
    assert not (tmp_path / "rec.ckpt").exists()
    assert "sparsity 0.5000 -> 0.5000 (kept exactly)" in capsys.readouterr().out
    # a recovered model declares its mask too, so it can be recovered again
    assert main(_recover_args(work, out, tmp_path / "again", "--memory", "none", "--no-eval")) == 0


def test_compressed_bfloat16_input_keeps_its_dtype_and_format(work, tmp_path, capsys):
    pruned = _prune(work, "sgpt50-bf16-compressed", "--method", "sparsegpt", "--sparsity", "0.5",
                    "--dtype", "bfloat16", "--save-format", "compressed")
    out = tmp_path / "rec"
    assert main(_recover_args(work, pruned, out, "--memory", "none", "--no-eval", "--save-format", "compressed")) == 0
    assert is_compressed_dir(out) and json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    before, _ = load_model(str(pruned), dtype="bfloat16")
    after, _ = load_model(str(out), dtype="bfloat16")
    assert linear_sparsity(after) == linear_sparsity(before) == pytest.approx(0.5)
    for (name, a), (_, b) in zip(masked_linears(after), masked_linears(before)):
        assert torch.equal(a.weight == 0, b.weight == 0) and not torch.equal(a.weight, b.weight), name
    report = json.loads((out / "report.json").read_text())
    assert report["save"]["format"] == "compressed" and report["save"]["dtype"] == "bfloat16"
    assert report["save"]["compressed_bytes"] < 0.7 * report["save"]["dense_bytes"]  # 50 % values + a bitmask
    assert "(compressed, bfloat16)" in capsys.readouterr().out


def test_recover_of_a_4_8_model_records_its_pattern_as_prune_does(work, tmp_path):
    """Prune and recover save through one path: a 4:8 model recovered and saved compressed records 4:8 in
    the layout's config and in report.json's save record, exactly as the pruned model does."""
    from leanml.models.compressed import CONFIG_KEY

    pruned = _prune(work, "mag48-compressed", "--method", "magnitude", "--pattern", "4:8", "--save-format",
                    "compressed")
    out = tmp_path / "rec"
    assert main(_recover_args(work, pruned, out, "--memory", "none", "--no-eval", "--save-format", "compressed")) == 0

    def record(path: Path) -> tuple[dict, dict]:
        config = json.loads((path / "config.json").read_text())[CONFIG_KEY]
        save = json.loads((path / "report.json").read_text())["save"]
        return config, save

    (p_config, p_save), (r_config, r_save) = record(pruned), record(out)
    assert p_config["sparsity_structure"] == r_config["sparsity_structure"] == "4:8"
    assert p_save["structure"] == r_save["structure"] == "4:8"
    assert p_config["targets"] == r_config["targets"] and len(r_config["targets"]) > 0
    assert p_config["global_sparsity"] == r_config["global_sparsity"] == p_save["sparsity"] == r_save["sparsity"]
    assert r_save["sparsity"] == pytest.approx(0.5)
    assert sorted(p_save) == sorted(r_save)  # the same record: format, dtype, bytes, sparsity, structure
    assert json.loads((out / "report.json").read_text())["mask"]["pattern"] == "4:8"


def test_fasp_model_recovers_at_its_smaller_size(work, tmp_path):
    pruned = _prune(work, "fasp30", "--method", "fasp", "--sparsity", "0.3")
    out = tmp_path / "rec"
    assert main(_recover_args(work, pruned, out, "--memory", "adacc", "--memory-budget", "0.9", "--no-eval")) == 0
    small, dense = AutoModelForCausalLM.from_pretrained(out), AutoModelForCausalLM.from_pretrained(work / "dense")
    assert small.config.intermediate_size < dense.config.intermediate_size
    assert small.num_parameters() == AutoModelForCausalLM.from_pretrained(pruned).num_parameters()
    report = json.loads((out / "report.json").read_text())
    # FASP removed its units physically (MLP units and whole key/value groups): no zeros left to keep
    assert report["mask"]["structured"] and report["sparsity"]["out"] == report["sparsity"]["in"] == 0
    assert report["memory"]["within_budget"]


def test_bad_input_is_one_line_and_writes_nothing(work, tmp_path, capsys):
    pruned = _prune(work, "sgpt24", "--method", "sparsegpt", "--pattern", "2:4")
    other = tiny_tokenizer(vocab=280)
    save_dir(tiny_llama(vocab=len(other)), other, tmp_path / "other-vocab")
    swapped = tiny_tokenizer(corpus=" ".join(w[::-1] for w in text().split()))  # same size, other tokens
    assert len(swapped) == len(tiny_tokenizer())
    save_dir(tiny_llama(vocab=len(swapped)), swapped, tmp_path / "other-tokens")
    cases = [
        (_recover_args(work, pruned, tmp_path / "o8", "--teacher", str(tmp_path / "other-tokens")),
         "another tokenizer"),
        (_recover_args(work, pruned, tmp_path / "o9", "--memory", "checkpoint", "--memory-budget", "0.5"),
         "--memory-budget"),
        (_recover_args(work, work / "dense", tmp_path / "o1"), "no pruned weights"),
        (_recover_args(work, pruned, tmp_path / "o2", "--teacher", str(tmp_path / "other-vocab")), "logits per token"),
        (_recover_args(work, pruned, tmp_path / "o3", "--memory-budget", "0.05"), "smallest feasible plan"),
        (_recover_args(work, pruned, tmp_path / "o4", "--pattern", "1:4"), "do not follow the 1:4 pattern"),
        (_recover_args(work, pruned, tmp_path / "o5", "--kd-weight", "2"), "--kd-weight"),
        (_recover_args(work, pruned, tmp_path / "o6", "--no-mask", "--pattern", "2:4"), "--no-mask"),
        (_recover_args(work, tmp_path / "missing", tmp_path / "o7"), "does not exist"),
    ]
    for args, message in cases:
        assert main(args) == 2, message
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("leanml: error: ") and message in err[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other-tokens", "other-vocab"]


def test_a_killed_run_resumes_to_the_uninterrupted_result(work, tmp_path):
    pruned = _prune(work, "sgpt24", "--method", "sparsegpt", "--pattern", "2:4")

    def args(out: Path) -> list[str]:
        a = _recover_args(work, pruned, out, "--memory", "none", "--no-eval", "--checkpoint-every", "1")
        a[a.index("--steps") + 1] = "30"
        return a

    env = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()))
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2] / "src"), env.get("PYTHONPATH", "")])
    killed = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "leanml", *args(killed)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    state = tmp_path / "killed.ckpt" / "state.pt"
    deadline = time.time() + 120
    while not state.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert state.exists() and not killed.exists()
    assert main([*args(killed), "--resume"]) == 0
    ref = tmp_path / "ref"
    assert main(args(ref)) == 0
    a = json.loads((killed / "report.json").read_text())
    b = json.loads((ref / "report.json").read_text())
    assert 0 < a["resumed_from_step"] < 30 and a["losses"]["loss"] == b["losses"]["loss"]
    ma, mb = AutoModelForCausalLM.from_pretrained(killed), AutoModelForCausalLM.from_pretrained(ref)
    assert all(torch.equal(x, y) for x, y in zip(ma.state_dict().values(), mb.state_dict().values()))
