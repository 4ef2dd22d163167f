"""Recovery benchmark: prune SmolLM2-135M, fine-tune it back under an Adacc memory budget, keep the sparsity.

Models: SmolLM2-135M pruned by ``leanml prune`` with its defaults except the method and sparsity
(SparseGPT 50 %, SparseGPT 2:4, FASP 30 %; 64 x 512 Shakespeare calibration windows, seed 0). Each is
recovered by ``leanml recover`` on the Shakespeare train split (every play but Hamlet) for a fixed
number of steps under ``--memory adacc --memory-budget 0.5``, once without and once with the dense
model as teacher (labels + distillation, pure distillation, and pure distillation on windows half
sampled from the teacher itself, also with twice the steps at lr 2e-4). The reference is the dense
model fine-tuned the same way (``--no-mask``, same teacher setting), because fine-tuning on
Shakespeare also moves the dense model:

    gap before = ppl(pruned) - ppl(dense)
    gap after  = ppl(pruned + recover) - ppl(dense + the same fine-tune)
    gap_closed = 1 - gap after / gap before

Perplexity (SparseGPT protocol, 512-token windows) on Hamlet (the Shakespeare test split, 103
windows) and on the last 300 Women's Clothing reviews (modern English, 47 windows), so domain drift
shows.

The work is split into chunks of at most ~20 minutes (one prune, one recovery run, or the evaluation
of one model), each run under the exclusive CPU lock as its own process; results are merged into
bench/results/recover.json by chunk key, so any chunk can be rerun alone:

    python bench/recover.py --all               # every missing chunk, each under flock, then render
    python bench/recover.py --only train:sgpt50:dense   # one chunk (wrap it in flock yourself)
    python bench/recover.py --render-only       # tables, plot, targets and docs/recover.md from the JSON

Pruned and recovered models live in $LEANML_CACHE/bench-recover (never in git). Prune, eval and train
chunks record the pruned weights' SHA-256, and each recovery is compared with the pruned model it started
from: a model pruned again (the cache lost) that differs keeps the earlier evaluation as ``eval:MODEL@N``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from _common import load_json, replace_block
from leanml.config import replace
from leanml.flags import to_argv
from leanml.memory.budget import Budget
from leanml.processes import exit_on_sigterm, run_child
from leanml.prune.config import PruneConfig, PruneJob
from leanml.recover.config import RecoverConfig, recover_training
from leanml.recover.job import RecoverJob

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DOC = ROOT / "docs" / "recover.md"
LOCK = "/tmp/leanml-cpu.lock"
DENSE = "smollm2-135m"
#: name -> (method, pattern label, the `leanml prune` config)
PRUNED = {
    "sgpt50": ("sparsegpt", "unstructured 50%", PruneConfig(method="sparsegpt", sparsity=0.5)),
    "sgpt24": ("sparsegpt", "2:4", PruneConfig(method="sparsegpt", pattern="2:4")),
    "fasp30": ("fasp", "structured 30%", PruneConfig(method="fasp", sparsity=0.3)),
}
#: recovery settings: no teacher; the dense teacher mixed with the labels (``--kd-weight`` setting, 0.5);
#: pure distillation from the dense teacher (``--distill-kd-weight``, 1.0: the labels unused); the same
#: with a share ``--teacher-samples`` (0.5) of the training windows sampled from the teacher (``mix``)
#: ``mixlong``: ``mix`` with twice the steps at a higher peak learning rate; ``mixlong75``: ``mixlong`` with
#: three quarters of the windows sampled from the teacher (:data:`VARIANTS`)
TEACHERS = ("none", "dense", "distill", "mix", "mixlong", "mixlong75")
#: settings that are another setting with some training options changed: name -> (base setting, changes)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "mixlong": ("mix", {"steps": 300, "lr": 2e-4}),
    "mixlong75": ("mix", {"steps": 300, "lr": 2e-4, "teacher_samples": 0.75}),
}
CORPORA = {"hamlet": "shakespeare", "reviews": "reviews"}
#: gap_closed targets (issue): these methods, both corpora
TARGET_METHODS = ("sgpt50", "fasp30")
TARGET_GAP = 0.40

DEFAULTS = {"steps": 150, "batch_size": 2, "seqlen": 256, "lr": 1e-4, "memory": "adacc", "budget": 0.5,
            "kd_weight": 0.5, "distill_kd_weight": 1.0, "teacher_samples": 0.5, "eval_seqlen": 512, "threads": 2}


def base_setting(teacher: str) -> str:
    """The teacher setting a recovery setting builds on (itself unless it is one of :data:`VARIANTS`)."""
    return VARIANTS[teacher][0] if teacher in VARIANTS else teacher


def run_settings(teacher: str, s: dict[str, Any]) -> dict[str, Any]:
    """The benchmark settings ``s`` with the changes a variant setting makes."""
    return {**s, **VARIANTS[teacher][1]} if teacher in VARIANTS else s


def variant_changes(teacher: str, skip: tuple[str, ...] = ()) -> str:
    """The options a variant setting changes, as ``"steps 300, lr 0.0002"`` ("" for other settings);
    options in ``skip`` left out."""
    changes = VARIANTS[teacher][1] if teacher in VARIANTS else {}
    return ", ".join(f"{k} {v:g}" for k, v in changes.items() if k not in skip)


def kd_weight(teacher: str, s: dict[str, Any]) -> float | None:
    """The distillation weight of a recovery setting (None: no teacher)."""
    teacher = base_setting(teacher)
    if teacher == "none":
        return None
    return float(s["kd_weight"] if teacher == "dense" else s.get("distill_kd_weight", DEFAULTS["distill_kd_weight"]))


def teacher_share(teacher: str, s: dict[str, Any]) -> float:
    """The share of training windows sampled from the teacher in a recovery setting."""
    teacher = base_setting(teacher)
    return float(s.get("teacher_samples", DEFAULTS["teacher_samples"])) if teacher == "mix" else 0.0


def sampling_seconds(train: dict[str, Any]) -> float | None:
    """Seconds the sampling of a training chunk's teacher windows took (None: it used none): measured in
    the run, or, where the run reused cached samples, in the run that drew them (a run on its own pays it)."""
    ts = train.get("teacher_samples") or {}
    return ts.get("sampling_seconds", ts.get("seconds"))


def teacher_label(teacher: str, s: dict[str, Any]) -> str:
    """A recovery setting in words; ``s``: the benchmark's settings (a variant's changes applied here)."""
    w = kd_weight(teacher, s)
    if w is None:
        return "no teacher"
    share = teacher_share(teacher, run_settings(teacher, s))
    changes = variant_changes(teacher, skip=("teacher_samples",))  # the share is said already
    return (f"dense teacher, kd weight {w:g}" + (f", {share:.0%} of the windows sampled from it" if share else "")
            + (f", {changes}" if changes else ""))


def work_dir() -> Path:
    from leanml.outputs import cache_dir

    path = cache_dir() / "bench-recover"
    path.mkdir(parents=True, exist_ok=True)
    return path


def load_chunks(path: Path) -> dict[str, Any]:
    return load_json(path, {"chunks": {}})


def env(threads: int) -> dict[str, str]:
    e = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), e.get("PYTHONPATH", "")])
    return e


def leanml_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "leanml", *args]


def run_logged(cmd: list[str], threads: int) -> float:
    """Run a command (output passed through); return its wall seconds; raise on failure."""
    print("$", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    run_child(cmd, env=env(threads))
    return time.perf_counter() - t0


# ----------------------------------------------------------------------------------------- chunks
def rec_name(model: str, teacher: str) -> str:
    return f"rec-{model}-{teacher}"


def all_chunks() -> list[str]:
    """In the order --all runs them: the first comparison (SparseGPT 50 % without a teacher, with its
    dense reference) comes first, so the first gap_closed numbers come early."""
    def run(model: str, teacher: str) -> list[str]:
        return [f"train:{model}:{teacher}", f"eval:{rec_name(model, teacher)}"]

    chunks = ["eval:dense", *run("dense", "none"), "prune:sgpt50", "eval:sgpt50", *run("sgpt50", "none"),
              *run("dense", "dense"), *run("sgpt50", "dense")]
    for model in ["fasp30", "sgpt24"]:
        chunks += [f"prune:{model}", f"eval:{model}", *run(model, "none"), *run(model, "dense")]
    for teacher in ("distill", "mix", *VARIANTS):
        for model in ["dense", "fasp30", "sgpt50", "sgpt24"]:
            chunks += run(model, teacher)
    assert len(set(chunks)) == len(chunks) == 1 + len(PRUNED) * 2 + (1 + len(PRUNED)) * len(TEACHERS) * 2
    return chunks


def model_path(key: str) -> str:
    """Where a model of the benchmark lives: the bundled dense model, a pruned or a recovered one."""
    return DENSE if key == "dense" else str(work_dir() / key)


def model_sha256(path: str | Path) -> str:
    """SHA-256 over a model directory's weight files (names and bytes, in name order): which pruned model
    a chunk saw. A pruned model lost with the cache and pruned again (by newer code, or a run resumed
    across versions) need not be the same model."""
    h = hashlib.sha256()
    for f in sorted(Path(path).glob("*.safetensors")):
        h.update(f.name.encode())
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def pruned_eval(chunks: dict[str, Any], model: str, train: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The evaluation of the pruned model ``model``: with a recovery chunk ``train``, the evaluation of the
    very model it started from (the same weights hash; chunks of runs that recorded no hash pair with each
    other), else the latest one (chunk ``eval:MODEL``; earlier models' evaluations are kept as
    ``eval:MODEL@N``)."""
    if train is None:
        return chunks.get(f"eval:{model}")
    sha = train.get("start_model_sha256")
    return next((chunks[k] for k in pruned_eval_keys(chunks, model) if chunks[k].get("model_sha256") == sha), None)


