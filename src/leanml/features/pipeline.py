"""FeatureBox pipeline: extraction of batch i+1 overlaps training on batch i; nothing touches disk.

A producer (a thread, or a separate process so that extraction and training each own a core) reads
raw log chunks, runs the graph layer by layer and puts finished :class:`FeatureBatch` es on a bounded
queue of ``prefetch`` batches; the trainer takes them off the queue. The queue bound keeps memory flat:
when training is slower the producer blocks, when extraction is slower the trainer waits (and the
report says how long).
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from leanml.features.arena import Arena, NoArena
from leanml.features.batch import FeatureBatch
from leanml.features.graph import FeatureGraph, load_graph
from leanml.features.model import CTROptimizer, FeatureDNN, model_for_graph
from leanml.features.readers import LogReader, Quarantine
from leanml.features.scheduler import ExecStats, LayerwiseExecutor
from leanml.utils import LeanmlError


@dataclass
class ExtractConfig:
    """Everything a producer needs to turn logs into batches (picklable, so a process can rebuild it)."""

    graph: dict[str, Any]
    logs: list[str]
    data_dir: str | None = None
    tables: dict[str, str] = field(default_factory=dict)
    batch_rows: int = 4096
    threads: int = 1  # CPU ops of one level run on this many threads
    torch_threads: int = 1
    arena: bool = True
    arena_bytes: int = 8 << 20
    quarantine: str | None = None
    shard: tuple[int, int] = (0, 1)
    device: str | None = None

    @classmethod
    def build(cls, graph: FeatureGraph | dict | str, logs: Iterable[str | Path], **kw: Any) -> ExtractConfig:
        if isinstance(graph, dict):
            graph = FeatureGraph.from_dict(graph)
        g = graph if isinstance(graph, FeatureGraph) else load_graph(graph)
        logs = [str(p) for p in logs]
        if kw.get("data_dir") is None and logs:
            kw["data_dir"] = str(Path(logs[0]).parent)
        return cls(graph=g.to_dict(), logs=logs, **kw)


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
    cpu_s: float = 0.0  # CPU seconds of the extracting thread
    read_s: float = 0.0
    exec: dict[str, Any] = field(default_factory=dict)
    arena: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Extractor:
    """Reader + layer-wise executor for one config; iterate it for batches."""

    def __init__(self, cfg: ExtractConfig) -> None:
        self.cfg = cfg
        self.graph = FeatureGraph.from_dict(cfg.graph)
        self.quarantine = Quarantine(Path(cfg.quarantine) if cfg.quarantine else None)
        self.reader = LogReader(cfg.logs, self.graph.schema, chunk_rows=cfg.batch_rows,
                                quarantine=self.quarantine, shard=tuple(cfg.shard))
        arena: Arena | NoArena = Arena(cfg.arena_bytes) if cfg.arena else NoArena()
        self.executor = LayerwiseExecutor(self.graph, device=cfg.device, threads=cfg.threads, arena=arena,
                                          data_dir=cfg.data_dir, tables=cfg.tables)
        self.read_s = 0.0
        self.extract_s = 0.0
        self.cpu_s = 0.0

    def __iter__(self) -> Iterator[FeatureBatch]:
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
            self.extract_s += time.perf_counter() - t0
            self.cpu_s += time.thread_time() - c0
            if batch is not None and len(batch):
                yield batch
        self.quarantine.close()

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


# ----------------------------------------------------------------------------------------- producers
_DONE = "__done__"
_ERROR = "__error__"


def _produce(cfg: ExtractConfig, q: Any, stop: Any, as_arrays: bool = False,
             source: Callable[[ExtractConfig], Any] | None = None) -> None:
    """Producer body shared by the thread and process producers.

    A process producer sends plain numpy arrays (pickled through the queue's pipe) rather than torch
    tensors, whose shared-memory handles would die with the producer before the consumer reads them.
    """
    try:
        ex = (source or Extractor)(cfg)
        for batch in ex:
            item: Any = ("__arrays__", [t.numpy() for t in batch.tensors()]) if as_arrays else batch
            while True:
                if stop.is_set():
                    return
                try:
                    q.put(item, timeout=0.2)
                    break
                except queue.Full:
                    continue
        q.put((_DONE, ex.report() if hasattr(ex, "report") else None))
    except BaseException as exc:  # the consumer re-raises it
        msg = str(exc) if isinstance(exc, LeanmlError) else traceback.format_exc()
        q.put((_ERROR, type(exc).__name__, msg))


def _produce_process(cfg: ExtractConfig, q: Any, stop: Any, source: Any = None) -> None:
    torch.set_num_threads(max(1, cfg.torch_threads))
    _produce(cfg, q, stop, as_arrays=True, source=source)


class Prefetcher:
    """Iterate batches made by a producer thread or process, at most ``depth`` batches ahead.

    After iteration, :attr:`report` holds the producer's :class:`ExtractReport`.
    """

    def __init__(self, cfg: ExtractConfig, depth: int = 2, mode: str = "thread",
                 source: Callable[[ExtractConfig], Any] | None = None) -> None:
        if depth < 1:
            raise LeanmlError(f"prefetch depth must be >= 1 (got {depth})")
        if mode not in ("thread", "process"):
            raise LeanmlError(f"producer must be thread or process (got {mode!r})")
        self.cfg, self.depth, self.mode = cfg, depth, mode
        self.source = source  # builds the batch iterable from cfg (default: Extractor); must be picklable
        self.report: ExtractReport | None = None
        self.wait_s = 0.0

    def __iter__(self) -> Iterator[FeatureBatch]:
        if self.mode == "thread":
            q: Any = queue.Queue(maxsize=self.depth)
            stop: Any = threading.Event()
            worker: Any = threading.Thread(target=_produce, args=(self.cfg, q, stop, False, self.source), daemon=True)
        else:
            import torch.multiprocessing as mp

            ctx = mp.get_context("spawn")
            q = ctx.Queue(maxsize=self.depth)
            stop = ctx.Event()
            worker = ctx.Process(target=_produce_process, args=(self.cfg, q, stop, self.source), daemon=True)
        worker.start()
        try:
            while True:
                t0 = time.perf_counter()
                item = q.get()
                self.wait_s += time.perf_counter() - t0
                if isinstance(item, tuple) and item and item[0] == _DONE:
                    self.report = item[1] if isinstance(item[1], ExtractReport) else None
                    break
                if isinstance(item, tuple) and item and item[0] == _ERROR:
                    if item[1] == "LeanmlError":
                        raise LeanmlError(item[2])
                    raise RuntimeError(f"feature extraction failed:\n{item[2]}")
                if isinstance(item, tuple) and item and item[0] == "__arrays__":
                    ts = [torch.from_numpy(a) for a in item[1]]
                    item = FeatureBatch(ts[0], ts[1], ts[2], ts[3:])
                yield item
        finally:
            stop.set()
            if self.mode == "process":
                while worker.is_alive():
                    try:
                        q.get(timeout=0.05)
                    except queue.Empty:
                        pass
                    worker.join(timeout=0.05)
            else:
                worker.join(timeout=5)


# ----------------------------------------------------------------------------------------- training
@dataclass
class TrainReport:
    """Training-side numbers: steps, rows, compute seconds, seconds spent waiting for data, mean loss."""

    steps: int = 0
    rows: int = 0
    train_s: float = 0.0
    cpu_s: float = 0.0  # CPU seconds of the training thread in training steps
    wait_s: float = 0.0
    loss: float = float("nan")
    losses: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["losses"] = [round(x, 5) for x in self.losses]
        return d


def train_on(model: FeatureDNN, batches: Iterable[FeatureBatch], opt: CTROptimizer,
             device: torch.device | str = "cpu", progress: bool = False, total: int | None = None,
             desc: str = "train", step_hook: Callable[[int], None] | None = None) -> TrainReport:
    """One pass of BCE training over ``batches``; separates compute time from time waiting for batches."""
    rep = TrainReport()
    model.train()
    loss_fn = torch.nn.BCEWithLogitsLoss()
    total_loss = 0.0
    bar = tqdm(total=total, desc=desc, unit="row", disable=not progress, leave=False)
    it = iter(batches)
    while True:
        t0 = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            rep.wait_s += time.perf_counter() - t0
            break
        t1, c1 = time.perf_counter(), time.thread_time()
        rep.wait_s += t1 - t0
        b = batch.to(device)
        loss = loss_fn(model(b), b.label)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        lv = float(loss.detach())
        rep.train_s += time.perf_counter() - t1
        rep.cpu_s += time.thread_time() - c1
        rep.steps += 1
        rep.rows += len(batch)
        total_loss += lv * len(batch)
        if rep.steps % 10 == 1:
            rep.losses.append(lv)
        bar.update(len(batch))
        if step_hook is not None:
            step_hook(rep.steps)
    bar.close()
    rep.loss = total_loss / max(rep.rows, 1)
    return rep


@torch.no_grad()
def evaluate(model: FeatureDNN, batches: Iterable[FeatureBatch], device: torch.device | str = "cpu") -> dict[str, float]:
    """AUC and logloss of the model on ``batches``."""
    from sklearn.metrics import roc_auc_score

    model.eval()
    ps, ys = [], []
    for b in batches:
        b = b.to(device)
        ps.append(torch.sigmoid(model(b)).cpu().numpy())
        ys.append(b.label.cpu().numpy())
    if not ps:
        raise LeanmlError("no evaluation rows; check the test log")
    p = np.clip(np.concatenate(ps), 1e-7, 1 - 1e-7)
    y = np.concatenate(ys)
    auc = float(roc_auc_score(y, p)) if 0 < y.sum() < len(y) else float("nan")
    logloss = float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))
    return {"auc": auc, "logloss": logloss, "rows": len(y)}


def run_pipelined(cfg: ExtractConfig, *, epochs: int = 1, prefetch: int = 2, producer: str = "thread",
                  lr: float = 1e-3, seed: int = 0, model: FeatureDNN | None = None, dim: int = 16,
                  hidden: tuple[int, ...] = (128, 64), device: str | None = None,
                  progress: bool = False) -> tuple[FeatureDNN, dict[str, Any]]:
    """Stream logs through the graph straight into training; returns the model and a JSON-able report."""
    torch.manual_seed(seed)
    graph = FeatureGraph.from_dict(cfg.graph)
    model = model or model_for_graph(graph, dim=dim, hidden=hidden)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model.to(dev)
    opt = CTROptimizer(model, lr=lr)
    t0 = time.perf_counter()
    reps, trains = [], []
    for ep in range(epochs):
        pf = Prefetcher(cfg, depth=prefetch, mode=producer)
        trains.append(train_on(model, pf, opt, dev, progress=progress, desc=f"pipelined epoch {ep + 1}"))
        reps.append(pf.report)
    wall = time.perf_counter() - t0
    ext = merge_reports([r for r in reps if r is not None])
    ext.extract_s = sum(r.extract_s for r in reps if r is not None)
    ext.cpu_s = sum(r.cpu_s for r in reps if r is not None)
    rows = sum(t.rows for t in trains)
    report = {
        "mode": "pipelined", "producer": producer, "prefetch": prefetch, "epochs": epochs,
        "rows": rows, "wall_s": wall, "samples_s": rows / wall if wall > 0 else 0.0,
        "extract_s": ext.extract_s, "train_s": sum(t.train_s for t in trains),
        "extract_cpu_s": ext.cpu_s, "train_cpu_s": sum(t.cpu_s for t in trains),
        "train_wait_s": sum(t.wait_s for t in trains), "loss": trains[-1].loss if trains else None,
        "extract": ext.as_dict(), "train": [t.as_dict() for t in trains],
    }
    return model, report
