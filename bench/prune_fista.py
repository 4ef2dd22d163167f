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
    spec = MaskSpec(0.5, nm)  # the scope is left to the method (the engine resolves it)
    # the engine stops after the last layer it prunes: pruning the first n layers costs n layers
    subset = None if n_layers is None else list(range(n_layers))
    t0 = time.perf_counter()
    report = prune_model(model, calib_ids, pruner, spec, intra_layer=intra_layer, batch_size=batch_size,
                         layers=subset)
    seconds = time.perf_counter() - t0
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
    if args.refine is not None:
        fista["refine"] = args.refine
    if args.only in ("main", "all"):
        for pattern in ("unstructured", "2:4"):
            plan.append({"experiment": "main", "method": "fista", "pattern": pattern, "warm_start": "sparsegpt"})
            if not args.skip_sparsegpt:
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
        # the reference point of every table below is one run: intra-layer on, K=20, T=3 (dense start;
        # with the SparseGPT start it is the seed-0 FISTA run above); the report reuses it
        plan.append({"experiment": "intra_layer", "method": "fista", "pattern": "unstructured",
                     "warm_start": "sparsegpt", "intra_layer": False, "n_layers": n})  # fmt: skip
        for intra in (True, False):
            plan.append({"experiment": "intra_layer", "method": "fista", "pattern": "unstructured",
                         "warm_start": "dense", "intra_layer": intra, "n_layers": n})  # fmt: skip
        for k in (5, 10, 40):
            plan.append({"experiment": "K", "method": "fista", "pattern": "unstructured", "warm_start": "dense",
                         "fista": {"iters": k, "rounds": args.rounds}, "n_layers": n})  # fmt: skip
        for t in (1, 2, 5):
            plan.append({"experiment": "T", "method": "fista", "pattern": "unstructured", "warm_start": "dense",
                         "fista": {"iters": args.iters, "rounds": t}, "n_layers": n})  # fmt: skip
    if args.methods:
        plan = [p for p in plan if p["method"] in args.methods.split(",")]
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