def pruned_eval_keys(chunks: dict[str, Any], model: str) -> list[str]:
    """The chunks evaluating versions of the pruned model ``model``: the latest, then ``eval:MODEL@N`` by N."""
    earlier = sorted((k for k in chunks if k.startswith(f"eval:{model}@")), key=lambda k: int(k.rpartition("@")[2]))
    return [k for k in (f"eval:{model}", *earlier) if k in chunks]


def store_chunk(chunks: dict[str, Any], key: str, result: dict[str, Any]) -> None:
    """Put a chunk's result under ``key``; a prune or evaluation of another pruned model (another weights
    hash) already there moves to ``KEY@N`` instead of being overwritten, so the recoveries that started
    from it keep their pruned perplexity."""
    old = chunks.get(key)
    if old is not None and "model_sha256" in result and old.get("model_sha256") != result["model_sha256"]:
        n = 1
        while f"{key}@{n}" in chunks:
            n += 1
        chunks[f"{key}@{n}"] = old
    chunks[key] = result


def chunk_prune(name: str, s: dict[str, Any]) -> dict[str, Any]:
    out = work_dir() / name
    job = PruneJob(model=DENSE, out=str(out), eval=False, config=PRUNED[name][2])
    shown = ("model", "method", "sparsity", "pattern")
    args = ["prune", *to_argv(job, always=shown)]
    seconds, resume = None, False
    if not (out / "report.json").exists():
        resume = out.with_name(out.name + ".ckpt").exists()  # a killed chunk continues
        seconds = run_logged(leanml_cmd("prune", *to_argv(replace(job, resume=resume), always=shown)), s["threads"])
    rep = json.loads((out / "report.json").read_text())
    return {"command": "leanml " + " ".join(args), "seconds": seconds, "prune_seconds": rep.get("prune_seconds"),
            "resumed": bool(seconds is not None and resume),  # prune_seconds then covers the resumed part only
            "measured_sparsity": rep.get("measured_sparsity"), "params_after": rep["model"]["params_after"],
            "params_before": rep["model"]["params_before"], "model_sha256": model_sha256(out)}


