"""Architecture coverage: every family x {magnitude, wanda, sparsegpt, fista, fasp}.

Tiny random-weight models built from each family's ``transformers`` config class (``tests/builders.py``,
2 layers; source ``random-tiny``) and the real SmolLM2-135M (source ``real``) are pruned through the
engine, saved with ``save_pretrained``, reloaded with plain ``AutoModelForCausalLM.from_pretrained``
and compared with the pruned in-memory model on fixed ids. One record per (model, source, method,
pattern):

    {"model_type", "source", "method", "pattern", "ok", "error", "sparsity_measured",
     "reload_max_abs_diff", "params_before", "params_after", "seconds", "cpu_seconds"}

``sparsity_measured`` is read from the reloaded weights (fraction of zeros over the decoder layers'
linears); ``seconds``/``cpu_seconds`` time the pruning alone. A setting the model cannot take records
``ok: false`` and the one-line error. Writes ``bench/results/arch.{json,md}`` and the coverage table
into ``docs/prune.md`` between the ``bench:arch`` markers.

    python bench/arch.py --only random        # the nine tiny families (about a minute)
    python bench/arch.py --only real          # SmolLM2-135M (minutes; run under the CPU lock)
    python bench/arch.py --render-only        # tables from the JSON
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from _common import merge_records, replace_block
from leanml.config import ConfigError
from leanml.errors import LeanmlError
from leanml.machine import machine_info, machine_line
from leanml.models import count_parameters, decoder_linear_names
from leanml.models.tiny import FAMILIES, tiny_family
from leanml.outputs import write_json
from leanml.prune.engine import prune_model
from leanml.prune.masks import MaskSpec
from leanml.prune.methods import pruner_class

ROOT = Path(__file__).resolve().parent.parent

RESULTS = ROOT / "bench" / "results"
DOC = ROOT / "docs" / "prune.md"
README = ROOT / "README.md"
METHODS = ["magnitude", "wanda", "sparsegpt", "fista", "fasp"]
#: (method, pattern) runs: 50 % unstructured for every unstructured method, 2:4 for the two that users
#: run most with it, 25 % structured for FASP (a quarter of all parameters, MLP units and whole key/value
#: groups; MLP units only in families whose head layout cannot shrink)
RUNS = [("magnitude", "50%"), ("wanda", "50%"), ("sparsegpt", "50%"), ("fista", "50%"), ("wanda", "2:4"),
        ("sparsegpt", "2:4"), ("fasp", "structured 25%")]
FIELDS = ["model_type", "source", "method", "pattern", "ok", "error", "sparsity_measured", "reload_max_abs_diff",
          "params_before", "params_after", "seconds", "cpu_seconds"]


def _spec(pattern: str) -> MaskSpec:
    if pattern == "2:4":
        return MaskSpec(pattern=(2, 4))
    if pattern.startswith("structured"):
        return MaskSpec(float(pattern.split()[-1].rstrip("%")) / 100)
    return MaskSpec(float(pattern.rstrip("%")) / 100)


def _sparsity(model: torch.nn.Module) -> float:
    zeros = total = 0
    for name in decoder_linear_names(model):
        w = model.get_submodule(name).weight
        zeros += int((w == 0).sum())
        total += w.numel()
    return zeros / max(total, 1)


def run_one(make, model_type: str, source: str, method: str, pattern: str, calib: torch.Tensor,
            test: torch.Tensor, batch_size: int) -> dict[str, Any]:
    """Prune a fresh model, save, reload with plain transformers, compare logits."""
    from transformers import AutoModelForCausalLM

    rec: dict[str, Any] = {k: None for k in FIELDS}
    rec.update(model_type=model_type, source=source, method=method, pattern=pattern, ok=False)
    try:
        model = make()
        rec["params_before"] = count_parameters(model)
        t0, c0 = time.perf_counter(), time.process_time()
        pruner = pruner_class(method)()
        try:
            prune_model(model, calib, pruner, _spec(pattern), batch_size=batch_size, progress=False)
        except ConfigError as exc:  # a family whose attention cannot shrink: FASP on its MLP alone
            if method != "fasp" or "pairs" not in exc.fields:
                raise
            model, pruner = make(), pruner_class(method)(pairs=("mlp",))
            prune_model(model, calib, pruner, _spec(pattern), batch_size=batch_size, progress=False)
            rec["fasp_pairs"] = "mlp"
        rec["seconds"], rec["cpu_seconds"] = time.perf_counter() - t0, time.process_time() - c0
        with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
            model.save_pretrained(tmp)
            loaded = AutoModelForCausalLM.from_pretrained(tmp).eval()
            ref, got = model(test).logits, loaded(test).logits
        rec["reload_max_abs_diff"] = float((ref - got).abs().max())
        rec["sparsity_measured"] = _sparsity(loaded)
        rec["params_after"] = count_parameters(loaded)
        rec["ok"] = rec["reload_max_abs_diff"] <= 1e-4
        if not rec["ok"]:
            rec["error"] = f"reloaded logits differ by {rec['reload_max_abs_diff']:.2e}"
    except Exception as exc:  # a setting the model cannot take is a result, not a crash
        rec["error"] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if not isinstance(exc, LeanmlError):
            traceback.print_exc()
    return rec


def run_random(args: argparse.Namespace) -> list[dict[str, Any]]:
    calib = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(0))
    test = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    records = []
    for family in args.families:
        for method, pattern in RUNS:
            if method in args.methods:
                rec = run_one(lambda f=family: tiny_family(f), family, "random-tiny", method, pattern, calib, test, 4)
                print(_line(rec), flush=True)
                records.append(rec)
    return records


def run_real(args: argparse.Namespace) -> list[dict[str, Any]]:
    from leanml.data.text import calibration_windows, load_text, token_windows
    from leanml.models import load_model

    dense, tok = load_model("smollm2-135m")
    calib = calibration_windows(tok, "shakespeare", args.nsamples, args.seqlen, 0)
    test = token_windows(tok, load_text("shakespeare", "test"), args.seqlen)[:2]

    records = []
    for method, pattern in RUNS:
        if method in args.methods:
            rec = run_one(lambda: copy.deepcopy(dense), "llama", "real", method, pattern, calib, test, 8)
            rec["model"] = "SmolLM2-135M"
            print(_line(rec), flush=True)
            records.append(rec)
    return records


def _line(r: dict[str, Any]) -> str:
    status = "ok" if r["ok"] else f"FAILED: {r['error']}"
    sp = f"{r['sparsity_measured']:.3f}" if r["sparsity_measured"] is not None else "-"
    return f"{r['source']:11s} {r['model_type']:12s} {r['method']:10s} {r['pattern']:15s} sparsity {sp}  {status}"


def _key(r: dict[str, Any]) -> tuple:
    return (r["source"], r["model_type"], r["method"], r["pattern"])


def merge(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return merge_records(old, new, _key)


def render(data: dict[str, Any]) -> tuple[str, str]:
    """(the full Markdown page, the coverage table for docs/prune.md), both from the records."""
    recs = sorted(data["records"], key=lambda r: (r["source"] != "random-tiny", FAMILIES.index(r["model_type"])
                                                  if r["model_type"] in FAMILIES else 99, r["method"], r["pattern"]))
    meta = data["meta"]
    head = [f"Machine: {meta['machine_line']}; torch threads {meta['torch_threads']}; load average "
            f"{meta['load']}.  ", "Commands: " + "; ".join(f"`{c}`" for c in meta["commands"]) + ".  ",
            "Tiny models: 2 layers from each family's config class, random weights, 8 x 64 calibration tokens; "
            "SmolLM2-135M: real weights, "
            f"{meta.get('real_calib', '-')} Shakespeare calibration tokens. A cell is `ok` when the pruned model "
            "saved with `save_pretrained` reloads with plain `AutoModelForCausalLM.from_pretrained` to logits "
            "within 1e-4 of the in-memory model; the number is the sparsity measured on the reloaded weights "
            "(structured: parameters after / before; `(mlp)`: FASP on MLP units alone, the family's key/value "
            "heads cannot shrink in its config).", ""]
    runs = [f"{m} {p}" for m, p in RUNS]
    rows = sorted({(r["source"], r["model_type"]) for r in recs},
                  key=lambda k: (k[0] != "random-tiny", FAMILIES.index(k[1]) if k[1] in FAMILIES else 99))
    cell = {(r["source"], r["model_type"], f"{r['method']} {r['pattern']}"): r for r in recs}
    table = ["| model | source | " + " | ".join(runs) + " |", "|---|---|" + "---|" * len(runs)]
    for src, mt in rows:
        cells = []
        for run in runs:
            r = cell.get((src, mt, run))
            if r is None:
                cells.append("-")
            elif not r["ok"]:
                cells.append("no")
            elif run.startswith("fasp"):
                cells.append(f"ok {r['params_after'] / r['params_before']:.3f}"
                             + (" (mlp)" if r.get("fasp_pairs") == "mlp" else ""))
            else:
                cells.append(f"ok {r['sparsity_measured']:.3f}")
        name = "SmolLM2-135M (llama)" if src == "real" else mt
        table.append(f"| {name} | {src} | " + " | ".join(cells) + " |")
    first: dict[str, str] = {}
    for m, p in RUNS:
        first.setdefault(m, p)
    ok_fams = {m: sum(1 for r in recs if r["source"] == "random-tiny" and r["method"] == m and r["ok"]
                      and r["pattern"] == first[m]) for m in METHODS}
    summary = ["Families `ok` (tiny, first pattern of each method): " +
               ", ".join(f"{m} {n}/{len(FAMILIES)}" for m, n in ok_fams.items()) + "."]
    worst = max((r["reload_max_abs_diff"] for r in recs if r["reload_max_abs_diff"] is not None), default=None)
    if worst is not None:
        summary.append(f"Largest reload difference: {worst:.1e}.")
    failures = [f"- {r['model_type']} ({r['source']}) {r['method']} {r['pattern']}: {r['error']}"
                for r in recs if not r["ok"]]
    detail = ["| model_type | source | method | pattern | ok | sparsity_measured | reload_max_abs_diff | "
              "params_before | params_after | seconds | cpu_seconds |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in recs:
        f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
        detail.append(f"| {r['model_type']} | {r['source']} | {r['method']} | {r['pattern']} | {r['ok']} | "
                      f"{f(r['sparsity_measured'], '.4f')} | {f(r['reload_max_abs_diff'], '.1e')} | "
                      f"{f(r['params_before'], ',')} | {f(r['params_after'], ',')} | {f(r['seconds'], '.2f')} | "
                      f"{f(r['cpu_seconds'], '.2f')} |")
    coverage = "\n".join([*head, *table, "", *summary, *(["", "Refused settings:", *failures] if failures else [])])
    page = "\n".join(["# Architecture coverage (`bench/arch.py`)", "", coverage, "", "## All records", "", *detail, ""])
    return page, coverage


def _replace_between_markers(path: Path, body: str) -> None:
    """Replace the text between the bench:arch markers of ``path`` (if the page has them)."""
    replace_block(path, "arch", f"\n{body}\n")


def write_doc_table(coverage: str) -> None:
    """The coverage section into docs/prune.md, and its table and summary (no prose) into the README."""
    _replace_between_markers(DOC, coverage)
    lines = coverage.splitlines()
    compact = ([ln for ln in lines if ln.startswith("|")] + [""]
               + [ln for ln in lines if ln.startswith(("Families", "Largest"))])
    machine = next((line for line in coverage.splitlines() if line.startswith("Machine:")), "").rstrip()
    _replace_between_markers(README, "\n".join([*compact, "", f"{machine} Full records: "
                                                 "[bench/results/arch.md](bench/results/arch.md)."]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["random", "real", "all"], default="all")
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma list of tiny families")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma list of methods")
    ap.add_argument("--nsamples", type=int, default=16, help="SmolLM2 calibration windows (default 16)")
    ap.add_argument("--seqlen", type=int, default=256, help="SmolLM2 calibration window length (default 256)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--render-only", action="store_true", help="rewrite the tables from the JSON")
    args = ap.parse_args()
    args.families = [f for f in args.families.split(",") if f]
    args.methods = [m for m in args.methods.split(",") if m]
    torch.set_num_threads(args.threads)
    path = RESULTS / "arch.json"
    data = json.loads(path.read_text()) if path.exists() else {"meta": {"commands": []}, "records": []}
    if not args.render_only:
        load_before = os.getloadavg()
        new = []
        if args.only in ("random", "all"):
            new += run_random(args)
        if args.only in ("real", "all"):
            new += run_real(args)
            data["meta"]["real_calib"] = f"{args.nsamples} x {args.seqlen}"
        command = "python bench/arch.py " + " ".join(sys.argv[1:])
        info = machine_info()
        data["meta"].update(machine_line=machine_line(), machine=info, torch_threads=args.threads,
                            load=f"{load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after the last chunk")
        data["meta"]["commands"] = list(dict.fromkeys([*data["meta"].get("commands", []), command.strip()]))
        data["records"] = merge(data["records"], new)
        write_json(path, data)
    page, coverage = render(data)
    (RESULTS / "arch.md").write_text(page)
    write_doc_table(coverage)
    print(coverage)
    return 0


if __name__ == "__main__":
    sys.exit(main())
