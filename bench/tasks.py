"""Zero-shot accuracy benchmark: do the perplexity gains of pruning methods carry over to accuracy?

Each row prunes SmolLM2-135M (or ``--model``) exactly as ``bench/prune.py`` does (its ``prune_ours``:
``leanml prune``'s defaults, the same calibration windows per seed: ``--nsamples`` x ``--seqlen`` tokens
of the calib split of ``--calib``), saves the pruned model, and evaluates that same saved model on

- the offline lm-eval tasks (``leanml eval --tasks``'s runner, :mod:`leanml.eval.tasks`; the first
  ``--limit`` items of each), accuracy and its standard error;
- perplexity on the whole test split of both corpora (Hamlet, the clothing reviews).

A task whose dense accuracy is not above its chance level at 95 % is reported but left out of the
average ("comparable tasks"). One record per (method, pattern, seed) in ``bench/results/tasks.json``,
merged by that key, so chunks run separately; ``tasks.md`` and ``tasks.png`` are regenerated from all
records after each row, and list the rows of the full plan that have not been run. A row in two
steps, each under the CPU lock (a saved model is reused by the second):

    flock /tmp/leanml-cpu.lock python bench/tasks.py --methods dense --limit 200
    flock /tmp/leanml-cpu.lock python bench/tasks.py --methods sparsegpt --patterns 50% --seeds 0 --prune-only
    flock /tmp/leanml-cpu.lock python bench/tasks.py --methods sparsegpt --patterns 50% --seeds 0 --limit 200
    python bench/tasks.py --render-only
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _common  # noqa: E402
import prune as P  # noqa: E402  (bench/prune.py: its pruning rows and calibration files)
import prune_harness as H  # noqa: E402
from leanml.eval.tasks import LM_EVAL_VERSION, OFFLINE_TASKS  # noqa: E402
from leanml.outputs import cache_dir, write_json  # noqa: E402
from leanml.processes import exit_on_sigterm  # noqa: E402

RESULTS = HERE / "results" / "tasks.json"
KEY = ("method", "pattern", "seed")
#: the plan of issue 51: method -> patterns (dense has none)
FULL_PLAN: dict[str, tuple[str, ...]] = {
    "dense": ("dense",),
    "magnitude": ("50%", "2:4"), "wanda": ("50%", "2:4"), "sparsegpt": ("50%", "2:4"), "fista": ("50%", "2:4"),
    "fasp": ("20%", "30%"), "flap": ("20%", "30%"),
}
FULL_SEEDS = (0, 1, 2)
CORPORA = ("shakespeare", "reviews")


# ---------------------------------------------------------------- running


def model_name(method: str, pattern: str, seed: int | None) -> str:
    return f"{method.replace(':', '-')}-{pattern.replace('%', 'pct').replace(':', 'of')}-seed{seed}"


def prune_row(ctx: P.Context, method: str, pattern: str, seed: int) -> tuple[Path, dict[str, Any]]:
    """The saved pruned model of a row (pruned now unless a finished one is on disk) and its prune info."""
    out = ctx.work / "models" / model_name(method, pattern, seed)
    done = out / "prune-info.json"
    if done.exists():
        return out, _common.load_json(done, {})
    shutil.rmtree(out, ignore_errors=True)
    info = P.prune_ours(ctx, method, pattern, "uniform", seed, out)
    write_json(done, {k: info[k] for k in ("seconds", "cpu_seconds", "settings")})
    return out, _common.load_json(done, {})


def evaluate(model_dir: Path, tests: dict[str, torch.Tensor], plan: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Perplexity on each corpus and the tasks' records of one saved model."""
    from leanml.eval.perplexity import perplexity
    from leanml.eval.tasks.runner import run_tasks
    from leanml.models import load_model

    model, tok = load_model(str(model_dir))
    t0 = time.perf_counter()
    ppl = {c: perplexity(model, w, batch_size=args.eval_batch_size, progress=True) for c, w in tests.items()}
    t1 = time.perf_counter()
    tasks = run_tasks(model, tok, plan, limit=args.limit, num_fewshot=None, batch_size=args.eval_batch_size)
    return {"ppl": ppl, "tasks": tasks, "ppl_seconds": t1 - t0, "tasks_seconds": time.perf_counter() - t1}