def chunk_train(model: str, teacher: str, s: dict[str, Any]) -> dict[str, Any]:
    """One recovery run; ``s``: the settings of this run (:func:`run_settings` applied)."""
    out = work_dir() / rec_name(model, teacher)
    w = kd_weight(teacher, s)
    share = teacher_share(teacher, s)
    train = recover_training(steps=s["steps"], batch_size=s["batch_size"], lr=s["lr"], strategy=s["memory"],
                             budget=Budget.parse(s["budget"]) if s["memory"] == "adacc" else None)
    recover = RecoverConfig(train=train, keep_masks=model != "dense", **({} if w is None else {"kd_weight": w}))
    job = RecoverJob(model=model_path(model), out=str(out), data="shakespeare", seqlen=s["seqlen"], recover=recover,
                     evaluate=False, overwrite=True, teacher=DENSE if w is not None else None,
                     # runs with the same teacher and share draw the same windows: sampled once, then reused
                     teacher_samples=share or 0.0,
                     teacher_samples_cache=str(work_dir() / "teacher-samples") if share else None,
                     resume=out.with_name(out.name + ".ckpt").exists())
    args = ["recover", *to_argv(job, always=("data", "steps", "batch_size", "seqlen", "lr", "strategy"))]
    start_sha = model_sha256(model_path(model)) if model in PRUNED else None
    wall = run_logged(leanml_cmd(*args), s["threads"])
    rep = json.loads((out / "report.json").read_text())
    mem, tm = rep["memory"], rep["timings"]
    return {
        "command": "leanml " + " ".join(a for a in args if a not in ("--overwrite", "--resume")),
        "wall_seconds": wall, "kd_weight": w,
        "train_seconds": tm["train_seconds"], "train_cpu_seconds": tm["train_cpu_seconds"],
        "teacher_seconds": tm["teacher_seconds"], "median_step_s": tm["median_step_s"],
        "setup_seconds": tm["setup_seconds"],
        "sparsity_in": rep["sparsity"]["in"], "sparsity_out": rep["sparsity"]["out"],
        "peak_bytes": mem["peak_bytes"], "budget_bytes": mem["budget_bytes"],
        "unoptimized_peak_bytes": mem["unoptimized_peak_bytes"], "budget_fraction": mem["budget_fraction"],
        "within_budget": mem["within_budget"], "plan": (mem.get("plan") or {}).get("summary"),
        "replans": len(rep.get("replans") or []), "max_rss_bytes": mem["max_rss_bytes"],
        "loss_first": rep["loss_first"], "loss_last10": rep["loss_last10"],
        "tokens_seen": rep["data"]["tokens_seen"], "resumed_from_step": rep["resumed_from_step"],
        "measured_steps": len(mem.get("measured_steps") or []),
        "teacher_samples": rep["data"].get("teacher_samples"),
        **({"start_model_sha256": start_sha} if start_sha else {}),
    }


