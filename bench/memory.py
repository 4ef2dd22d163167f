"""Training-memory benchmark on SmolLM2-135M: Adacc (eager, and on compiled blocks) against no
optimization, full checkpointing, selective checkpointing and torch.compile's activation memory budget
(at the full budget, so its speed-up is separated from its memory savings, and at 75/50/25 %).

Run it in chunks (each its own process and CPU-lock slot, records merged into memory.json by key):

    python bench/memory.py --section smollm2 --repeat 0 --part a   # one interleaved comparison of 7 strategies
    python bench/memory.py --section smollm2 --repeat 0 --part b   # the other 7 (checkpoint runs in both)
    ... the same for --repeat 1 and 2
    python bench/memory.py --section bf16                  # SmolLM2 in bfloat16
    python bench/memory.py --section loss --seed 0         # 200 steps, none vs adacc@50% (seeds 0, 1, 2)
    python bench/memory.py --section small                 # the quick run: a small LLaMA config
    python bench/memory.py --render-only                   # rewrite memory.md/.png and docs/memory.md

Within a chunk every strategy trains its own module tree over ONE shared set of weights and one AdamW,
one step each in turn (the order rotates every step), so load from other processes hits them alike.
Every step's peak is measured (saved-activation meter; on CUDA also max_memory_allocated). Budgets are
fractions of ONE unoptimized peak, computed block by block. Step time = median of the timed steps after
warm-up; tokens/s also counts any re-planning inside those steps. Writes bench/results/memory.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from _common import load_json, merge_records, replace_block
from leanml.data.text import load_text, token_windows
from leanml.machine import machine_info, machine_line
from leanml.memory import Budget
from leanml.outputs import write_json
from leanml.train import (
    StrategyRunner,
    TrainConfig,
    batches,
    lm_unoptimized_peak,
    remap_vocab,
    shared_weights_copy,
)

RESULTS = Path(__file__).resolve().parent / "results"
DOC = Path(__file__).resolve().parent.parent / "docs" / "memory.md"
MIB = 2**20

SMALL = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=512, tie_word_embeddings=True, use_cache=False)
COMPILE_BLOCK_BUDGETS = (1.0, 0.5, 0.25, 0.0)
REPEATS, MIN_TIMED, LOSS_SEEDS = 3, 10, 3  # the protocol the targets are read against

# (strategy, budget, compile_blocks)
ALL = [("none", 1.0, False), ("checkpoint", 1.0, False), ("sac", 1.0, False),
       ("compile", 1.0, False), ("compile", 0.75, False), ("compile", 0.5, False), ("compile", 0.25, False),
       ("adacc", 0.25, False), ("adacc", 0.5, False), ("adacc", 0.75, False),
       ("adacc", 0.25, True), ("adacc", 0.5, True), ("adacc", 0.75, True)]
BF16 = [("none", 1.0, False), ("checkpoint", 1.0, False), ("compile", 0.5, False), ("compile", 0.25, False),
        ("adacc", 0.25, False), ("adacc", 0.5, False), ("adacc", 0.25, True), ("adacc", 0.5, True)]
LOSS = [("none", 1.0, False), ("adacc", 0.5, False)]
# the planner's times pooled over identical layers (the default) against each layer's own times, side by side
# with compile at the same budgets (a 4th element False: per-layer times)
TIMINGS = [("compile", 0.5, False), ("adacc", 0.5, True, False), ("adacc", 0.5, True),
           ("compile", 0.25, False), ("adacc", 0.25, True, False), ("adacc", 0.25, True)]
# SmolLM2 chunks of about 20 minutes: each target's comparison runs side by side within one part
PARTS = {"a": {"none", "checkpoint", "sac", "compile@100%", "compile@75%", "adacc@75%", "adacc+compile@75%"},
         "b": {"checkpoint", "compile@50%", "compile@25%", "adacc@25%", "adacc@50%", "adacc+compile@25%",
               "adacc+compile@50%"}}
QUICK = [("none", 1.0, False), ("checkpoint", 1.0, False), ("sac", 1.0, False), ("compile", 1.0, False),
         ("compile", 0.5, False), ("adacc", 0.25, False), ("adacc", 0.5, False), ("adacc", 0.75, False),
         ("adacc", 0.5, True)]

EVERY_THIRD = [*range(0, 30, 3), 29]  # SmolLM2 layers whose compressors / compiled variants are measured
SECTIONS = {
    # name: model, dtype, batch, seqlen, warmup, timed steps, strategies, measured layers
    "smollm2": dict(model="smollm2-135m", dtype="float32", batch=2, seqlen=512, warmup=2, timed=10, plan=ALL,
                    layers=EVERY_THIRD),
    "bf16": dict(model="smollm2-135m", dtype="bfloat16", batch=2, seqlen=512, warmup=2, timed=10, plan=BF16,
                 layers=EVERY_THIRD),
    "small": dict(model="small", dtype="float32", batch=4, seqlen=256, warmup=2, timed=10, plan=QUICK, layers=None),
    "timings": dict(model="smollm2-135m", dtype="float32", batch=2, seqlen=512, warmup=2, timed=10, plan=TIMINGS,
                    layers=EVERY_THIRD),
    "loss": dict(model="smollm2-135m", dtype="float32", batch=2, seqlen=128, warmup=2, timed=198, plan=LOSS,
                 layers=EVERY_THIRD),
}


def label(strategy: str, budget: float, compile_blocks: bool, pool_layers: bool = True) -> str:
    return TrainConfig(strategy=strategy, budget=Budget.parse(budget),
                       compile_blocks=COMPILE_BLOCK_BUDGETS if compile_blocks else (), pool_layers=pool_layers).label


def load(model: str, dtype: str, vocab: int) -> tuple[torch.nn.Module, Any]:
    from transformers import AutoTokenizer

    from leanml.models import bundled_dir, load_model

    if model == "small":
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        m = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, **SMALL)).to(getattr(torch, dtype))
        return m, AutoTokenizer.from_pretrained(bundled_dir("smollm2-135m"))
    m, tok = load_model(model, dtype=getattr(torch, dtype))
    return m, tok


def text_windows(tok: Any, seqlen: int, vocab: int | None) -> torch.Tensor:
    windows = token_windows(tok, load_text("shakespeare", "train")[:1_500_000], seqlen)
    return remap_vocab(windows, vocab) if vocab else windows


def rel_spread(values: list[float]) -> float:
    """(p75 - p25) / median."""
    if len(values) < 2:
        return 0.0
    q = statistics.quantiles(values, n=4)
    return (q[2] - q[0]) / statistics.median(values)


def run_chunk(section: str, repeat: int, seed: int, only: set[str] | None, threads: int, vocab: int,
              lr: float, part: str = "all", max_error: float = TrainConfig.max_error) -> list[dict[str, Any]]:
    """One interleaved comparison of the section's strategies; returns one record per strategy."""
    spec = SECTIONS[section]
    torch.set_num_threads(threads)
    model, tok = load(spec["model"], spec["dtype"], vocab)
    model.train()
    windows = text_windows(tok, spec["seqlen"], vocab if spec["model"] == "small" else None)
    steps = spec["warmup"] + spec["timed"]
    data = batches(windows, spec["batch"], steps + 1, seed=seed if section == "loss" else repeat)
    plan = [p for p in spec["plan"] if (only is None or label(*p) in only)
            and (part == "all" or label(*p) in PARTS[part])]
    base = lm_unoptimized_peak(model, data[0])
    print(f"[{section}] unoptimized peak {base / MIB:.1f} MiB (block by block)", file=sys.stderr)
    load_before = os.getloadavg()
    runners: list[StrategyRunner] = []
    errors: list[dict[str, Any]] = []
    shared_opt = None
    profiles: dict[bool, Any] = {}  # one Adacc profile per kind (eager / compiled options), shared by budgets
    for strategy, budget, cb, *pool in plan:
        if section == "loss":  # independent training runs: own weights, own optimizer
            torch.manual_seed(seed)
            m, _ = load(spec["model"], spec["dtype"], vocab)
            m.train()
            opt = None
        else:
            m = shared_weights_copy(model)
            if shared_opt is None:
                shared_opt = torch.optim.AdamW(model.parameters(), lr=lr)
            opt = shared_opt
        cfg = TrainConfig(strategy=strategy, budget=Budget.parse(budget), batch_size=spec["batch"], steps=steps, lr=lr,
                          warmup=spec["warmup"], progress=False, max_error=max_error,
                          compile_blocks=COMPILE_BLOCK_BUDGETS if cb else (), compress_layers=spec["layers"],
                          pool_layers=pool[0] if pool else True)
        runner = StrategyRunner(m, cfg, unoptimized_peak=base, optimizer=opt, profile=profiles.get(cb))
        t0 = time.perf_counter()
        try:
            runner.setup(data[0])
        except Exception as exc:  # noqa: BLE001 - a strategy that does not run here is recorded as such
            runner.close()
            msg = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            print(f"[{section}] {cfg.label}: did not run ({msg})", file=sys.stderr)
            errors.append({"label": cfg.label, "strategy": strategy, "error": msg})
            continue
        print(f"[{section}] {cfg.label}: set up in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        if runner.adacc is not None and runner.adacc.profile is not None:
            profiles.setdefault(cb, runner.adacc.profile)
        runners.append(runner)
    for i, x in enumerate(tqdm(data[:steps], desc=f"{section}: interleaved steps")):
        k = i % max(1, len(runners))
        for runner in runners[k:] + runners[:k]:
            runner.step(x)
    load_after = os.getloadavg()
    if section != "loss":  # one more, untimed step each under the allocator's own accounting
        for runner in tqdm(runners, desc=f"{section}: allocator peaks"):
            runner.allocator_step(data[steps])
    common = {"section": section, "repeat": repeat, "part": part, "seed": seed, "model": spec["model"],
              "dtype": spec["dtype"],
              "batch_size": spec["batch"], "seqlen": spec["seqlen"], "threads": threads, "lr": lr,
              "max_error": max_error,
              "measured_layers": spec["layers"],
              "unoptimized_peak_bytes": base, "load_before": load_before, "load_after": load_after}
    records = []
    for runner in runners:
        runner.close()
        r = runner.result()
        timed = r["step_times"][r["warmup"]:]
        r["spread"] = rel_spread(timed)
        if section != "loss":
            r.pop("losses", None)
        if r.get("plan"):
            r["plan"] = {k: r["plan"][k] for k in ("summary", "layer_modes", "predicted_peak", "predicted_time_s",
                                                     "measured_peak", "status", "solve_s", "budget_bytes")}
        records.append(common | r)
    records += [common | e for e in errors]
    return records


def merge(path: Path, records: list[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    payload = load_json(path, {})
    if "chunks" not in payload:  # an earlier layout: start over
        payload = {"chunks": [], "records": []}
    key = lambda r: (r["section"], r["repeat"], r.get("part", "all"), r["seed"], r["label"])  # noqa: E731
    payload["records"] = merge_records(payload["records"], records, key)
    payload["chunks"].append(meta)
    payload["machine"] = machine_info()
    payload["machine_line"] = machine_line()
    return payload


# ---------------------------------------------------------------------------------------------- rendering


def _run(r: dict[str, Any]) -> tuple:
    """The chunk a record ran in: its strategies ran side by side."""
    return (r["repeat"], r.get("part", "all"), r["seed"])


def aggregate(records: list[dict[str, Any]], section: str) -> list[dict[str, Any]]:
    """Per strategy over repeats: median tokens/s and step time, min-max spread, the largest measured
    peak, steps over budget, and ratios measured side by side within each repeat (median, min, max)."""
    recs = [r for r in records if r["section"] == section and not r.get("error")]
    labels = list(dict.fromkeys(r["label"] for r in recs))
    by_run: dict[tuple, dict[str, dict[str, Any]]] = {}
    for r in recs:
        by_run.setdefault(_run(r), {})[r["label"]] = r
    out = []
    for lab in labels:
        rs = [r for r in recs if r["label"] == lab]
        tps = [r["tokens_s"] for r in rs]

        def ratio(other: str, rs: list[dict[str, Any]] = rs) -> list[float]:
            return [r["tokens_s"] / by_run[_run(r)][other]["tokens_s"] for r in rs if other in by_run[_run(r)]]

        first = rs[0]
        agg = {
            "label": lab, "strategy": first["strategy"], "compile_blocks": first.get("compile_blocks"),
            "budget_fraction": first.get("budget_fraction"), "repeats": len(rs),
            "tokens_s": statistics.median(tps), "tokens_s_min": min(tps), "tokens_s_max": max(tps),
            "spread": (max(tps) - min(tps)) / statistics.median(tps),
            "step_s": statistics.median(r["step_s"] for r in rs),
            "step_cpu_s": statistics.median(r["step_cpu_s"] for r in rs),
            "within_run_spread": statistics.median(r["spread"] for r in rs),
            "peak_bytes": max(r["peak_bytes"] for r in rs),
            "allocator_peak_bytes": max((r["allocator_peak_bytes"] for r in rs if r.get("allocator_peak_bytes")),
                                        default=None),
            "unoptimized_peak_bytes": first["unoptimized_peak_bytes"],
            "budget_bytes": first.get("budget_bytes"),
            "timed_steps": sum(len(r["step_peaks"]) - r["warmup"] for r in rs),
            "steps_over_budget": (sum(r["steps_over_budget"] for r in rs)
                                  if first.get("steps_over_budget") is not None else None),
            "peak_measured_every_step": all(r["peak_measured_every_step"] for r in rs),
            "setup_s": statistics.median(r["setup_s"] for r in rs),
            "profile_peak_bytes": max((r["profile_peak_bytes"] for r in rs if r.get("profile_peak_bytes")),
                                      default=None),
            "replan_s": sum(r["replan_s"] for r in rs),
            "final_loss": statistics.median(r["final_loss"] for r in rs),
            "plan": first.get("plan"),
            "vs_checkpoint": ratio("checkpoint"), "vs_none": ratio("none"),
        }
        if first["strategy"] == "adacc":
            agg["vs_compile_same_budget"] = ratio(f"compile@{first['budget_fraction']:.0%}")
        out.append(agg)
    return out


def _med(xs: list[float]) -> str:
    if not xs:
        return "-"
    if len(xs) == 1:
        return f"{xs[0]:.2f}x"
    return f"{statistics.median(xs):.2f}x ({min(xs):.2f}-{max(xs):.2f})"


def _mib(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / MIB:.0f}"


def table(aggs: list[dict[str, Any]]) -> list[str]:
    """The section's table; `peak / unopt.` is against the section's unoptimized peak (the header's), also
    for a strategy whose own differs (see :func:`section_header`)."""
    ref = _section_peak(aggs) if aggs else 1
    rows = ["| strategy | peak MiB | peak / unopt. | steps over budget | allocator peak MiB | median step s | "
            "tokens/s (median) | tokens/s min-max | vs checkpoint | vs compile, same budget | setup s | plan |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for a in aggs:
        over = "-" if a["steps_over_budget"] is None else f"{a['steps_over_budget']}/{a['timed_steps']}"
        plan = ""
        if a.get("plan"):
            plan = ", ".join(f"{k} {v}" for k, v in a["plan"]["summary"].items() if v)
        rows.append(
            f"| {a['label']} | {a['peak_bytes'] / MIB:.1f} | {a['peak_bytes'] / ref:.0%} | "
            f"{over} | {_mib(a['allocator_peak_bytes'])} | {a['step_s']:.3f} | {a['tokens_s']:.0f} | "
            f"{a['tokens_s_min']:.0f}-{a['tokens_s_max']:.0f} | "
            f"{_med(a['vs_checkpoint'])} | {_med(a.get('vs_compile_same_budget', []))} | {a['setup_s']:.0f} | {plan} |")
    return rows


def best_adacc(aggs: list[dict[str, Any]], frac: float) -> dict[str, Any] | None:
    cands = [a for a in aggs if a["strategy"] == "adacc" and a["budget_fraction"] == frac]
    return max(cands, key=lambda a: a["tokens_s"]) if cands else None


def ratio_in_repeats(records: list[dict[str, Any]], section: str, a: str, b: str) -> list[float]:
    """tokens/s of ``a`` over ``b``, per chunk in which both ran (measured side by side)."""
    out = []
    for run in sorted({_run(r) for r in records if r["section"] == section}):
        rs = {r["label"]: r for r in records if r["section"] == section and _run(r) == run and not r.get("error")}
        if a in rs and b in rs:
            out.append(rs[a]["tokens_s"] / rs[b]["tokens_s"])
    return out


def coverage(records: list[dict[str, Any]], section: str) -> list[str]:
    """What the records hold against the protocol (every strategy, REPEATS repeats, MIN_TIMED timed steps,
    a bf16 run, LOSS_SEEDS loss seeds), so a target read from fewer runs says so."""
    recs = [r for r in records if r["section"] == section and not r.get("error")]
    runs = {lab: sorted({(r["repeat"], r.get("part", "all")) for r in recs if r["label"] == lab})
            for lab in dict.fromkeys(r["label"] for r in recs)}
    want = [label(*p) for p in SECTIONS[section]["plan"]]
    missing = [lab for lab in want if lab not in runs]
    reps = sorted({len({rep for rep, _ in v}) for v in runs.values()})
    timed = min((r["steps"] - r["warmup"] for r in recs), default=0)
    full = not missing and reps == [REPEATS] and timed >= MIN_TIMED
    completeness = ("complete" if full
                    else "**incomplete**: the met/missed verdicts below rest on fewer runs than asked")
    lines = [f"- Protocol: {len(runs)}/{len(want)} strategies measured"
             + (f" (never run: {', '.join(missing)})" if missing else "")
             + f", {'/'.join(map(str, reps)) or 0} repeat(s) each of {REPEATS} asked, at least {timed} timed steps "
             f"per strategy ({MIN_TIMED} asked): {completeness}."]
    bf16 = [r for r in records if r["section"] == "bf16" and not r.get("error")]
    if bf16:
        lines.append(f"- bf16 run: {len({r['label'] for r in bf16})}/{len(BF16)} strategies recorded, "
                     f"{len({r['repeat'] for r in bf16})} repeat(s).")
    else:
        lines.append("- bf16 run: **not run** (no records).")
    seeds = sorted({r["seed"] for r in records if r["section"] == "loss" and not r.get("error")})
    if len(seeds) < LOSS_SEEDS:
        lines.append(f"- Loss within 1% after 200 steps: **not measured** ({len(seeds)}/{LOSS_SEEDS} seeds recorded).")
    return lines


def targets(records: list[dict[str, Any]], aggs: list[dict[str, Any]], section: str) -> list[str]:
    """The issue's targets on SmolLM2, checked against the measured records."""
    lines = ["## Targets (SmolLM2-135M)", ""]
    if not aggs:
        return lines + ["- no SmolLM2 records yet", ""]
    lines += coverage(records, section)
    compile_aggs = sorted([a for a in aggs if a["strategy"] == "compile"], key=lambda a: a["budget_fraction"])
    ck = next((a for a in aggs if a["label"] == "checkpoint"), None)
    for frac, need_compile, need_ck in ((0.25, 1.10, None), (0.5, 1.0, 1.15)):
        best = best_adacc(aggs, frac)
        if best is None:
            lines.append(f"- {frac:.0%} budget: no Adacc run")
            continue
        same = next((c for c in compile_aggs if c["budget_fraction"] == frac), None)
        comp = same
        if frac == 0.25:  # the comparator: compile@25%, or the lowest compile budget using at least
            # Adacc's measured memory when compile@25% uses less
            comp = next((c for c in compile_aggs if c["budget_fraction"] >= frac
                         and c["peak_bytes"] >= best["peak_bytes"]), None)
        if same is not None and same is not comp:
            rs = ratio_in_repeats(records, section, best["label"], same["label"])
            lines.append(f"- {frac:.0%} budget: {best['label']} ran {_med(rs)} the tokens/s of {same['label']}, which "
                         f"used less memory ({same['peak_bytes'] / MIB:.0f} vs {best['peak_bytes'] / MIB:.0f} MiB).")
        if comp is None:
            lines.append(f"- {frac:.0%} budget: no compile run at {frac:.0%} or with a peak no lower than "
                         f"{best['label']}'s ({best['peak_bytes'] / MIB:.0f} MiB)")
        else:
            rs = ratio_in_repeats(records, section, best["label"], comp["label"])
            med = statistics.median(rs) if rs else float("nan")
            lines.append(
                f"- {frac:.0%} budget: {best['label']} (the faster Adacc variant) ran {_med(rs)} the tokens/s of "
                f"{comp['label']} (peaks {best['peak_bytes'] / MIB:.0f} vs {comp['peak_bytes'] / MIB:.0f} MiB); "
                f"target >= {need_compile:.2f}x: {'met' if med >= need_compile else '**missed**'}.")
        alloc = [(a["label"], a["allocator_peak_bytes"]) for a in (best, same, comp) if a is not None
                 and a.get("allocator_peak_bytes")]
        if alloc:
            lines.append(f"- {frac:.0%} budget, allocator peaks of one extra step (gradients and compiled kernels' "
                         "workspace included): " + ", ".join(f"{lab} {b / MIB:.0f} MiB" for lab, b in
                                                            dict(alloc).items()) + ".")
        if need_ck and ck:
            rs = ratio_in_repeats(records, section, best["label"], "checkpoint")
            med = statistics.median(rs) if rs else float("nan")
            lines.append(f"- {frac:.0%} budget: {best['label']} vs full checkpointing: {_med(rs)}; target >= "
                         f"{need_ck:.2f}x: {'met' if med >= need_ck else '**missed**'}.")
    for kind in ("adacc", "compile"):
        runs = [a for a in aggs if a["strategy"] == kind and a["steps_over_budget"] is not None]
        steps = sum(a["timed_steps"] for a in runs)
        over = sum(a["steps_over_budget"] for a in runs)
        worst = max((a["peak_bytes"] / a["budget_bytes"] for a in runs), default=0.0)
        what = "target: every timed step within budget" if kind == "adacc" else \
            "compile promises no fraction of the eager peak; shown for comparison"
        lines.append(f"- Measured peak <= budget, {kind} runs: {steps - over}/{steps} timed steps "
                     f"(largest peak/budget {worst:.3f}; {what})"
                     + (f": {'met' if over == 0 else '**missed**'}." if kind == "adacc" else "."))
    recs = [r for r in records if r["section"] == section and r["strategy"] == "adacc" and not r.get("error")]
    cuda = [(p, b) for r in recs if r.get("cuda_step_peaks") for p, b in zip(r["cuda_step_peaks"][r["warmup"]:],
                                                                           r["step_budget_bytes"][r["warmup"]:])]
    lines.append(f"- CUDA max_memory_allocated per timed step: {sum(p <= b for p, b in cuda)}/{len(cuda)} within "
                 "budget (allocator bytes: activations and gradients)." if cuda else
                 "- CUDA max_memory_allocated per step: not measured (no GPU on the machine that ran these records).")
    prof = [a for a in aggs if a["strategy"] == "adacc" and a.get("profile_peak_bytes")]
    if prof:
        worst = max(prof, key=lambda a: a["profile_peak_bytes"] / a["budget_bytes"])
        ok = sum(a["profile_peak_bytes"] <= a["budget_bytes"] for a in prof)
        lines.append(f"- Profiling never above the budget: {ok}/{len(prof)} Adacc runs profiled within their budget "
                     f"(largest profile peak / budget {worst['profile_peak_bytes'] / worst['budget_bytes']:.2f}, "
                     f"{worst['label']}): {'met' if ok == len(prof) else '**missed**'}.")
    return lines


def loss_lines(records: list[dict[str, Any]]) -> list[str]:
    recs = [r for r in records if r["section"] == "loss" and not r.get("error")]
    seeds = sorted({r["seed"] for r in recs})
    if not seeds:
        return []
    first = recs[0]
    lines = [f"## Loss after {first['steps']} steps ({first['model']}, batch {first['batch_size']} x seqlen "
             f"{first['seqlen']}, AdamW lr {first['lr']:g}, Shakespeare train split; same initial weights and "
             "batches per seed; final loss = mean of the last 10 step losses)", "",
             "| seed | none | adacc@50% | difference | Adacc peak / budget (all steps) |", "|---|---|---|---|---|"]
    diffs = []
    for s in seeds:
        rs = {r["label"]: r for r in recs if r["seed"] == s}
        if "none" not in rs or "adacc@50%" not in rs:
            continue
        a, n = rs["adacc@50%"], rs["none"]
        d = a["final_loss"] / n["final_loss"] - 1
        diffs.append(d)
        lines.append(f"| {s} | {n['final_loss']:.4f} | {a['final_loss']:.4f} | {d:+.2%} | "
                     f"{max(a['step_peaks']) / a['budget_bytes']:.3f} |")
    if diffs:
        worst = max(abs(d) for d in diffs)
        verdict = ("met" if worst <= 0.01 and len(diffs) >= 3
                   else "**missed**" if worst > 0.01 else "pending (fewer than 3 seeds)")
        lines += ["", f"- Target: loss within 1% of the unoptimized run on every seed: largest difference "
                      f"{worst:.2%} over {len(diffs)} seed(s): {verdict}."]
    return lines + [""]


def plot(records: list[dict[str, Any]], aggs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    ax = axes[0]
    for a in aggs:
        x, y = a["peak_bytes"] / MIB, a["tokens_s"]
        color = {"adacc": "C3", "compile": "C0"}.get(a["strategy"], "C7")
        ax.errorbar(x, y, yerr=[[y - a["tokens_s_min"]], [a["tokens_s_max"] - y]], fmt="o", color=color, capsize=3)
        ax.annotate(a["label"], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("largest measured peak of saved activations (MiB)")
    ax.set_ylabel("tokens / s (median over repeats, min-max)")
    ax.set_title("SmolLM2-135M: memory vs throughput")
    ax.grid(alpha=0.3)
    ax = axes[1]
    for r in [r for r in records if r["section"] == "loss" and not r.get("error")]:
        losses = r["losses"]
        k = 10
        smooth = [statistics.fmean(losses[max(0, i - k + 1): i + 1]) for i in range(len(losses))]
        ax.plot(smooth, label=f"{r['label']} seed {r['seed']}", ls="-" if r["strategy"] == "none" else "--")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (moving mean of 10)")
    ax.set_title("fine-tuning loss")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def timing_lines(records: list[dict[str, Any]]) -> list[str]:
    """The planner on pooled times against the planner on each layer's own times (section ``timings``),
    and which planner each section's Adacc records ran."""
    out = []
    for frac in (0.25, 0.5):
        pooled, own, comp = f"adacc+compile@{frac:.0%}", f"adacc+compile@{frac:.0%} per-layer", f"compile@{frac:.0%}"
        r = ratio_in_repeats(records, "timings", pooled, own)
        if r:
            out.append(f"- {frac:.0%} budget: pooled times ran {_med(r)} the tokens/s of per-layer times; against "
                       f"{comp}: pooled {_med(ratio_in_repeats(records, 'timings', pooled, comp))}, per-layer "
                       f"{_med(ratio_in_repeats(records, 'timings', own, comp))} ({len(r)} repeat(s), side by side).")
    for section in ("smollm2", "bf16", "loss", "small"):
        rs = [r for r in records if r["section"] == section and r["strategy"] == "adacc" and not r.get("error")]
        if rs:
            n = sum(1 for r in rs if r.get("pool_layers"))
            out.append(f"- Section {section}: {n}/{len(rs)} Adacc records planned from pooled times"
                       + (" (the others from each layer's own times: recorded before pooling became the default)."
                          if n < len(rs) else "."))
            cb = [r for r in rs if r.get("compile_blocks")]
            if cb:
                n = sum(1 for r in cb if r.get("compiled_loss"))
                out.append(f"- Section {section}: {n}/{len(cb)} Adacc-on-compiled-blocks records ran the model's loss "
                           "as compiled kernels"
                           + (" (the others ran it eagerly: recorded before the loss was compiled with the blocks)."
                              if n < len(cb) else "."))
    return out


def section_header(records: list[dict[str, Any]], section: str, title: str) -> list[str]:
    recs = [r for r in records if r["section"] == section and not r.get("error")]
    if not recs:
        return []
    r = recs[0]
    reps = sorted({x["repeat"] for x in recs})
    parts = sorted({x.get("part", "all") for x in recs})
    steps = r["steps"] - r["warmup"]
    loads = [x["load_before"][0] for x in recs] + [x["load_after"][0] for x in recs]
    return [f"## {title}: {r['model']} ({r['dtype']}), batch {r['batch_size']} x seqlen {r['seqlen']}, "
            f"{r['threads']} torch threads; {len(reps)} repeat(s)"
            + (f" in chunks {'/'.join(parts)} (checkpoint runs in each)" if parts != ["all"] else "")
            + f", each {r['warmup']} warm-up + {steps} timed steps per strategy, interleaved step by step; "
            f"unoptimized peak {_section_peak(recs) / MIB:.1f} MiB; "
            f"1-minute load average during the runs {min(loads):.1f}-{max(loads):.1f}", ""] + _own_peaks(recs)


def _section_peak(items: list[dict[str, Any]]) -> float:
    """The section's unoptimized peak: that of its first non-Adacc record (measured the same way for all of
    them), else of its first record."""
    return next((r for r in items if r["strategy"] != "adacc"), items[0])["unoptimized_peak_bytes"]


def _own_peaks(recs: list[dict[str, Any]]) -> list[str]:
    """A line for strategies whose records carry another unoptimized peak than the section's: Adacc plans
    against the peak its own profile measures, and its budgets are fractions of that."""
    ref = _section_peak(recs)
    own: dict[str, set[int]] = {}
    for r in recs:
        if r["unoptimized_peak_bytes"] != ref:
            own.setdefault(r["label"], set()).add(r["unoptimized_peak_bytes"])
    if not own:
        return []

    def diff(v: int) -> str:
        d = v - ref
        return f"{d / MIB:+.1f} MiB" if abs(d) >= 0.05 * MIB else f"{d:+d} bytes"

    parts = [f"{lab}: {'/'.join(f'{v / MIB:.1f} MiB ({diff(v)})' for v in sorted(vals))}" for lab, vals in own.items()]
    values = {v for vals in own.values() for v in vals}
    way = "fewer" if max(values) < ref else "more" if min(values) > ref else "other"
    note = ""
    if all(r.get("compiled_loss") for r in recs if r["label"] in own):
        note = " These runs computed the loss as compiled kernels, which save other tensors than the eager loss"
        if way == "fewer" and recs[0]["dtype"] in ("bfloat16", "float16"):
            note += " (the eager loss keeps float32 log-probabilities of the half-precision logits)"
        note += "."
    return [f"Unoptimized peak measured by Adacc's own profile, where it differs from the one above: "
            f"{'; '.join(parts)}. Their budgets (and `steps over budget`) are fractions of that peak ({way} bytes "
            f"than the same fraction of the section's); `peak / unopt.` is against {ref / MIB:.1f} MiB for every "
            f"row.{note}", ""]


def render(payload: dict[str, Any], out: Path, doc: Path | None = None) -> None:
    """Write ``out``/memory.md and .png from the payload, and the tables into ``doc`` between its
    bench markers (main() passes docs/memory.md only when ``out`` is bench/results)."""
    records = payload["records"]
    smol = aggregate(records, "smollm2")
    lines = ["# Training memory: Adacc vs checkpointing and torch.compile's activation budget", "",
             f"Machine: {payload['machine_line']}; cores shared with other jobs (see the load averages).", "",
             "Commands (one chunk each): " + "; ".join(f"`{c['command']}`" for c in payload["chunks"][-12:]), "",
             "Peak = the largest, over every timed step, of live saved-activation bytes (saved-tensors hook, storages "
             "de-duplicated, parameters skipped, plus recompute and decompression workspace). Budgets are fractions of "
             "one unoptimized peak computed block by block. tokens/s = tokens per step / median step time, with any "
             "re-planning time added; ratios are measured side by side within each repeat (median and min-max over "
             "repeats). `compile@X` is torch.compile with activation_memory_budget = X (its own scale: X of the "
             "runtime-optimal saved set; its recomputation workspace inside fused kernels is invisible to the meter "
             "on CPU). `adacc+compile@X`: Adacc whose MILP may also run layers as compiled blocks "
             f"(compiler budgets {', '.join(f'{b:g}' for b in COMPILE_BLOCK_BUDGETS)}). `allocator peak`: one extra, "
             "untimed step per strategy after the timed ones, the peak of every byte the allocator handed out above "
             "the step's start (torch profiler allocation events on CPU, max_memory_allocated on CUDA): activations, "
             "gradients and optimizer state alike, and the workspace inside compiled kernels the meter cannot see.", ""]
    summary = section_header(records, "smollm2", "Headline") + table(smol) + [""] if smol else []
    lines += summary
    tgt = targets(records, smol, "smollm2") + [""]
    lines += tgt
    loss = loss_lines(records)
    lines += loss
    for section, title in (("timings", "Planner times pooled over identical layers (default) vs each layer's own "
                                       "(`per-layer`)"), ("bf16", "bfloat16 model"),
                           ("small", "Quick run: small LLaMA config")):
        aggs = aggregate(records, section)
        if aggs:
            lines += section_header(records, section, title) + table(aggs) + [""]
            if section == "timings":
                lines += timing_lines(records) + [""]
    errs = [r for r in records if r.get("error")]
    if errs:
        seen: dict[str, int] = {}
        for r in errs:  # the same refusal in several repeats: one line, with its count
            key = f"{r['section']} {r['label']}: {r['error']}"
            seen[key] = seen.get(key, 0) + 1
        lines += ["## Strategies that did not run", ""] + [f"- {k}" + (f" ({n} repeats)" if n > 1 else "")
                                                          for k, n in seen.items()] + [""]
    (out / "memory.md").write_text("\n".join(lines))
    if smol or records:
        plot(records, smol, out / "memory.png")
    if doc is not None:
        block = ["", "Generated by `bench/memory.py` from `bench/results/memory.json` (full tables: "
                 "[bench/results/memory.md](../bench/results/memory.md)).", ""]
        block += [ln.replace("## ", "### ", 1) if ln.startswith("## ") else ln for ln in summary + tgt + loss]
        replace_block(doc, "memory", "\n".join(block) + "\n")
    print("\n".join(lines))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--section", choices=list(SECTIONS), default=None, help="which chunk to run")
    ap.add_argument("--repeat", type=int, default=0, help="repeat index of this chunk (0, 1, 2)")
    ap.add_argument("--part", choices=["all", *PARTS], default="all", help="smollm2: which half of the strategies")
    ap.add_argument("--seed", type=int, default=0, help="loss section: the seed")
    ap.add_argument("--only", default=None, help="comma-separated strategy labels to run (e.g. adacc@50%%,checkpoint)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=2048, help="small config: keep this many most frequent tokens")
    ap.add_argument("--lr", type=float, default=None, help="default 1e-4 (SmolLM2) / 1e-3 (small config)")
    ap.add_argument("--timed", type=int, default=None, help="override the number of timed steps")
    ap.add_argument("--max-error", type=float, default=TrainConfig.max_error,
                    help=f"Adacc's relative-error cap on lossy compressors (default {TrainConfig.max_error:g}); "
                    "records carry it")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--render-only", action="store_true",
                    help="only rewrite memory.md/.png (and docs) from memory.json")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "memory.json"
    doc = DOC if out.resolve() == RESULTS else None  # a run elsewhere (a trial) leaves the docs alone
    if args.render_only:
        render(json.loads(path.read_text()), out, doc)
        return 0
    if args.section is None:
        ap.error("pass --section (or --render-only)")
    if args.max_error != TrainConfig.max_error and doc is not None:  # the published records used the default
        ap.error(f"--max-error {args.max_error:g} differs from the published records' {TrainConfig.max_error:g}: "
                 "pass --out DIR for a trial")
    if args.timed is not None:
        SECTIONS[args.section]["timed"] = args.timed
    lr = args.lr if args.lr is not None else (1e-3 if SECTIONS[args.section]["model"] == "small" else 1e-4)
    t0, c0 = time.perf_counter(), time.process_time()
    only = set(args.only.split(",")) if args.only else None
    records = run_chunk(args.section, args.repeat, args.seed, only, args.threads, args.vocab, lr, args.part,
                        args.max_error)
    meta = {"command": "python bench/memory.py " + " ".join(sys.argv[1:]), "section": args.section,
            "repeat": args.repeat, "part": args.part, "seed": args.seed, "seconds": time.perf_counter() - t0,
            "cpu_seconds": time.process_time() - c0, "finished": time.strftime("%Y-%m-%d %H:%M:%S")}
    payload = merge(path, records, meta)
    write_json(path, payload)
    render(payload, out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
