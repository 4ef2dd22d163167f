"""``leanml eval`` reports the sparsity of the weights it evaluated: measured over the linears, and the
N:M pattern when the zeros follow one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import leanml
from cli.conftest import run_cli, save_tiny_llama, save_zeroed_copy
from leanml.eval.sparsity import model_sparsity, nm_pattern, sparsity_line
from leanml.models.tiny import tiny_llama
from leanml.prune.config import PruneConfig


def _pruned(**config: object) -> torch.nn.Module:
    model = tiny_llama()
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    leanml.prune(model, ids, PruneConfig(seqlen=32, device="cpu", **config), progress=False)
    return model


def test_a_dense_model_has_no_zeros_and_no_pattern() -> None:
    record = model_sparsity(tiny_llama())
    assert record == {"linear": 0.0, "pattern": None, "pattern_sparsity": None}
    assert sparsity_line(record) == "sparsity 0.000 of the linear weights"


@pytest.mark.parametrize("pattern,sparsity", [("2:4", 0.5), ("1:4", 0.75), ("4:8", 0.5), ("1:8", 0.875)])
def test_an_nm_model_reads_its_pattern(pattern: str, sparsity: float) -> None:
    record = model_sparsity(_pruned(method="magnitude", pattern=pattern))
    n, m = map(int, pattern.split(":"))
    # the smallest M among equal ratios: a 4:8 mask of magnitude is not 2:4 in every group of 4
    assert record["pattern"] is not None and record["pattern_sparsity"] == pytest.approx(sparsity)
    assert record["linear"] == pytest.approx(sparsity, abs=0.01)
    got_n, got_m = map(int, record["pattern"].split(":"))
    assert got_n / got_m == pytest.approx(n / m) and got_m <= m
    assert f"({record['pattern']} in every linear)" in sparsity_line(record)


def test_unstructured_zeros_name_no_pattern_even_when_a_loose_one_holds() -> None:
    model = _pruned(method="wanda", sparsity=0.6)
    record = model_sparsity(model)
    assert record["linear"] == pytest.approx(0.6, abs=0.01) and record["pattern"] is None
    assert nm_pattern(model) is None


def test_the_eval_command_prints_and_writes_the_sparsity(tmp_path: Path) -> None:
    dense = save_tiny_llama(tmp_path / "dense")
    pruned = save_zeroed_copy(dense, tmp_path / "pruned", sparsity=0.5)
    text = tmp_path / "text.txt"
    text.write_text("To be, or not to be, that is the question. " * 200, encoding="utf-8")
    out = tmp_path / "ppl.json"
    result = run_cli(["eval", "--model", pruned, "--data", text, "--seqlen", "32", "--max-windows", "2",
                      "--json", out])
    assert result.code == 0, str(result)
    record = json.loads(out.read_text())["sparsity"]
    assert record["linear"] == pytest.approx(0.5, abs=0.01) and record["pattern"] is None
    assert sparsity_line(record) in result.stdout
    assert "perplexity" in result.stdout
