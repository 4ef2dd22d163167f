"""Pruning benchmark: dense, magnitude, Wanda and SparseGPT at 50 % unstructured and 2:4 on one model,
with one calibration set, side by side in one run.

    .venv/bin/python bench/prune.py                 # SmolLM2-135M, 32 x 512 calibration tokens
    .venv/bin/python bench/prune.py --quick         # fewer calibration / evaluation windows

Writes ``bench/results/prune.{md,json,png}``. Records from other scripts (e.g. FISTA's) already in
``prune.json`` are kept; records of the same (method, pattern, warm_start, variant) are replaced.
Helpers :func:`run_method`, :func:`merge_records` and :func:`write_outputs` are imported by
``bench/prune_fista.py``.
"""

from __future__ import annotations

import argparse
import copy
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from leanml.data.text import calibration_windows, load_text, token_windows  # noqa: E402
from leanml.eval.perplexity import perplexity  # noqa: E402
from leanml.models import load_model  # noqa: E402
from leanml.prune.engine import prune_model  # noqa: E402
from leanml.prune.masks import MaskSpec  # noqa: E402
from leanml.prune.methods import pruner_class  # noqa: E402
from leanml.utils import machine_info, machine_line, write_json  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# Shared with bench/prune_fista.py so every method sees the same calibration and test windows.
DEFAULT_MODEL = "smollm2-135m"
DEFAULT_CALIB = "shakespeare"
DEFAULT_NSAMPLES = 16
DEFAULT_SEQLEN = 512
DEFAULT_SEED = 0
DEFAULT_EVAL_WINDOWS = 10
DEFAULT_BATCH_SIZE = 8
PATTERNS = {"unstructured": MaskSpec(0.5), "2:4": MaskSpec(pattern=(2, 4))}
BASELINES = ["magnitude", "wanda", "sparsegpt"]


def record_key(r: dict[str, Any]) -> tuple:
    return (r["method"], r["pattern"], r.get("warm_start"), r.get("variant"))


def merge_records(new: list[dict[str, Any]], path: Path = RESULTS / "prune.json") -> list[dict[str, Any]]:
    """Records in ``path`` with those of ``new`` replacing the ones with the same key."""
    old = json.loads(path.read_text()) if path.exists() else []
    keys = {record_key(r) for r in new}
    return [r for r in old if record_key(r) not in keys] + new


def run_method(
    model: torch.nn.Module,
    dense_state: dict[str, torch.Tensor],
    calib: torch.Tensor,
    test: torch.Tensor,
    method: str,
    spec: MaskSpec,
    pruner: Any = None,
    **engine_kwargs: Any,
) -> tuple[float, float, dict[str, Any]]:
    """Restore the dense weights, prune with ``method``, return (perplexity, prune seconds, report)."""
    model.load_state_dict(dense_state)
    cls = pruner_class(method)
    pruner = pruner or cls()
    spec = MaskSpec(spec.sparsity, spec.pattern, getattr(cls, "default_scope", "row"))
    t0 = time.perf_counter()
    report = prune_model(model, calib, pruner, spec, **engine_kwargs)
    seconds = time.perf_counter() - t0
    ppl = perplexity(model, test, batch_size=4, progress=False)
    return ppl, seconds, report


