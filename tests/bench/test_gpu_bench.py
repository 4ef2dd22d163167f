"""The prepared GPU check (bench/gpu.py) in its dry mode: tiny sizes on the CPU, every part through the same
code that runs on the GPU, so the script cannot rot between GPU sessions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchload import load_bench

ROOT = Path(__file__).resolve().parents[2]
REQUIRED = ("device", "gpu", "torch", "part", "ok", "error")


def test_dry_run_writes_a_record_for_every_part_and_method(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--dry", "--out", str(tmp_path),
                           "--deadline", "900"], capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "gpu.json").read_text())
    recs = doc["records"]
    assert doc["dry"] and doc["machine"]["torch"]
    assert all(k in r for r in recs for k in REQUIRED)
    assert {r["part"] for r in recs} == {"prune", "speed", "memory", "recover", "ctr", "features"}
    prune = {r["method"]: r for r in recs if r["part"] == "prune"}
    for method in ("wanda", "sparsegpt", "fista", "fasp"):
        r = prune[method]
        assert r["ok"], r["error"]
        assert r["seconds"] == pytest.approx(r["engine_seconds"] + r["solver_seconds"])
        assert r["sparsity_measured"] > 0.2
    assert prune["llmcompressor-sparsegpt"]["ok"] is False  # not in the project's environment
    memory = {r["strategy"]: r for r in recs if r["part"] == "memory"}
    for label in ("none", "checkpoint", "adacc@50%"):
        assert memory[label]["ok"] and memory[label]["tokens_s"] > 0, memory[label]["error"]
    assert memory["adacc@50%"]["steps_over_budget"] == 0
    refused = memory["adacc@25%"]
    assert refused["ok"] or "below the smallest feasible plan" in refused["error"]  # tiny model: may not fit
    for part in ("recover", "ctr", "features"):
        assert all(r["ok"] for r in recs if r["part"] == part), [r["error"] for r in recs if r["part"] == part]
    md = (tmp_path / "gpu.md").read_text()
    assert "## Targets" in md and "dry run" in md


def test_dry_run_refuses_to_write_into_the_results_folder():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--dry", "--parts", "ctr"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "--dry writes tiny-size records" in proc.stderr


def test_frontier_ratio_interpolates_compile_between_its_budgets():
    gpu = load_bench("gpu")
    recs = [{"part": "memory", "ok": True, "strategy": "compile@25%", "peak_bytes": 100, "tokens_s": 50.0},
            {"part": "memory", "ok": True, "strategy": "compile@50%", "peak_bytes": 200, "tokens_s": 100.0},
            {"part": "memory", "ok": True, "strategy": "adacc+compile@25%", "peak_bytes": 150, "tokens_s": 82.5}]
    assert gpu.frontier_ratio(recs, "adacc+compile@25%") == pytest.approx(82.5 / 75.0)
    recs[-1]["peak_bytes"] = 50  # below the frontier's smallest peak: no comparison
    assert gpu.frontier_ratio(recs, "adacc+compile@25%") is None
