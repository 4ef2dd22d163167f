"""The two-stage baseline FeatureBox replaces: run the graph to completion into Parquet, then train
from those files. Same graph, same batches (one Parquet row group per batch), so the feature tensors
are identical to the pipelined ones.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from leanml.errors import LeanmlError
from leanml.features.read.checks import temp_sibling
from leanml.features.run.batch import FeatureBatch, split_ids
from leanml.features.run.extract import ExtractConfig, Extractor, no_rows_message
from leanml.features.run.graph import FeatureGraph
from leanml.features.train.model import CTROptimizer, FeatureDNN, model_for_graph
from leanml.features.train.pipeline import TrainOptions, train_on
from leanml.outputs import atomic_dir, clean_stale, write_json
from leanml.progress import EtaBar

BATCHES_PER_FILE = 64


def batch_to_table(batch: FeatureBatch, seq_names: list[str]) -> pa.Table:
    """A batch as an Arrow table: label, sparse/dense as fixed-size lists, one column per sequence."""
    n = len(batch)

    def fixed(t: torch.Tensor, typ: pa.DataType) -> pa.Array:
        arr = t.numpy().reshape(n, -1)
        return pa.FixedSizeListArray.from_arrays(pa.array(arr.ravel(), type=typ), arr.shape[1])

    cols = {"label": pa.array(batch.label.numpy(), type=pa.float32()),
            "sparse": fixed(batch.sparse, pa.int64()), "dense": fixed(batch.dense, pa.float32())}
    for name, s in zip(seq_names, batch.seqs):
        cols[f"seq:{name}"] = fixed(s, pa.int64())
    return pa.table(cols)


def table_to_batch(table: pa.Table, seq_names: list[str], widths: dict[str, int]) -> FeatureBatch:
    """A row group back into a packed :class:`FeatureBatch` (ids of all fields in one buffer)."""
    n = table.num_rows

    def flat(col: str) -> np.ndarray:
        return table.column(col).combine_chunks().flatten().to_numpy(zero_copy_only=False)

    id_cols = ["sparse", *[f"seq:{s}" for s in seq_names]]
    ids = np.empty((n, sum(widths[c] for c in id_cols)), dtype=np.int64)
    start = 0
    for c in id_cols:
        ids[:, start : start + widths[c]] = flat(c).reshape(n, widths[c])
        start += widths[c]
    dense = np.array(flat("dense"), dtype=np.float32).reshape(n, widths["dense"])
    return split_ids(torch.from_numpy(table.column("label").to_numpy().astype(np.float32)), torch.from_numpy(ids),
                      torch.from_numpy(dense), [widths[f"seq:{s}"] for s in seq_names])


def extract_to_parquet(cfg: ExtractConfig, out: str | Path, overwrite: bool = False,
                       progress: bool = False, total_rows: int | None = None) -> dict[str, Any]:
    """Stage 1: extract every batch and write ``part-*.parquet`` (+ ``report.json``) into ``out`` atomically.

    The quarantine file (``cfg.quarantine``) is written under a temporary name and published with the
    folder (a stale one of an earlier run is removed when this run quarantines nothing). Raises
    :class:`LeanmlError`, writing nothing, when no row is left to write. ``total_rows`` (log lines, may be
    an estimate) gives the progress bar its length and an estimated time after the first batch."""
    final_q = Path(cfg.quarantine) if cfg.quarantine else None
    if final_q is not None:
        final_q.parent.mkdir(parents=True, exist_ok=True)
        clean_stale(final_q)
        cfg = replace(cfg, quarantine=str(temp_sibling(final_q)))
        Path(cfg.quarantine).unlink(missing_ok=True)
    try:
        return _extract(cfg, out, overwrite, progress, final_q, total_rows)
    finally:
        if final_q is not None:
            Path(cfg.quarantine).unlink(missing_ok=True)


def _extract(cfg: ExtractConfig, out: str | Path, overwrite: bool, progress: bool,
             final_q: Path | None, total_rows: int | None) -> dict[str, Any]:
    t0 = time.perf_counter()
    ex = Extractor(cfg)
    graph = ex.graph
    seq_names = graph.outputs.sequence
    meta = {"graph": json.dumps(graph.to_dict()),
            "cardinalities": json.dumps({c: graph.cardinality(c) for c in graph.outputs.columns()})}
    write_s = 0.0
    files = 0
    rows = 0
    with atomic_dir(out, overwrite=overwrite) as tmp:
        writer = None
        in_file = 0
        bar = EtaBar(total=total_rows, desc="extract", unit="row", disable=not progress, leave=False)
        for batch in ex:
            tw = time.perf_counter()
            table = batch_to_table(batch, seq_names)
            if writer is None or in_file == BATCHES_PER_FILE:
                if writer is not None:
                    writer.close()
                schema = table.schema.with_metadata(meta)
                writer = pq.ParquetWriter(tmp / f"part-{files:05d}.parquet", schema, compression="snappy")
                files += 1
                in_file = 0
            writer.write_table(table.replace_schema_metadata(meta), row_group_size=len(batch))
            in_file += 1
            rows += len(batch)
            write_s += time.perf_counter() - tw
            bar.update(len(batch))
        bar.close()
        if writer is not None:
            writer.close()
        rep = ex.report()
        if not rows:
            raise LeanmlError(no_rows_message(rep.as_dict(), "extract"))
        if final_q is not None:
            rep.quarantine_file = str(final_q) if rep.quarantine_file else None
            if Path(cfg.quarantine).exists():
                Path(cfg.quarantine).replace(final_q)
            else:
                final_q.unlink(missing_ok=True)
        wall = time.perf_counter() - t0
        report = {"stage": "extract", "rows": rows, "files": files, "wall_s": wall, "write_s": write_s,
                  "extract_s": rep.extract_s, "extract": rep.as_dict(), "graph": graph.name}
        write_json(tmp / "report.json", report)
    return report


def check_features_dir(features_dir: str | Path, what: str = "features_dir") -> int:
    """Raise unless ``features_dir`` holds readable ``part-*.parquet`` files from :func:`extract_to_parquet`
    with rows; returns their row count. ``what`` names the parameter (or flag) that gave the folder."""
    d = Path(features_dir)
    if not d.is_dir():
        raise LeanmlError(f"{what} {d} is not a folder; pass the output folder of `leanml features extract`")
    files = sorted(d.glob("part-*.parquet"))
    if not files:
        raise LeanmlError(f"no part-*.parquet files in {d}; run `leanml features extract` first")
    rows = 0
    for f in files:
        try:
            pf = pq.ParquetFile(f)
            meta = pf.schema_arrow.metadata or {}
            json.loads(meta[b"graph"])
        except (pa.ArrowException, OSError, KeyError, ValueError) as exc:
            raise LeanmlError(f"{f} is not a readable feature file of `leanml features extract` "
                              f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); "
                              "run the extract again") from None
        rows += pf.metadata.num_rows
    if not rows:
        raise LeanmlError(f"the feature files in {d} have no rows; run `leanml features extract` on a log with rows")
    return rows


def read_parquet_batches(features_dir: str | Path) -> Iterator[FeatureBatch]:
    """Stage 2 input: the batches written by :func:`extract_to_parquet`, one per row group, in order."""
    files = sorted(Path(features_dir).glob("part-*.parquet"))
    if not files:
        raise LeanmlError(f"no part-*.parquet files in {features_dir}; run `leanml features extract` first")
    for f in files:
        pf = pq.ParquetFile(f)
        graph = json.loads(pf.schema_arrow.metadata[b"graph"])
        seq_names = list(graph["outputs"].get("sequence", []))
        widths = {name: pf.schema_arrow.field(name).type.list_size
                  for name in ["sparse", "dense", *[f"seq:{s}" for s in seq_names]]}
        for rg in range(pf.num_row_groups):
            yield table_to_batch(pf.read_row_group(rg), seq_names, widths)


def parquet_graph(features_dir: str | Path) -> tuple[FeatureGraph, dict[str, int | None]]:
    files = sorted(Path(features_dir).glob("part-*.parquet"))
    if not files:
        raise LeanmlError(f"no part-*.parquet files in {features_dir}; run `leanml features extract` first")
    meta = pq.ParquetFile(files[0]).schema_arrow.metadata
    return FeatureGraph.from_dict(json.loads(meta[b"graph"])), json.loads(meta[b"cardinalities"])


def train_from_parquet(features_dir: str | Path, train: TrainOptions | None = None, *,
                       model: FeatureDNN | None = None, device: str | None = None, progress: bool = False,
                       total_rows: int | None = None) -> tuple[FeatureDNN, dict[str, Any]]:
    """Stage 2: train from the Parquet features (reading is part of the measured time).

    ``total_rows`` (rows per epoch) gives the progress bar its length and an estimated time after the first batch."""
    train = train or TrainOptions()
    torch.manual_seed(train.seed)
    graph, cards = parquet_graph(features_dir)
    model = model or model_for_graph(graph, dim=train.dim, hidden=train.hidden,
                                     cardinalities={k: v for k, v in cards.items() if v})
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model.to(dev)
    opt = CTROptimizer(model, lr=train.lr)
    t0 = time.perf_counter()
    trains = [train_on(model, read_parquet_batches(features_dir), opt, dev, progress=progress, total=total_rows,
                       desc=f"train epoch {e + 1}") for e in range(train.epochs)]
    wall = time.perf_counter() - t0
    rows = sum(t.rows for t in trains)
    return model, {"stage": "train", "rows": rows, "wall_s": wall, "train_s": sum(t.train_s for t in trains),
                   "read_s": sum(t.wait_s for t in trains), "loss": trains[-1].loss,
                   "train_cpu_s": sum(t.cpu_s for t in trains),
                   "train": [t.as_dict() for t in trains]}


def run_two_stage(cfg: ExtractConfig, out: str | Path, train: TrainOptions | None = None, *,
                  device: str | None = None, overwrite: bool = True,
                  progress: bool = False) -> tuple[FeatureDNN, dict[str, Any]]:
    """Both stages back to back; the report has the same keys as the pipelined one."""
    t0 = time.perf_counter()
    ext = extract_to_parquet(cfg, out, overwrite=overwrite, progress=progress)
    model, tr = train_from_parquet(out, train, device=device, progress=progress)
    wall = time.perf_counter() - t0
    return model, {"mode": "two_stage", "rows": tr["rows"], "wall_s": wall,
                   "samples_s": tr["rows"] / wall if wall > 0 else 0.0,
                   "extract_s": ext["wall_s"], "train_s": tr["wall_s"], "write_s": ext["write_s"],
                   "extract_cpu_s": ext["extract"]["cpu_s"], "train_cpu_s": tr["train_cpu_s"],
                   "read_s": tr["read_s"], "loss": tr["loss"], "extract": ext["extract"], "train": tr["train"]}
