"""FeatureBox pipeline: extraction of batch i+1 overlaps training on batch i; nothing touches disk.

Producers read raw log chunks, run the graph layer by layer and hand finished :class:`FeatureBatch` es
to the trainer, at most a bounded number ahead (memory stays flat: when training is slower the
producers block, when extraction is slower the trainer waits, and the report says how long).

* ``process`` (default): ``workers`` producer processes behind a ``torch.utils.data.DataLoader`` over
  the :class:`FeatureStream` iterable dataset. Batches reach the trainer through shared memory (no
  pickled arrays through a pipe), ``prefetch`` batches per worker (``prefetch_factor``), workers kept
  for later epochs (``persistent_workers``). Worker ``w`` of ``W`` extracts chunks ``w, w+W, ...``, and
  the loader returns them round-robin, so the batch order is the chunk order whatever ``W`` is. A
  worker that fails raises in the trainer with its error (its one-line message for input errors, the
  traceback otherwise); one that dies (killed, out of memory) raises there too.
* ``thread``: one producer thread in the trainer's process, a queue of ``prefetch`` batches. The
  readers and ops run in arrow / numpy kernels that release the GIL, but the glue between them does not.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from leanml.features.arena import Arena, NoArena
from leanml.features.batch import FeatureBatch
from leanml.features.graph import FeatureGraph, load_graph
from leanml.features.lookup import build_plan
from leanml.features.model import CTROptimizer, FeatureDNN, FusedEmbedding, model_for_graph
from leanml.features.readers import LogReader, Quarantine
from leanml.features.scheduler import ExecStats, LayerwiseExecutor
from leanml.features.shm import SlotRef, SlotRing
from leanml.utils import EtaBar, LeanmlError


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
    engine: str = "arrow"  # reader engine: arrow (native) or python (reference)
    entity: bool = True  # per-entity ops once per table row (False: every op per log row)
    # ids per field of the model's fused embedding table: when set, every batch carries its lookup plan
    # (leanml.features.lookup), built here beside extraction instead of in the training step
    lookup_sizes: list[int] | None = None

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
        self.graph = FeatureGraph.from_dict(cfg.graph)
        self.quarantine = Quarantine(Path(cfg.quarantine) if cfg.quarantine else None)
        self.reader = LogReader(cfg.logs, self.graph.schema, chunk_rows=cfg.batch_rows,
                                quarantine=self.quarantine, shard=tuple(cfg.shard), engine=cfg.engine,
                                yield_empty=True)
        arena: Arena | NoArena = Arena(cfg.arena_bytes) if cfg.arena else NoArena()
        self.executor = LayerwiseExecutor(self.graph, device=cfg.device, threads=cfg.threads, arena=arena,
                                          data_dir=cfg.data_dir, tables=cfg.tables, entity=cfg.entity)
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


# ----------------------------------------------------------------------------------------- producers
_DONE = "__done__"
_ERROR = "__error__"


def _produce(cfg: ExtractConfig, q: Any, stop: Any, source: Callable[[ExtractConfig], Any] | None = None) -> None:
    """Body of the producer thread: batches onto ``q``, then the report (or the error) as the last item."""
    try:
        ex = (source or Extractor)(cfg)
        for batch in ex:
            while True:
                if stop.is_set():
                    return
                try:
                    q.put(batch, timeout=0.2)
                    break
                except queue.Full:
                    continue
        q.put((_DONE, ex.report() if hasattr(ex, "report") else None))
    except BaseException as exc:  # the consumer re-raises it
        msg = str(exc) if isinstance(exc, LeanmlError) else traceback.format_exc()
        q.put((_ERROR, type(exc).__name__, msg))


class WorkerDone:
    """Last item of a worker's stream: its extraction report and its process CPU seconds."""

    def __init__(self, report: ExtractReport | None, cpu_s: float, worker: int) -> None:
        self.report, self.cpu_s, self.worker = report, cpu_s, worker


class WorkerFailed:
    """A worker's input error (:class:`LeanmlError`), re-raised with its one-line message by the trainer."""

    def __init__(self, message: str, worker: int) -> None:
        self.message, self.worker = message, worker


