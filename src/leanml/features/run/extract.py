"""FeatureBox extraction: the options of a producer, and the reader + layer-wise executor that turns logs
into :class:`FeatureBatch` es (:class:`Extractor`), with the report of what it read, quarantined and ran.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from leanml.features.options import PipelineOptions
from leanml.features.read.logschema import Quarantine
from leanml.features.read.readers import LogReader
from leanml.features.run.arena import Arena, NoArena
from leanml.features.run.batch import FeatureBatch
from leanml.features.run.graph import FeatureGraph, load_graph
from leanml.features.run.scheduler import ExecStats, LayerwiseExecutor
from leanml.features.train.lookup import build_plan


@dataclass(frozen=True)
class ExtractConfig:
    """Everything a producer needs to turn logs into batches (picklable, so a process can rebuild it).
    ``graph`` is parsed once, by :meth:`build`, and every extractor, model and report of the run uses
    this object."""

    graph: FeatureGraph
    logs: tuple[str, ...]
    options: PipelineOptions = field(default_factory=PipelineOptions)
    data_dir: str | None = None
    tables: dict[str, str] = field(default_factory=dict)
    quarantine: str | None = None
    shard: tuple[int, int] = (0, 1)
    # ids per field of the model's fused embedding table: when set, every batch carries its lookup plan
    # (leanml.features.train.lookup), built here beside extraction instead of in the training step
    lookup_sizes: tuple[int, ...] | None = None

    @classmethod
    def build(cls, graph: FeatureGraph | dict | str, logs: Iterable[str | Path],
              options: PipelineOptions | None = None, **kw: Any) -> ExtractConfig:
        """The config of a graph (object, dict, YAML path or bundled name) over ``logs``; ``data_dir``
        defaults to the first log's folder."""
        if isinstance(graph, dict):
            graph = FeatureGraph.from_dict(graph)
        g = graph if isinstance(graph, FeatureGraph) else load_graph(graph)
        logs = tuple(str(p) for p in logs)
        if kw.get("data_dir") is None and logs:
            kw["data_dir"] = str(Path(logs[0]).parent)
        return cls(graph=g, logs=logs, options=options or PipelineOptions(), **kw)


@dataclass
class ExtractReport:
    """What extraction did: rows, quarantine by reason, per-op time, arena statistics, busy seconds."""

    rows_read: int = 0
    lines_read: int = 0
    rows_out: int = 0
    batches: int = 0
    quarantined: dict[str, int] = field(default_factory=dict)
    quarantine_file: str | None = None
    extract_s: float = 0.0
    cpu_s: float = 0.0  # CPU seconds of the extracting thread(s) or worker process(es)
    read_s: float = 0.0
    exec: dict[str, Any] = field(default_factory=dict)
    arena: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Extractor:
    """Reader + layer-wise executor for one config; iterate it for batches."""

    def __init__(self, cfg: ExtractConfig) -> None:
        self.cfg = cfg
        self.graph = cfg.graph
        self.quarantine = Quarantine(Path(cfg.quarantine) if cfg.quarantine else None)
        self.reader = LogReader(cfg.logs, self.graph.schema, chunk_rows=cfg.options.batch_rows,
                                quarantine=self.quarantine, shard=tuple(cfg.shard), engine=cfg.options.reader,
                                yield_empty=True)
        arena: Arena | NoArena = Arena(cfg.options.arena_bytes) if cfg.options.arena else NoArena()
        self.executor = LayerwiseExecutor(self.graph, device=cfg.options.device, threads=cfg.options.threads,
                                          arena=arena, data_dir=cfg.data_dir, tables=cfg.tables,
                                          entity=cfg.options.entity)
        self.read_s = 0.0
        self.extract_s = 0.0
        self.cpu_s = 0.0

    def __iter__(self) -> Iterator[FeatureBatch]:
        for batch in self.iter_chunks():
            if batch is not None:
                yield batch

    def iter_chunks(self) -> Iterator[FeatureBatch | None]:
        """One item per chunk this shard owns: its batch, or None when no row of it survived."""
        it = iter(self.reader)
        while True:
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                chunk = next(it)
            except StopIteration:
                self.extract_s += time.perf_counter() - t0
                self.cpu_s += time.thread_time() - c0
                break
            t1 = time.perf_counter()
            self.read_s += t1 - t0
            batch = self.executor.run(chunk) if chunk and len(next(iter(chunk.values()))) else None
            if batch is not None and len(batch) and self.cfg.lookup_sizes:
                batch.plan = build_plan(batch.ids(), batch.layout(), self.cfg.lookup_sizes)
            self.extract_s += time.perf_counter() - t0
            self.cpu_s += time.thread_time() - c0
            yield batch if batch is not None and len(batch) else None
        self.quarantine.close()

    def warm(self) -> float:
        """Load the tables and compute the per-entity features now (before workers fork); returns CPU seconds."""
        c0 = time.process_time()
        for lv in self.executor.plan.levels:
            for op in lv:
                if self.executor.entity and hasattr(op, "positions"):
                    self.executor.entities(op)
        return time.process_time() - c0

    def report(self) -> ExtractReport:
        st = self.executor.stats
        return ExtractReport(rows_read=self.reader.rows_read, lines_read=self.reader.lines_read,
                             rows_out=st.rows_out, batches=st.batches, quarantined=dict(self.quarantine.counts),
                             quarantine_file=self.cfg.quarantine if self.quarantine.total else None,
                             extract_s=self.extract_s, cpu_s=self.cpu_s, read_s=self.read_s, exec=st.as_dict(),
                             arena=self.executor.arena.stats.as_dict())


def merge_reports(reports: list[ExtractReport]) -> ExtractReport:
    out = ExtractReport()
    stats = ExecStats()
    q: Counter = Counter()
    for r in reports:
        out.rows_read += r.rows_read
        out.lines_read += r.lines_read
        out.rows_out += r.rows_out
        out.batches += r.batches
        out.extract_s = max(out.extract_s, r.extract_s)
        out.cpu_s += r.cpu_s
        out.read_s = max(out.read_s, r.read_s)
        q.update(r.quarantined)
        s = ExecStats()
        s.op_seconds.update(r.exec.get("op_seconds", {}))
        s.counters.update(r.exec.get("counters", {}))
        stats.merge(s)
        for k, v in r.arena.items():
            out.arena[k] = out.arena.get(k, 0) + v if k not in ("peak_bytes", "capacity_bytes") else max(
                out.arena.get(k, 0), v)
        out.quarantine_file = out.quarantine_file or r.quarantine_file
    out.quarantined = dict(q)
    out.exec = stats.as_dict()
    return out


def no_rows_message(ext: dict[str, Any], what: str) -> str:
    """The one-line error when extraction left no row (all quarantined or filtered)."""
    q = ext.get("quarantined") or {}
    why = f"{sum(q.values())} quarantined ({', '.join(f'{k}={v}' for k, v in sorted(q.items()))}), " if q else ""
    return (f"no rows to {what}: {ext.get('lines_read', 0)} lines read, {why}{ext.get('rows_read', 0)} parsed, "
            "none left after the graph's filters; check the log and the graph (nothing was written)")