def _operator_stats(
    dense, tok, s: dict[str, Any], seed: int, layer: int, holdout: int, target: str = "qkv"
) -> dict[str, Any]:
    """Statistics of ``layer``'s attention input projections (``target="qkv"``: q, k, v stacked) or of
    its MLP down projection (``"down"``) after SparseGPT pruned the layers before it: fit statistics
    from ``nsamples - holdout`` calibration windows, held-out statistics from the other ``holdout``
    windows (the same seeded draw)."""
    from leanml.data.text import calibration_windows
    from leanml.prune.engine import prune_model
    from leanml.prune.masks import MaskSpec
    from leanml.prune.methods.baselines import SparseGPTPruner

    ids = calibration_windows(tok, s["calib"], s["nsamples"], s["seqlen"], seed)
    fit, held = ids[: len(ids) - holdout], ids[len(ids) - holdout :]
    from leanml.models.layout import get_adapter

    trunc = copy.deepcopy(dense)
    del get_adapter(trunc).layers()[layer + 1 :]  # nothing after the studied layer is needed
    ref = copy.deepcopy(trunc)
    prune_model(trunc, fit, SparseGPTPruner(), MaskSpec(0.5, None, "layer"), layers=list(range(layer)), progress=False)

    def stats(x_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        box: dict[str, list[torch.Tensor]] = {"pruned": [], "dense": []}
        hooks = [
            get_adapter(m).layers()[layer].get_submodule("self_attn.q_proj" if target == "qkv" else "mlp.down_proj")
            .register_forward_pre_hook(
                lambda _m, a, k=key: box[k].append(a[0].reshape(-1, a[0].shape[-1]).float())
            )
            for m, key in ((trunc, "pruned"), (ref, "dense"))
        ]
        with torch.no_grad():
            for start in range(0, len(x_ids), 8):
                trunc(input_ids=x_ids[start : start + 8])
                ref(input_ids=x_ids[start : start + 8])
        for h in hooks:
            h.remove()
        xs, x = torch.cat(box["pruned"]), torch.cat(box["dense"])
        n = len(xs)
        return {"H": xs.T @ xs / n, "G": x.T @ xs / n, "Hd": x.T @ x / n}

    studied = get_adapter(dense).layers()[layer]
    names = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"] if target == "qkv" else ["mlp.down_proj"]
    W = torch.cat([studied.get_submodule(n).weight.data for n in names]).float()
    return {"W": W, "fit": stats(fit), "held": stats(held)}


def operator_ablation(dense, tok, s: dict[str, Any], args) -> list[dict[str, Any]]:
    """Operator-level ablations: held-out relative output error of layer ``--operator-layer``'s q/k/v."""
    from leanml.prune.cores.fista import FistaProblem, fista_prune
    from leanml.prune.cores.magnitude import magnitude_prune
    from leanml.prune.cores.sparsegpt import sparsegpt_prune
    from leanml.prune.cores.wanda import wanda_prune
    from leanml.prune.masks import MaskSpec

    base = {"iters": 20, "rounds": 3, "xi": 0.3, "lam": 1e-3, "precondition": True, "refine_iters": 0,
            "lambda_scope": "row", "damp": 0.0, "refine_method": "apg", "correction": 1.0, "ridge": 0.0,
            "tol": 0.0, "refit_start": True}  # the settings this study ran with  # fmt: skip
    variants: list[tuple[str, str, dict[str, Any]]] = [("default", "", {})]
    variants += [("K", str(k), {"iters": k}) for k in (5, 10, 40)]
    variants += [("T", str(t), {"rounds": t}) for t in (1, 2, 5)]
    variants += [("xi", str(x), {"xi": x}) for x in (0.1, 1.0)]
    variants += [("lambda0", str(x), {"lam": x}) for x in (1e-4, 1e-2)]
    variants += [("precondition", "off", {"precondition": False}), ("refine", "20", {"refine_iters": 20}),
                 ("lambda_scope", "layer", {"lambda_scope": "layer"}), ("damp", "0.01", {"damp": 0.01}),
                 ("mask_scope", "layer", {}), ("mask_scope", "layer, refine 20", {"refine_iters": 20})]  # fmt: skip
    out: list[dict[str, Any]] = []
    for seed in args.operator_seeds:
        st = _operator_stats(dense, tok, s, seed, args.operator_layer, args.operator_holdout)
        W, fit, held = st["W"], st["fit"], st["held"]
        for pattern in (None, (2, 4)):
            spec_row = MaskSpec(0.5, pattern, "row")
            pname = "2:4" if pattern else "unstructured"
            t0 = time.perf_counter()
            sg = sparsegpt_prune(W, fit["H"], MaskSpec(0.5, pattern, "layer"))  # SparseGPT's default scope
            sg_s = time.perf_counter() - t0
            starts = {"dense": W, "sparsegpt": sg}
            common = {"seed": seed, "pattern": pname}
            out.append({**common, "method": "sparsegpt", "ablation": "-", "value": "-", "seconds": sg_s,
                        "fit_error": _rel_err(sg, W, fit), "heldout_error": _rel_err(sg, W, held)})  # fmt: skip
            for name, Wn in (("magnitude", magnitude_prune(W, spec_row)),
                             ("wanda", wanda_prune(W, torch.diagonal(fit["H"]), spec_row))):  # fmt: skip
                out.append({**common, "method": name, "ablation": "-", "value": "-", "seconds": 0.0,
                            "fit_error": _rel_err(Wn, W, fit), "heldout_error": _rel_err(Wn, W, held)})  # fmt: skip
            for warm, Ws in starts.items():
                for abl, val, kw in variants:
                    if seed != args.operator_seeds[0] and abl != "default":
                        continue
                    if pattern is not None and abl not in ("default", "K", "T", "refine"):
                        continue
                    cfg = {**base, **kw}
                    spec = spec_row
                    if abl == "mask_scope":  # one threshold per matrix; the SparseGPT start uses the same scope
                        spec = MaskSpec(0.5, pattern, "layer")
                        Ws = sg if warm == "sparsegpt" else W
                    t0 = time.perf_counter()
                    res = fista_prune(W, fit["H"], spec, _options(cfg),
                                      FistaProblem(G=fit["G"], Hd=fit["Hd"], W_start=Ws))
                    sec = time.perf_counter() - t0 + (sg_s if warm == "sparsegpt" else 0.0)
                    out.append({**common, "method": f"fista/{warm}", "ablation": abl, "value": val, "seconds": sec,
                                "fit_error": _rel_err(res.W, W, fit),
                                "heldout_error": _rel_err(res.W, W, held)})  # fmt: skip
                    print(out[-1], flush=True)
    return out


def _options(fields: dict[str, Any]) -> Any:
    """FistaOptions with ``fields`` changed (``refine_iters`` names ``refine``)."""
    from leanml.prune.methods.fista import FistaOptions

    fields = dict(fields)
    if "refine_iters" in fields:
        fields["refine"] = fields.pop("refine_iters")
    return FistaOptions(**fields)


def _rel_err(Wn: torch.Tensor, W: torch.Tensor, st: dict[str, torch.Tensor]) -> float:
    """||Wn X* - W X||^2 / ||W X||^2 from the statistics H = X*X*^T, G = X X*^T, Hd = X X^T."""
    t1 = torch.einsum("ij,jk,ik->", Wn, st["H"], Wn)
    t2 = torch.einsum("ij,jk,ik->", W, st["G"], Wn)
    t3 = torch.einsum("ij,jk,ik->", W, st["Hd"], W)
    return float((t1 - 2 * t2 + t3) / t3)


def calib_size_study(dense, tok, s: dict[str, Any], args) -> list[dict[str, Any]]:
    """Why FISTA's lead over SparseGPT shrinks from calibration to test: fit both on n calibration
    windows and measure the relative output error on held-out windows, for several n.

    Both methods use their leanml defaults (FISTA: SparseGPT warm start, K=20, T=3, refine 20, one
    threshold per matrix; SparseGPT: one threshold per matrix), on layer ``--operator-layer``'s q/k/v
    and down projection.
    """
    from leanml.prune.cores.fista import FistaProblem, fista_prune
    from leanml.prune.cores.sparsegpt import sparsegpt_prune
    from leanml.prune.masks import MaskSpec

    cfg = _options({})  # leanml prune --method fista's defaults
    out: list[dict[str, Any]] = []
    for target in ("qkv", "down"):
        for n_fit in args.calib_sizes:
            for seed in args.operator_seeds:
                st = _operator_stats(dense, tok, dict(s, nsamples=n_fit + args.operator_holdout), seed,
                                     args.operator_layer, args.operator_holdout, target)  # fmt: skip
                W, fit, held = st["W"], st["fit"], st["held"]
                for pattern in (None, (2, 4)):
                    spec = MaskSpec(0.5, pattern, "layer")
                    t0 = time.perf_counter()
                    sg = sparsegpt_prune(W, fit["H"], spec)
                    sg_s = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    fi = fista_prune(W, fit["H"], spec, cfg, FistaProblem(G=fit["G"], Hd=fit["Hd"], W_start=sg)).W
                    fi_s = time.perf_counter() - t0 + sg_s
                    row = {"target": target, "shape": list(W.shape), "fit_windows": n_fit, "seed": seed,
                           "pattern": "2:4" if pattern else "unstructured",
                           "sparsegpt_fit": _rel_err(sg, W, fit), "sparsegpt_heldout": _rel_err(sg, W, held),
                           "fista_fit": _rel_err(fi, W, fit), "fista_heldout": _rel_err(fi, W, held),
                           "sparsegpt_seconds": sg_s, "fista_seconds": fi_s}  # fmt: skip
                    out.append(row)
                    print(row, flush=True)
    return out


def calib_size_report(rows: list[dict[str, Any]], s: dict[str, Any], args, machine: str, command: str) -> str:
    lines = [f"## Calibration size: FISTA / SparseGPT error on fit and held-out windows (layer {args.operator_layer})",
             "", f"Machine: {machine}", "", f"Command: `{command}`", "",
             f"Each method fitted on n windows of {s['seqlen']} calibration tokens (layers before it pruned by "
             f"SparseGPT on the same windows), error measured on {args.operator_holdout} further windows of the "
             "same seeded draw. Relative output error against the dense layer; ratio < 1 means FISTA is better. "
             f"Seeds: {args.operator_seeds} (mean).", "",
             "| linear | pattern | fit windows | SparseGPT fit | FISTA fit | fit ratio | SparseGPT held-out | "
             "FISTA held-out | held-out ratio |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["target"], r["pattern"], r["fit_windows"]), []).append(r)
    for (target, pattern, n), rr in groups.items():
        m = {k: statistics.mean(r[k] for r in rr) for k in ("sparsegpt_fit", "fista_fit", "sparsegpt_heldout",
                                                             "fista_heldout")}  # fmt: skip
        name = f"{'q/k/v' if target == 'qkv' else 'down_proj'} {'x'.join(map(str, rr[0]['shape']))}"
        lines.append(f"| {name} | {pattern} | {n} | {m['sparsegpt_fit']:.5f} | {m['fista_fit']:.5f} | "
                     f"{m['fista_fit'] / m['sparsegpt_fit']:.3f} | {m['sparsegpt_heldout']:.5f} | "
                     f"{m['fista_heldout']:.5f} | {m['fista_heldout'] / m['sparsegpt_heldout']:.3f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def operator_report(rows: list[dict[str, Any]], s: dict[str, Any], args) -> str:
    seeds = sorted({r["seed"] for r in rows})
    lines = [f"## Operator-level ablations (layer {args.operator_layer} q/k/v, 960 x 576, after SparseGPT pruned "
             f"the layers before it; fit on {s['nsamples'] - args.operator_holdout} calibration windows, error on "
             f"{args.operator_holdout} held-out calibration windows of the same draw)", "",
             "Relative output error ||W* X* - W X||^2 / ||W X||^2 against the dense model (lower is better). "
             "This is a reduced setting chosen because full-model runs take hours on this shared machine.", ""]
    lines += ["| pattern | method | ablation | value | seeds | fit error | held-out error (mean +- std) | seconds |",
              "|---|---|---|---|---|---:|---:|---:|"]  # fmt: skip
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["pattern"], r["method"], r["ablation"], r["value"]), []).append(r)
    for (pattern, method, abl, val), rr in groups.items():
        ho = [r["heldout_error"] for r in rr]
        sd = statistics.stdev(ho) if len(ho) > 1 else 0.0
        lines.append(f"| {pattern} | {method} | {abl} | {val} | {len(rr)} | "
                     f"{statistics.mean(r['fit_error'] for r in rr):.5f} | {statistics.mean(ho):.5f} +- {sd:.5f} | "
                     f"{statistics.mean(r['seconds'] for r in rr):.1f} |")  # fmt: skip
    _ = seeds
    return "\n".join(lines) + "\n"


def _variant(r: dict[str, Any]) -> str | None:
    """How a FISTA record differs from the full-model baselines of ``bench/prune.py``."""
    parts = []
    if r.get("layers_pruned_request") is not None:
        parts.append(f"first {r['layers_pruned_request']} of 30 layers pruned (see prune_fista.md)")
    refine = r["method_config"].get("refine", 0)
    parts.append(f"refine {refine}" if refine else "paper procedure (refine 0)")
    if r["pattern"] == "unstructured":
        parts.append(f"per-{r['scope']} mask")
    return "; ".join(parts)


def _fista_records(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The main-comparison FISTA records in ``prune.json``'s format (with ``warm_start`` and ``variant``)."""
    keys = ("method", "warm_start", "pattern", "sparsity", "ppl", "seconds", "model", "calib", "nsamples", "seqlen",
            "eval_windows", "source", "method_config")  # fmt: skip
    return [
        {k: r[k] for k in keys} | {"layers_pruned": r["layers_pruned"], "intra_layer": r["intra_layer"],
                                   "variant": _variant(r)}  # fmt: skip
        for r in recs
        if r["experiment"] == "main" and r["method"] == "fista"
    ]


def merge_into_prune_json(records: list[dict[str, Any]], path: Path) -> None:
    """Add/replace the FISTA records in ``prune.json`` (``merge_records`` of ``bench/prune.py``, keyed by
    method, pattern, profile, seed and corpus); every other record (the baselines) is kept."""
    from leanml.outputs import write_json
    from prune import merge_records  # bench/prune.py

    write_json(path, merge_records(records, path))


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
    if main:
        n_main = main[0]["layers_pruned_request"]
        scope = "all 30 layers pruned" if n_main is None else f"reduced: only the first {n_main} of 30 layers pruned"
        lines += [f"## Main comparison ({scope})", "",
                  "| pattern | method | warm start | ppl | ppl / SparseGPT | seconds | seconds / SparseGPT |",
                  "|---|---|---|---:|---:|---:|---:|"]  # fmt: skip
        for pattern in ("unstructured", "2:4"):
            rows = [r for r in main if r["pattern"] == pattern]
            sg = next((r for r in rows if r["method"] == "sparsegpt"), None)
            for r in rows:
                refine = r["method_config"].get("refine", 0)
                warm = f"{r['warm_start']}, refine {refine}" if r.get("warm_start") else "-"
                if r.get("warm_start") and r["pattern"] == "unstructured":
                    warm += f", per-{r['scope']} mask"
                lines.append(
                    f"| {pattern if pattern == '2:4' else '50% unstructured'} | {r['method']} | {warm} "
                    f"| {r['ppl']:.3f} | {_fmt_ratio(r['ppl'], sg and sg['ppl'])} | {r['seconds']:.0f} "
                    f"| {_fmt_ratio(r['seconds'], sg and sg['seconds'])} |"
                )
        lines += ["", "Seconds are wall time of the pruning engine. These main-comparison runs shared the 2 cores "
                  "with other jobs (load 8-14), so their time ratios are indicative only; the operator-level "
                  "table below times the solvers alone.", ""]  # fmt: skip
    abl = [r for r in recs if r["experiment"] != "main"]
    if abl:
        n = abl[0]["layers_pruned_request"]
        lines += [f"## Ablations (reduced: only the first {n} of 30 layers pruned, 50% unstructured; "
                  f"perplexity of the whole model)", ""]  # fmt: skip
        seeds = [r for r in abl if r["experiment"] == "seeds"]
        if seeds:
            lines += ["| calibration seeds | method | ppl mean | ppl std | n | seconds mean |",
                      "|---|---|---:|---:|---:|---:|"]
            for method in ("sparsegpt", "fista"):
                rr = [r for r in seeds if r["method"] == method]
                if rr:
                    p = [r["ppl"] for r in rr]
                    sd = statistics.stdev(p) if len(p) > 1 else 0.0
                    lines.append(f"| {sorted(r['calib_seed'] for r in rr)} | {method} | {statistics.mean(p):.3f} "
                                 f"| {sd:.3f} | {len(p)} | "
                                 f"{statistics.mean(r['seconds'] for r in rr):.0f} |")  # fmt: skip
            lines.append("")
        ref_dense = next((r for r in abl if r["experiment"] == "intra_layer" and r["intra_layer"]
                          and r.get("warm_start") == "dense"), None)  # fmt: skip
        ref_sg = next((r for r in seeds if r["method"] == "fista" and r["calib_seed"] == s["seed"]), None)
        for exp, label in (("intra_layer", "intra-layer correction"), ("K", "K (iterations per round)"),
                           ("T", "T (lambda rounds)")):  # fmt: skip
            rr = [r for r in abl if r["experiment"] == exp]
            if not rr:
                continue
            shared = [ref_sg] if exp == "intra_layer" else [ref_dense]
            rr = [r for r in shared if r is not None and r not in rr] + rr
            key = {"K": "iters", "T": "rounds"}.get(exp)
            rr.sort(key=lambda r: (str(r.get("warm_start")), not r["intra_layer"]) if key is None
                    else r["method_config"][key])  # fmt: skip
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
    axes[0].bar(range(len(main)), [r["ppl"] for r in main],
                color=["C1" if r["method"] == "fista" else "C0" for r in main])
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


def report_only(args) -> int:
    """Combine the cached runs of every tag (not --quick) and the operator ablations into prune_fista.md."""
    runs: dict[str, Any] = {}
    caches = sorted(p for p in RESULTS.glob("prune_fista*.json")
                    if not any(t in p.name for t in ("quick", "operator", "calibsize")))
    base = None
    for path in caches:
        data = json.loads(path.read_text())
        base = base or data
        for key, rec in data.get("runs", {}).items():
            runs[key + json.dumps([rec["method_config"], rec["scope"]], sort_keys=True)] = rec
    if base is None:
        print("no cached runs")
        return 1
    recs = list(runs.values())
    md = write_report(recs, base["settings"], args, base["machine"], base["dense_ppl"])
    md = md.replace("Command:", "Combined by:", 1)
    sources = [f"- `{p.name}`: `.venv/bin/python bench/prune_fista.py "
               f"{json.loads(p.read_text()).get('command', '(not recorded)')}`"
               for p in caches]  # fmt: skip
    md = md.replace("\n\nCalibration:", "\n\nRuns from:\n" + "\n".join(sources) + "\n\nCalibration:", 1)
    for extra in ("prune_fista_operator.md", "prune_fista_calibsize.md"):
        if (RESULTS / extra).exists():
            md += "\n" + (RESULTS / extra).read_text()
    (RESULTS / "prune_fista.md").write_text(md)
    plot(recs, RESULTS / "prune_fista.png")
    fista_main = _fista_records(recs)
    if fista_main:
        merge_into_prune_json(fista_main, RESULTS / "prune.json")
    print(md)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["main", "ablations", "all", "operator", "calib-size"], default="all")
    ap.add_argument("--calib-sizes", type=int, nargs="+", default=[8, 24, 56],
                    help="with --only calib-size: calibration windows to fit on")
    ap.add_argument("--operator-layer", type=int, default=1, help="layer of the operator-level ablations")
    ap.add_argument("--operator-holdout", type=int, default=8, help="held-out calibration windows")
    ap.add_argument("--operator-seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--quick", action="store_true", help="4 layers, 8 x 256 calibration, 4 eval windows")
    ap.add_argument("--iters", type=int, default=20, help="K for the main comparison (default 20)")
    ap.add_argument("--rounds", type=int, default=3, help="T for the main comparison (default 3)")
    ap.add_argument("--ablation-layers", type=int, default=4, help="layers pruned in the ablations (default 4)")
    ap.add_argument("--layers", type=int, default=None, help="prune only the first N layers in the main runs")
    ap.add_argument("--refine", type=int, default=None, help="--fista-refine for every FISTA run")
    ap.add_argument("--methods", default=None, help="comma list: run only these methods (sparsegpt,fista)")
    ap.add_argument("--skip-sparsegpt", action="store_true", help="main comparison without the SparseGPT runs")
    ap.add_argument("--tag", default="", help="suffix of the result files (a separate cache)")
    ap.add_argument("--eval-windows", type=int, default=None, help="test windows for perplexity (default 20)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--max-minutes", type=float, default=None, help="stop starting new runs after this long")
    ap.add_argument("--report-only", action="store_true",
                    help="write prune_fista.md/png from every cached prune_fista*.json (main + tags + operator)")
    ap.add_argument("--fresh", action="store_true", help="ignore cached runs")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from leanml.data.text import calibration_windows
    from leanml.eval.perplexity import perplexity
    from leanml.machine import machine_line
    from leanml.outputs import write_json

    s = _base_settings()
    tag = args.tag
    if args.report_only:
        return report_only(args)
    if args.only == "calib-size":
        dense, tok = _load(s["model"])
        rows = calib_size_study(dense, tok, s, args)
        command = f".venv/bin/python bench/prune_fista.py {' '.join(sys.argv[1:])}"
        write_json(RESULTS / "prune_fista_calibsize.json", {"settings": s, "machine": machine_line(), "rows": rows,
                                                              "command": command})  # fmt: skip
        md = calib_size_report(rows, s, args, machine_line(), command)
        (RESULTS / "prune_fista_calibsize.md").write_text(md)
        print(md)
        return 0
    if args.only == "operator":
        dense, tok = _load(s["model"])
        rows = operator_ablation(dense, tok, s, args)
        write_json(RESULTS / "prune_fista_operator.json", {"settings": s, "machine": machine_line(), "rows": rows})
        md = (f"Machine: {machine_line()}\n\n"
              f"Command: `.venv/bin/python bench/prune_fista.py {' '.join(sys.argv[1:])}`\n\n")
        md += operator_report(rows, s, args)
        (RESULTS / "prune_fista_operator.md").write_text(md)
        print(md)
        return 0
    if args.quick:
        s.update(nsamples=8, seqlen=256, eval_windows=4)
        args.layers = args.layers or 4
        args.ablation_layers = min(args.ablation_layers, 2)
        tag = "_quick" + args.tag
    if args.eval_windows:
        s["eval_windows"] = args.eval_windows
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
        write_json(out_json, {"settings": s, "dense_ppl": dense_ppl, "machine": machine_line(), "runs": runs,
                              "command": " ".join(sys.argv[1:])})  # fmt: skip
    recs = list(runs.values())
    write_json(out_json, {"settings": s, "dense_ppl": dense_ppl, "machine": machine_line(), "runs": runs,
                          "command": " ".join(sys.argv[1:])})  # fmt: skip
    md = write_report(recs, s, args, machine_line(), dense_ppl)
    (RESULTS / f"prune_fista{tag}.md").write_text(md)
    plot(recs, RESULTS / f"prune_fista{tag}.png")
    if not args.quick:
        fista_main = _fista_records(recs)
        if fista_main:
            merge_into_prune_json(fista_main, RESULTS / "prune.json")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