class FeatureStream(torch.utils.data.IterableDataset):
    """The batches of an :class:`ExtractConfig` as an iterable dataset for ``DataLoader`` workers.

    Worker ``w`` of ``W`` extracts the chunks ``i`` with ``i % W == w`` (within the config's own shard,
    e.g. a DDP rank's) and yields one item per chunk (an empty chunk as None), so the loader's
    round-robin order over workers is the chunk order. Its last item is a :class:`WorkerDone`.
    ``source`` replaces :class:`Extractor` (it must offer ``iter_chunks`` or be iterable).
    """

    def __init__(self, cfg: ExtractConfig, source: Callable[[ExtractConfig], Any] | None = None,
                 ring_slots: int = 0) -> None:
        super().__init__()
        self.cfg, self.source, self.ring_slots = cfg, source, ring_slots
        self._ring: SlotRing | None = None  # made in the worker from its first batch, kept across epochs

    def worker_config(self, worker: int, workers: int) -> ExtractConfig:
        r, n = self.cfg.shard
        q = self.cfg.quarantine
        if q and workers > 1:
            q = str(Path(q).with_name(f"{Path(q).stem}.worker{worker}{Path(q).suffix}"))
        return replace(self.cfg, shard=(r + n * worker, n * workers), quarantine=q)

    def __iter__(self) -> Iterator[Any]:
        info = torch.utils.data.get_worker_info()
        w, n = (info.id, info.num_workers) if info is not None else (0, 1)
        c0 = time.process_time() if info is not None else time.thread_time()
        try:
            ex = (self.source or Extractor)(self.worker_config(w, n))
            items = ex.iter_chunks() if hasattr(ex, "iter_chunks") else iter(ex)
            yield from (self._via_ring(items, w) if info is not None and self.ring_slots > 0 else items)
        except LeanmlError as exc:
            yield WorkerFailed(str(exc), w)
            return
        cpu = (time.process_time() if info is not None else time.thread_time()) - c0
        yield WorkerDone(ex.report() if hasattr(ex, "report") else None, cpu, w)

    def _via_ring(self, items: Iterable[Any], worker: int) -> Iterator[Any]:
        """Batches as :class:`SlotRef` s into this worker's shared-memory ring (the ring itself rides along
        with the first one of each epoch); a batch that finds no free slot travels the ordinary way."""
        attached = False
        if self._ring is not None:
            self._ring.reclaim()
        for item in items:
            if isinstance(item, FeatureBatch):
                if self._ring is None:
                    self._ring = SlotRing.for_batch(item, self.ring_slots, self.cfg.batch_rows)
                slot = self._ring.put(item)
                if slot is not None:
                    yield SlotRef(worker, slot, len(item), None if attached else self._ring,
                                  SlotRing.plan_counts(item))
                    attached = True
                    continue
            yield item


def _worker_init(worker_id: int) -> None:
    info = torch.utils.data.get_worker_info()
    torch.set_num_threads(max(1, info.dataset.cfg.torch_threads) if info is not None else 1)


def merge_quarantine(path: str, workers: int) -> str | None:
    """Concatenate the workers' quarantine files into ``path`` ordered by source and line; None if empty."""
    import json

    parts = [Path(path).with_name(f"{Path(path).stem}.worker{w}{Path(path).suffix}") for w in range(workers)]
    recs = []
    for p in parts:
        if p.exists():
            recs += [json.loads(x) for x in p.read_text(encoding="utf-8").splitlines() if x]
            p.unlink()
    if not recs:
        return None
    recs.sort(key=lambda r: (r["source"], r["line"]))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as fh:
        for r in recs:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")
    return path