def write_outputs(records: list[dict[str, Any]], command: str, extra_md: str = "") -> None:
    """``prune.json``, the Markdown table and the plot, from all records."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    records = list({record_key(r): r for r in records}.values())  # one record per key, the latest
    write_json(RESULTS / "prune.json", records)
    # ratios only against SparseGPT measured in the same setting (same variant)
    ref = {(r["pattern"], r.get("variant")): r for r in records if r["method"] == "sparsegpt"}
    lines = [
        "# Pruning benchmark",
        "",
        f"Machine: {machine_line()}.  ",
        "Commands: " + "; ".join(f"`{c}`" for c in dict.fromkeys([*(r["command"] for r in records if r.get("command")),
                                                                  command])) + ".  ",
        "Perplexity: SparseGPT protocol on the Hamlet test split (Shakespeare stands in for WikiText-2 offline), "
        f"{records[0]['eval_windows']} windows x {records[0]['seqlen']} tokens; calibration "
        f"{records[0]['nsamples']} x {records[0]['seqlen']} tokens from other plays (seed 0), the same set for every method.",
        "",
        "Rows with a variant come from separate runs (`bench/prune_fista.py`, or `bench/prune.py --variant`); "
        "their ratios are against SparseGPT with the same variant, measured in the same run (`-` where that run "
        "had none: see `prune_fista.md`).",
        "Prune seconds include the engine's calibration forward passes, which dominate for the cheap methods.",
        "",
        "| method | warm start | variant | pattern | sparsity | ppl | ppl / SparseGPT | prune s | time / SparseGPT |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    order = {"dense": 0, "magnitude": 1, "wanda": 2, "sparsegpt": 3, "fista": 4}
    patterns = {"dense": 0, "unstructured": 1}
    shown = [r for r in records if r["method"] != "dense" or not r.get("variant")]  # one dense row: same model
    for r in sorted(shown, key=lambda r: (patterns.get(r["pattern"], 2), str(r.get("variant") or ""),
                                          order.get(r["method"], 9), str(r.get("warm_start")))):
        base = ref.get((r["pattern"], r.get("variant")))
        ratio = f"{r['ppl'] / base['ppl']:.3f}" if base else "-"
        tratio = f"{r['seconds'] / base['seconds']:.2f}" if base and base["seconds"] and r["seconds"] else "-"
        lines.append(
            f"| {r['method']} | {r.get('warm_start') or '-'} | {r.get('variant') or '-'} | {r['pattern']} | "
            f"{r['sparsity']:.2f} | {r['ppl']:.2f} | {ratio} | {r['seconds']:.1f} | {tratio} |"
        )
    (RESULTS / "prune.md").write_text("\n".join(lines) + "\n" + extra_md)
    _plot(records)


def _plot(records: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(15, 5))
    for ax, pattern in zip(axes, ["unstructured", "2:4"]):
        # the baselines' run, then every full-model variant (FISTA beside its same-run SparseGPT);
        # reduced settings (only some layers pruned) stay in the table
        base = [r for r in records if r["pattern"] in (pattern, "dense") and not r.get("variant")]
        full = [r for r in records if r["pattern"] == pattern and str(r.get("variant", "")).startswith("full model")]
        full.sort(key=lambda r: (r["variant"], r["method"] != "sparsegpt", str(r.get("warm_start"))))
        rows = base + full
        labels = [r["method"] + (f"\n({r['warm_start']})" if r.get("warm_start") else "")
                  + (f"\n[{r['variant'].removeprefix('full model, ')[:25]}]" if r.get("variant") else "")
                  for r in rows]  # fmt: skip
        colors = ["tab:orange" if r["method"] == "fista" else "tab:blue" for r in rows]
        ax.bar(range(len(rows)), [r["ppl"] for r in rows], color=colors)
        ax.set_xticks(range(len(rows)), labels, fontsize=6)
        ax.set_yscale("log")
        ax.set_ylabel("perplexity (log)")
        ax.set_title(f"{'50% unstructured' if pattern == 'unstructured' else '2:4'}")
        for i, r in enumerate(rows):
            ax.text(i, r["ppl"], f"{r['ppl']:.1f}", ha="center", va="bottom", fontsize=8)
    fig.suptitle(f"{records[0]['model']}: perplexity after pruning (lower is better)")
    fig.tight_layout()
    fig.savefig(RESULTS / "prune.png", dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--nsamples", type=int, default=DEFAULT_NSAMPLES)
    ap.add_argument("--seqlen", type=int, default=DEFAULT_SEQLEN)
    ap.add_argument("--eval-windows", type=int, default=DEFAULT_EVAL_WINDOWS)
    ap.add_argument("--methods", default=",".join(BASELINES),
                    help="comma list of methods; fista:<start> sets FISTA's warm start (e.g. fista:dense)")
    ap.add_argument("--quick", action="store_true", help="8 calibration and 8 evaluation windows")
    ap.add_argument("--patterns", default=",".join(PATTERNS), help="comma list of: unstructured,2:4")
    ap.add_argument("--variant", default=None, help="label for this run's records (ratios stay within a variant)")
    ap.add_argument("--render-only", action="store_true", help="rewrite the table and plot from prune.json")
    args = ap.parse_args()
    if args.render_only:
        records = json.loads((RESULTS / "prune.json").read_text())
        write_outputs(records, "python bench/prune.py")
        print((RESULTS / "prune.md").read_text())
        return
    if args.quick:
        args.nsamples, args.eval_windows = 8, 8
    torch.manual_seed(0)
    model, tok = load_model(args.model)
    calib = calibration_windows(tok, DEFAULT_CALIB, args.nsamples, args.seqlen, seed=DEFAULT_SEED)
    test = token_windows(tok, load_text("shakespeare", "test"), args.seqlen)[: args.eval_windows]
    dense_state = copy.deepcopy(model.state_dict())
    command = shlex.join(["python", "bench/prune.py", *sys.argv[1:]])
    common = {"model": args.model, "calib": "shakespeare", "nsamples": args.nsamples, "seqlen": args.seqlen,
              "eval_windows": int(test.shape[0])}
    if args.variant:
        common["variant"] = args.variant
    records = [{"method": "dense", "pattern": "dense", "sparsity": 0.0,
                "ppl": perplexity(model, test, batch_size=4, progress=False), "seconds": 0.0, **common}]
    print(f"dense ppl {records[0]['ppl']:.2f}", flush=True)
    for pattern in args.patterns.split(","):
        spec = PATTERNS[pattern]
        for entry in args.methods.split(","):
            method, _, warm = entry.partition(":")  # fista:dense is FISTA from a cold (dense) start
            pruner = pruner_class(method)(warm_start=warm) if warm else pruner_class(method)()
            ppl, seconds, _ = run_method(model, dense_state, calib, test, method, spec, pruner=pruner,
                                         progress=True, batch_size=DEFAULT_BATCH_SIZE)
            record = {"method": method, "pattern": pattern, "sparsity": spec.target_sparsity, "ppl": ppl,
                      "seconds": seconds, **common}
            if hasattr(pruner, "warm_start"):
                record["warm_start"] = pruner.warm_start
                record["method_config"] = pruner.config()
            record["command"] = command
            records.append(record)
            print(f"{method:10s} {pattern:12s} ppl {ppl:8.2f}  {seconds:6.1f} s", flush=True)
    all_records = merge_records(records)
    for r in all_records:
        r.setdefault("machine", machine_info()["cpu"])
    write_outputs(all_records, command)
    print((RESULTS / "prune.md").read_text())


if __name__ == "__main__":
    main()
