"""The wheel works outside the checkout: built here, installed into a clean venv with only the core (and the torch
this suite runs on), it answers ``--version`` and ``--help`` and prunes and evaluates a tiny model from a temporary
folder; then the ``features`` extra added to the same venv plans a graph from the wheel's package data and extracts
features from a generated log."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli.conftest import SAMPLE_TEXT, save_tiny_llama

ROOT = Path(__file__).resolve().parents[1]
#: packages that only extras bring: none may come with the core install
EXTRA_DISTS = ("pyarrow", "pandas", "pillow", "ray", "datasets", "lm-eval", "gguf", "matplotlib", "scikit-learn",
               "compressed-tensors")


def run(cmd: list[str | Path], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``cmd`` outside the checkout: no PYTHONPATH, offline hub, one thread; fail with its output."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "LEANML_DEBUG")}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                "TOKENIZERS_PARALLELISM": "false", "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def installed(venv: Path, cwd: Path) -> dict[str, str]:
    out = run([venv / "bin" / "python", "-m", "pip", "list", "--format=freeze"], cwd).stdout
    return {line.split("==")[0].lower().replace("_", "-"): line.split("==")[1] for line in out.splitlines()
            if "==" in line}


@pytest.mark.slow
def test_the_wheel_installs_and_runs_outside_the_checkout(tmp_path: Path) -> None:
    work = tmp_path / "elsewhere"
    work.mkdir()
    # the wheel, built from this checkout
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path / "dist",
         ROOT], work)
    wheel = next((tmp_path / "dist").glob("leanml-*.whl"))
    # a clean venv: torch first (the release this suite runs on, from pip's cache or find-links), then the wheel
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", venv], work)
    pip = [venv / "bin" / "python", "-m", "pip", "install", "-q"]
    run([*pip, f"torch=={torch.__version__}"], work, timeout=600)
    run([*pip, wheel], work, timeout=600)
    have = installed(venv, work)
    assert have["torch"] == torch.__version__, "installing leanml changed the torch that was there"
    assert not [d for d in EXTRA_DISTS if d in have], f"the core install pulled extras: {sorted(have)}"

    leanml = venv / "bin" / "leanml"
    where = run([venv / "bin" / "python", "-c", "import leanml; print(leanml.__file__)"], work).stdout.strip()
    assert Path(where).is_relative_to(venv), where  # the installed copy, not the checkout
    version = run([leanml, "--version"], work).stdout
    assert f"torch {torch.__version__}" in version and "leanml " in version and "device " in version
    assert "prune" in run([leanml, "--help"], work).stdout
    assert "--sparsity" in run([leanml, "prune", "--help"], work).stdout

    # a real prune with perplexity before and after, then eval of the result
    save_tiny_llama(work / "model")
    (work / "text.txt").write_text(SAMPLE_TEXT, encoding="utf-8")
    pruned = run([leanml, "prune", "--model", "model", "--method", "wanda", "--sparsity", "0.5", "--calib",
                  "text.txt", "--eval-data", "text.txt", "--seqlen", "32", "--nsamples", "2", "--out", "out"], work)
    assert "sparsity 0.500" in pruned.stdout + pruned.stderr and (work / "out" / "config.json").is_file()
    evaluated = run([leanml, "eval", "--model", "out", "--data", "text.txt", "--seqlen", "32"], work)
    assert "perplexity" in evaluated.stdout

    # without the features extra its command says how to get it; with it, the packaged graph plans and extracts
    refused = subprocess.run([leanml, "features", "plan", "movielens"], cwd=work, capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": ""}, timeout=120)
    assert refused.returncode == 2 and "pip install 'leanml[features]'" in refused.stderr, refused.stderr
    run([*pip, f"{wheel}[features]"], work, timeout=600)
    assert installed(venv, work)["torch"] == torch.__version__
    assert "movielens" in run([leanml, "features", "plan", "movielens"], work).stdout.lower()
    run([leanml, "features", "generate", "--rows", "2000", "--out", "logs"], work)
    log = next((work / "logs").glob("impressions_*.tsv"))
    run([leanml, "features", "extract", "--graph", "movielens", "--log", log, "--out", "feats"], work)
    assert list((work / "feats").rglob("*.parquet"))