class Prefetcher:
    """Iterate batches made by producer worker processes (``mode="process"``) or a producer thread.

    ``depth``: batches ahead per worker (process) or queue depth (thread). ``workers``: producer
    processes. ``persistent``: keep the workers between iterations (epochs). ``warm``: load tables and
    per-entity features in this process before the workers fork, so every worker shares them (the CPU
    seconds go to :attr:`warm_cpu_s`). ``ring``: workers hand batches over through a ring of ``depth + 3``
    shared-memory slots each (:mod:`leanml.features.shm`) instead of a fresh shared segment per batch
    (``False``, and always when batches are pinned for CUDA: the DataLoader's ordinary tensor sharing).
    After each iteration :attr:`report` holds the merged :class:`ExtractReport` (``cpu_s`` = the producers'
    CPU seconds) and :attr:`handoff` counts the batches that came through the ring (``ring``) and the ordinary
    way (``copied``: ring off, or no slot free because the caller still holds earlier batches).
    """

    def __init__(self, cfg: ExtractConfig, depth: int = 2, mode: str = "process",
                 source: Callable[[ExtractConfig], Any] | None = None, workers: int = 1,
                 persistent: bool = False, warm: bool = True, mp_context: str | None = None,
                 ring: bool = True) -> None:
        if depth < 1:
            raise LeanmlError(f"prefetch depth must be >= 1 (got {depth})")
        if mode not in ("thread", "process"):
            raise LeanmlError(f"producer must be thread or process (got {mode!r})")
        if workers < 1:
            raise LeanmlError(f"workers must be >= 1 (got {workers})")
        self.cfg, self.depth, self.mode, self.workers = cfg, depth, mode, workers
        self.source = source  # builds the batch iterable from cfg (default: Extractor)
        self.persistent, self.warm, self.mp_context, self.ring = persistent, warm, mp_context, ring
        self.report: ExtractReport | None = None
        self.wait_s = 0.0
        self.warm_cpu_s = 0.0
        self.handoff: Counter = Counter()
        self._loader: Any = None

    def __iter__(self) -> Iterator[FeatureBatch]:
        return self._iter_thread() if self.mode == "thread" else self._iter_workers()

    def close(self) -> None:
        """Stop persistent workers."""
        loader, self._loader = self._loader, None
        it = getattr(loader, "_iterator", None)
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()

    def _make_loader(self) -> Any:
        ctx = self.mp_context or ("fork" if os.name == "posix" and "fork" in _start_methods() else None)
        if self.warm and self.source is None and ctx == "fork":
            self.warm_cpu_s += Extractor(self.cfg).warm()
        cuda = torch.cuda.is_available() and (self.cfg.device or "cuda").startswith("cuda")
        return torch.utils.data.DataLoader(
            FeatureStream(self.cfg, self.source, ring_slots=self.depth + 3 if self.ring and not cuda else 0),
            batch_size=None, num_workers=self.workers,
            prefetch_factor=self.depth, persistent_workers=self.persistent, multiprocessing_context=ctx,
            worker_init_fn=_worker_init, pin_memory=cuda, in_order=True)

    def _iter_workers(self) -> Iterator[FeatureBatch]:
        if self._loader is None:
            self._loader = self._make_loader()
        done: list[WorkerDone] = []
        rings: dict[int, SlotRing] = {}
        self.handoff = Counter()
        it = iter(self._loader)
        try:
            while True:
                t0 = time.perf_counter()
                try:
                    item = next(it)
                except StopIteration:
                    break
                finally:
                    self.wait_s += time.perf_counter() - t0
                if isinstance(item, WorkerFailed):
                    raise LeanmlError(item.message)
                if isinstance(item, SlotRef):
                    if item.ring is not None:
                        rings[item.worker] = item.ring
                    self.handoff["ring"] += 1
                    yield rings[item.worker].batch(item.slot, item.n, item.plan)
                elif isinstance(item, WorkerDone):
                    done.append(item)
                elif item is not None:
                    self.handoff["copied"] += 1
                    yield item
        finally:
            if not self.persistent:
                del it
                self._loader = None
        reports = [d.report for d in sorted(done, key=lambda d: d.worker) if d.report is not None]
        rep = merge_reports(reports) if reports else ExtractReport()
        rep.cpu_s = sum(d.cpu_s for d in done)
        rep.extract_s = sum(r.extract_s for r in reports)
        if self.cfg.quarantine and self.workers > 1:
            rep.quarantine_file = merge_quarantine(self.cfg.quarantine, self.workers)
        self.report = rep

    def _iter_thread(self) -> Iterator[FeatureBatch]:
        q: Any = queue.Queue(maxsize=self.depth)
        stop = threading.Event()
        worker = threading.Thread(target=_produce, args=(self.cfg, q, stop, self.source), daemon=True)
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
                yield item
        finally:
            stop.set()
            worker.join(timeout=5)


def _start_methods() -> list[str]:
    import multiprocessing

    return multiprocessing.get_all_start_methods()


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


