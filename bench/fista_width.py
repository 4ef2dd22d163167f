"""FISTA at width: the layer-wise objective each preset reaches against a converged reference, and the
iterations it used, on SmolLM2's real statistics and on the 360M / 1.1B / 3B shapes.

For each operator shape (m outputs x n inputs) the script builds the statistics ``H`` of ``--tokens``
calibration tokens, prunes a ``--rows`` subset of the weight's rows (the problem separates by row, so the
subset's objective is exact for those rows) with each preset and with the converged reference of the same
settings (K 200 FISTA iterations, 200 refit iterations, float64 products), and records the objective reached
(the output error FISTA minimises, ridge included), the iterations used and the CPU-seconds. SparseGPT's
objective on the same rows is the yardstick. Shapes:

- ``smollm2``: SmolLM2-135M's q_proj / o_proj / gate_proj / down_proj of layers 2, 11 and 25 on real
  activations (``--nsamples`` x 512 tokens of the Shakespeare calib split, dense model);
- ``360m``, ``1.1b``, ``3b``: the attention and MLP shapes of SmolLM2-360M, TinyLlama-1.1B and Llama-3.2-3B
  with synthetic activations that have LLM-like feature scales (log-normal, a few features 50x louder) and
  Gaussian weights; no real weights of these sizes are offline.

    python bench/fista_width.py                       # every shape, both presets, 50 % and 2:4
    python bench/fista_width.py --render-only

Writes ``bench/results/fista_width.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
from leanml.machine import machine_info  # noqa: E402
from leanml.outputs import atomic_file, write_json  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "fista_width.json"
#: name -> (hidden, mlp) of the synthetic shapes
SHAPES = {"360m": (960, 2560), "1.1b": (2048, 5632), "3b": (3072, 8192)}
REFERENCE = {"iters": 200, "refine": 200, "tol": 0.0}
TARGET = 0.01  # a preset's objective within 1 % of the converged reference's


def cpu() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def synthetic(name: str, tokens: int, seed: int) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(operator, W, H) for the attention (hidden x hidden) and MLP (mlp x hidden, hidden x mlp) shapes."""
    hidden, mlp = SHAPES[name]
    g = torch.Generator().manual_seed(seed)
    out = []
    for op, (m, n) in (("q_proj", (hidden, hidden)), ("gate_proj", (mlp, hidden)), ("down_proj", (hidden, mlp))):
        scale = torch.exp(1.0 * torch.randn(n, generator=g))
        scale[torch.randperm(n, generator=g)[: max(1, n // 500)]] *= 50.0  # a few loud features
        X = torch.randn(tokens, n, generator=g) * scale
        H = X.T @ X / tokens
        W = torch.randn(m, n, generator=g) / n**0.5
        out.append((f"{name}.{op}", W, H))
    return out


def smollm2(nsamples: int, seed: int) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(operator, W, H) of SmolLM2-135M layers 2, 11, 25 on real activations of the dense model."""
    from leanml.data.text import calibration_windows
    from leanml.models import bundled_dir, load_model

    model, tok = load_model(str(bundled_dir("smollm2-135m")))
    ids = calibration_windows(tok, "shakespeare", nsamples, 512, seed=seed)
    mods = {}
    for li in (2, 11, 25):
        layer = model.model.layers[li]
        for op, mod in (("q_proj", layer.self_attn.q_proj), ("o_proj", layer.self_attn.o_proj),
                        ("gate_proj", layer.mlp.gate_proj), ("down_proj", layer.mlp.down_proj)):
            mods[f"smollm2.{li}.{op}"] = mod
    acc: dict[str, list] = {k: [None, 0] for k in mods}

    def hook(key: str):
        def fn(_m, inp):
            x = inp[0].reshape(-1, inp[0].shape[-1]).double()
            acc[key][0] = x.T @ x if acc[key][0] is None else acc[key][0] + x.T @ x
            acc[key][1] += x.shape[0]
        return fn

    handles = [m.register_forward_pre_hook(hook(k)) for k, m in mods.items()]
    with torch.no_grad():
        for i in range(0, ids.shape[0], 4):
            model(ids[i:i + 4])
    for h in handles:
        h.remove()
    return [(k, mods[k].weight.data.clone().float(), (acc[k][0] / acc[k][1]).float()) for k in mods]


def solve(W: torch.Tensor, H: torch.Tensor, spec: Any, options: Any, low: torch.dtype | None,
          dtype: torch.dtype) -> dict[str, Any]:
    """One preset (or the reference) on one operator: objective, iterations, CPU-seconds."""
    from leanml.prune.cores.fista import FistaProblem, fista_prune
    from leanml.prune.cores.sparsegpt import hinv_upper, sparsegpt_prune
    from leanml.prune.cores.wanda import wanda_prune

    Wd, Hd = W.to(dtype), H.to(dtype)
    c0 = cpu()
    if options.warm_start == "sparsegpt":
        start = sparsegpt_prune(Wd, Hd, spec, U=hinv_upper(Hd, 0.01)[0])
    else:
        start = wanda_prune(Wd, torch.diagonal(Hd), spec)
    res = fista_prune(Wd, Hd, spec, options, FistaProblem(W_start=start), low_dtype=low)
    return {"objective": float(res.error.sum()), "start_objective": float(res.start_error.sum()),
            "fista_iters": sum(res.fista_iters), "refine_iters_used": res.refine_iters_used, "cpu_seconds": cpu() - c0}


def run_operator(op: str, W: torch.Tensor, H: torch.Tensor, args: argparse.Namespace) -> list[dict[str, Any]]:
    from leanml.prune.cores.sparsegpt import hinv_upper, sparsegpt_prune
    from leanml.prune.masks import MaskSpec
    from leanml.prune.methods.fista import FistaOptions, solve_low_dtype

    rows = torch.randperm(W.shape[0], generator=torch.Generator().manual_seed(0))[: args.rows].sort().values
    W = W[rows]
    out = []
    for pattern in args.patterns:
        spec = MaskSpec(0.5, (2, 4) if pattern == "2:4" else None, "row")
        sg = sparsegpt_prune(W, H, spec, U=hinv_upper(H, 0.01)[0])
        D = (sg.double() - W.double())
        sg_obj = float(((D @ H.double()) * D).sum())
        for preset in args.presets:
            o = FistaOptions(preset=preset)
            low = solve_low_dtype(o.precision, torch.device("cpu"))
            got = solve(W, H, spec, o, low, torch.float32)
            ref_o = FistaOptions(**{**{k: getattr(o, k) for k in ("warm_start", "correction", "refit_start")},
                                    **REFERENCE})
            ref = solve(W, H, spec, ref_o, None, torch.float64)
            rec = {"operator": op, "shape": [int(W.shape[0]), int(W.shape[1])], "rows": int(W.shape[0]),
                   "width": int(W.shape[1]), "pattern": pattern, "preset": preset, **got,
                   "reference_objective": ref["objective"], "reference_cpu_seconds": ref["cpu_seconds"],
                   "gap": got["objective"] / ref["objective"] - 1.0, "sparsegpt_objective_no_ridge": sg_obj,
                   "product_dtype": str(low or torch.float32).removeprefix("torch.")}
            print(f"{op:24s} {pattern:4s} {preset:8s} gap {100 * rec['gap']:+.3f} %  K {got['fista_iters']} "
                  f"refit {got['refine_iters_used']:.1f}  {got['cpu_seconds']:.2f} CPU-s", flush=True)
            out.append(rec)
    return out


def render_markdown(records: list[dict[str, Any]]) -> str:
    m = records[0]["machine"] if records else {}
    lines = ["# FISTA at width: objective against a converged reference", "",
             "Generated by `bench/fista_width.py` from `fista_width.json`. Per operator, a subset of rows pruned by "
             "each preset and by the converged reference of the same settings (K 200, refit 200, float64); gap = "
             "preset objective / reference objective - 1 (the objective FISTA minimises: output error plus the "
             f"ridge). Target: every gap within {100 * TARGET:.0f} %.", "",
             f"Machine: {m.get('cpu')}, {m.get('cores_available')} cores, torch {m.get('torch')}.", "",
             "| shape | width n | pattern | preset | gap mean | gap max | FISTA iters | refit iters "
             "| CPU-s per 100 rows | within 1 % |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in records:
        shape = "smollm2" if r["operator"].startswith("smollm2") else r["operator"].rsplit(".", 1)[0]
        groups.setdefault((shape, r["width"], r["pattern"], r["preset"]), []).append(r)
    for (shape, n, pattern, preset), rs in sorted(groups.items(),
                                                  key=lambda kv: (kv[0][0] != "smollm2", kv[0][1], kv[0][2], kv[0][3])):
        gaps = [r["gap"] for r in rs]
        lines.append(f"| {shape} | {n} | {pattern} | {preset} | {100 * statistics.fmean(gaps):+.3f} % | "
                     f"{100 * max(gaps):+.3f} % | {statistics.fmean(r['fista_iters'] for r in rs):.1f} | "
                     f"{statistics.fmean(r['refine_iters_used'] for r in rs):.1f} | "
                     f"{statistics.fmean(100 * r['cpu_seconds'] / r['rows'] for r in rs):.2f} | "
                     f"{'yes' if max(gaps) <= TARGET else 'NO'} |")
    return "\n".join(lines) + "\n"


def plot(records: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for (pattern, preset) in sorted({(r["pattern"], r["preset"]) for r in records}):
        rs = sorted((r for r in records if r["pattern"] == pattern and r["preset"] == preset), key=lambda r: r["width"])
        label = f"{preset}, {pattern}"
        axes[0].plot([r["width"] for r in rs], [100 * r["gap"] for r in rs], "o", label=label, alpha=0.7)
        axes[1].plot([r["width"] for r in rs], [r["refine_iters_used"] for r in rs], "o", label=label, alpha=0.7)
    axes[0].axhline(100 * TARGET, color="k", ls="--", lw=1)
    axes[0].set_ylabel("objective gap to the converged reference (%)")
    axes[1].set_ylabel("refit iterations used (mean per block)")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("input width n")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="smollm2,360m,1.1b,3b")
    ap.add_argument("--presets", default="default,fast")
    ap.add_argument("--patterns", default="50%,2:4")
    ap.add_argument("--rows", type=int, default=256, help="rows of each operator pruned (a random subset)")
    ap.add_argument("--tokens", type=int, default=4096, help="calibration tokens of the synthetic shapes")
    ap.add_argument("--nsamples", type=int, default=16, help="SmolLM2 calibration windows of 512 tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--results", default=str(RESULTS))
    ap.add_argument("--render-only", action="store_true")
    args = ap.parse_args(argv)
    args.presets = [p for p in args.presets.split(",") if p]
    args.patterns = [p for p in args.patterns.split(",") if p]
    results = Path(args.results)
    records = _common.load_json(results, [])
    if not args.render_only:
        torch.set_num_threads(args.threads)
        info = {**machine_info(), "cores_available": len(__import__("os").sched_getaffinity(0))}
        for shape in [s for s in args.shapes.split(",") if s]:
            with _common.cpu_lock():
                ops = smollm2(args.nsamples, 0) if shape == "smollm2" else synthetic(shape, args.tokens, 0)
                new = []
                for op, W, H in ops:
                    for r in run_operator(op, W, H, args):
                        new.append({**r, "machine": info, "date": time.strftime("%Y-%m-%d %H:%M:%S")})
            key = _common.key_of(("operator", "pattern", "preset"))
            records = _common.merge_records(_common.load_json(results, []), new, key, keep_place=True)
            write_json(results, records)
    with atomic_file(results.with_suffix(".md")) as tmp:
        tmp.write_text(render_markdown(records))
    with atomic_file(results.with_suffix(".png"), suffix=".png") as tmp:
        plot(records, tmp)
    print(results.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
