"""FeatureBox training: a pass of CTR training over batches (:func:`train_on`), its evaluation, and the
pipelined driver (:func:`run_pipelined`): producers (:mod:`leanml.features.run.producers`) extract batch
i+1 while the trainer trains on batch i; nothing touches disk.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch

from leanml.ctr.metrics import auc as ctr_auc
from leanml.errors import LeanmlError
from leanml.features.options import ProducerOptions, TrainOptions
from leanml.features.run.batch import FeatureBatch
from leanml.features.run.extract import ExtractConfig, merge_reports
from leanml.features.run.producers import Prefetcher
from leanml.features.train.model import CTROptimizer, FeatureDNN, FusedEmbedding, model_for_graph
from leanml.finite import check_finite_loss, lr_hint
from leanml.progress import EtaBar


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
    """One pass of BCE training over ``batches``; separates compute time from time waiting for batches.

    With ``progress`` and ``total`` (rows expected, may be an estimate) the estimated time of the pass is
    printed to stderr after the first batch."""
    rep = TrainReport()
    model.train()
    loss_fn = torch.nn.BCEWithLogitsLoss()
    total_loss = 0.0
    bar = EtaBar(total=total, desc=desc, unit="row", disable=not progress, leave=False)
    # a CTROptimizer, or a torch optimizer (DDP training uses Adam)
    hint = lr_hint(opt.lr if isinstance(opt, CTROptimizer) else opt.param_groups[0]["lr"])
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
        lv = float(loss.detach())
        check_finite_loss(lv, rep.steps + 1, hint, "FeatureBox training")
        opt.step()
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
def evaluate(model: FeatureDNN, batches: Iterable[FeatureBatch],
             device: torch.device | str = "cpu") -> dict[str, float]:
    """AUC and logloss of the model on ``batches``."""
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
    auc = ctr_auc(y, p)  # nan when one class only
    logloss = float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))
    return {"auc": auc, "logloss": logloss, "rows": len(y)}


def run_pipelined(cfg: ExtractConfig, train: TrainOptions | None = None, producer: ProducerOptions | None = None,
                  *, model: FeatureDNN | None = None, device: str | None = None, progress: bool = False,
                  total_rows: int | None = None) -> tuple[FeatureDNN, dict[str, Any]]:
    """Stream logs through the graph straight into training; returns the model and a JSON-able report.

    ``producer.producer="process"``: ``workers`` DataLoader worker processes (shared memory, ``prefetch``
    batches each, kept across epochs); ``"thread"``: one producer thread with a queue of ``prefetch``
    batches. With ``producer.plans`` the producers also build every batch's lookup plan for the model's
    fused table (``lookup_sizes``), so that part of the training step runs beside it. ``total_rows`` (log
    lines per epoch, may be an estimate) gives the progress bar its length and an estimated time after the
    first batch.
    """
    train, producer = train or TrainOptions(), producer or ProducerOptions()
    torch.manual_seed(train.seed)
    graph = cfg.graph
    model = model or model_for_graph(graph, dim=train.dim, hidden=train.hidden)
    if not producer.plans:
        cfg = replace(cfg, lookup_sizes=None)
    elif cfg.lookup_sizes is None and isinstance(getattr(model, "emb", None), FusedEmbedding):
        cfg = replace(cfg, lookup_sizes=tuple(model.emb.sizes))
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model.to(dev)
    opt = CTROptimizer(model, lr=train.lr)
    t0 = time.perf_counter()
    reps, trains = [], []
    handoff: Counter = Counter()
    pf = Prefetcher(cfg, producer, persistent=train.epochs > 1)
    try:
        for ep in range(train.epochs):
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
        "mode": "pipelined", "producer": producer.producer,
        "workers": producer.workers if producer.producer == "process" else 0,
        "lookup_plans": cfg.lookup_sizes is not None,
        "prefetch": producer.prefetch, "epochs": train.epochs,
        "rows": rows, "wall_s": wall, "samples_s": rows / wall if wall > 0 else 0.0,
        "extract_s": ext.extract_s, "train_s": sum(t.train_s for t in trains),
        "extract_cpu_s": ext.cpu_s, "warm_cpu_s": pf.warm_cpu_s, "train_cpu_s": sum(t.cpu_s for t in trains),
        "train_wait_s": sum(t.wait_s for t in trains), "handoff": dict(handoff),
        "loss": trains[-1].loss if trains else None,
        "extract": ext.as_dict(), "train": [t.as_dict() for t in trains],
    }
    return model, report
