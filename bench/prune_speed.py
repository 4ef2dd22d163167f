"""Where pruning time goes, and how the engine's modes compare, on SmolLM2-135M.

Each record prunes SmolLM2 at 50 % unstructured with one method and engine mode and splits the time
into the engine's phases, summed over the pruned layers (from the engine's report):

- ``capture``: the embedding pass that records every layer's inputs;
- ``stats``: calibration forwards that gather the groups' input statistics (H, and G/Hd for methods
  that compare with the dense model), including the accumulation;
- ``solve``: the method itself (SparseGPT's OBS sweep, FISTA's solver, ...);
- ``forward``: passes that advance the activation streams to the next layer;
- ``report``: the per-linear error report;
- ``other``: the rest of the wall time (copies, hooks, Python).

``--code before`` runs the same measurement with an older leanml on ``PYTHONPATH`` (its reports have
no ``forward``/``report`` split: they are inside ``other``). CPU-seconds are ``time.process_time()``
of the process (all its threads). Records merge into ``bench/results/prune_speed.json`` by key;
``bench/results/prune_speed.md`` is generated from them.

    python bench/prune_speed.py --layers 4 --runs sparsegpt:intra,sparsegpt:one-pass
    PYTHONPATH=/path/to/old/src python bench/prune_speed.py --code before --layers 4 --runs sparsegpt:intra
    python bench/prune_speed.py --runs sparsegpt:default --nsamples 32          # the full model
    python bench/prune_speed.py --runs fista+iters=5+rounds=1+refine=10:default --nsamples 64 --eval val
    python bench/prune_speed.py --torchrun 2 --runs fista:dense --nsamples 64     # layer-parallel, 2 processes
    python bench/prune_speed.py --render-only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"
PHASES = ["capture", "stats", "solve", "forward", "report", "other"]


def _git_rev() -> str:
    try:
        import leanml

        root = Path(leanml.__file__).resolve().parents[2]
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True).stdout.strip() or "?"
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "src"], capture_output=True,
                               text=True).stdout.strip()
        return rev + ("+changes" if dirty else "")
    except Exception:  # noqa: BLE001 - an exported tree has no git
        return "?"


def run(method: str, mode: str, args: argparse.Namespace, model, calib) -> dict[str, Any]:
    import copy

    from leanml.prune.engine import prune_model
    from leanml.prune.masks import MaskSpec
    from leanml.prune.methods import pruner_class

    name, *opts = method.split("+")  # e.g. fista+iters=5+rounds=1+refine=10
    options = {k: type_of(v) for k, v in (o.split("=") for o in opts)}
    pruner = pruner_class(name)(**options)
    kwargs: dict[str, Any] = {"batch_size": args.batch_size, "progress": False}
    if mode != "default":
        kwargs["intra_layer"] = mode == "intra"
    if args.layers is not None:
        kwargs["layers"] = list(range(args.layers))
    m = copy.deepcopy(model)
    load = os.getloadavg()[0]
    t0, c0 = time.perf_counter(), time.process_time()
    report = prune_model(m, calib, pruner, MaskSpec(0.5), **kwargs)  # the method's own scope
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    layers = report["layers"]
    phases = {
        "capture": report["engine"].get("capture_seconds", 0.0),
        "stats": sum(lay.get("stats_seconds", 0.0) for lay in layers),
        "solve": sum(lay.get("prune_seconds", 0.0) for lay in layers),
        "forward": sum(lay.get("forward_seconds", 0.0) for lay in layers),
        "report": sum(lay.get("report_seconds", 0.0) for lay in layers),
    }
    phases["other"] = wall - sum(phases.values())
    quality = {}
    if args.eval:
        from leanml.data.text import load_text, token_windows
        from leanml.eval.perplexity import perplexity

        windows = token_windows(args.tokenizer, load_text("shakespeare", args.eval), args.seqlen)
        quality = {"eval_split": args.eval, "eval_windows": int(windows.shape[0]),
                   "ppl": perplexity(m, windows, batch_size=8, progress=False)}
        # the reviews' validation split: modern English the calibration plays never touch
        rwin = token_windows(args.tokenizer, load_text("reviews", args.eval), args.seqlen)
        quality.update({"reviews_eval_windows": int(rwin.shape[0]),
                        "reviews_ppl": perplexity(m, rwin, batch_size=8, progress=False)})
    return {**quality,
        "code": args.code, "rev": args.rev or _git_rev(), "method": method,
        "method_config": report.get("method_config"), "mode": mode,
        "intra_layer": report["engine"].get("intra_layer"), "layers_pruned": len(layers),
        "nsamples": args.nsamples, "seqlen": args.seqlen, "batch_size": args.batch_size,
        "wall_s": wall, "cpu_s": cpu, **{f"{k}_s": v for k, v in phases.items()},
        # quality: each pruned layer's relative output error against the dense model (the engine's report)
        "rel_output_errors": [lay["rel_output_error"] for lay in layers],
        "rel_output_error_mean": sum(lay["rel_output_error"] for lay in layers) / max(len(layers), 1),
        "threads": torch.get_num_threads(), "load_before": load, "load_after": os.getloadavg()[0],
        "command": "python bench/prune_speed.py " + " ".join(sys.argv[1:]),
    }


def type_of(text: str) -> Any:
    """``"5"`` -> 5, ``"0.3"`` -> 0.3, anything else stays a string."""
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def run_torchrun(method: str, args: argparse.Namespace) -> dict[str, Any]:
    """Layer-parallel pruning with ``--torchrun`` processes through the CLI (dense inputs, one torch
    thread per process); wall time and the CPU time of all processes."""
    import resource
    import tempfile

    name, *opts = method.split("+")
    extra = [f"--{name}-{k}={v}" for k, v in (o.split("=") for o in opts)]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.torchrun}",
               "-m", "leanml", "prune", "--model", "smollm2-135m", "--method", name, "--mode", "dense",
               "--nsamples", str(args.nsamples), "--seqlen", str(args.seqlen), "--batch-size", str(args.batch_size),
               "--no-eval", "--out", str(out), *extra]
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, args.threads // args.torchrun))}
        load = os.getloadavg()[0]
        c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run(cmd, env=env, check=True)
        wall = time.perf_counter() - t0
        c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        report = json.loads((out / "report.json").read_text())
    layers = report["layers"]
    phases = {"capture": report["engine"].get("capture_seconds", 0.0),
              "stats": sum(lay["stats_seconds"] for lay in layers),
              "solve": sum(lay["prune_seconds"] for lay in layers),
              "forward": sum(lay["forward_seconds"] for lay in layers),
              "report": sum(lay["report_seconds"] for lay in layers)}
    phases["other"] = None  # the phases of two processes overlap in time
    return {"code": args.code, "rev": args.rev or _git_rev(), "method": method,
            "method_config": report["method_config"],
            "mode": f"torchrun x{args.torchrun}", "intra_layer": report["engine"]["intra_layer"],
            "layers_pruned": len(layers), "nsamples": args.nsamples, "seqlen": args.seqlen,
            "batch_size": args.batch_size, "wall_s": wall,
            "cpu_s": (c1.ru_utime + c1.ru_stime) - (c0.ru_utime + c0.ru_stime),
            "rank_seconds": report.get("rank_seconds"), **{f"{k}_s": v for k, v in phases.items()},
            "threads": f"{args.torchrun} x {max(1, args.threads // args.torchrun)}", "load_before": load,
            "load_after": os.getloadavg()[0], "command": "python bench/prune_speed.py " + " ".join(sys.argv[1:])}


# --------------------------------------------------------------------------------------------------
# solver study: FISTA settings at the operator level, fit on calibration windows, error on the val split


def _layer_stats(args: argparse.Namespace, model, tok) -> dict[str, Any]:
    """Statistics of every group of decoder layer ``--study-layer`` after SparseGPT (50 %, its defaults)
    pruned the layers before it on the calibration windows: ``fit`` from those windows, ``val`` from
    the first ``--study-val`` windows of the validation split (two held-out plays). Per group: ``H``
    (pruned-path input), ``G`` (dense x pruned-path), ``Hd`` (dense input), averaged over tokens.
    Cached under the leanml cache directory."""
    import copy

    from leanml.data.text import calibration_windows, load_text, token_windows
    from leanml.models.layout import discover_groups, get_adapter
    from leanml.outputs import cache_dir
    from leanml.prune.engine import prune_model
    from leanml.prune.masks import MaskSpec
    from leanml.prune.methods import pruner_class

    layer = args.study_layer
    path = cache_dir() / "bench" / f"solver_stats_l{layer}_{args.nsamples}x{args.seqlen}_val{args.study_val}.pt"
    if path.exists():
        return torch.load(path, weights_only=False)
    calib = calibration_windows(tok, "shakespeare", args.nsamples, args.seqlen, 0)
    val = token_windows(tok, load_text("shakespeare", "val"), args.seqlen)[: args.study_val]
    dense = copy.deepcopy(model)
    del get_adapter(dense).layers()[layer + 1 :]  # nothing after the studied layer is needed
    pruned = copy.deepcopy(dense)
    prune_model(pruned, calib, pruner_class("sparsegpt")(), MaskSpec(0.5), layers=list(range(layer)),
                batch_size=args.batch_size, progress=False)
    studied = get_adapter(dense).layers()[layer]
    groups = discover_groups(studied, lambda: dense(input_ids=calib[:1]), "llama")
    out: dict[str, Any] = {"layer": layer, "weights": {n: lin.weight.data.clone() for g in groups
                                                       for n, lin in g.linears.items()},
                           "groups": [list(g.linears) for g in groups]}
    for split, ids in (("fit", calib), ("val", val)):
        acc: dict[str, dict[str, torch.Tensor]] = {}
        box: dict[str, dict[str, torch.Tensor]] = {"pruned": {}, "dense": {}}
        hooks = []
        for m, key in ((pruned, "pruned"), (dense, "dense")):
            lay = get_adapter(m).layers()[layer]
            for g in groups:
                name = next(iter(g.linears))
                hooks.append(lay.get_submodule(name).register_forward_pre_hook(
                    lambda _m, a, d=box[key], n=name: d.__setitem__(n, a[0].reshape(-1, a[0].shape[-1]).float())))
        with torch.no_grad():
            for start in range(0, len(ids), args.batch_size):
                for m in (pruned, dense):
                    m(input_ids=ids[start : start + args.batch_size], use_cache=False)
                for name, xs in box["pruned"].items():
                    x = box["dense"][name]
                    a = acc.setdefault(name, {"H": 0.0, "G": 0.0, "Hd": 0.0, "n": 0})
                    a["H"] = a["H"] + xs.T @ xs
                    a["G"] = a["G"] + x.T @ xs
                    a["Hd"] = a["Hd"] + x.T @ x
                    a["n"] += xs.shape[0]
        for h in hooks:
            h.remove()
        out[split] = {name: {k: a[k] / a["n"] for k in ("H", "G", "Hd")} | {"ntokens": a["n"]}
                      for name, a in acc.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(out, path)
    return out


def solver_study(args: argparse.Namespace, model, tok) -> list[dict[str, Any]]:
    """Each ``--study-variants`` entry (``method+key=value+...``) prunes every linear of the studied layer
    from the fit statistics; records the relative output error on fit and val statistics and the CPU
    seconds of the solve (one process, ``--threads`` threads)."""
    from torch import nn

    from leanml.prune.base import Group, GroupStats
    from leanml.prune.cores.refine import row_output_errors
    from leanml.prune.masks import MaskSpec
    from leanml.prune.methods import pruner_class

    st = _layer_stats(args, model, tok)
    records = []
    for variant in args.study_variants.split(","):
        name, *opts = variant.split("+")
        pruner = pruner_class(name)(**{k: type_of(v) for k, v in (o.split("=") for o in opts)})
        spec = pruner.resolve_spec(MaskSpec(0.5) if args.study_pattern is None
                                   else MaskSpec(pattern=args.study_pattern))
        fit_e = val_e = fit_d = val_d = 0.0
        cpu = wall = 0.0
        per: dict[str, dict[str, float]] = {}
        for names in st["groups"]:
            leader = names[0]
            linears = {}
            for n in names:
                W = st["weights"][n]
                lin = nn.Linear(W.shape[1], W.shape[0], bias=False)
                lin.weight.data.copy_(W)
                linears[n] = lin
            f = st["fit"][leader]
            stats = GroupStats(H=f["H"], G=f["G"], Hd=None, ntokens=f["ntokens"], mean=None,
                               out_sq={n: ((st["weights"][n] @ f["Hd"]) * st["weights"][n]).sum(1) for n in names})
            if not pruner.needs_dense:
                stats = GroupStats(H=f["H"], ntokens=f["ntokens"])
            t0, c0 = time.perf_counter(), time.process_time()
            pruner.prune_group(Group(leader, linears), stats, spec)
            wall += time.perf_counter() - t0
            cpu += time.process_time() - c0
            for n in names:
                W, Wn = st["weights"][n], linears[n].weight.data
                errs = {}
                for split in ("fit", "val"):
                    s_ = st[split][leader]
                    dc = ((W @ s_["Hd"]) * W).sum(1)
                    errs[split] = (float(row_output_errors(Wn, s_["H"], W @ s_["G"], dc).sum()), float(dc.sum()))
                per[n] = {"fit": errs["fit"][0] / errs["fit"][1], "val": errs["val"][0] / errs["val"][1],
                          "sparsity": float((Wn == 0).float().mean())}
                fit_e += errs["fit"][0]
                fit_d += errs["fit"][1]
                val_e += errs["val"][0]
                val_d += errs["val"][1]
        rec = {"kind": "solver", "variant": variant, "method_config": pruner.config(), "layer": st["layer"],
               "pattern": args.study_pattern and f"{args.study_pattern[0]}:{args.study_pattern[1]}",
               "nsamples": args.nsamples, "seqlen": args.seqlen, "val_windows": args.study_val,
               "fit_rel_error": fit_e / fit_d, "val_rel_error": val_e / val_d,
               "mean_val_rel_error": sum(p["val"] for p in per.values()) / len(per),
               "per_linear": per, "solve_wall_s": wall, "solve_cpu_s": cpu, "threads": torch.get_num_threads(),
               "load": os.getloadavg()[0], "rev": args.rev or _git_rev(),
               "command": "python bench/prune_speed.py " + " ".join(sys.argv[1:])}
        print(f"{variant:50s} fit {rec['fit_rel_error']:.5f} val {rec['val_rel_error']:.5f} "
              f"mean val {rec['mean_val_rel_error']:.5f} cpu {cpu:.1f}s wall {wall:.1f}s", flush=True)
        records.append(rec)
    return records


def key(r: dict[str, Any]) -> tuple:
    return (r["code"], r["rev"], r["method"], r["mode"], r["layers_pruned"], r["nsamples"], r["seqlen"],
            r.get("eval_split"))


def render(records: list[dict[str, Any]]) -> str:
    from leanml.machine import machine_line

    recs = sorted(records, key=lambda r: (-r["layers_pruned"], r["nsamples"], r["method"], r["code"] != "before",
                                          r["mode"]))
    lines = ["# Pruning time by phase (`bench/prune_speed.py`)", "",
             f"Machine: {machine_line()}. SmolLM2-135M, 50 % unstructured, calibration windows of 512 tokens "
             "from the Shakespeare calibration plays (seed 0); every run alone under the CPU lock. Seconds are "
             "wall time per phase summed over the pruned layers; `cpu s` is the process's CPU time (all threads). "
             "`before` is the committed engine a change was measured against (`--code before`, the revision in "
             "brackets; the oldest reports have no `forward`/`report` split: that time is inside `other`).", "",
             "Commands: " + "; ".join(f"`{c}`" for c in dict.fromkeys(r["command"] for r in recs)) + ".", "",
             "`val ppl`: perplexity of the pruned model on the whole validation split (two held-out plays, "
             "never used for calibration or testing), where measured; `reviews val`: on the reviews' "
             "validation split (Women's Clothing reviews before the test split), where measured. "
             "`rel err`: the pruned layers' relative "
             "output error against the dense model (the engine's `rel_output_error`), mean over layers, where "
             "recorded.", "",
             "| code | method | mode | layers | calibration | wall s | cpu s | " + " | ".join(PHASES) +
             " | rel err | val ppl | reviews val | threads | load |",
             "|---|---|---|---:|---|---:|---:|" + "---:|" * len(PHASES) + "---:|---:|---:|---:|---|"]
    for r in recs:
        mode = r["mode"] + ("" if r["mode"] != "default" else f" ({'intra' if r['intra_layer'] else 'one-pass'})")
        lines.append(f"| {r['code']} ({r['rev']}) | {r['method']} | {mode} | {r['layers_pruned']} | "
                     f"{r['nsamples']} x {r['seqlen']} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | "
                     + " | ".join("-" if r[p + "_s"] is None else f"{r[p + '_s']:.1f}" for p in PHASES)
                     + (f" | {r['rel_output_error_mean']:.4f}" if "rel_output_error_mean" in r else " | -")
                     + (f" | {r['ppl']:.2f}" if "ppl" in r else " | -")
                     + (f" | {r['reviews_ppl']:.2f}" if "reviews_ppl" in r else " | -")
                     + f" | {r['threads']} | {r['load_before']:.1f} / {r['load_after']:.1f} |")
    return "\n".join(lines) + "\n"


SOLVER_JSON = RESULTS / "prune_speed_solver.json"


def _solver_key(r: dict[str, Any]) -> tuple:
    return (r["variant"], r["layer"], r["pattern"], r["nsamples"], r["seqlen"], r["val_windows"])


def render_solver(records: list[dict[str, Any]]) -> str:
    from leanml.machine import machine_line

    recs = sorted(records, key=lambda r: (r["layer"], r["pattern"] or "", r["variant"]))
    lines = ["# FISTA solver settings at the operator level (`bench/prune_speed.py --solver-study`)", "",
             f"Machine: {machine_line()}. SmolLM2-135M: the layers before the studied one pruned by SparseGPT (50 %); "
             "every linear of the studied layer pruned from statistics of the calibration windows (fit); the error "
             "is the relative output error against the dense model, `sum ||W* x* - W x||^2 / sum ||W x||^2` over the "
             "layer's linears, on the fit windows and on the first windows of the validation split (two held-out "
             "plays, never used for calibration or testing). Solve seconds: the solver alone, one process.", "",
             "Commands: " + "; ".join(f"`{c}`" for c in dict.fromkeys(r["command"] for r in recs)) + ".", "",
             "| layer | pattern | calibration | val windows | variant | fit error | val error | mean val error "
             "(per linear) | solve cpu s | solve wall s | threads | load |",
             "|---:|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in recs:
        lines.append(f"| {r['layer']} | {r['pattern'] or '50%'} | {r['nsamples']} x {r['seqlen']} | "
                     f"{r['val_windows']} | "
                     f"`{r['variant']}` | {r['fit_rel_error']:.5f} | {r['val_rel_error']:.5f} | "
                     f"{r['mean_val_rel_error']:.5f} | {r['solve_cpu_s']:.1f} | {r['solve_wall_s']:.1f} | "
                     f"{r['threads']} | {r['load']:.1f} |")
    return "\n".join(lines) + "\n"


def main_solver_study(args: argparse.Namespace) -> int:
    from leanml.outputs import write_json

    records = json.loads(SOLVER_JSON.read_text()) if SOLVER_JSON.exists() else []
    if not args.render_only:
        from leanml.models import load_model

        model, tok = load_model("smollm2-135m")
        for rec in solver_study(args, model, tok):
            records = [r for r in records if _solver_key(r) != _solver_key(rec)] + [rec]
            write_json(SOLVER_JSON, records)
    (RESULTS / "prune_speed_solver.md").write_text(render_solver(records))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default="sparsegpt:default", help="comma list of method:mode (mode: default, intra, "
                    "one-pass)")
    ap.add_argument("--layers", type=int, default=None, help="prune only the first N layers (default: all)")
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--code", default="after", help="label of the code under test (before / after)")
    ap.add_argument("--rev", default=None, help="revision of the code under test (default: git of leanml)")
    ap.add_argument("--eval", default=None, choices=["val"],
                    help="also measure perplexity on this split of Shakespeare (val: two held-out plays) and of "
                    "the reviews")
    ap.add_argument("--torchrun", type=int, default=0,
                    help="run each method layer-parallel with this many processes through the CLI instead")
    ap.add_argument("--solver-study", action="store_true",
                    help="operator-level study of solver settings on one layer (fit: calibration, error: val split)")
    ap.add_argument("--study-layer", type=int, default=5, help="decoder layer of the solver study (default 5)")
    ap.add_argument("--study-val", type=int, default=32, help="val-split windows of the solver study (default 32)")
    ap.add_argument("--study-variants", default="sparsegpt,fista",
                    help="comma list of method+key=value+... (e.g. fista+refine=10+refine_method=cg)")
    ap.add_argument("--study-pattern", default=None,
                    help="N:M pattern of the solver study (default 50 %% unstructured)")
    ap.add_argument("--render-only", action="store_true")
    args = ap.parse_args()
    if args.study_pattern:
        from leanml.prune.masks import parse_pattern

        args.study_pattern = parse_pattern(args.study_pattern)
    torch.set_num_threads(args.threads)
    if args.solver_study:
        return main_solver_study(args)
    path = RESULTS / "prune_speed.json"
    records = json.loads(path.read_text()) if path.exists() else []
    if not args.render_only:
        from leanml.data.text import calibration_windows
        from leanml.models import load_model
        from leanml.outputs import write_json

        if not args.torchrun:
            model, tok = load_model("smollm2-135m")
            args.tokenizer = tok
            calib = calibration_windows(tok, "shakespeare", args.nsamples, args.seqlen, 0)
        for item in args.runs.split(","):
            method, mode = item.split(":")
            rec = run_torchrun(method, args) if args.torchrun else run(method, mode, args, model, calib)
            print(json.dumps(rec), flush=True)
            records = [r for r in records if key(r) != key(rec)] + [rec]
            write_json(path, records)
    (RESULTS / "prune_speed.md").write_text(render(records))
    print(render(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
