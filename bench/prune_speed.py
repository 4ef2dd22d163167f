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
        return subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip() or "?"
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
    scope = getattr(pruner, "default_scope", "row")
    kwargs: dict[str, Any] = {"batch_size": args.batch_size, "progress": False}
    if mode != "default":
        kwargs["intra_layer"] = mode == "intra"
    if args.layers is not None:
        kwargs["layers"] = list(range(args.layers))
    m = copy.deepcopy(model)
    load = os.getloadavg()[0]
    t0, c0 = time.perf_counter(), time.process_time()
    report = prune_model(m, calib, pruner, MaskSpec(0.5, None, scope), **kwargs)
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
    return {**quality,
        "code": args.code, "rev": args.rev or _git_rev(), "method": method,
        "method_config": report.get("method_config"), "mode": mode,
        "intra_layer": report["engine"].get("intra_layer"), "layers_pruned": len(layers),
        "nsamples": args.nsamples, "seqlen": args.seqlen, "batch_size": args.batch_size,
        "wall_s": wall, "cpu_s": cpu, **{f"{k}_s": v for k, v in phases.items()},
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
              "stats": sum(lay["stats_seconds"] for lay in layers), "solve": sum(lay["prune_seconds"] for lay in layers),
              "forward": sum(lay["forward_seconds"] for lay in layers),
              "report": sum(lay["report_seconds"] for lay in layers)}
    phases["other"] = None  # the phases of two processes overlap in time
    return {"code": args.code, "rev": args.rev or _git_rev(), "method": method, "method_config": report["method_config"],
            "mode": f"torchrun x{args.torchrun}", "intra_layer": report["engine"]["intra_layer"],
            "layers_pruned": len(layers), "nsamples": args.nsamples, "seqlen": args.seqlen,
            "batch_size": args.batch_size, "wall_s": wall,
            "cpu_s": (c1.ru_utime + c1.ru_stime) - (c0.ru_utime + c0.ru_stime),
            "rank_seconds": report.get("rank_seconds"), **{f"{k}_s": v for k, v in phases.items()},
            "threads": f"{args.torchrun} x {max(1, args.threads // args.torchrun)}", "load_before": load,
            "load_after": os.getloadavg()[0], "command": "python bench/prune_speed.py " + " ".join(sys.argv[1:])}


def key(r: dict[str, Any]) -> tuple:
    return (r["code"], r["method"], r["mode"], r["layers_pruned"], r["nsamples"], r["seqlen"], r.get("eval_split"))


def render(records: list[dict[str, Any]]) -> str:
    from leanml.utils import machine_line

    recs = sorted(records, key=lambda r: (-r["layers_pruned"], r["nsamples"], r["method"], r["code"] != "before",
                                          r["mode"]))
    lines = ["# Pruning time by phase (`bench/prune_speed.py`)", "",
             f"Machine: {machine_line()}. SmolLM2-135M, 50 % unstructured, calibration windows of 512 tokens "
             "from the Shakespeare calibration plays (seed 0); every run alone under the CPU lock. Seconds are "
             "wall time per phase summed over the pruned layers; `cpu s` is the process's CPU time (all threads). "
             "`before` is the engine before this change (its `forward` and `report` time is inside `other`).", "",
             "Commands: " + "; ".join(f"`{c}`" for c in dict.fromkeys(r["command"] for r in recs)) + ".", "",
             "`val ppl`: perplexity of the pruned model on the whole validation split (two held-out plays, "
             "never used for calibration or testing), where measured.", "",
             "| code | method | mode | layers | calibration | wall s | cpu s | " + " | ".join(PHASES) +
             " | val ppl | threads | load |", "|---|---|---|---:|---|---:|---:|" + "---:|" * len(PHASES) + "---:|---:|---|"]
    for r in recs:
        mode = r["mode"] + ("" if r["mode"] != "default" else f" ({'intra' if r['intra_layer'] else 'one-pass'})")
        lines.append(f"| {r['code']} ({r['rev']}) | {r['method']} | {mode} | {r['layers_pruned']} | "
                     f"{r['nsamples']} x {r['seqlen']} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | "
                     + " | ".join("-" if r[p + "_s"] is None else f"{r[p + '_s']:.1f}" for p in PHASES)
                     + (f" | {r['ppl']:.2f}" if "ppl" in r else " | -")
                     + f" | {r['threads']} | {r['load_before']:.1f} / {r['load_after']:.1f} |")
    return "\n".join(lines) + "\n"


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
                    help="also measure perplexity on this Shakespeare split (val: two held-out plays)")
    ap.add_argument("--torchrun", type=int, default=0,
                    help="run each method layer-parallel with this many processes through the CLI instead")
    ap.add_argument("--render-only", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = RESULTS / "prune_speed.json"
    records = json.loads(path.read_text()) if path.exists() else []
    if not args.render_only:
        from leanml.data.text import calibration_windows
        from leanml.models import load_model
        from leanml.utils import write_json

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