def chunk_eval(key: str, s: dict[str, Any]) -> dict[str, Any]:
    import torch

    from leanml.data.text import load_text, token_windows
    from leanml.eval.perplexity import perplexity
    from leanml.models import count_parameters, load_model
    from leanml.recover import linear_sparsity

    torch.set_num_threads(s["threads"])
    model, tok = load_model(model_path(key))
    out: dict[str, Any] = {"sparsity": linear_sparsity(model), "params": count_parameters(model), "ppl": {},
                           "windows": {}, "seconds": {}}
    if key in PRUNED:
        out["model_sha256"] = model_sha256(model_path(key))
    for label, corpus in CORPORA.items():
        windows = token_windows(tok, load_text(corpus, "test"), s["eval_seqlen"])
        t0 = time.perf_counter()
        out["ppl"][label] = perplexity(model, windows, batch_size=4)
        out["seconds"][label] = time.perf_counter() - t0
        out["windows"][label] = int(windows.shape[0])
        print(f"{key} {label}: ppl {out['ppl'][label]:.3f} ({windows.shape[0]} windows)", flush=True)
    return out


def run_chunk(chunk: str, s: dict[str, Any]) -> dict[str, Any]:
    kind, _, rest = chunk.partition(":")
    load0, t0, c0 = os.getloadavg(), time.perf_counter(), time.process_time()
    if kind == "prune":
        result = chunk_prune(rest, s)
    elif kind == "train":
        model, teacher = rest.split(":")
        if teacher not in TEACHERS:
            raise SystemExit(f"unknown recovery setting {teacher!r}; one of: {', '.join(TEACHERS)}")
        s = run_settings(teacher, s)  # the run, and its record, use the variant's settings
        result = chunk_train(model, teacher, s)
    elif kind == "eval":
        result = chunk_eval(rest, s)
    else:
        raise SystemExit(f"unknown chunk {chunk!r}; one of: {', '.join(all_chunks())}")
    from leanml.machine import machine_info

    result.update({"load_before": load0, "load_after": os.getloadavg(), "chunk_seconds": time.perf_counter() - t0,
                   "chunk_cpu_seconds_self": time.process_time() - c0, "machine": machine_info(),
                   "threads": s["threads"], "settings": s})
    return result


# ----------------------------------------------------------------------------------------- records
def build_records(data: dict[str, Any]) -> list[dict[str, Any]]:
    chunks = data["chunks"]
    records = []
    for model, (method, pattern, _) in PRUNED.items():
        for teacher in TEACHERS:
            train = chunks.get(f"train:{model}:{teacher}")
            dense_ft = chunks.get(f"eval:{rec_name('dense', teacher)}")
            need = [chunks.get("eval:dense"), pruned_eval(chunks, model, train),
                    chunks.get(f"eval:{rec_name(model, teacher)}"), dense_ft, train]
            if any(x is None for x in need):
                continue
            ev_dense, ev_pruned, ev_rec = need[0], need[1], need[2]
            for corpus in CORPORA:
                p_dense, p_ft = ev_dense["ppl"][corpus], dense_ft["ppl"][corpus]
                p_pruned, p_rec = ev_pruned["ppl"][corpus], ev_rec["ppl"][corpus]
                gap_before = p_pruned - p_dense
                records.append({
                    "method": method, "model": model, "pattern": pattern,
                    "sparsity_in": ev_pruned["sparsity"], "sparsity_out": ev_rec["sparsity"],
                    "params": ev_rec["params"], "teacher": teacher,
                    "kd_weight": train.get("kd_weight", kd_weight(teacher, train["settings"])),
                    "steps": train["settings"]["steps"], "lr": train["settings"]["lr"],
                    "teacher_samples": teacher_share(teacher, train["settings"]),
                    "memory": train["settings"]["memory"], "budget_fraction": train["budget_fraction"],
                    "peak_bytes": train["peak_bytes"], "budget_bytes": train["budget_bytes"],
                    "unoptimized_peak_bytes": train["unoptimized_peak_bytes"], "within_budget": train["within_budget"],
                    "corpus": corpus, "ppl_dense": p_dense, "ppl_dense_ft": p_ft, "ppl_pruned": p_pruned,
                    "ppl_recovered": p_rec, "gap_before": gap_before, "gap_after": p_rec - p_ft,
                    "gap_closed": 1.0 - (p_rec - p_ft) / gap_before if gap_before else None,
                    # sampling the teacher's windows is part of the run's time
                    "seconds": train["train_seconds"] + (sampling_seconds(train) or 0.0),
                    "sampling_seconds": sampling_seconds(train),
                    "teacher_seconds": train["teacher_seconds"],
                    "median_step_s": train["median_step_s"], "cpu_seconds": train["train_cpu_seconds"],
                    "load": train["load_before"][0], "command": train["command"],
                })
    return records


