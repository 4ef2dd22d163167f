"""The pruning frontier: perplexity against CPU-seconds for every method and FISTA setting, side by side.

Every row prunes SmolLM2-135M with the SAME calibration windows per seed (one token-id file, read by our
methods and by llm-compressor's), saves and reloads the model, measures its sparsity from the saved weights,
and evaluates it on the first ``--eval-windows`` windows of each corpus's test split (Hamlet and the
clothing reviews; the count is in every record). Rows are named by a setting label:

- ``dense``, ``magnitude``, ``wanda``, ``sparsegpt``, ``fista``: ``leanml prune --method M`` defaults;
- ``llmc-sparsegpt``: llm-compressor's ``SparseGPTModifier`` in ``.venv-peers`` (``bench/peers/llmc_prune.py``);
- ``fista@fast``: a FISTA preset (``--fista-preset fast``);
- ``fista{iters=1,refine=10,warm_start=wanda}``: FISTA with these option fields changed (any field of
  ``FistaOptions``; values parsed by the field's type), on top of a preset when written ``fista@fast{...}``;
  a field the method's options lack is an engine field of ``PruneConfig`` (``fista@fast{intra_layer=false}``).

Keys: (method label, pattern, seed, nsamples, corpus); records carry the measured sparsity, the prune
wall and CPU-seconds split into the method's own work (``solver_seconds``) and the engine's
(``engine_seconds``), the resolved method options, the machine and its load. Each row takes the shared CPU
lock (``/tmp/leanml-cpu.lock``) for itself, so other heavy jobs wait between rows, never during one.

    python bench/prune_frontier.py --settings sparsegpt,fista,fista@fast --patterns 50%,2:4 --seeds 0,1,2 --nsamples 16
    python bench/prune_frontier.py --render-only

Writes ``bench/results/prune_frontier.{json,md,png}`` (one panel per pattern and corpus, error bars: std over
seeds).
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import statistics
import sys
import time
import typing
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
import prune as P  # noqa: E402
import prune_harness as H  # noqa: E402
from leanml.errors import LeanmlError  # noqa: E402
from leanml.outputs import cache_dir  # noqa: E402
from leanml.processes import exit_on_sigterm  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "prune_frontier.json"
KEY = ("method", "pattern", "seed", "nsamples", "corpus")
LABEL = re.compile(r"(?P<method>[a-z_]+(?:-[a-z]+)?)(?:@(?P<preset>[a-z]+))?(?:\{(?P<fields>[^}]*)\})?$")


def parse_label(label: str) -> tuple[str, str | None, dict[str, str]]:
    """``"fista@fast{iters=1}"`` -> ``("fista", "fast", {"iters": "1"})``; ValueError when malformed."""
    m = LABEL.match(label)
    if not m:
        raise ValueError(f"setting {label!r} is not METHOD[@PRESET][{{field=value,...}}]")
    fields = {}
    for part in filter(None, (m.group("fields") or "").split(",")):
        name, eq, value = part.partition("=")
        if not eq:
            raise ValueError(f"setting {label!r}: {part!r} is not field=value")
        fields[name.strip()] = value.strip()
    return m.group("method"), m.group("preset"), fields


def _typed(cls: type, name: str, text: str) -> Any:
    """``text`` as the value of field ``name`` of ``cls`` (bool: true/false; Optional and Literal unwrapped)."""
    hints = typing.get_type_hints(cls)
    if name not in hints:
        raise ValueError(f"{cls.__name__} has no field {name!r}")
    tp = hints[name]
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is typing.Literal or (args and typing.get_origin(args[0]) is typing.Literal):
        return text
    base = args[0] if args else tp
    if base is bool:
        return text.lower() in ("1", "true", "yes")
    return base(text) if base in (int, float) else text


def options_for(label: str) -> tuple[str, Any, dict[str, Any]]:
    """The method name, its options object and the engine fields (``PruneConfig``'s, e.g. ``intra_layer``)
    of a setting label: a field the method's options do not have is looked up in ``PruneConfig``."""
    from leanml.prune.config import PruneConfig
    from leanml.prune.methods import pruner_class

    method, preset, fields = parse_label(label)
    cls = pruner_class(method).Options
    own = typing.get_type_hints(cls)
    kwargs = {k: _typed(cls, k, v) for k, v in fields.items() if k in own}
    engine = {k: _typed(PruneConfig, k, v) for k, v in fields.items() if k not in own}
    if preset:
        kwargs["preset"] = preset
    return method, cls(**kwargs), engine


def config_for(label: str, pattern: str) -> Any:
    from leanml.prune.config import PruneConfig

    method, options, engine = options_for(label)
    sparsity, nm = H.parse_pattern(pattern)
    return PruneConfig(method=method, sparsity=sparsity, pattern=f"{nm[0]}:{nm[1]}" if nm else None, options=options,
                       **engine)


def prune_ours(ctx: P.Context, label: str, pattern: str, seed: int, out: Path) -> dict[str, Any]:
    """Prune with our engine at ``label``'s settings, timed like bench/prune.py (the call only)."""
    import leanml.prune
    from leanml.models import load_model, save_model

    config = config_for(label, pattern)
    _, ids = ctx.calibration(seed)
    model, tok = load_model(str(ctx.model_dir))
    t0, c0 = time.perf_counter(), P.cpu_seconds()
    report = leanml.prune(model, ids, config)
    seconds, cpu = time.perf_counter() - t0, P.cpu_seconds() - c0
    save_model(model, tok, out)
    return {"seconds": seconds, "cpu_seconds": cpu, "method_config": report["method_config"],
            "solver_seconds": report["solver_seconds"], "engine_seconds": report["engine_seconds"],
            "iterations": _iterations(report)}


def _iterations(report: dict[str, Any]) -> dict[str, float] | None:
    """Mean FISTA and refit iterations per linear, where the method reports them."""
    rows = [v for lay in report.get("layers", []) for v in (lay.get("linears") or {}).values() if isinstance(v, dict)]
    out = {}
    for key in ("fista_iters", "refine_iters_used"):
        vals = [float(v[key]) for v in rows if key in v]
        if vals:
            out[key] = statistics.fmean(vals)
    return out or None


def run_row(ctx: P.Context, label: str, pattern: str, seed: int | None) -> list[dict[str, Any]]:
    """One pruned (or dense) model evaluated on every corpus: one record per corpus."""
    from leanml.eval.perplexity import perplexity
    from leanml.models import load_model

    a = ctx.args
    name = re.sub(r"[^A-Za-z0-9_.=-]+", "_", f"{label}-{pattern}-seed{seed}-n{a.nsamples}")
    out = ctx.work / "models" / name
    shutil.rmtree(out, ignore_errors=True)
    base: dict[str, Any] = {"method": label, "pattern": pattern, "seed": seed, "profile": "uniform",
                            "nsamples": a.nsamples if label != "dense" else None, "model": a.model, "seqlen": a.seqlen,
                            "command": ctx.command, "machine": P.machine(), "load": {"before": list(P.os.getloadavg())},
                            "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        with _common.cpu_lock():
            base["cpu_lock_held"] = True
            if label == "dense":
                info, model_dir = {"seconds": 0.0, "cpu_seconds": 0.0}, ctx.model_dir
            else:
                _, ids = ctx.calibration(seed)
                base.update(sparsity=H.parse_pattern(pattern)[0], calib=a.calib, calib_sha256=P.ids_sha256(ids))
                if label in H.PEERS:
                    info = P.prune_peer(ctx, label, pattern, "uniform", seed, out)
                else:
                    info = prune_ours(ctx, label, pattern, seed, out)
                model_dir = out
            base.update(info)
            kinds = H.sparsity_by_kind(model_dir)
            base.update(sparsity_measured=kinds["decoder_linears"], sparsity_by_kind=kinds["by_kind"],
                        flags=H.untouched_flags(kinds["by_kind"], ctx.dense_kinds))
            model, _ = load_model(str(model_dir))
            records = []
            for corpus, windows in ctx.tests.items():
                t0 = time.perf_counter()
                ppl = perplexity(model, windows, batch_size=a.eval_batch_size, progress=False)
                records.append({**base, "corpus": corpus, "eval_windows": int(windows.shape[0]), "ppl": ppl,
                                "eval_text": f"first {windows.shape[0]} x {windows.shape[1]} tokens of the {corpus} "
                                             "test split",
                                "eval_seconds": time.perf_counter() - t0})
    except (LeanmlError, OSError, RuntimeError, ValueError) as exc:
        msg = f"{type(exc).__name__}: {exc}".splitlines()[0]
        print(f"{label} {pattern} seed {seed}: {msg}", flush=True)
        records = [{**base, "corpus": c, "eval_windows": int(w.shape[0]), "ppl": None, "error": msg}
                   for c, w in ctx.tests.items()]
    finally:
        shutil.rmtree(out, ignore_errors=True)
    for r in records:
        r["load"]["after"] = list(P.os.getloadavg())
    return records


# ---------------------------------------------------------------- tables and plot


def _stat(vals: list[float]) -> tuple[float, float, int]:
    return statistics.fmean(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0, len(vals)


def summary(records: list[dict[str, Any]]) -> dict[tuple, dict[str, Any]]:
    """(pattern, corpus, nsamples, method) -> ppl and CPU-seconds mean/std/n over seeds (usable records only)."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in records:
        if H.usable(r):
            groups.setdefault((r["pattern"], r["corpus"], r["nsamples"], r["method"]), []).append(r)
    out = {}
    for k, rs in groups.items():
        out[k] = {"ppl": _stat([r["ppl"] for r in rs]), "cpu": _stat([r["cpu_seconds"] for r in rs]),
                  "solver": _stat([r.get("solver_seconds") or 0.0 for r in rs]),
                  "seeds": sorted(r["seed"] for r in rs if r["seed"] is not None),
                  "eval_windows": rs[0]["eval_windows"], "iterations": rs[0].get("iterations")}
    return out


def same_seed_reference(records: list[dict[str, Any]], key: tuple, seeds: list[int], field: str) -> float | None:
    """Our SparseGPT's mean ``field`` (ppl or cpu_seconds) at ``key`` = (pattern, corpus, nsamples), over
    exactly ``seeds``; None when SparseGPT lacks one of them (a ratio over other seeds would mix the
    calibration draws' own spread into the comparison)."""
    by_seed = {r["seed"]: r[field] for r in records if H.usable(r) and r["method"] == "sparsegpt"
               and (r["pattern"], r["corpus"], r["nsamples"]) == key}
    if not seeds or any(k not in by_seed for k in seeds):
        return None
    return statistics.fmean(by_seed[k] for k in seeds)


def render_markdown(records: list[dict[str, Any]]) -> str:
    s = summary(records)
    machines = {(r["machine"].get("cpu"), r["machine"].get("cores_available"), r["machine"].get("torch"))
                for r in records}
    lines = ["# Pruning frontier: perplexity against CPU-seconds", "",
             "Generated by `bench/prune_frontier.py` from `prune_frontier.json`. SmolLM2-135M, calibration from the "
             "Shakespeare calib split (the same token-id file per seed for every row), evaluation on the first "
             "windows of each test split (count in the table), 512 tokens per window. CPU-s: the pruning call's "
             "user + system seconds (solve = the method's own work, the rest is the engine's). Ratios: against our "
             "SparseGPT of the same pattern and calibration size over the same seeds (no ratio where SparseGPT "
             "lacks one of the row's seeds).", "",
             "Machines: " + "; ".join(f"{c}, {n} cores, torch {t}" for c, n, t in sorted(machines, key=str)), ""]
    dense = {c: v["ppl"][0] for (p, c, n, m), v in s.items() if m == "dense"}
    for pattern in sorted({k[0] for k in s if k[0] != "dense"}, key=H.pattern_order):
        for nsamples in sorted({k[2] for k in s if k[0] == pattern}):
            corpora = sorted({k[1] for k in s if k[0] == pattern and k[2] == nsamples},
                             key=lambda c: c != "shakespeare")
            methods = sorted({k[3] for k in s if k[0] == pattern and k[2] == nsamples},
                             key=lambda m: s[(pattern, corpora[0], nsamples, m)]["cpu"][0]
                             if (pattern, corpora[0], nsamples, m) in s else 0)
            lines += [f"## {pattern}, {nsamples} x 512 calibration", "",
                      "| setting | seeds | "
                      + " | ".join(f"{H.CORPUS_NAMES.get(c, c)} ppl (vs SparseGPT)" for c in corpora)
                      + " | CPU-s (vs SparseGPT) | solve s | iterations (FISTA / refit) |",
                      "|---|---|" + "---|" * len(corpora) + "---|---|---|"]
            for m in methods:
                cells = []
                for c in corpora:
                    v = s.get((pattern, c, nsamples, m))
                    if not v:
                        cells.append("")
                        continue
                    mean, std, _ = v["ppl"]
                    ref = same_seed_reference(records, (pattern, c, nsamples), v["seeds"], "ppl")
                    cells.append(f"{mean:.2f} ± {std:.2f}" + (f" ({mean / ref:.3f}x)" if ref else ""))
                v = s[(pattern, corpora[0], nsamples, m)]
                ref = same_seed_reference(records, (pattern, corpora[0], nsamples), v["seeds"], "cpu_seconds")
                cpu = f"{v['cpu'][0]:.1f} ± {v['cpu'][1]:.1f}" + (f" ({v['cpu'][0] / ref:.2f}x)" if ref else "")
                it = v["iterations"] or {}
                its = " / ".join(f"{it[k]:.1f}" for k in ("fista_iters", "refine_iters_used") if k in it)
                lines.append(f"| `{m}` | {','.join(map(str, v['seeds']))} | " + " | ".join(cells)
                             + f" | {cpu} | {v['solver'][0]:.1f} | {its} |")
            windows = {c: s[(pattern, c, nsamples, methods[0])]["eval_windows"] for c in corpora}
            lines += ["", "Evaluation windows: "
                      + ", ".join(f"{H.CORPUS_NAMES.get(c, c)} {w}" for c, w in windows.items())
                      + (". Dense: "
                         + ", ".join(f"{H.CORPUS_NAMES.get(c, c)} {dense[c]:.2f}" for c in corpora if c in dense)
                         if dense else ""), ""]
    errors = [r for r in records if r.get("error")]
    if errors:
        lines += ["## Rows that failed", ""] + [f"- `{r['method']}` {r['pattern']} seed {r['seed']}: {r['error']}"
                                                for r in errors if r["corpus"] == errors[0]["corpus"]] + [""]
    return "\n".join(lines)


def plot(records: list[dict[str, Any]], path: Path) -> None:
    """One panel per (pattern, corpus): perplexity against CPU-seconds, seed means with std bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = summary(records)
    panels = sorted({(k[0], k[1]) for k in s if k[0] != "dense"},
                    key=lambda pc: (H.pattern_order(pc[0]), pc[1] != "shakespeare"))
    if not panels:
        return
    cols = 2
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, 4.8 * rows), squeeze=False)
    for ax, (pattern, corpus) in zip(axes.flat, panels):
        for (p, c, n, m), v in sorted(s.items(), key=lambda kv: str(kv[0])):
            if p != pattern or c != corpus:
                continue
            marker = "o" if n == min(k[2] for k in s if k[0] == pattern) else "s"
            ax.errorbar(v["cpu"][0], v["ppl"][0], xerr=v["cpu"][1], yerr=v["ppl"][1], fmt=marker, capsize=3,
                        label=f"{m} ({n}x512)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("pruning CPU-seconds (log)")
        ax.set_ylabel("perplexity (log)")
        ax.set_title(f"{pattern}, {H.CORPUS_NAMES.get(corpus, corpus)} (lower left is better)")
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_outputs(records: list[dict[str, Any]], results: Path) -> None:
    _common.write_outputs(records, results, render_markdown, plot)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", default="magnitude,wanda,sparsegpt,fista,fista@fast",
                    help="comma list of setting labels (dense, llmc-sparsegpt, METHOD[@PRESET][{field=value;...}]); "
                         "inside braces separate fields with ';' on the command line")
    ap.add_argument("--patterns", default="50%,2:4")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--nsamples", type=int, default=16)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--eval-windows", type=int, default=32, help="first N windows of each test split")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-batch-size", type=int, default=4)
    ap.add_argument("--model", default=P.DEFAULT_MODEL)
    ap.add_argument("--calib", default=P.DEFAULT_CALIB)
    ap.add_argument("--results", default=str(RESULTS))
    ap.add_argument("--render-only", action="store_true")
    args = ap.parse_args(argv)
    results = Path(args.results)
    old = _common.load_json(results, [])
    if args.render_only:
        write_outputs(old, results)
        print(results.with_suffix(".md").read_text())
        return
    exit_on_sigterm()
    # braces hold ';'-separated fields so the comma list stays splittable
    labels = [x.replace(";", ",") for x in args.settings.split(",") if x]
    patterns = [p for p in args.patterns.split(",") if p]
    try:
        for p in patterns:
            H.parse_pattern(p)
            for label in labels:
                if label not in ("dense", *H.PEERS):
                    config_for(label, p)
        seeds = [int(x) for x in args.seeds.split(",") if x]
    except (ValueError, LeanmlError) as exc:
        ap.error(str(exc))
    torch.set_num_threads(args.threads)
    from leanml.data.text import load_text, token_windows
    from leanml.models import BUNDLED, bundled_dir, load_model

    model_dir = bundled_dir(args.model) if args.model in BUNDLED else Path(args.model).resolve()
    _, tok = load_model(str(model_dir))
    tests = {c: token_windows(tok, load_text(c, "test"), args.seqlen)[: args.eval_windows] for c in P.CORPORA}
    work = cache_dir() / "bench-frontier"
    work.mkdir(parents=True, exist_ok=True)
    args.calib_samples, args.peers_python = 0.0, str(P.PEERS_PYTHON)
    ctx = P.Context(args, model_dir, tok, tests, H.sparsity_by_kind(model_dir)["by_kind"], work,
                    shlex.join(["python", "bench/prune_frontier.py", *(sys.argv[1:] if argv is None else argv)]))
    rows = [("dense", "dense", None)] if "dense" in labels else []
    rows += [(lab, p, seed) for seed in seeds for p in patterns for lab in labels if lab != "dense"]
    for row in tqdm(rows, desc="rows", unit="row"):
        new = run_row(ctx, *row)
        old = _common.merge_records(_common.load_json(results, []), new, _common.key_of(KEY), keep_place=True)
        write_outputs(old, results)
        for r in new:
            ppl = "error" if r["ppl"] is None else f"{r['ppl']:.2f}"
            print(f"{r['method']:40s} {r['pattern']:4s} seed {r['seed']} n{r['nsamples']} {r['corpus']:11s} "
                  f"ppl {ppl:>8s}  "
                  f"prune {r.get('seconds', 0):.0f} s / {r.get('cpu_seconds', 0):.0f} CPU-s", flush=True)


if __name__ == "__main__":
    main()
