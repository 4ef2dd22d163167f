"""Benchmark: FeatureBox pipelined extraction + training vs the two-stage (Parquet) baseline.

Modes, on one synthetic log (MovieLens schema, Zipf IDs, long-tail histories, bundled movielens graph):
  extract_only  the graph over the log, batches kept in memory (no training)
  train_only    training on those pre-extracted in-memory batches
  two_stage     extract to Parquet, then train from the Parquet files
  pipelined     extraction overlapping training: DataLoader worker process(es) feeding the trainer
                through shared memory (producer "process"), or one producer thread (producer "thread")
Every mode is run once per repeat; the order of the modes rotates from repeat to repeat (interleaved),
and the tables give the median and the min-max spread over repeats. Ratios between modes are taken
within each repeat (side by side) and then summarised the same way.

CPU accounting: ``cores_available`` comes from the cgroup CPU quota and the affinity mask
(``leanml.machine.cores_available``); each run records the CPU seconds of the extraction (producer
threads / worker processes) and of the training steps, the CPU seconds of the whole process tree
(``getrusage`` of this process and its reaped children), the utilisation (those CPU seconds / wall
seconds, i.e. cores busy on average) and ``os.getloadavg()`` before and after.

The ``setup`` part also measures, on the first 1M rows of the same log: the code before this work
(``--before-ref``, run from a ``git archive`` of that commit) against the current code (rows per
CPU-second of extraction and of training), that the features are identical (current fast path vs the
pure-Python reference path vs the code before), a training batch-size sweep (rows per CPU-second,
loss, held-out AUC) and the arena micro-benchmark.

Run in chunks of at most ~20 minutes under the exclusive CPU lock; records merge into the JSON:

    flock /tmp/leanml-cpu.lock python bench/features.py --rows 10000000 --only setup
    flock /tmp/leanml-cpu.lock python bench/features.py --rows 10000000 --only repeat:0
    flock /tmp/leanml-cpu.lock python bench/features.py --rows 10000000 --only repeat:1
    flock /tmp/leanml-cpu.lock python bench/features.py --rows 10000000 --only repeat:2
    python bench/features.py --rows 10000000 --render-only
    python bench/features.py --quick --only setup,repeat:0     # 200k rows, a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from _common import replace_block
from leanml.features.options import PipelineOptions, ProducerOptions, TrainOptions
from leanml.features.read.data import LogSpec, generate_logs
from leanml.features.run.arena import Arena, NoArena
from leanml.features.run.batch import FeatureBatch
from leanml.features.run.extract import ExtractConfig, Extractor
from leanml.features.run.graph import load_graph
from leanml.features.run.scheduler import clear_caches
from leanml.features.train.model import CTROptimizer, model_for_graph
from leanml.features.train.pipeline import evaluate, run_pipelined, train_on
from leanml.features.train.twostage import run_two_stage
from leanml.machine import cores_available, machine_info, machine_line
from leanml.outputs import cache_dir, write_json

RESULTS = Path(__file__).parent / "results"
DOCS = Path(__file__).parent.parent / "docs" / "features.md"
LR, SEED = 2e-3, 0
MODES = [("extract_only", None), ("train_only", None), ("two_stage", None), ("pipelined", "process"),
         ("pipelined", "thread")]
TARGETS = {"extract_rows_per_cpu_s": 400_000, "train_rows_per_cpu_s": 100_000, "vs_train_only": 1.15,
           "vs_two_stage": 0.6, "cores": 1.6}


# ------------------------------------------------------------------------------------------ accounting
def _tree_cpu() -> float:
    """CPU seconds of this process (all threads) and of its reaped children."""
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


class Meter:
    """Wall seconds, process-tree CPU seconds and load around one run."""

    def __enter__(self) -> Meter:
        self.load_before = [round(x, 2) for x in os.getloadavg()]
        self.t0, self.c0 = time.perf_counter(), _tree_cpu()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.t0
        self.cpu = _tree_cpu() - self.c0
        self.load_after = [round(x, 2) for x in os.getloadavg()]

    def fields(self) -> dict[str, Any]:
        return {"wall_s": round(self.wall, 3), "total_cpu_s": round(self.cpu, 3),
                "utilisation": round(self.cpu / self.wall, 3) if self.wall else None,
                "loadavg_before": self.load_before, "loadavg_after": self.load_after}


def compact(b: FeatureBatch) -> FeatureBatch:
    """A batch kept in memory for train_only with int32 ids (half the memory); see :func:`expand`."""
    return FeatureBatch(b.label, b.sparse.to(torch.int32), b.dense, [s.to(torch.int32) for s in b.seqs])


def expand(b: FeatureBatch) -> FeatureBatch:
    """Back to int64, packed as collate makes it (this copy happens outside the measured training steps)."""
    return b.packed()


# ------------------------------------------------------------------------------------------ data
def bench_data(rows: int) -> Path:
    data = cache_dir() / "features" / f"bench_{rows}"
    if not (data / "impressions_000.tsv").exists():
        generate_logs(data, LogSpec(rows, seed=0))
    return data


def head_log(data: Path, start: int, n: int, name: str) -> Path:
    """Lines ``start .. start+n`` of the bench log as their own file next to the tables (for setup runs)."""
    out = data / name
    if not out.exists():
        with open(data / "impressions_000.tsv", "rb") as src, open(out.with_suffix(".tmp"), "wb") as dst:
            for i, line in enumerate(src):
                if i >= start + n:
                    break
                if i >= start:
                    dst.write(line)
        out.with_suffix(".tmp").rename(out)
    return out


# ------------------------------------------------------------------------------------------ modes
def run_mode(mode: str, producer: str | None, cfg: ExtractConfig, args: argparse.Namespace,
             kept: list[FeatureBatch]) -> dict[str, Any]:
    graph = load_graph("movielens")
    rec: dict[str, Any] = {"mode": mode, "producer": producer}
    clear_caches()  # every mode loads its tables and computes its per-entity features itself
    if mode == "extract_only":
        kept.clear()
        with Meter() as m:
            ex = Extractor(cfg)
            for b in tqdm(ex, desc="extract_only", unit="batch", leave=False):
                kept.append(compact(b))
        rep = ex.report()
        rec.update(rows=sum(len(b) for b in kept), rows_read=rep.rows_read, extract_s=round(rep.extract_s, 3),
                   extract_cpu_s=round(rep.cpu_s, 3), train_s=None, train_cpu_s=None,
                   op_seconds=rep.exec["op_seconds"], op_rows_per_s=rep.exec["op_rows_per_s"],
                   arena=rep.arena, quarantined=rep.quarantined, **m.fields())
    elif mode == "train_only":
        if not kept:
            raise SystemExit("train_only needs the batches of extract_only from the same repeat")
        torch.manual_seed(SEED)
        model = model_for_graph(graph)
        opt = CTROptimizer(model, lr=LR)
        n = sum(len(b) for b in kept)
        with Meter() as m:
            tr = train_on(model, (expand(b) for b in kept), opt, "cpu", progress=True, total=n, desc="train_only")
        rec.update(rows=tr.rows, extract_s=None, extract_cpu_s=None, train_s=round(tr.train_s, 3),
                   train_cpu_s=round(tr.cpu_s, 3), loss=round(tr.loss, 5), **m.fields())
        kept.clear()
    elif mode == "two_stage":
        with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp, Meter() as m:
            _, two = run_two_stage(cfg, Path(tmp) / "features", TrainOptions(lr=LR, seed=SEED), device="cpu",
                                   progress=True)
            size = sum(p.stat().st_size for p in (Path(tmp) / "features").glob("*.parquet"))
        rec.update(rows=two["rows"], extract_s=round(two["extract_s"], 3), train_s=round(two["train_s"], 3),
                   extract_cpu_s=round(two["extract_cpu_s"], 3), train_cpu_s=round(two["train_cpu_s"], 3),
                   write_s=round(two["write_s"], 3), read_s=round(two["read_s"], 3),
                   parquet_mb=round(size / 2**20, 1), loss=round(two["loss"], 5), **m.fields())
    else:
        with Meter() as m:
            _, pipe = run_pipelined(cfg, TrainOptions(lr=LR, seed=SEED),
                                    ProducerOptions(producer=producer, workers=args.workers, prefetch=args.prefetch),
                                    device="cpu", progress=True)
        rec.update(rows=pipe["rows"], workers=pipe["workers"], prefetch=args.prefetch,
                   extract_s=round(pipe["extract_s"], 3), train_s=round(pipe["train_s"], 3),
                   extract_cpu_s=round(pipe["extract_cpu_s"], 3), warm_cpu_s=round(pipe["warm_cpu_s"], 3),
                   train_cpu_s=round(pipe["train_cpu_s"], 3), train_wait_s=round(pipe["train_wait_s"], 3),
                   handoff=pipe["handoff"], loss=round(pipe["loss"], 5), **m.fields())
    rec["samples_s"] = round(rec["rows"] / rec["wall_s"], 1)
    return rec


def run_repeat(k: int, cfg: ExtractConfig, args: argparse.Namespace) -> list[dict[str, Any]]:
    """All modes once; the blocks rotate with ``k`` (extract_only stays right before train_only)."""
    blocks = [[MODES[0], MODES[1]], [MODES[2]], [MODES[3]], [MODES[4]]]
    order = [m for blk in blocks[k % len(blocks):] + blocks[: k % len(blocks)] for m in blk]
    kept: list[FeatureBatch] = []
    out = []
    for mode, producer in order:
        rec = run_mode(mode, producer, cfg, args, kept)
        rec["repeat"] = k
        rec["position"] = order.index((mode, producer))
        print({x: v for x, v in rec.items() if x not in ("op_seconds", "op_rows_per_s", "arena")}, flush=True)
        out.append(rec)
    return out


# ------------------------------------------------------------------------------------------ setup
BEFORE_SNIPPET = r"""
import json, sys, time, torch
torch.set_num_threads(1)
from leanml.features.pipeline import ExtractConfig, Extractor, train_on
from leanml.features.graph import load_graph
from leanml.features.model import CTROptimizer, model_for_graph
from leanml.features.batch import FeatureBatch
log, batch_rows, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
cfg = ExtractConfig.build("movielens", [log], batch_rows=batch_rows)
c = time.process_time(); ex = Extractor(cfg); batches = list(ex); ecpu = time.process_time() - c
torch.manual_seed(0)
model = model_for_graph(load_graph("movielens")); opt = CTROptimizer(model, lr=2e-3)
c = time.process_time(); tr = train_on(model, batches, opt, "cpu"); tcpu = time.process_time() - c
torch.save(FeatureBatch.concat(batches).tensors(), out)
print(json.dumps({"rows": sum(len(b) for b in batches), "extract_cpu_s": ecpu, "train_cpu_s": tcpu,
                  "train_step_cpu_s": tr.cpu_s, "loss": tr.loss}))