def closes(records: list[dict[str, Any]]) -> bool:
    """Whether every record closes at least the target share of its gap."""
    return all(r["gap_closed"] is not None and r["gap_closed"] >= TARGET_GAP for r in records)


def targets(records: list[dict[str, Any]], data: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, each ``met`` True / False from the records, or None ("not run") where no
    measurement exists."""
    out = []
    exact = [r for r in records if r["corpus"] == "hamlet"]
    bad = [f"{r['model']}/{r['teacher']}: {r['sparsity_in']:.6f} -> {r['sparsity_out']:.6f}" for r in exact
           if r["sparsity_out"] != r["sparsity_in"]]
    out.append({"target": "sparsity_out == sparsity_in exactly (measured zeros of the saved models)",
                "met": (not bad) if exact else None,
                "detail": "; ".join(bad) if bad else
                ", ".join(f"{r['model']}/{r['teacher']} {r['sparsity_out']:.6f}" for r in exact) + " (in == out)"
                if exact else "no recovered model evaluated"})
    for model in TARGET_METHODS:
        for teacher in TEACHERS:
            rs = [r for r in records if r["model"] == model and r["teacher"] == teacher]
            target = (f"{model} ({teacher_label(teacher, data.get('settings', DEFAULTS))}) closes >= "
                      f"{TARGET_GAP:.0%} of the gap on both corpora")
            if len(rs) < len(CORPORA):
                need = ["eval:dense", f"eval:{model}", f"train:{model}:{teacher}", f"eval:{rec_name(model, teacher)}",
                        f"train:dense:{teacher}", f"eval:{rec_name('dense', teacher)}"]
                missing = [c for c in need if c not in data["chunks"]]
                out.append({"target": target, "met": None, "detail": "missing chunks: " + ", ".join(missing)})
                continue
            detail = ", ".join(f"{r['corpus']} {fmt(r['gap_closed'], '.1%')}" for r in rs)
            out.append({"target": target, "detail": detail, "met": closes(rs)})
    # the issue's target itself: one recovery setting that closes the share for every target method on both corpora
    per_setting = {}
    for teacher in TEACHERS:
        rs = [r for r in records if r["model"] in TARGET_METHODS and r["teacher"] == teacher]
        if len(rs) == len(TARGET_METHODS) * len(CORPORA):
            per_setting[teacher] = closes(rs)
    winners = [t for t, ok in per_setting.items() if ok]
    out.append({"target": f"one recovery setting closes >= {TARGET_GAP:.0%} of the gap for "
                          f"{' and '.join(TARGET_METHODS)} on both corpora",
                "met": bool(winners) if per_setting else None,
                "detail": ("met by: " + ", ".join(teacher_label(t, data.get("settings", DEFAULTS)) for t in winners))
                if winners else ("settings measured: " + ", ".join(per_setting) if per_setting else "not run")})
    runs = [(k, c) for k, c in data["chunks"].items() if k.startswith("train:") and c.get("budget_bytes")]
    over = [f"{k}: {c['peak_bytes'] / 2**20:.0f} > {c['budget_bytes'] / 2**20:.0f} MiB" for k, c in runs
            if c["peak_bytes"] > c["budget_bytes"]]
    detail = "; ".join(over) if over else ", ".join(
        f"{k[6:]} {c['peak_bytes'] / 2**20:.1f} / {c['budget_bytes'] / 2**20:.1f} MiB" for k, c in runs)
    out.append({"target": "peak activation memory within the Adacc budget (every run)",
                "met": (not over) if runs else None, "detail": detail or "no training run"})
    return out


def verdict(met: bool | None) -> str:
    return "not run" if met is None else "met" if met else "missed"


# ----------------------------------------------------------------------------------------- render
def fmt(v: Any, spec: str = ".2f") -> str:
    if v is None:
        return "-"
    return format(v, spec)


def _record_row(r: dict[str, Any]) -> str:
    mib = 2**20
    teacher = r["teacher"] if r.get("kd_weight") is None else f"{r['teacher']} (kd {r['kd_weight']:g})"
    return (f"| {r['method']} | {r['pattern']} | {teacher} | {r['corpus']} | {r['sparsity_in']:.4f} "
            f"| {r['sparsity_out']:.4f} | {r['params'] / 1e6:.2f} M | {r['ppl_dense']:.2f} | {r['ppl_dense_ft']:.2f} "
            f"| {r['ppl_pruned']:.2f} | {r['ppl_recovered']:.2f} | {fmt(r['gap_closed'], '.1%')} "
            f"| {r['peak_bytes'] / mib:.0f} | {fmt(r['budget_bytes'] and r['budget_bytes'] / mib, '.0f')} "
            f"| {r['seconds']:.0f} | {fmt(r['median_step_s'])} |")


def _missing_row(chunks: dict[str, Any], model: str, method: str, pattern: str, teacher: str, corpus: str) -> str:
    """A configuration whose chunks are not all done: the measured parts, "not run" for the rest."""
    def ppl(key: str) -> str:
        c = chunks.get(f"eval:{key}")
        return f"{c['ppl'][corpus]:.2f}" if c else "not run"

    train = chunks.get(f"train:{model}:{teacher}")  # a recovery trained but not yet evaluated shows its run
    pruned = pruned_eval(chunks, model, train)
    cells = [method, pattern, teacher, corpus,
             f"{pruned['sparsity']:.4f}" if pruned else "not run", "not run",
             f"{pruned['params'] / 1e6:.2f} M (pruned)" if pruned else "-",
             ppl("dense"), ppl(rec_name("dense", teacher)),
             f"{pruned['ppl'][corpus]:.2f}" if pruned else "not run", "not run", "not run"]
    mib = 2**20
    cells += ([f"{train['peak_bytes'] / mib:.0f}", fmt(train["budget_bytes"] and train["budget_bytes"] / mib, ".0f"),
               f"{train['train_seconds']:.0f}", fmt(train["median_step_s"])] if train else
              ["not run", "not run", "not run", "-"])
    return "| " + " | ".join(cells) + " |"


def _pruned_models_lines(chunks: dict[str, Any]) -> list[str]:
    """Where a pruned model was pruned more than once (the cache lost, newer code): each version, its
    perplexities and the recoveries compared with it."""
    lines = []
    for model in PRUNED:
        keys = pruned_eval_keys(chunks, model)
        if len(keys) < 2:
            continue
        parts = []
        for k in keys:
            c = chunks[k]
            sha = c.get("model_sha256")
            runs = [t for t in TEACHERS if (tr := chunks.get(f"train:{model}:{t}")) is not None
                    and tr.get("start_model_sha256") == sha]
            parts.append(f"`{k}` (weights {'sha256 ' + sha[:12] if sha else 'hash not recorded'}; "
                         + ", ".join(f"{corpus} {c['ppl'][corpus]:.2f}" for corpus in CORPORA)
                         + f"; recoveries {', '.join(runs) or 'none'})")
        lines.append(f"{model} was pruned {len(keys)} times with the same command; each recovery is compared "
                     "with the model it started from: " + "; ".join(parts) + ".")
    return ["", *lines] if lines else []


def render_tables(data: dict[str, Any], records: list[dict[str, Any]], tgts: list[dict[str, Any]]) -> str:
    from leanml.machine import machine_line

    s = data.get("settings", DEFAULTS)
    chunks = data["chunks"]
    mib = 2**20
    loads = [c["load_before"][0] for c in chunks.values() if "load_before" in c]
    lines = [
        f"Machine: {machine_line()}; {s['threads']} torch threads; 1-minute load when chunks started: "
        f"{min(loads):.2f}-{max(loads):.2f}." if loads else f"Machine: {machine_line()}.",
        "",
        f"Command: `python bench/recover.py --all` (each chunk under `flock {LOCK}`). Recovery: "
        f"`leanml recover` on the Shakespeare train split (every play but Hamlet), {s['steps']} steps x "
        f"{s['batch_size']} x {s['seqlen']} tokens, AdamW lr {s['lr']} (warm-up 10, cosine to 10 %), "
        f"`--memory {s['memory']} --memory-budget {s['budget']}`; teacher = the dense SmolLM2, "
        f"`--kd-weight {s['kd_weight']}` (rows `dense`) or "
        f"`--kd-weight {s.get('distill_kd_weight', DEFAULTS['distill_kd_weight'])}` (rows `distill`: pure "
        "distillation, the labels unused; its dense reference is trained the same way); rows `mix`: the same "
        f"pure distillation with `--teacher-samples {s.get('teacher_samples', DEFAULTS['teacher_samples'])}` "
        "(that share of the training windows sampled from the dense teacher, temperature 1, from its BOS "
        "token, the rest Shakespeare; the sampling time is in train s, also for runs that reuse the samples an earlier "
        "run of the same teacher and share drew, `--teacher-samples-cache`, marked cached); "
        + "; ".join(f"rows `{t}`: `{VARIANTS[t][0]}` with {variant_changes(t)}" for t in VARIANTS)
        + ". Pruning: `leanml prune` defaults except method and sparsity "
        f"(64 x 512 calibration tokens). Perplexity: SparseGPT protocol, {s['eval_seqlen']}-token windows, "
        f"Hamlet (all test windows) and the last 300 Women's Clothing reviews.",
        "",
        "gap_closed = 1 - (ppl recovered - ppl dense fine-tuned the same way) / (ppl pruned - ppl dense). "
        "Sparsity = measured exact zeros over all decoder linears of the saved model (FASP's pruned MLP "
        "units are removed, so its zeros are only the attention dimensions; params shows the shrinking). "
        "Peak = saved-activation bytes of a training step (teacher targets included), the largest over the "
        "measured steps; budget = 0.5 x the unoptimized peak of the same step.",
        "",
        "| method | pattern | teacher | corpus | sparsity in | sparsity out | params | ppl dense | ppl dense ft "
        "| ppl pruned | ppl recovered | gap closed | peak MiB | budget MiB | train s | s/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, (method, pattern, _) in PRUNED.items():
        for teacher in TEACHERS:
            for corpus in CORPORA:
                r = next((r for r in records if (r["model"], r["teacher"], r["corpus"]) == (model, teacher, corpus)),
                         None)
                lines.append(_record_row(r) if r else _missing_row(chunks, model, method, pattern, teacher, corpus))
    lines += _pruned_models_lines(chunks)
    lines += ["", "Training runs (the dense rows are the fine-tuned references):", "",
              "| run | sparsity in | sparsity out | peak MiB | unoptimized MiB | budget MiB | within | loss first "
              "| loss last 10 | train s | teacher s | sampling s | CPU s | load | metered steps | plan |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key in all_chunks():
        if not key.startswith("train:"):
            continue
        c = chunks.get(key)
        if c is None:
            lines.append(f"| {key[6:]} | " + " | ".join(["not run"] + ["-"] * 14) + " |")
            continue
        plan = ", ".join(f"{k} {v}" for k, v in (c.get("plan") or {}).items() if v)
        lines.append(
            f"| {key[6:]} | {c['sparsity_in']:.4f} | {c['sparsity_out']:.4f} | {c['peak_bytes'] / mib:.0f} "
            f"| {fmt(c['unoptimized_peak_bytes'] and c['unoptimized_peak_bytes'] / mib, '.0f')} "
            f"| {fmt(c['budget_bytes'] and c['budget_bytes'] / mib, '.0f')} | {c['within_budget']} "
            f"| {c['loss_first']:.3f} | {c['loss_last10']:.3f} | {c['train_seconds']:.0f} | {c['teacher_seconds']:.0f} "
            f"| {fmt(sampling_seconds(c), '.0f')}"
            f"{' (cached)' if (c.get('teacher_samples') or {}).get('reused_from_cache') else ''} "
            f"| {c['train_cpu_seconds']:.0f} | {c['load_before'][0]:.2f} | {fmt(c.get('measured_steps'), 'd')} "
            f"| {plan} |")
    for name, trial in (data.get("trials") or {}).items():
        lines += ["", f"Trial `{name}`: {trial.get('note', '')}. `{trial.get('command', '')}`"]
        curves = {k[len("loss_by_step_"):]: v for k, v in trial.items() if k.startswith("loss_by_step_")}
        if curves:
            common = sorted(set.intersection(*(set(map(int, v)) for v in curves.values())))
            late = [k for k in common if k >= 20]
            if late:
                lines.append(f"Mean per-step loss over steps {late[0]}-{late[-1]}: " + ", ".join(
                    f"{label} {sum(v[str(k)] for k in late) / len(late):.3f}" for label, v in curves.items()) + ".")
    lines += ["", "## Targets", ""]
    for t in tgts:
        lines.append(f"- {t['target']}: **{verdict(t['met'])}** ({t['detail']})")
    done = [c for c in all_chunks() if c in chunks]
    missing = [c for c in all_chunks() if c not in chunks]
    lines += ["", f"Chunks done ({len(done)}/{len(all_chunks())}): {', '.join(done) or 'none'}.",
              "", f"Not run: {', '.join(missing) or 'none'}."]
    return "\n".join(lines) + "\n"


def plot(records: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from leanml.outputs import atomic_file

    fig, axes = plt.subplots(1, len(CORPORA), figsize=(10, 3.8), sharey=True)
    models = list(PRUNED)
    width = 0.8 / len(TEACHERS)
    labels = {"none": "no teacher", "dense": "dense teacher + labels", "distill": "pure distillation",
              "mix": "pure distillation, half teacher samples",
              **{t: "the same, " + variant_changes(t) for t in VARIANTS}}
    for ax, corpus in zip(axes, CORPORA):
        for j, teacher in enumerate(TEACHERS):
            vals = []
            for m in models:
                r = next((r for r in records
                          if r["model"] == m and r["teacher"] == teacher and r["corpus"] == corpus), None)
                vals.append(100 * r["gap_closed"] if r and r["gap_closed"] is not None else float("nan"))
            xs = [i + (j - (len(TEACHERS) - 1) / 2) * width for i in range(len(models))]
            ax.bar(xs, vals, width, label=labels.get(teacher, teacher))
            for x, v in zip(xs, vals):
                if v != v:  # no measurement: say so instead of drawing a zero
                    ax.text(x, 1, "not run", rotation=90, ha="center", va="bottom", fontsize=7, color="grey")
        ax.set_xlim(-0.6, len(models) - 0.4)  # also where every bar of a side is missing
        ax.axhline(100 * TARGET_GAP, color="k", ls="--", lw=0.8, label=f"target {TARGET_GAP:.0%}")
        ax.set_xticks(range(len(models)), [PRUNED[m][1] + ("\n(FASP)" if PRUNED[m][0] == "fasp" else "\n(SparseGPT)")
                                           for m in models], fontsize=8)
        ax.set_title(f"{corpus}: gap closed by recovery")
        ax.set_ylabel("% of the pruning gap closed")
    axes[-1].legend(fontsize=8, loc="upper right")  # the reviews side has room above its bars
    fig.tight_layout()
    with atomic_file(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)


def render(data: dict[str, Any], out: Path) -> None:
    from leanml.outputs import atomic_file, write_json

    records = build_records(data)
    tgts = targets(records, data)
    data["records"] = records
    data["targets"] = tgts
    write_json(out / "recover.json", data)
    body = render_tables(data, records, tgts)
    with atomic_file(out / "recover.md") as tmp:
        tmp.write_text("# Recovery fine-tuning of pruned SmolLM2-135M under an Adacc budget\n\n" + body)
    if records:
        plot(records, out / "recover.png")
    if out.resolve() == RESULTS.resolve():  # a scratch --out leaves the docs alone
        replace_block(DOC, "recover", f"\n{body}")
    print(body)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--all", action="store_true", help="run every missing chunk, each under the exclusive CPU lock")
    ap.add_argument("--only", default=None, help="comma-separated chunks to (re)run in this process")
    ap.add_argument("--redo", action="store_true", help="with --all: rerun chunks already in the JSON")
    ap.add_argument("--render-only", action="store_true", help="only rewrite the tables, plot and targets")
    ap.add_argument("--list", action="store_true", help="list the chunks and whether they are done")
    for key, value in DEFAULTS.items():
        ap.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=value)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    exit_on_sigterm()  # a killed run takes its children (the peer, `leanml recover`) with it
    out = Path(args.out)
    path = out / "recover.json"
    data = load_chunks(path)
    settings = {k: getattr(args, k) for k in DEFAULTS}
    data.setdefault("settings", settings)
    if args.list:
        for c in all_chunks():
            print(("done " if c in data["chunks"] else "todo ") + c)
        return 0
    if args.only:
        for chunk in args.only.split(","):
            result = run_chunk(chunk.strip(), settings)
            data = load_chunks(path)  # merge into the latest file (other chunks may have finished meanwhile)
            data.setdefault("settings", settings)
            store_chunk(data["chunks"], chunk.strip(), result)
            from leanml.outputs import write_json

            write_json(path, data)
    elif args.all:
        extra = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in DEFAULTS] + [f"--out={out}"]
        for chunk in all_chunks():
            if chunk in load_chunks(path)["chunks"] and not args.redo:
                continue
            run_child(["flock", LOCK, sys.executable, __file__, "--only", chunk, *extra], env=env(args.threads))
        data = load_chunks(path)
    if not args.list:
        render(data, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
