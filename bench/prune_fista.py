"""FISTAPruner benchmark on SmolLM2-135M: cold and warm start beside SparseGPT, plus ablations.

Main comparison (full model, every layer pruned): SparseGPT, FISTA cold start (dense) and FISTA warm
start (SparseGPT weights) at 50 % unstructured and 2:4, perplexity on the test split and pruning
seconds, measured side by side in one run on this machine. The FISTA records are merged into
``bench/results/prune.json`` (``"method": "fista"`` with a ``"warm_start"`` field) next to the baseline
records written by ``bench/prune.py``, which are kept.

Ablations (reduced setting, said so in the table): only the first ``--ablation-layers`` decoder layers
are pruned (50 % unstructured) and the full model is evaluated: 3 calibration seeds (mean +- std,
FISTA and SparseGPT), intra-layer correction on/off, K (iterations per round) and T (rounds).

Every finished run is cached in ``bench/results/prune_fista.json``; a rerun skips what is done (pass
``--fresh`` to start over). Writes ``bench/results/prune_fista.{md,png,json}``.

    .venv/bin/python bench/prune_fista.py            # main comparison, then ablations
    .venv/bin/python bench/prune_fista.py --only main
    .venv/bin/python bench/prune_fista.py --quick    # 4 layers, 8 x 256 calibration, 4 eval windows
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
sys.path.insert(0, str(ROOT))


def _base_settings() -> dict[str, Any]:
    """Calibration / evaluation settings of ``bench/prune.py`` when it defines them, else ours."""
    settings = {"model": "smollm2-135m", "calib": "shakespeare", "nsamples": 32, "seqlen": 512, "seed": 0,
                "eval_windows": 20, "batch_size": 8}  # fmt: skip
    try:
        import prune as base  # bench/prune.py
    except Exception:  # noqa: BLE001 - absent or not importable: keep ours
        return settings
    for key in list(settings):
        for attr in (key.upper(), f"DEFAULT_{key.upper()}"):
            if hasattr(base, attr):
                settings[key] = getattr(base, attr)
    return settings


def _load(model_name: str):
    from leanml.models import load_model

    return load_model(model_name)


def _eval_windows(tokenizer, seqlen: int, n: int | None) -> torch.Tensor:
    from leanml.data.text import load_text, token_windows

    windows = token_windows(tokenizer, load_text("shakespeare", "test"), seqlen)
    return windows if n is None else windows[:n]


def run_one(
    dense, test_ids: torch.Tensor, calib_ids: torch.Tensor, method: str, pattern: str, *,
    fista_kwargs: dict[str, Any] | None = None, intra_layer: bool = True, n_layers: int | None = None,
    batch_size: int = 8,
) -> dict[str, Any]:  # fmt: skip
    """Prune a copy of ``dense`` (all layers, or the first ``n_layers``) and measure perplexity."""
    from leanml.eval.perplexity import perplexity
    from leanml.prune.engine import prune_model
    from leanml.prune.masks import MaskSpec, parse_pattern
    from leanml.prune.methods.baselines import SparseGPTPruner
    from leanml.prune.methods.fista import FistaPruner

    model = copy.deepcopy(dense)
    pruner = SparseGPTPruner() if method == "sparsegpt" else FistaPruner(**(fista_kwargs or {}))
    nm = parse_pattern(pattern)
    spec = MaskSpec(0.5, nm, type(pruner).default_scope)
    layers = model.model.layers
    if n_layers is not None:
        model.model.layers = layers[:n_layers]
    t0 = time.perf_counter()
    report = prune_model(model, calib_ids, pruner, spec, intra_layer=intra_layer, batch_size=batch_size)
    seconds = time.perf_counter() - t0
    model.model.layers = layers
    ppl = perplexity(model, test_ids, batch_size=batch_size)
    rel = [layer["rel_output_error"] for layer in report["layers"]]
    return {
        "method": method,
        "pattern": "unstructured" if nm is None else pattern,
        "sparsity": 0.5,
        "scope": spec.scope,
        "ppl": ppl,
        "seconds": seconds,
        "intra_layer": intra_layer,
        "layers_pruned": len(rel),
        "last_layer_rel_error": rel[-1],
        "method_config": pruner.config(),
    }


def _key(rec: dict[str, Any]) -> str:
    cfg = rec.get("method_config", {})
    return json.dumps(
        [rec["experiment"], rec["method"], rec["pattern"], rec.get("warm_start"), rec["calib_seed"],
         rec["intra_layer"], cfg.get("iters"), cfg.get("rounds"), rec["layers_pruned_request"]]
    )  # fmt: skip


def _plan(args, s) -> list[dict[str, Any]]:
    """The runs, in priority order: main comparison first, then ablations."""
    plan: list[dict[str, Any]] = []
    fista = {"iters": args.iters, "rounds": args.rounds}
    if args.only in ("main", "all"):
        for pattern in ("unstructured", "2:4"):
            plan.append({"experiment": "main", "method": "fista", "pattern": pattern, "warm_start": "sparsegpt"})
            plan.append({"experiment": "main", "method": "sparsegpt", "pattern": pattern})
        for pattern in ("unstructured", "2:4"):
            plan.append({"experiment": "main", "method": "fista", "pattern": pattern, "warm_start": "dense"})
    if args.only in ("ablations", "all"):
        n = args.ablation_layers
        for seed in (0, 1, 2):
            plan.append({"experiment": "seeds", "method": "sparsegpt", "pattern": "unstructured", "calib_seed": seed,
                         "n_layers": n})  # fmt: skip
            plan.append({"experiment": "seeds", "method": "fista", "pattern": "unstructured", "calib_seed": seed,
                         "warm_start": "sparsegpt", "n_layers": n})  # fmt: skip
        for intra in (True, False):
            for warm in ("sparsegpt", "dense"):
                plan.append({"experiment": "intra_layer", "method": "fista", "pattern": "unstructured",
                             "warm_start": warm, "intra_layer": intra, "n_layers": n})  # fmt: skip
        for k in (5, 10, 20, 40):
            plan.append({"experiment": "K", "method": "fista", "pattern": "unstructured", "warm_start": "dense",
                         "fista": {"iters": k, "rounds": args.rounds}, "n_layers": n})  # fmt: skip
        for t in (1, 2, 3, 5):
            plan.append({"experiment": "T", "method": "fista", "pattern": "unstructured", "warm_start": "dense",
                         "fista": {"iters": args.iters, "rounds": t}, "n_layers": n})  # fmt: skip
    for p in plan:
        p.setdefault("calib_seed", s["seed"])
        p.setdefault("intra_layer", True)
        p.setdefault("n_layers", args.layers)
        if p["method"] == "fista":
            p["fista"] = {**fista, **p.get("fista", {}), "warm_start": p["warm_start"]}
    return plan


def _plan_key(p: dict[str, Any]) -> str:
    cfg = p.get("fista", {})
    return json.dumps(
        [p["experiment"], p["method"], p["pattern"], p.get("warm_start"), p["calib_seed"], p["intra_layer"],
         cfg.get("iters"), cfg.get("rounds"), p["n_layers"]]
    )  # fmt: skip


def merge_into_prune_json(records: list[dict[str, Any]], path: Path) -> None:
    """Replace the FISTA main records in ``prune.json``; every other record (the baselines) is kept."""
    from leanml.utils import write_json

    existing = json.loads(path.read_text()) if path.exists() else []
    kept = [r for r in existing if not (r.get("method") == "fista" and r.get("source") == "bench/prune_fista.py")]
    write_json(path, kept + records)


def _fmt_ratio(a: float, b: float | None) -> str:
    return f"{a / b:.3f}" if b else "-"


def write_report(recs: list[dict[str, Any]], s: dict[str, Any], args, machine: str, dense_ppl: float) -> str:
    main = [r for r in recs if r["experiment"] == "main"]
    lines = [f"# FISTAPruner on {s['model']}", "", f"Machine: {machine}", "",
             f"Command: `{' '.join(['.venv/bin/python', 'bench/prune_fista.py', *sys.argv[1:]])}`", "",
             f"Calibration: {s['calib']} calib split, {s['nsamples']} x {s['seqlen']} tokens, seed {s['seed']}; "
             f"perplexity on the test split (Hamlet), first {s['eval_windows']} windows of {s['seqlen']}. "
             f"Dense perplexity {dense_ppl:.3f}. FISTA: K={args.iters}, T={args.rounds}, other options default.",
             ""]  # fmt: skip
    lines += ["## Main comparison (all layers pruned)", "",
              "| pattern | method | warm start | ppl | ppl / SparseGPT | seconds | seconds / SparseGPT |",
              "|---|---|---|---:|---:|---:|---:|"]  # fmt: skip
    for pattern in ("unstructured", "2:4"):
        rows = [r for r in main if r["pattern"] == pattern]
        sg = next((r for r in rows if r["method"] == "sparsegpt"), None)
        for r in rows:
            lines.append(
                f"| {pattern if pattern == '2:4' else '50% unstructured'} | {r['method']} | {r.get('warm_start') or '-'} "
                f"| {r['ppl']:.3f} | {_fmt_ratio(r['ppl'], sg and sg['ppl'])} | {r['seconds']:.0f} "
                f"| {_fmt_ratio(r['seconds'], sg and sg['seconds'])} |"
            )
    lines.append("")
    abl = [r for r in recs if r["experiment"] != "main"]
    if abl:
        n = abl[0]["layers_pruned_request"]
        lines += [f"## Ablations (reduced: only the first {n} of 30 layers pruned, 50% unstructured; "
                  f"perplexity of the whole model)", ""]  # fmt: skip
        seeds = [r for r in abl if r["experiment"] == "seeds"]
        if seeds:
            lines += ["| calibration seeds | method | ppl mean | ppl std | n | seconds mean |", "|---|---|---:|---:|---:|---:|"]
            for method in ("sparsegpt", "fista"):
                rr = [r for r in seeds if r["method"] == method]
                if rr:
                    p = [r["ppl"] for r in rr]
                    sd = statistics.stdev(p) if len(p) > 1 else 0.0
                    lines.append(f"| {sorted(r['calib_seed'] for r in rr)} | {method} | {statistics.mean(p):.3f} "
                                 f"| {sd:.3f} | {len(p)} | {statistics.mean(r['seconds'] for r in rr):.0f} |")  # fmt: skip
            lines.append("")
        for exp, label in (("intra_layer", "intra-layer correction"), ("K", "K (iterations per round)"),
                           ("T", "T (lambda rounds)")):  # fmt: skip
            rr = [r for r in abl if r["experiment"] == exp]
            if not rr:
                continue
            lines += [f"| {label} | warm start | ppl | last pruned layer rel. output error | seconds |",
                      "|---|---|---:|---:|---:|"]  # fmt: skip
            for r in rr:
                val = {"intra_layer": "on" if r["intra_layer"] else "off", "K": r["method_config"]["iters"],
                       "T": r["method_config"]["rounds"]}[exp]  # fmt: skip
                lines.append(f"| {val} | {r.get('warm_start')} | {r['ppl']:.3f} | {r['last_layer_rel_error']:.5f} "
                             f"| {r['seconds']:.0f} |")  # fmt: skip
            lines.append("")
    return "\n".join(lines) + "\n"


def plot(recs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    main = [r for r in recs if r["experiment"] == "main"]
    labels = [f"{r['method']}{'/' + r['warm_start'] if r.get('warm_start') else ''}\n{r['pattern']}" for r in main]
    axes[0].bar(range(len(main)), [r["ppl"] for r in main], color=["C1" if r["method"] == "fista" else "C0" for r in main])
    axes[0].set_xticks(range(len(main)), labels, fontsize=7)
    axes[0].set_ylabel("perplexity (test)")
    axes[0].set_title("main comparison")
    for ax, exp, key in ((axes[1], "K", "iters"), (axes[2], "T", "rounds")):
        rr = sorted((r for r in recs if r["experiment"] == exp), key=lambda r: r["method_config"][key])
        if rr:
            ax.plot([r["method_config"][key] for r in rr], [r["ppl"] for r in rr], "o-")
        ax.set_xlabel(exp)
        ax.set_ylabel("perplexity (reduced setting)")
        ax.set_title(f"{exp} sensitivity")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["main", "ablations", "all"], default="all")
    ap.add_argument("--quick", action="store_true", help="4 layers, 8 x 256 calibration, 4 eval windows")
    ap.add_argument("--iters", type=int, default=20, help="K for the main comparison (default 20)")
    ap.add_argument("--rounds", type=int, default=3, help="T for the main comparison (default 3)")
    ap.add_argument("--ablation-layers", type=int, default=4, help="layers pruned in the ablations (default 4)")
    ap.add_argument("--layers", type=int, default=None, help="prune only the first N layers in the main runs")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--max-minutes", type=float, default=None, help="stop starting new runs after this long")
    ap.add_argument("--fresh", action="store_true", help="ignore cached runs")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from leanml.data.text import calibration_windows
    from leanml.eval.perplexity import perplexity
    from leanml.utils import machine_line, write_json

    s = _base_settings()
    tag = ""
    if args.quick:
        s.update(nsamples=8, seqlen=256, eval_windows=4)
        args.layers = args.layers or 4
        args.ablation_layers = min(args.ablation_layers, 2)
        tag = "_quick"
    out_json = RESULTS / f"prune_fista{tag}.json"
    cache = {} if args.fresh or not out_json.exists() else json.loads(out_json.read_text())
    runs: dict[str, Any] = cache.get("runs", {})
    if cache.get("settings") and cache["settings"] != s:
        runs = {}
    dense, tok = _load(s["model"])
    test_ids = _eval_windows(tok, s["seqlen"], s["eval_windows"])
    if "dense_ppl" in cache and runs:
        dense_ppl = cache["dense_ppl"]
    else:
        dense_ppl = perplexity(dense, test_ids, batch_size=s["batch_size"])
    t_start = time.perf_counter()
    calib_cache: dict[int, torch.Tensor] = {}
    for p in _plan(args, s):
        key = _plan_key(p)
        if key in runs:
            continue
        if args.max_minutes and (time.perf_counter() - t_start) / 60 > args.max_minutes:
            print(f"time budget reached; skipping {key}")
            continue
        seed = p["calib_seed"]
        if seed not in calib_cache:
            calib_cache[seed] = calibration_windows(tok, s["calib"], s["nsamples"], s["seqlen"], seed)
        print(f"run {key}", flush=True)
        rec = run_one(dense, test_ids, calib_cache[seed], p["method"], p["pattern"], fista_kwargs=p.get("fista"),
                      intra_layer=p["intra_layer"], n_layers=p["n_layers"], batch_size=s["batch_size"])  # fmt: skip
        rec.update(experiment=p["experiment"], warm_start=p.get("warm_start"), calib_seed=seed,
                   layers_pruned_request=p["n_layers"], model=s["model"], calib=s["calib"], nsamples=s["nsamples"],
                   seqlen=s["seqlen"], eval_windows=s["eval_windows"], source="bench/prune_fista.py")  # fmt: skip
        print(f"  ppl {rec['ppl']:.3f}  seconds {rec['seconds']:.0f}", flush=True)
        runs[key] = rec
        write_json(out_json, {"settings": s, "dense_ppl": dense_ppl, "machine": machine_line(), "runs": runs})
    recs = list(runs.values())
    write_json(out_json, {"settings": s, "dense_ppl": dense_ppl, "machine": machine_line(), "runs": runs})
    md = write_report(recs, s, args, machine_line(), dense_ppl)
    (RESULTS / f"prune_fista{tag}.md").write_text(md)
    plot(recs, RESULTS / f"prune_fista{tag}.png")
    if not args.quick:
        fista_main = [
            {k: r[k] for k in ("method", "warm_start", "pattern", "sparsity", "ppl", "seconds", "model", "calib",
                               "nsamples", "seqlen", "eval_windows", "source", "method_config")}
            for r in recs if r["experiment"] == "main" and r["method"] == "fista" and r["layers_pruned_request"] is None
        ]  # fmt: skip
        if fista_main:
            merge_into_prune_json(fista_main, RESULTS / "prune.json")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