"""


def before_code(ref: str) -> Path:
    """The ``src`` tree of commit ``ref`` (exported with ``git archive`` into the cache)."""
    root = Path(__file__).resolve().parent.parent
    sha = subprocess.run(["git", "rev-parse", "--short", ref], cwd=root, capture_output=True, text=True,
                         check=True).stdout.strip()
    dest = cache_dir() / "features" / f"code_{sha}"
    if not (dest / "src").exists():
        dest.mkdir(parents=True, exist_ok=True)
        arch = subprocess.run(["git", "archive", sha, "src"], cwd=root, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=arch, check=True)
    return dest / "src"


CORUN = r"""
import sys, time, torch
torch.set_num_threads(1)
x, w = torch.randn(8192, 178), torch.randn(178, 128)
t0, c0, k = time.perf_counter(), time.process_time(), 0
while time.perf_counter() - t0 < float(sys.argv[1]):
    for _ in range(10):
        x @ w
    k += 10
print(k / (time.process_time() - c0), k / (time.perf_counter() - t0))
"""


def corun_check(seconds: float = 3.0) -> dict[str, Any]:
    """The same single-threaded matmul loop alone, then two copies at once: iterations per CPU second and
    per wall second. When the two copies each get less per CPU second than one alone, the two cores share
    something (cache, memory bandwidth, a physical core) and a second busy process slows the first."""
    def run(k: int) -> list[tuple[float, float]]:
        procs = [subprocess.Popen([sys.executable, "-c", CORUN, str(seconds)], stdout=subprocess.PIPE, text=True)
                 for _ in range(k)]
        return [tuple(map(float, p.communicate()[0].split())) for p in procs]

    solo, pair = run(1)[0], run(2)
    return {"solo_iters_per_cpu_s": round(solo[0], 1), "solo_iters_per_wall_s": round(solo[1], 1),
            "pair_iters_per_cpu_s": [round(a, 1) for a, _ in pair],
            "pair_iters_per_wall_s": [round(b, 1) for _, b in pair],
            "pair_speed_vs_solo": round(sum(b for _, b in pair) / solo[1], 3),
            "pair_cpu_efficiency_vs_solo": round(statistics.mean(a for a, _ in pair) / solo[0], 3),
            "loadavg": [round(x, 2) for x in os.getloadavg()]}


def run_setup(data: Path, args: argparse.Namespace) -> dict[str, Any]:
    n_head = min(1_000_000, args.rows // 2)
    head = head_log(data, 0, n_head, f"head_{n_head}.tsv")
    hold = head_log(data, n_head, min(200_000, args.rows - n_head), f"holdout_{n_head}.tsv")
    graph = load_graph("movielens")
    out: dict[str, Any] = {"head_rows": n_head, "corun": corun_check()}
    print("co-run check", out["corun"], flush=True)
    # 1. before vs after on the same rows, each with its own default batch size
    src = before_code(args.before_ref)
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
        res = subprocess.run([sys.executable, "-c", BEFORE_SNIPPET, str(head), "4096", f"{tmp}/t.pt"],
                             capture_output=True, text=True, env=env, check=True)
        before = json.loads(res.stdout.strip().splitlines()[-1])
        before_tensors = torch.load(f"{tmp}/t.pt")
    before.update(code=f"before ({args.before_ref})", batch_rows=4096)
    cfg = ExtractConfig.build("movielens", [head], PipelineOptions(batch_rows=args.batch_rows))
    clear_caches()
    c = time.process_time()
    ex = Extractor(cfg)
    batches = list(ex)
    ecpu = time.process_time() - c
    torch.manual_seed(SEED)
    model = model_for_graph(graph)
    opt = CTROptimizer(model, lr=LR)
    c = time.process_time()
    tr = train_on(model, batches, opt, "cpu")
    tcpu = time.process_time() - c
    after = {"code": "after", "batch_rows": args.batch_rows, "rows": sum(len(b) for b in batches),
             "extract_cpu_s": ecpu, "train_cpu_s": tcpu, "train_step_cpu_s": tr.cpu_s, "loss": tr.loss}
    for r in (before, after):
        r["extract_rows_per_cpu_s"] = round(r["rows"] / r["extract_cpu_s"])
        r["train_rows_per_cpu_s"] = round(r["rows"] / r["train_cpu_s"])
    out["before_after"] = [before, after]
    out["lookup_plans"] = lookup_plan_share(cfg, graph)
    print("lookup plans", out["lookup_plans"], flush=True)
    # 2. identical features: fast path vs the pure-Python reference path (python reader, every op per row)
    #    and vs the code before (same batch size as it used)
    fast = FeatureBatch.concat(batches)
    ref = FeatureBatch.concat(list(Extractor(
        replace(cfg, options=replace(cfg.options, reader="python", entity=False)))))
    fast4096 = FeatureBatch.concat(list(Extractor(replace(cfg, options=replace(cfg.options, batch_rows=4096)))))
    same_before = len(before_tensors) == len(fast4096.tensors()) and all(
        torch.equal(a, b) for a, b in zip(before_tensors, fast4096.tensors()))
    out["identity"] = {"rows": len(fast), "fast_equals_reference": fast.equal(ref),
                       "fast_equals_code_before": same_before}
    print(out["before_after"], out["identity"], flush=True)
    del batches, ref, fast4096, before_tensors
    # 3. training batch size: rows per CPU second, loss, held-out AUC (same rows, same seed)
    sweep = []
    test = list(Extractor(ExtractConfig.build("movielens", [hold], PipelineOptions(batch_rows=16384))))
    for bs in args.sweep:
        bl = list(Extractor(replace(cfg, options=replace(cfg.options, batch_rows=bs))))
        torch.manual_seed(SEED)
        model = model_for_graph(graph)
        opt = CTROptimizer(model, lr=LR)
        tr = train_on(model, bl, opt, "cpu", progress=True, total=len(fast), desc=f"batch {bs}")
        ev = evaluate(model, test)
        sweep.append({"batch_rows": bs, "rows": tr.rows, "train_cpu_s": round(tr.cpu_s, 3),
                      "rows_per_cpu_s": round(tr.rows / tr.cpu_s), "loss": round(tr.loss, 5),
                      "test_auc": round(ev["auc"], 4), "test_logloss": round(ev["logloss"], 5),
                      "test_rows": ev["rows"]})
        print(sweep[-1], flush=True)
    out["batch_sweep"] = sweep
    out["arena_microbench"] = arena_microbench()
    return out


def lookup_plan_share(cfg: ExtractConfig, graph: Any, reps: int = 3) -> dict[str, Any]:
    """What moving the lookup plans into the producer shifts: extraction CPU seconds without / with building
    them, and training CPU seconds (training steps only) on batches without / with plans, interleaved
    ``reps`` times (medians), same rows, same seed."""
    sizes = model_for_graph(graph).emb.sizes
    res: dict[str, list[float]] = {"extract_plain": [], "extract_plans": [], "train_plain": [], "train_plans": []}
    losses: dict[str, float] = {}
    batches: dict[str, list[FeatureBatch]] = {}
    for k in range(reps):
        for name in (("plain", "plans") if k % 2 == 0 else ("plans", "plain")):
            clear_caches()
            c = time.process_time()
            batches[name] = list(Extractor(replace(cfg, lookup_sizes=sizes if name == "plans" else None)))
            res[f"extract_{name}"].append(time.process_time() - c)
            torch.manual_seed(SEED)
            model = model_for_graph(graph)
            tr = train_on(model, batches[name], CTROptimizer(model, lr=LR), "cpu")
            res[f"train_{name}"].append(tr.cpu_s)
            losses[name] = tr.loss
    rows = sum(len(b) for b in batches["plain"])
    return {"rows": rows, "reps": reps, **{k: round(statistics.median(v), 3) for k, v in res.items()},
            "runs": {k: [round(x, 3) for x in v] for k, v in res.items()},
            "same_loss": losses["plain"] == losses["plans"], "loss": losses["plain"]}


def arena_microbench(reps: int = 3, seed: int = 0) -> list[dict[str, Any]]:
    """Per batch, op outputs of lognormal sizes are allocated, written once and kept live until the end of
    the batch (as intermediates are), then freed / reset; ~80 KB and ~20 MB outputs; best of ``reps``."""
    rng = np.random.default_rng(seed)
    out = []
    for regime, mu, batches, per in (("small (~80 KB outputs)", 11.0, 200, 40),
                                     ("large (~20 MB outputs)", 16.5, 20, 12)):
        sizes = [rng.lognormal(mu, 0.8, per).astype(np.int64) // 8 for _ in range(batches)]
        total = int(sum(int(s.sum()) for s in sizes)) * 8
        best: dict[str, float] = {}
        for _ in range(reps):
            for name, alloc in (("np.empty", NoArena()), ("arena", Arena(4 << 20, growth=1.5))):
                t0 = time.process_time()
                for sz in sizes:
                    live = []
                    for n in sz.tolist():
                        a = alloc.alloc(n, np.int64)
                        a.fill(1)
                        live.append(a)
                    del live
                    alloc.reset()
                best[name] = min(best.get(name, float("inf")), time.process_time() - t0)
        for name in ("np.empty", "arena"):
            out.append({"regime": regime, "allocator": name, "bytes": total, "cpu_s": round(best[name], 4),
                        "gb_s": round(total / best[name] / 1e9, 3),
                        "speedup_vs_np_empty": round(best["np.empty"] / best[name], 2)})
    return out


# ------------------------------------------------------------------------------------------ summary
def _med(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarise(runs: list[dict[str, Any]], cores: dict[str, Any]) -> tuple[list[dict], dict[str, Any]]:
    """Summary records per mode (median, spread) and the per-repeat ratios."""
    records = []
    for mode, producer in MODES:
        rs = [r for r in runs if r["mode"] == mode and r.get("producer") == producer]
        if not rs:
            continue
        rec: dict[str, Any] = {"mode": mode, "producer": producer, "rows": rs[0]["rows"]}
        for f in ("wall_s", "extract_s", "train_s", "extract_cpu_s", "train_cpu_s", "total_cpu_s", "utilisation",
                  "train_wait_s", "write_s", "read_s", "loss"):
            vals = [r.get(f) for r in rs if r.get(f) is not None]
            if vals:
                rec[f] = round(_med(vals), 4)
        rec["samples_s"] = round(rec["rows"] / rec["wall_s"], 1)
        rec["cores_available"] = cores["cores"]
        rec["repeats"] = len(rs)
        rec["spread"] = {f: [min(r[f] for r in rs), max(r[f] for r in rs)]
                         for f in ("wall_s", "extract_cpu_s", "train_cpu_s", "utilisation")
                         if all(r.get(f) is not None for r in rs)}
        rec["loadavg_before"] = [r["loadavg_before"] for r in rs]
        records.append(rec)
    ratios: dict[str, Any] = {}
    for producer in ("process", "thread"):
        per = []
        for k in sorted({r["repeat"] for r in runs}):
            by = {(r["mode"], r.get("producer")): r for r in runs if r["repeat"] == k}
            p, t, two = by.get(("pipelined", producer)), by.get(("train_only", None)), by.get(("two_stage", None))
            if p and t and two:
                per.append({"repeat": k, "vs_train_only": p["wall_s"] / t["wall_s"],
                            "vs_two_stage": p["wall_s"] / two["wall_s"], "utilisation": p["utilisation"]})
        if per:
            ratios[producer] = {
                "repeats": len(per),
                "vs_train_only": round(_med([x["vs_train_only"] for x in per]), 3),
                "vs_two_stage": round(_med([x["vs_two_stage"] for x in per]), 3),
                "spread": {f: [round(min(x[f] for x in per), 3), round(max(x[f] for x in per), 3)]
                           for f in ("vs_train_only", "vs_two_stage")},
                "per_repeat": [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in x.items()} for x in per]}
    return records, ratios


def _fmt(x: Any, nd: int = 1) -> str:
    return "" if x is None else f"{x:,.{nd}f}"


def _spread(rec: dict, f: str, nd: int = 1) -> str:
    s = rec.get("spread", {}).get(f)
    if rec.get(f) is None:
        return ""
    return f"{rec[f]:,.{nd}f}" + (f" ({s[0]:,.{nd}f}-{s[1]:,.{nd}f})" if s and rec["repeats"] > 1 else "")


def render(res: dict[str, Any], out: Path) -> str:
    rows, cores = res["rows"], res["cores"]
    records, ratios = res["records"], res["ratios"]
    by = {(r["mode"], r["producer"]): r for r in records}
    lines = [f"# FeatureBox benchmark ({rows:,} generated rows, movielens graph)", "",
             f"Machine: {machine_line()}; cores available to the run: **{cores['cores']:g}** (affinity mask "
             f"{cores['affinity']}, cgroup CPU quota {cores['quota'] if cores['quota'] is not None else 'none'}).",
             "", f"Commands: {', '.join(f'`{c}`' for c in res.get('commands', []))}", "",
             f"Training: one thread (`torch.set_num_threads(1)`), batches of {res['batch_rows']:,} rows, SparseAdam + "
             f"Adam, lr {LR}. Pipelined: {res['workers']} DataLoader worker process(es) with prefetch factor "
             f"{res['prefetch']} (shared memory), or one producer thread; pipelined producers also build every "
             "batch's lookup plan (counted in their extract CPU s; see below). Each mode ran once per repeat, "
             "modes interleaved (their order rotates per repeat); values are medians over repeats, (min-max) in "
             "brackets. CPU s = CPU seconds; utilisation = CPU seconds of the whole process tree / wall seconds.",
             "", "| mode | producer | rows | repeats | wall s | samples/s | extract CPU s | train CPU s | "
             "total CPU s | utilisation (cores) | trainer waited s | load before |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in records:
        load = "; ".join(f"{x[0]:.2f}" for x in r["loadavg_before"])
        lines.append(f"| {r['mode']} | {r['producer'] or ''} | {r['rows']:,} | {r['repeats']} | "
                     f"{_spread(r, 'wall_s')} | {r['samples_s']:,.0f} | {_spread(r, 'extract_cpu_s')} | "
                     f"{_spread(r, 'train_cpu_s')} | {_fmt(r.get('total_cpu_s'))} | {_spread(r, 'utilisation', 2)} | "
                     f"{_fmt(r.get('train_wait_s'))} | {load} |")
    e, t, two = by.get(("extract_only", None)), by.get(("train_only", None)), by.get(("two_stage", None))
    lines += ["", "## Targets (checked from the records above)", ""]
    ok = lambda b: "**met**" if b else "**MISSED**"  # noqa: E731
    if e:
        v = e["rows"] / e["extract_cpu_s"]
        ident = res.get("setup", {}).get("identity", {})
        same = ident.get("fast_equals_reference") is True and ident.get("fast_equals_code_before") is True
        status = ok(v >= TARGETS["extract_rows_per_cpu_s"] and same) if ident else "**not checked** (no setup part)"
        lines.append(f"- Extraction >= {TARGETS['extract_rows_per_cpu_s']:,} rows per CPU second with identical "
                     f"features: {v:,.0f} rows per CPU second ({e['rows']:,} rows / {e['extract_cpu_s']:.1f} CPU s, "
                     f"median of {e['repeats']}) {status}; features identical to the pure-Python reference path: "
                     f"{ident.get('fast_equals_reference')}, to the code before: "
                     f"{ident.get('fast_equals_code_before')} (on {ident.get('rows', 0):,} rows).")
    if t:
        v = t["rows"] / t["train_cpu_s"]
        lines.append(f"- Training >= {TARGETS['train_rows_per_cpu_s']:,} rows per CPU second: {v:,.0f} "
                     f"({t['rows']:,} rows / {t['train_cpu_s']:.1f} CPU s) {ok(v >= TARGETS['train_rows_per_cpu_s'])}.")
    low = cores["cores"] < TARGETS["cores"]
    proj = None
    if e and t and two:
        ecpu, tcpu = e["extract_cpu_s"], t["train_cpu_s"]
        proj_pipe = max(ecpu, tcpu)
        proj_two = ecpu + tcpu + (two.get("total_cpu_s", 0) - two["extract_cpu_s"] - two["train_cpu_s"])
        proj = (proj_pipe / tcpu, proj_pipe / proj_two)
    for producer, rt in ratios.items():
        p = by[("pipelined", producer)]
        util = p.get("utilisation") or 0
        a, b = rt["vs_train_only"], rt["vs_two_stage"]
        sa, sb = rt["spread"]["vs_train_only"], rt["spread"]["vs_two_stage"]
        if low:  # the wall-time targets hold for >= 1.6 cores; give the projection beside the measurement
            sta = stb = f"**not testable** (only {cores['cores']:g} cores available)"
            if proj:
                sta += f", CPU-second projection {proj[0]:.2f} x"
                stb += f", CPU-second projection {proj[1]:.2f} x"
        else:
            sta, stb = ok(a <= TARGETS["vs_train_only"]), ok(b <= TARGETS["vs_two_stage"])
        lines.append(f"- Pipelined ({producer}) <= {TARGETS['vs_train_only']} x train-only wall: {a:.2f} x "
                     f"({sa[0]:.2f}-{sa[1]:.2f} over {rt['repeats']} repeats) {sta}; "
                     f"<= {TARGETS['vs_two_stage']} x two-stage wall: {b:.2f} x ({sb[0]:.2f}-{sb[1]:.2f}) "
                     f"{stb}; it kept {util:.2f} cores busy on average.")
    if proj:
        note = (f"Only {cores['cores']:g} cores are available to this run (target condition: >= "
                f"{TARGETS['cores']}), so the wall-time ratios above cannot show the overlap. " if low else "")
        lines += ["", f"{note}CPU-second projection for two otherwise idle cores (from the CPU seconds measured above, "
                  f"not a wall-time measurement): pipelined >= max(extract CPU, train CPU) = {proj_pipe:.1f} s, "
                  f"train-only >= {tcpu:.1f} s, two-stage >= its process-tree CPU seconds = {proj_two:.1f} s; "
                  f"projected ratios {proj[0]:.2f} x train-only and {proj[1]:.2f} x two-stage."]
    corun = (res.get("setup") or {}).get("corun")
    if corun:
        lines += ["", f"Two busy processes on this machine: the same single-threaded matmul loop ran "
                  f"{corun['pair_speed_vs_solo']:.2f} x as many iterations per wall second with two copies as with "
                  f"one, each copy doing {corun['pair_cpu_efficiency_vs_solo']:.2f} x the work per CPU second of a "
                  f"lone copy (load average then {corun['loadavg'][0]:.2f}). Overlap can at best reach that."]
    hand = [r["handoff"] for r in res["runs"] if r.get("producer") == "process" and r.get("handoff") is not None]
    if hand:
        ring, total = sum(h.get("ring", 0) for h in hand), sum(sum(h.values()) for h in hand)
        lines += ["", f"Pipelined (process) hand-over: {ring:,} of {total:,} batches came through the workers' "
                  f"shared-memory slot rings, {total - ring:,} through the DataLoader's ordinary tensor sharing."]
    if two:
        lines += ["", f"Two-stage detail: Parquet write {two.get('write_s', 0):.1f} s, "
                  f"read {two.get('read_s', 0):.1f} s (median wall seconds)."]
    setup = res.get("setup")
    if setup and setup.get("before_after"):
        lines += ["", f"## Before and after (first {setup['head_rows']:,} rows of the same log, one repeat, each "
                  "code with its own batch size)", "",
                  "| code | batch rows | rows | extract CPU s | extract rows / CPU s | train CPU s "
                  "| train rows / CPU s | train loss |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in setup["before_after"]:
            lines.append(f"| {r['code']} | {r['batch_rows']:,} | {r['rows']:,} | {r['extract_cpu_s']:.2f} | "
                         f"{r['extract_rows_per_cpu_s']:,} | {r['train_cpu_s']:.2f} | {r['train_rows_per_cpu_s']:,} | "
                         f"{r['loss']:.4f} |")
        b0, b1 = setup["before_after"]
        lines += ["", f"Extraction {b1['extract_rows_per_cpu_s'] / b0['extract_rows_per_cpu_s']:.1f} x and training "
                  f"{b1['train_rows_per_cpu_s'] / b0['train_rows_per_cpu_s']:.1f} x more rows per CPU second than "
                  "before."]
        lp = setup.get("lookup_plans")
        if lp:
            n = lp["rows"]
            lines += ["", f"## Lookup plans built by the producer (same {n:,} rows; median of {lp['reps']} "
                      "interleaved runs)", "",
                      "The fused embedding derives from the ids alone where every slot's table row goes, its bag and "
                      "weight, and the slots sorted by row for the backward. A pipelined producer builds this plan "
                      "beside extraction and hands it over with the batch (the pipelined rows above); train-only and "
                      "two-stage training build it inside the training step. Here both variants keep every batch in "
                      "memory, which a pipelined producer does not; the pipelined rows above give the producer's and "
                      "the trainer's CPU seconds in the real setting.", "",
                      "| batches | extract CPU s | extract rows / CPU s | train CPU s | train rows / CPU s |",
                      "|---|---:|---:|---:|---:|"]
            for name, label in (("plain", "features only"), ("plans", "features + lookup plans")):
                ecs, tcs = lp[f"extract_{name}"], lp[f"train_{name}"]
                lines.append(f"| {label} | {ecs:.2f} | {n / ecs:,.0f} | {tcs:.2f} | {n / tcs:,.0f} |")
            lines += ["", "Training steps with the plan at hand take "
                      f"{lp['train_plans'] / lp['train_plain']:.2f} x the "
                      f"CPU seconds; extraction takes {lp['extract_plans'] / lp['extract_plain']:.2f} x. Same training "
                      f"loss to the last bit: {lp['same_loss']}."]
        lines += ["", "## Training batch size (same rows and seed; AUC on the next "
                  f"{setup['batch_sweep'][0]['test_rows']:,} rows of the log)", "",
                  "| batch rows | train rows / CPU s | train loss | held-out AUC | held-out logloss |",
                  "|---:|---:|---:|---:|---:|"]
        for s in setup["batch_sweep"]:
            lines.append(f"| {s['batch_rows']:,} | {s['rows_per_cpu_s']:,} | {s['loss']:.4f} | {s['test_auc']:.4f} | "
                         f"{s['test_logloss']:.4f} |")
    ex_runs = [r for r in res["runs"] if r["mode"] == "extract_only"]
    if ex_runs:
        r0 = ex_runs[-1]
        ops = sorted(r0["op_seconds"].items(), key=lambda kv: -kv[1])
        lines += ["", f"## Where extraction time goes (extract_only, repeat {r0['repeat']}; per-op wall seconds "
                  "summed over batches; per-entity rows are one-off)", "", "| op | seconds | rows/s |",
                  "|---|---:|---:|"]
        for k, v in ops:
            lines.append(f"| {k} | {v:.2f} | {_fmt(r0['op_rows_per_s'].get(k), 0)} |")
        ar = r0.get("arena") or {}
        if ar:
            lines += ["", f"Arena during extraction: peak {ar['peak_bytes'] / 2**20:.1f} MiB per batch, "
                      f"{ar['bytes_reused'] / 2**30:.2f} GiB of {ar['bytes_allocated'] / 2**30:.2f} GiB handed out "
                      f"were reused memory, {ar['grows']} grow(s), {ar['spill_allocations']} spill(s)."]
    if setup and setup.get("arena_microbench"):
        lines += ["", "## Arena micro-benchmark (outputs live until the end of their batch; CPU time, best of 3)", "",
                  "| regime | allocator | CPU s | GB/s | speed-up |", "|---|---|---:|---:|---:|"]
        for a in setup["arena_microbench"]:
            lines.append(f"| {a['regime']} | {a['allocator']} | {a['cpu_s']:.3f} | {a['gb_s']:.2f} | "
                         f"{a['speedup_vs_np_empty']:.2f}x |")
    text = "\n".join(lines) + "\n"
    (out / "features.md").write_text(text)
    plot(res, out)
    return text


def plot(res: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = res["records"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    labels = [r["mode"] + (f"\n({r['producer']})" if r["producer"] else "") for r in recs]
    med = [r["wall_s"] for r in recs]
    lo = [r["wall_s"] - r["spread"]["wall_s"][0] for r in recs]
    hi = [r["spread"]["wall_s"][1] - r["wall_s"] for r in recs]
    axes[0].bar(labels, med, yerr=[lo, hi], capsize=4, color=["#888", "#888", "#c44", "#4a4", "#6a6"][: len(recs)])
    axes[0].set_ylabel("wall seconds (median, min-max)")
    axes[0].set_title(f"{res['rows']:,} rows end to end")
    axes[1].bar(labels, [r.get("utilisation") or 0 for r in recs], color="#48c")
    axes[1].axhline(res["cores"]["cores"], ls="--", c="k", lw=1, label="cores available")
    axes[1].set_ylabel("CPU seconds / wall seconds")
    axes[1].set_title("cores kept busy")
    axes[1].legend()
    setup = res.get("setup")
    if setup and setup.get("before_after"):
        b0, b1 = setup["before_after"]
        x = np.arange(2)
        axes[2].bar(x - 0.2, [b0["extract_rows_per_cpu_s"] / 1e3, b0["train_rows_per_cpu_s"] / 1e3], 0.4,
                    label="before")
        axes[2].bar(x + 0.2, [b1["extract_rows_per_cpu_s"] / 1e3, b1["train_rows_per_cpu_s"] / 1e3], 0.4,
                    label="after")
        axes[2].axhline(TARGETS["extract_rows_per_cpu_s"] / 1e3, ls=":", c="#4a4", lw=1)
        axes[2].axhline(TARGETS["train_rows_per_cpu_s"] / 1e3, ls=":", c="#c44", lw=1)
        axes[2].set_xticks(x, ["extraction", "training"])
        axes[2].set_ylabel("thousand rows per CPU second")
        axes[2].set_title("before / after (dotted: targets)")
        axes[2].legend()
    fig.tight_layout()
    fig.savefig(out / "features.png", dpi=110)
    plt.close(fig)


def write_docs_table(text: str) -> None:
    """The generated report between the bench markers of docs/features.md (headings demoted one level)."""
    body = "\n".join(("#" + ln if ln.startswith("#") else ln) for ln in text.splitlines()[1:]).strip()
    replace_block(DOCS, "features", "\n\n" + body + "\n\n")


# ------------------------------------------------------------------------------------------ main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--quick", action="store_true", help="200k rows")
    ap.add_argument("--batch-rows", type=int, default=8192)
    ap.add_argument("--prefetch", type=int, default=2, help="batches made ahead per worker")
    ap.add_argument("--workers", type=int, default=1, help="producer processes of the pipelined (process) mode")
    ap.add_argument("--only", default="setup,repeat:0,repeat:1,repeat:2",
                    help="comma list of parts: setup, repeat:K (K = 0, 1, ...)")
    ap.add_argument("--render-only", action="store_true", help="rewrite the Markdown/plot from the JSON")
    ap.add_argument("--before-ref", default="a490210", help="git commit of the code before (for the setup part)")
    ap.add_argument("--sweep", default="4096,8192,16384,32768", help="training batch sizes for the setup sweep")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    args.rows = 200_000 if args.quick else args.rows
    args.sweep = [int(x) for x in args.sweep.split(",") if x]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "features.json"
    res: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    config = {"rows": args.rows, "batch_rows": args.batch_rows, "prefetch": args.prefetch, "workers": args.workers}
    if any(res.get(k) != v for k, v in config.items()):
        res = {}  # another configuration: start over
    res.update(config)
    res.setdefault("runs", [])
    res.setdefault("commands", [])
    if not args.render_only:
        torch.set_num_threads(1)
        cmd = "python bench/features.py " + " ".join(sys.argv[1:])
        if cmd not in res["commands"]:
            res["commands"].append(cmd)
        res["machine"], res["cores"] = machine_info(), cores_available()
        print(machine_line(), res["cores"], os.getloadavg(), flush=True)
        data = bench_data(args.rows)
        cfg = ExtractConfig.build("movielens", [data / "impressions_000.tsv"],
                                  PipelineOptions(batch_rows=args.batch_rows))
        CTROptimizer(model_for_graph(load_graph("movielens")))  # one-time torch.optim import, kept out of timings
        for part in [p.strip() for p in args.only.split(",") if p.strip()]:
            if part == "setup":
                res["setup"] = run_setup(data, args)
            elif part.startswith("repeat:"):
                k = int(part.split(":", 1)[1])
                new = run_repeat(k, cfg, args)
                res["runs"] = [r for r in res["runs"] if r["repeat"] != k] + new
            else:
                raise SystemExit(f"unknown part {part!r}; use setup or repeat:K")
            res["records"], res["ratios"] = summarise(res["runs"], res["cores"])
            write_json(path, res)
    if not res.get("runs"):
        print("no runs recorded yet")
        return 0
    res["records"], res["ratios"] = summarise(res["runs"], res["cores"])
    write_json(path, res)
    text = render(res, out)
    if out.resolve() == RESULTS.resolve():  # a smoke run elsewhere leaves the docs page alone
        write_docs_table(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