def no_rows_message(ext: dict[str, Any], what: str) -> str:
    """The one-line error when extraction left no row (all quarantined or filtered)."""
    q = ext.get("quarantined") or {}
    why = f"{sum(q.values())} quarantined ({', '.join(f'{k}={v}' for k, v in sorted(q.items()))}), " if q else ""
    return (f"no rows to {what}: {ext.get('lines_read', 0)} lines read, {why}{ext.get('rows_read', 0)} parsed, "
            "none left after the graph's filters; check the log and the graph (nothing was written)")


def train_on(model: FeatureDNN, batches: Iterable[FeatureBatch], opt: CTROptimizer,
             device: torch.device | str = "cpu", progress: bool = False, total: int | None = None,
             desc: str = "train", step_hook: Callable[[int], None] | None = None) -> TrainReport:
    """One pass of BCE training over ``batches``; separates compute time from time waiting for batches.

    With ``progress`` and ``total`` (rows expected, may be an estimate) the estimated time of the pass is
    printed to stderr after the first batch."""
    rep = TrainReport()
    model.train()
    loss_fn = torch.nn.BCEWithLogitsLoss()
    total_loss = 0.0
    bar = EtaBar(total=total, desc=desc, unit="row", disable=not progress, leave=False)
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


def run_pipelined(cfg: ExtractConfig, *, epochs: int = 1, prefetch: int = 2, producer: str = "process",
                  workers: int = 1, lr: float = 1e-3, seed: int = 0, model: FeatureDNN | None = None,
                  dim: int = 16, hidden: tuple[int, ...] = (128, 64), device: str | None = None,
                  progress: bool = False, plans: bool = True,
                  total_rows: int | None = None) -> tuple[FeatureDNN, dict[str, Any]]:
    """Stream logs through the graph straight into training; returns the model and a JSON-able report.

    ``producer="process"``: ``workers`` DataLoader worker processes (shared memory, ``prefetch`` batches
    each, kept across epochs); ``"thread"``: one producer thread with a queue of ``prefetch`` batches.
    With ``plans`` the producers also build every batch's lookup plan for the model's fused table
    (``lookup_sizes``), so that part of the training step runs beside it. ``total_rows`` (log lines per
    epoch, may be an estimate) gives the progress bar its length and an estimated time after the first batch.
    """
    torch.manual_seed(seed)
    graph = FeatureGraph.from_dict(cfg.graph)
    model = model or model_for_graph(graph, dim=dim, hidden=hidden)
    if not plans:
        cfg = replace(cfg, lookup_sizes=None)
    elif cfg.lookup_sizes is None and isinstance(getattr(model, "emb", None), FusedEmbedding):
        cfg = replace(cfg, lookup_sizes=list(model.emb.sizes))
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model.to(dev)
    opt = CTROptimizer(model, lr=lr)
    t0 = time.perf_counter()
    reps, trains = [], []
    handoff: Counter = Counter()
    pf = Prefetcher(cfg, depth=prefetch, mode=producer, workers=workers, persistent=epochs > 1)
    try:
        for ep in range(epochs):
            trains.append(train_on(model, pf, opt, dev, progress=progress, desc=f"pipelined epoch {ep + 1}",
                                   total=total_rows))
            reps.append(pf.report)
            handoff.update(pf.handoff)
    finally:
        pf.close()
    wall = time.perf_counter() - t0
    ext = merge_reports([r for r in reps if r is not None])
    ext.extract_s = sum(r.extract_s for r in reps if r is not None)
    ext.cpu_s = sum(r.cpu_s for r in reps if r is not None) + pf.warm_cpu_s
    rows = sum(t.rows for t in trains)
    report = {
        "mode": "pipelined", "producer": producer, "workers": workers if producer == "process" else 0,
        "lookup_plans": cfg.lookup_sizes is not None,
        "prefetch": prefetch, "epochs": epochs,
        "rows": rows, "wall_s": wall, "samples_s": rows / wall if wall > 0 else 0.0,
        "extract_s": ext.extract_s, "train_s": sum(t.train_s for t in trains),
        "extract_cpu_s": ext.cpu_s, "warm_cpu_s": pf.warm_cpu_s, "train_cpu_s": sum(t.cpu_s for t in trains),
        "train_wait_s": sum(t.wait_s for t in trains), "handoff": dict(handoff),
        "loss": trains[-1].loss if trains else None,
        "extract": ext.as_dict(), "train": [t.as_dict() for t in trains],
    }
    return model, report
