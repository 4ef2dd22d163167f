"""``leanml train`` end to end on a tiny LLaMA with the SmolLM2 tokenizer and real Shakespeare text."""

import csv
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

import leanml.data.text as text
from leanml.cli import main
from leanml.models import bundled_dir


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    tok = AutoTokenizer.from_pretrained(bundled_dir("smollm2-135m"))
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=128,
                      tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(autouse=True)
def short_text(monkeypatch: pytest.MonkeyPatch) -> None:
    full = text.load_text
    monkeypatch.setattr(text, "load_text", lambda name, split: full(name, split)[:40_000])


def test_train_cli_writes_report(tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "run"
    rc = main(["train", "--model", str(tiny_dir), "--data", "shakespeare", "--batch-size", "2", "--seqlen", "32",
               "--steps", "3", "--memory", "adacc", "--memory-budget", "0.97", "--lr", "1e-3", "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    res = report["result"]
    assert res["strategy"] == "adacc" and res["steps"] == 3
    # the 49k-token output layer dominates this tiny model, so only a mild budget is feasible
    assert res["peak_bytes"] <= res["budget_bytes"] <= 0.97 * res["unoptimized_peak_bytes"] + 1
    assert report["machine"]["torch"] == torch.__version__
    assert res["peak_measured_every_step"] and len(res["step_peaks"]) == 3
    assert max(res["step_peaks"]) <= res["budget_bytes"] and res["steps_over_budget"] == 0
    rows = list(csv.reader(open(out / "losses.csv")))
    assert rows[0] == ["step", "loss", "step_s", "peak_bytes"] and len(rows) == 4
    assert "report:" in capsys.readouterr().out


def test_train_cli_budget_too_small(tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rc = main(["train", "--model", str(tiny_dir), "--batch-size", "2", "--seqlen", "32", "--steps", "2",
               "--memory", "adacc", "--memory-budget", "0.5", "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert rc == 2 and "below the smallest feasible plan" in err
    assert not (tmp_path / "x").exists()


def test_train_cli_bad_args(tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["train", "--model", str(tiny_dir), "--steps", "0", "--out", str(tmp_path / "y")]) == 2
    assert "at least 1" in capsys.readouterr().err
    assert main(["train", "--model", str(tiny_dir), "--memory-budget", "lots", "--out", str(tmp_path / "z")]) == 2
    assert "cannot read memory budget" in capsys.readouterr().err
    assert main(["train", "--model", str(tiny_dir), "--memory", "checkpoint", "--compile-blocks",
                 "--out", str(tmp_path / "w")]) == 2
    assert "option of --memory adacc" in capsys.readouterr().err
    assert main(["train", "--model", str(tiny_dir), "--compile-blocks", "1,2", "--out", str(tmp_path / "v")]) == 2
    assert "compiler budgets in [0, 1]" in capsys.readouterr().err
    assert not any((tmp_path / d).exists() for d in "yzwv")
