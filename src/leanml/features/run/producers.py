"""FeatureBox producers: extraction of batch i+1 overlaps training on batch i; nothing touches disk.

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
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from leanml.errors import LeanmlError
from leanml.features.options import ProducerOptions
from leanml.features.run.batch import FeatureBatch
from leanml.features.run.extract import ExtractConfig, Extractor, ExtractReport, merge_reports
from leanml.features.run.shm import SlotRef, SlotRing

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
                    self._ring = SlotRing.for_batch(item, self.ring_slots, self.cfg.options.batch_rows)
                slot = self._ring.put(item)
                if slot is not None:
                    yield SlotRef(worker, slot, len(item), None if attached else self._ring,
                                  SlotRing.plan_counts(item))
                    attached = True
                    continue
            yield item


def _worker_init(worker_id: int) -> None:
    info = torch.utils.data.get_worker_info()
    torch.set_num_threads(info.dataset.cfg.options.torch_threads if info is not None else 1)  # >= 1: PipelineOptions


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
    """Iterate batches made by producer worker processes (``producer="process"``) or a producer thread.

    ``options``: the producer, its ``workers`` and ``prefetch`` (batches ahead per worker, or the thread's
    queue depth). ``persistent``: keep the workers between iterations (epochs). ``warm``: load tables and
    per-entity features in this process before the workers fork, so every worker shares them (the CPU
    seconds go to :attr:`warm_cpu_s`). ``ring``: workers hand batches over through a ring of ``depth + 3``
    shared-memory slots each (:mod:`leanml.features.run.shm`) instead of a fresh shared segment per batch
    (``False``, and always when batches are pinned for CUDA: the DataLoader's ordinary tensor sharing).
    After each iteration :attr:`report` holds the merged :class:`ExtractReport` (``cpu_s`` = the producers'
    CPU seconds) and :attr:`handoff` counts the batches that came through the ring (``ring``) and the ordinary
    way (``copied``: ring off, or no slot free because the caller still holds earlier batches).
    """

    def __init__(self, cfg: ExtractConfig, options: ProducerOptions | None = None,
                 source: Callable[[ExtractConfig], Any] | None = None, persistent: bool = False,
                 warm: bool = True, mp_context: str | None = None, ring: bool = True) -> None:
        options = options or ProducerOptions()
        self.cfg = cfg
        self.depth, self.mode, self.workers = options.prefetch, options.producer, options.workers
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
        cuda = torch.cuda.is_available() and (self.cfg.options.device or "cuda").startswith("cuda")
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
