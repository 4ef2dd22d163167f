"""Scale-out: the same graph on Ray Data (local, 2 CPUs) and torchrun DDP (2 gloo processes) on shards."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from leanml.features.options import PipelineOptions, TrainOptions
from leanml.features.read.data import LogSpec, generate_logs
from leanml.features.run.batch import FeatureBatch
from leanml.features.run.extract import ExtractConfig, Extractor

TINY = """
name: tiny
schema: {ts: int, user_id: int, item_id: int, click: int, hist: str}
tables: {users: users.jsonl}
ops:
  - {op: dict_join, input: user_id, table: users, key: user_id, columns: {age: age, gender: gender}}
  - {op: hash, input: user_id, output: user, buckets: 997}
  - {op: hash, input: item_id, output: item, buckets: 997, seed: 1}
  - {op: cross, inputs: [gender, item_id], output: g_x_item, buckets: 1999}
  - {op: bucketize, input: age, output: age_b, boundaries: [25, 40, 60]}
  - {op: normalize, input: age, output: age_z, mean: 40, std: 15}
  - {op: split, input: hist, output: hist_l, dtype: int}
  - {op: hash, input: hist_l, output: hist_h, buckets: 997, seed: 1}
  - {op: truncate_pad, input: hist_h, output: hist_seq, max_len: 5, keep: last}
outputs: {label: click, sparse: [user, item, g_x_item, age_b], dense: [age_z], sequence: [hist_seq]}
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("tiny")
    generate_logs(d, LogSpec(2400, seed=5, malformed_rate=0.005), progress=False)
    (d / "tiny.yaml").write_text(TINY)
    return d, d / "impressions_000.tsv"


def _rows(b: FeatureBatch) -> np.ndarray:
    m = np.concatenate([b.label[:, None].double().numpy(), b.sparse.double().numpy(), b.dense.double().numpy(),
                        *[s.double().numpy() for s in b.seqs]], axis=1)
    return m[np.lexsort(m.T[::-1])]


@pytest.mark.slow  # several processes
def test_ray_data_matches_local_extraction(tiny, tmp_path):
    ray = pytest.importorskip("ray")
    from leanml.features.train.ray_runner import run_ray

    d, log = tiny
    cfg = ExtractConfig.build(str(d / "tiny.yaml"), [log], PipelineOptions(batch_rows=512))
    local = Extractor(cfg)
    ref = FeatureBatch.concat(list(local))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        kept: list[FeatureBatch] = []
        _, rep = run_ray(cfg, TrainOptions(dim=4, hidden=(8,)), quarantine_dir=str(tmp_path / "q"), keep=kept)
    finally:
        ray.shutdown()
    got = FeatureBatch.concat(kept)
    assert rep["rows"] == len(ref) == len(got)
    np.testing.assert_array_equal(_rows(got), _rows(ref))  # same rows (Ray may reorder them)
    assert rep["quarantined"] == dict(local.quarantine.counts) and sum(rep["quarantined"].values()) > 0


@pytest.mark.slow  # several processes
def test_torchrun_ddp_consumes_disjoint_shards(tiny, tmp_path):
    d, log = tiny
    cfg = ExtractConfig.build(str(d / "tiny.yaml"), [log], PipelineOptions(batch_rows=256))
    total = sum(len(b) for b in Extractor(cfg))
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # a port free now, and torchrun's stderr in the failure: with a pid-derived port it exited 1 once in a
    # full-suite run, its stderr hidden (it passed when rerun alone)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([str(torchrun), "--nproc_per_node", "2", "--master_port", str(port),
                           "-m", "leanml.features.train.ddp", "--graph", str(d / "tiny.yaml"), "--input", str(log),
                           "--batch-rows", "256", "--dim", "4", "--hidden", "8", "--out", str(tmp_path)],
                          timeout=240, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, f"torchrun exit {proc.returncode}:\n{proc.stderr[-4000:]}"
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["rows"] > 0 for r in ranks) and sum(r["rows"] for r in ranks) == total
    assert ranks[0]["param_checksum"] == pytest.approx(ranks[1]["param_checksum"], rel=1e-9)
    assert torch.isfinite(torch.tensor([r["loss"] for r in ranks])).all()