def run_row(ctx: P.Context, plan: Any, method: str, pattern: str, seed: int | None) -> dict[str, Any] | None:
    a = ctx.args
    rec: dict[str, Any] = {"method": method, "pattern": pattern, "seed": seed, "model": a.model, "limit": a.limit,
                           "command": ctx.command, "machine": P.machine(), "cpu_lock_held": P.cpu_lock_held(),
                           "load_before": list(os.getloadavg()), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    if method == "dense":
        model_dir = ctx.model_dir
    else:
        _, ids = ctx.calibration(seed)
        rec.update(calib=a.calib, nsamples=a.nsamples, seqlen=a.seqlen, calib_sha256=P.ids_sha256(ids))
        model_dir, info = prune_row(ctx, method, pattern, seed)
        rec["prune"] = info
        if a.prune_only:
            print(f"{method} {pattern} seed {seed}: pruned, saved in {model_dir}", flush=True)
            return None
    rec["sparsity_measured"] = H.sparsity_by_kind(model_dir)["decoder_linears"]
    rec.update(evaluate(model_dir, ctx.tests, plan, a))
    rec["load_after"] = list(os.getloadavg())
    return rec


# ---------------------------------------------------------------- statistics


def comparable_tasks(records: list[dict[str, Any]]) -> dict[str, bool]:
    """Each task of the dense record: whether its dense score is above chance at 95 %."""
    dense = next((r for r in records if r["method"] == "dense"), None)
    if dense is None:
        return {}
    return {t: bool(v.get("above_chance")) for t, v in dense["tasks"].items()}


def average(rec: dict[str, Any], tasks: list[str]) -> tuple[float, float] | None:
    """Mean score over ``tasks`` and its standard error (the tasks' item samples taken as independent)."""
    vals = [rec["tasks"].get(t) for t in tasks]
    if not tasks or any(v is None or v.get("score") is None for v in vals):
        return None
    mean = sum(v["score"] for v in vals) / len(vals)
    se = math.sqrt(sum((v.get("score_stderr") or 0.0) ** 2 for v in vals)) / len(vals)
    return mean, se


def groups(records: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    out: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in records:
        out.setdefault((r["method"], r["pattern"]), []).append(r)
    return dict(sorted(out.items(), key=lambda kv: (kv[0][0] != "dense", H.pattern_order(kv[0][1]), kv[0][0])))


def cell(values: list[float], stderr: float | None = None, digits: int = 3) -> str:
    """mean ± std over seeds; one seed: the value ± its standard error (marked se)."""
    if not values:
        return "–"
    if len(values) > 1:
        return f"{statistics.fmean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"
    return f"{values[0]:.{digits}f}" + (f" ± {stderr:.{digits}f} se" if stderr is not None else "")


def rank_order(items: dict[str, float], reverse: bool) -> list[str]:
    return [k for k, _ in sorted(items.items(), key=lambda kv: kv[1], reverse=reverse)]


# ---------------------------------------------------------------- rendering


def render_markdown(records: list[dict[str, Any]]) -> str:
    comp = comparable_tasks(records)
    tasks = list(comp) or list(OFFLINE_TASKS)
    use = [t for t in tasks if comp.get(t)]
    g = groups(records)
    limits = sorted({r.get("limit") for r in records}, key=lambda x: (x is None, x or 0))
    lines = ["# Zero-shot accuracy of pruned SmolLM2-135M (lm-eval, offline tasks)", "",
             "Generated by `bench/tasks.py` from `tasks.json`. Each row prunes with `leanml prune`'s defaults "
             "(the pruning rows of `bench/prune.py`: calibration "
             f"{records[-1].get('nsamples') or P.DEFAULT_NSAMPLES} x {P.DEFAULT_SEQLEN} tokens of the shakespeare "
             "calib split per seed), saves the model, and evaluates that saved model: accuracy through lm-eval "
             f"{LM_EVAL_VERSION} on "
             f"the first {', '.join('all' if x is None else str(x) for x in limits)} items of each task, and "
             "perplexity on the whole test split of both corpora (Hamlet, the last 300 review texts).", "",
             "## Tasks", "", "| task | items | evaluated | chance | dense score (95 % interval) | comparable |",
             "|---|---|---|---|---|---|"]
    dense = next((r for r in records if r["method"] == "dense"), None)
    for t in tasks:
        d = dense["tasks"].get(t, {}) if dense else {}
        ci = d.get("ci95")
        score = f"{d.get('metric')} {d['score']:.3f} ({ci[0]:.3f}–{ci[1]:.3f})" if ci else "–"
        lines.append(f"| {t} | {d.get('size', '–')} | {d.get('n', '–')} | {d.get('chance', '–')} | {score} | "
                     f"{'yes' if comp.get(t) else 'no: not above chance at 95 %, left out of the average'} |")
    lines += ["", "## Methods", "",
              "Scores: mean ± std over calibration seeds; with one seed, the score ± its standard error (se). "
              f"avg: mean over the comparable tasks ({', '.join(use) or 'none'}).", "",
              "| method | pattern | seeds | " + " | ".join(tasks) + " | avg | ppl Hamlet | ppl reviews | sparsity |",
              "|---|---|---|" + "---|" * (len(tasks) + 4)]
    avgs: dict[str, float] = {}
    ppls: dict[str, dict[str, float]] = {c: {} for c in CORPORA}
    for (method, pattern), rs in g.items():
        label = method if method == "dense" else f"{method} {pattern}"
        cells = []
        for t in tasks:
            vals = [r["tasks"][t]["score"] for r in rs if r["tasks"].get(t, {}).get("score") is not None]
            cells.append(cell(vals, rs[0]["tasks"].get(t, {}).get("score_stderr") if len(vals) == 1 else None))
        av = [a for r in rs if (a := average(r, use))]
        avg_cell = cell([a[0] for a in av], av[0][1] if len(av) == 1 else None)
        if av:
            avgs[label] = statistics.fmean(a[0] for a in av)
        for c in CORPORA:
            vals = [r["ppl"][c] for r in rs if r["ppl"].get(c) is not None]
            if vals:
                ppls[c][label] = statistics.fmean(vals)
        ppl_cells = [cell([r["ppl"][c] for r in rs if c in r["ppl"]], digits=2) for c in CORPORA]
        seeds = ",".join(str(r["seed"]) for r in rs) if method != "dense" else "–"
        lines.append(f"| {method} | {pattern} | {seeds} | " + " | ".join(cells) + f" | {avg_cell} | "
                     + " | ".join(ppl_cells) + f" | {statistics.fmean(r['sparsity_measured'] for r in rs):.3f} |")
    lines += ["", "## Does the perplexity ordering agree with the accuracy ordering?", ""]
    lines += orderings(avgs, ppls)
    lines += ["", "## FISTA against SparseGPT", ""] + head_to_head(records, use)
    lines += ["", "## Not run", ""] + not_run(records)
    lines += ["", "Machine: " + ", ".join(f"{k} {v}" for k, v in records[-1]["machine"].items()
                                           if k in ("cpu", "cores", "torch", "transformers")) + "."]
    return "\n".join(lines) + "\n"


def orderings(avgs: dict[str, float], ppls: dict[str, dict[str, float]]) -> list[str]:
    if len(avgs) < 2:
        return ["Fewer than two rows with an average: nothing to order yet."]
    by_acc = rank_order(avgs, reverse=True)
    out = [f"- by average accuracy (best first): {' > '.join(by_acc)}"]
    for c in CORPORA:
        shared = {k: v for k, v in ppls[c].items() if k in avgs}
        by_ppl = rank_order(shared, reverse=False)
        acc_same = [k for k in by_acc if k in shared]
        verdict = "agree" if by_ppl == acc_same else "do not agree"
        out.append(f"- by perplexity on {H.CORPUS_NAMES[c]} (best first): {' > '.join(by_ppl)}: the orderings "
                   f"**{verdict}**")
    out.append("- an ordering within the intervals of the table above is not a measured difference; see the next "
               "section for the one comparison the issue targets.")
    return out


def head_to_head(records: list[dict[str, Any]], use: list[str]) -> list[str]:
    """FISTA against SparseGPT per pattern. With the same seeds on both sides (the same calibration
    windows), the interval is Student's t over the per-seed differences (n - 1 degrees of freedom);
    with one seed, the items' standard errors."""
    from scipy.stats import t as student_t

    out = []
    for pattern in ("50%", "2:4"):
        pairs = {}
        for m in ("fista", "sparsegpt"):
            av = {r["seed"]: a for r in records if r["method"] == m and r["pattern"] == pattern
                  if (a := average(r, use))}
            if av:
                pairs[m] = av
        if len(pairs) < 2:
            out.append(f"- {pattern}: not measured (needs both fista and sparsegpt rows).")
            continue
        f, s = pairs["fista"], pairs["sparsegpt"]
        seeds = sorted(set(f) & set(s))
        if len(seeds) > 1:
            d = [f[k][0] - s[k][0] for k in seeds]
            diff = statistics.fmean(d)
            half = student_t.ppf(0.975, len(d) - 1) * statistics.stdev(d) / math.sqrt(len(d))
            how = f"Student's t over the differences of seeds {','.join(map(str, seeds))}"
        else:
            fa, sa = next(iter(f.values())), next(iter(s.values()))
            diff = fa[0] - sa[0]
            half = 1.96 * math.sqrt(fa[1] ** 2 + sa[1] ** 2)
            how = "from the items' standard errors, one seed"
        lo, hi = diff - half, diff + half
        verdict = ("FISTA ≥ SparseGPT: met" if diff >= 0 else "FISTA < SparseGPT: missed") + (
            " (the interval includes 0: no measured difference)" if lo <= 0 <= hi else "")
        out.append(f"- {pattern}: average accuracy FISTA − SparseGPT = {diff:+.3f} (95 % interval {lo:+.3f} to "
                   f"{hi:+.3f}, {how}); {verdict}.")
    return out


def not_run(records: list[dict[str, Any]]) -> list[str]:
    have = {(r["method"], r["pattern"], r["seed"]) for r in records}
    missing = []
    for method, patterns in FULL_PLAN.items():
        for pattern in patterns:
            seeds = (None,) if method == "dense" else FULL_SEEDS
            left = [s for s in seeds if (method, pattern, s) not in have]
            if left:
                missing.append(f"{method} {pattern}" + ("" if method == "dense" else
                                                       f" (seeds {','.join(map(str, left))})"))
    out = [f"- of the plan of issue 51: {'; '.join(missing)}." if missing else "- the whole plan of issue 51 ran."]
    out.append("- `leanml recover` after SparseGPT / FISTA 50 %: not run.")
    limits = {r.get("limit") for r in records}
    if limits != {None}:
        out.append(f"- the tasks ran on their first {', '.join(str(x) for x in sorted(x for x in limits if x))} "
                   "items (--limit), not all of them.")
    return out


def plot(records: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    use = [t for t, ok in comparable_tasks(records).items() if ok]
    labels, accs, errs, hamlet = [], [], [], []
    for (method, pattern), rs in groups(records).items():
        av = [a for r in rs if (a := average(r, use))]
        if not av:
            continue
        labels.append(method if method == "dense" else f"{method}\n{pattern}")
        accs.append(statistics.fmean(a[0] for a in av))
        errs.append(statistics.stdev([a[0] for a in av]) if len(av) > 1 else 1.96 * av[0][1])
        hamlet.append(statistics.fmean(r["ppl"]["shakespeare"] for r in rs))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.bar(range(len(labels)), accs, yerr=errs, capsize=3)
    ax1.set_xticks(range(len(labels)), labels, fontsize=8)
    ax1.set_ylabel("average accuracy (comparable tasks)")
    ax1.set_title("accuracy (bars: 95 % interval or seed std)")
    ax2.scatter(hamlet, accs)
    for x, y, t in zip(hamlet, accs, labels):
        ax2.annotate(t.replace("\n", " "), (x, y), fontsize=7)
    ax2.set_xscale("log")
    ax2.set_xlabel("perplexity, Hamlet (log)")
    ax2.set_ylabel("average accuracy")
    ax2.set_title("perplexity against accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(records: list[dict[str, Any]], results: Path) -> None:
    _common.write_outputs(records, results, render_markdown, plot)


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=P.DEFAULT_MODEL)
    ap.add_argument("--methods", default="dense", help="comma list: dense and our methods (magnitude, wanda, "
                                                         "sparsegpt, fista, fasp, flap)")
    ap.add_argument("--patterns", default="50%", help="comma list of NN%% and N:M (default 50%%)")
    ap.add_argument("--seeds", default="0", help="comma list of calibration seeds (default 0)")
    ap.add_argument("--limit", type=int, default=None, help="first N items of each task (default all)")
    ap.add_argument("--tasks", default=",".join(OFFLINE_TASKS), help="comma list of tasks (default the offline ones)")
    ap.add_argument("--nsamples", type=int, default=P.DEFAULT_NSAMPLES)
    ap.add_argument("--seqlen", type=int, default=P.DEFAULT_SEQLEN)
    ap.add_argument("--calib", default=P.DEFAULT_CALIB)
    ap.add_argument("--threads", type=int, default=P.DEFAULT_THREADS)
    ap.add_argument("--eval-batch-size", type=int, default=4)
    ap.add_argument("--prune-only", action="store_true", help="prune and save the rows' models, evaluate nothing")
    ap.add_argument("--work-dir", default=None, help="calibration files and saved models (default <cache>/bench-tasks)")
    ap.add_argument("--results", default=str(RESULTS))
    ap.add_argument("--render-only", action="store_true")
    args = ap.parse_args(argv)
    args.calib_samples, args.batch_size = 0.0, None  # what bench/prune.py's Context reads
    exit_on_sigterm()
    results = Path(args.results)
    key = _common.key_of(KEY)
    if args.render_only:
        write_outputs(_common.load_json(results, []), results)
        print(results.with_suffix(".md").read_text())
        return
    from leanml.data.text import load_text, token_windows
    from leanml.eval.tasks.runner import check_tasks, parse_task_list
    from leanml.models import BUNDLED, bundled_dir, load_model

    methods = [m for m in args.methods.split(",") if m]
    patterns = [p for p in args.patterns.split(",") if p]
    seeds = [int(s) for s in args.seeds.split(",") if s]
    for m in methods:
        if m != "dense":
            P.our_config(m, patterns[0], "uniform", None)
    torch.set_num_threads(args.threads)
    plan = None if args.prune_only else check_tasks(parse_task_list(args.tasks))
    model_dir = bundled_dir(args.model) if args.model in BUNDLED else Path(args.model).resolve()
    _, tok = load_model(str(model_dir))
    tests = {c: token_windows(tok, load_text(c, "test"), args.seqlen) for c in CORPORA}
    work = Path(args.work_dir) if args.work_dir else cache_dir() / "bench-tasks"
    work.mkdir(parents=True, exist_ok=True)
    ctx = P.Context(args, model_dir, tok, tests, {}, work,
                    shlex.join(["python", "bench/tasks.py", *(sys.argv[1:] if argv is None else argv)]))
    rows = [("dense", "dense", None)] if "dense" in methods else []
    rows += [(m, p, s) for s in seeds for p in patterns for m in methods if m != "dense"]
    for row in rows:
        rec = run_row(ctx, plan, *row)
        if rec is None:
            continue
        records = _common.merge_records(_common.load_json(results, []), [rec], key, keep_place=True)
        write_outputs(records, results)
        scores = ", ".join(f"{t} {v['score']:.3f}" for t, v in rec["tasks"].items() if v.get("score") is not None)
        print(f"{row[0]} {row[1]} seed {row[2]}: {scores}; ppl " +
              ", ".join(f"{c} {v:.2f}" for c, v in rec["ppl"].items()), flush=True)


if __name__ == "__main__":
    main()
