"""The same graph on Ray Data: ``read_text`` -> ``map_batches`` (the layer-wise executor in an actor
pool) -> ``iter_torch_batches`` streaming into training, for logs that outgrow one machine.

Ray does not report line numbers of ``read_text`` rows, so quarantined rows carry line ``-1``; each
actor appends to its own ``quarantine-<pid>.jsonl`` in the quarantine directory.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from leanml.errors import LeanmlError
from leanml.extras import require_extra
from leanml.features.read.linelogs import parse_lines
from leanml.features.read.logschema import Quarantine
from leanml.features.run.arena import Arena
from leanml.features.run.batch import FeatureBatch
from leanml.features.run.extract import ExtractConfig
from leanml.features.run.graph import FeatureGraph
from leanml.features.run.scheduler import LayerwiseExecutor
from leanml.features.train.model import CTROptimizer, FeatureDNN, model_for_graph
from leanml.features.train.pipeline import TrainOptions, train_on


class RayExtract:
    """``map_batches`` callable: raw text lines -> model-input columns (numpy)."""

    def __init__(self, cfg: ExtractConfig, quarantine_dir: str | None = None) -> None:
        self.cfg = cfg
        self.graph = cfg.graph
        qpath = Path(quarantine_dir) / f"quarantine-{os.getpid()}.jsonl" if quarantine_dir else None
        self.quarantine = Quarantine(qpath)
        opts = cfg.options
        self.executor = LayerwiseExecutor(self.graph, device=opts.device, threads=opts.threads,
                                          arena=Arena(opts.arena_bytes), data_dir=cfg.data_dir, tables=cfg.tables,
                                          entity=opts.entity)
        self.jsonl = cfg.logs and cfg.logs[0].removesuffix(".gz").endswith((".jsonl", ".json"))

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        lines = [(s + "\n").encode("utf-8") for s in batch["text"].tolist()]
        chunk = parse_lines(lines, self.graph.schema, self.quarantine, "ray", -1,
                            fmt="jsonl" if self.jsonl else "tsv", engine=self.cfg.options.reader)
        self.quarantine.close()
        if not chunk or len(next(iter(chunk.values()))) == 0:
            return _empty(self.graph)
        fb = self.executor.run(chunk)
        out = {"label": fb.label.numpy(), "sparse": fb.sparse.numpy(), "dense": fb.dense.numpy()}
        for name, s in zip(self.graph.outputs.sequence, fb.seqs):
            out[f"seq:{name}"] = s.numpy()
        return out


def _empty(graph: FeatureGraph) -> dict[str, np.ndarray]:
    o = graph.outputs
    out = {"label": np.zeros(0, np.float32), "sparse": np.zeros((0, len(o.sparse)), np.int64),
           "dense": np.zeros((0, len(o.dense)), np.float32)}
    for name in o.sequence:
        op = graph.producers()[name]
        out[f"seq:{name}"] = np.zeros((0, getattr(op, "max_len", 1)), np.int64)
    return out


def ray_dataset(cfg: ExtractConfig, quarantine_dir: str | None = None, actors: int = 1) -> Any:
    """A lazy Ray dataset of model-input columns for the logs of ``cfg`` (TSV or JSON lines)."""
    require_extra("ray", "ray.data")
    import ray.data

    for p in cfg.logs:
        if not Path(p).exists():
            raise LeanmlError(f"log file {p} does not exist; check the path")
        if p.endswith(".parquet"):
            raise LeanmlError("the Ray runner reads line-delimited logs (TSV / JSON lines); convert Parquet first")
    ds = ray.data.read_text(list(cfg.logs))
    return ds.map_batches(RayExtract, fn_constructor_kwargs={"cfg": cfg, "quarantine_dir": quarantine_dir},
                          batch_size=cfg.options.batch_rows, batch_format="numpy",
                          compute=ray.data.ActorPoolStrategy(size=actors))


def to_feature_batch(b: dict[str, torch.Tensor], seq_names: list[str]) -> FeatureBatch:
    return FeatureBatch(b["label"], b["sparse"], b["dense"], [b[f"seq:{s}"] for s in seq_names])


def run_ray(cfg: ExtractConfig, train: TrainOptions | None = None, *, actors: int = 1, num_cpus: int | None = None,
            quarantine_dir: str | None = None, model: FeatureDNN | None = None, progress: bool = False,
            keep: list[FeatureBatch] | None = None) -> tuple[FeatureDNN, dict[str, Any]]:
    """Train from a Ray Data stream of the graph's output; starts a local Ray if none is running.

    ``keep``: when a list, every batch trained on is also appended to it (for inspection and tests).
    """
    ray = require_extra("ray", "ray", "ray.data")
    if not ray.is_initialized():
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
    train = train or TrainOptions()
    torch.manual_seed(train.seed)
    graph = cfg.graph
    model = model or model_for_graph(graph, dim=train.dim, hidden=train.hidden)
    opt = CTROptimizer(model, lr=train.lr)
    seqs = graph.outputs.sequence
    t0 = time.perf_counter()
    trains = []
    for ep in range(train.epochs):
        ds = ray_dataset(cfg, quarantine_dir, actors)
        stream = (to_feature_batch(b, seqs) for b in ds.iter_torch_batches(batch_size=cfg.options.batch_rows))
        if keep is not None:
            stream = (keep.append(b) or b for b in stream)
        trains.append(train_on(model, stream, opt, "cpu", progress=progress, desc=f"ray epoch {ep + 1}"))
    wall = time.perf_counter() - t0
    q: Counter = Counter()
    if quarantine_dir and Path(quarantine_dir).exists():
        import json

        for f in Path(quarantine_dir).glob("quarantine-*.jsonl"):
            for line in f.read_text().splitlines():
                q[json.loads(line)["reason"]] += 1
    rows = sum(t.rows for t in trains)
    return model, {"mode": "ray", "rows": rows, "wall_s": wall, "samples_s": rows / wall if wall else 0.0,
                   "train_s": sum(t.train_s for t in trains), "train_wait_s": sum(t.wait_s for t in trains),
                   "quarantined": dict(q), "loss": trains[-1].loss, "train": [t.as_dict() for t in trains]}
