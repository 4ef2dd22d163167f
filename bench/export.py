"""Disk size and reload time of ``--save-format compressed`` versus dense, on SmolLM2-135M.

For each sparsity (50 %, 2:4, 70 % by default): prune SmolLM2-135M-Instruct (float32) with
``leanml prune --method magnitude --no-eval --save-format compressed`` (magnitude: no calibration, so the
run is about the format, not the method), then write the dense copy of the same weights with
``leanml.models.compressed.decompress_dir`` (what stock ``from_pretrained`` loads). Record:

- bytes of the weight files of the compressed and the dense directory (``leanml.eval.speed.dir_size_bytes``),
  their ratio, and the unpruned model's bytes;
- measured sparsity of the decoder linears (zeros / weights), from the reloaded model;
- reload seconds, median of ``--repeats`` interleaved loads: the compressed directory through
  ``leanml.models.load_model`` and the dense one through plain ``AutoModelForCausalLM.from_pretrained``
  (both float32, CPU), and whether the two give identical logits;
- what plain ``from_pretrained`` does with the compressed directory (it must fail, not load random weights).

    flock /tmp/leanml-cpu.lock .venv/bin/python bench/export.py            # writes bench/results/export.{json,md}
    flock /tmp/leanml-cpu.lock .venv/bin/python bench/export.py --sparsities 0.5 --repeats 1 --out /tmp/x
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from _common import replace_block
from leanml.config import replace
from leanml.eval.speed import dir_size_bytes
from leanml.flags import to_argv
from leanml.machine import machine_info, machine_line
from leanml.models import bundled_dir, decoder_linear_names, load_model
from leanml.models.compressed import decompress_dir
from leanml.outputs import atomic_file, write_json
from leanml.prune.config import PruneConfig, PruneJob
from leanml.prune.job import run_job

RESULTS = Path(__file__).resolve().parent / "results"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "prune.md"


def _label(s: str) -> str:
    return s if ":" in s else f"{float(s):.0%}"


def measured_sparsity(model: torch.nn.Module) -> float:
    modules = dict(model.named_modules())
    ws = [modules[n].weight for n in decoder_linear_names(model)]
    return sum(int((w == 0).sum()) for w in ws) / sum(w.numel() for w in ws)


def _plain(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _plain_on_compressed(path: Path) -> str:
    try:
        _plain(path)
    except Exception as exc:  # noqa: BLE001 - what stock transformers raises is the measurement
        return f"fails: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    return "LOADS (unexpected)"


def run_one(spec: str, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    comp, dense = work / f"c-{spec.replace(':', 'of')}", work / f"d-{spec.replace(':', 'of')}"
    mask = {"pattern": spec} if ":" in spec else {"sparsity": float(spec)}
    # magnitude needs no calibration; the engine's per-layer error report runs on 4 short windows
    job = PruneJob(model="smollm2-135m", out=str(comp), overwrite=True, eval=False, save_format="compressed",
                   config=PruneConfig(method="magnitude", nsamples=4, seqlen=64, **mask))
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    run_job(job)
    prune_s = time.perf_counter() - t0
    decompress_dir(comp, dense, overwrite=True)
    saved = json.loads((comp / "report.json").read_text())["save"]
    ids = torch.randint(0, 49152, (1, 64), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {"c_load": [], "c_ready": [], "d_load": [], "d_ready": []}
    for _ in range(args.repeats):  # interleaved; "ready": loaded and the first logits computed
        for key, load in (("c", lambda: load_model(str(comp))[0]), ("d", lambda: _plain(dense))):
            gc.collect()
            t0 = time.perf_counter()
            model = load()
            times[f"{key}_load"].append(time.perf_counter() - t0)
            with torch.no_grad():
                logits = model(input_ids=ids).logits
            times[f"{key}_ready"].append(time.perf_counter() - t0)
            if key == "c":
                m_c, logits_c = model, logits
            else:
                same = torch.equal(logits_c, logits)
            del model
    rec = {
        "sparsity": _label(spec), "method": "magnitude", "dtype": "float32",
        "command": "leanml prune " + " ".join(to_argv(replace(job, out="DIR", overwrite=False),
                                                      always=("model", "method", "sparsity", "pattern"))),
        "measured_sparsity": measured_sparsity(m_c),
        "compressed_bytes": dir_size_bytes(comp), "dense_bytes": dir_size_bytes(dense),
        "linears_dense_bytes": saved["dense_bytes"], "linears_compressed_bytes": saved["compressed_bytes"],
        "reload_compressed_s": statistics.median(times["c_load"]),
        "reload_dense_plain_s": statistics.median(times["d_load"]),
        "ready_compressed_s": statistics.median(times["c_ready"]),
        "ready_dense_plain_s": statistics.median(times["d_ready"]),
        "reload_runs_s": times, "reload_identical_logits": same, "prune_seconds": prune_s,
        "plain_from_pretrained_on_compressed": _plain_on_compressed(comp),
        "loadavg_1min": [load_before, os.getloadavg()[0]],
    }
    rec["ratio"] = rec["compressed_bytes"] / rec["dense_bytes"]
    rec["linears_ratio"] = rec["linears_compressed_bytes"] / rec["linears_dense_bytes"]
    del m_c
    shutil.rmtree(comp, ignore_errors=True)
    shutil.rmtree(dense, ignore_errors=True)
    return rec


def write_outputs(records: list[dict[str, Any]], unpruned: int, args: argparse.Namespace, out: Path) -> list[str]:
    """Write ``export.md`` and ``export.json``; returns the Markdown lines."""
    out.mkdir(parents=True, exist_ok=True)
    command = ("python bench/export.py " + " ".join(sys.argv[1:])).strip()
    lines = [
        "# Compressed save format: size on disk and reload time (SmolLM2-135M, float32)",
        "",
        f"Machine: {machine_line()}; transformers {machine_info().get('transformers')}",
        "",
        f"Command: `{command}`. Each model: `leanml prune --model smollm2-135m --method magnitude --no-eval "
        "--save-format compressed`, then `decompress_dir` for the dense copy of the same weights. Bytes: weight "
        "files only (ratio: whole directories; pruned linears ratio: the pruned weights alone, the embedding "
        "table is stored as is). Reload: float32 on the CPU, median of "
        f"{args.repeats} interleaved loads; compressed through `leanml.models.load_model` (tokenizer included), "
        "dense through plain `AutoModelForCausalLM.from_pretrained` (safetensors are memory-mapped, so its load "
        "defers reading); ready: load plus the first forward pass over 64 tokens. "
        f"Unpruned model: {unpruned:,} bytes.",
        "",
        "| sparsity | measured | compressed bytes | dense bytes | ratio | pruned linears ratio | reload compressed s "
        "| reload dense s | ready compressed s | ready dense s | same logits | plain from_pretrained on compressed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        lines.append(
            f"| {r['sparsity']} | {r['measured_sparsity']:.4f} | {r['compressed_bytes']:,} | {r['dense_bytes']:,} | "
            f"{r['ratio']:.3f} | {r['linears_ratio']:.3f} | {r['reload_compressed_s']:.2f} | "
            f"{r['reload_dense_plain_s']:.2f} | {r['ready_compressed_s']:.2f} | {r['ready_dense_plain_s']:.2f} | "
            f"{'yes' if r['reload_identical_logits'] else 'NO'} | {r['plain_from_pretrained_on_compressed']} |"
        )
    lines.append("")
    with atomic_file(out / "export.md") as tmp:
        tmp.write_text("\n".join(lines))
    write_json(out / "export.json", {"machine": machine_info(), "command": command, "unpruned_bytes": unpruned,
                                     "repeats": args.repeats, "records": records})
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sparsities", default="0.5,2:4,0.7", help="comma list of fractions or N:M patterns")
    ap.add_argument("--repeats", type=int, default=3, help="reloads per format (median reported)")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    unpruned = dir_size_bytes(bundled_dir("smollm2-135m"))
    records = []
    with tempfile.TemporaryDirectory(prefix="leanml-export-") as work:
        for spec in args.sparsities.split(","):
            records.append(run_one(spec, Path(work), args))
            print({k: records[-1][k] for k in ("sparsity", "measured_sparsity", "compressed_bytes", "dense_bytes",
                                                "ratio", "linears_ratio", "reload_compressed_s", "reload_dense_plain_s",
                                                "ready_compressed_s", "ready_dense_plain_s")}, flush=True)
            lines = write_outputs(records, unpruned, args, Path(args.out))
    if Path(args.out).resolve() == RESULTS:  # the docs quote the records' table
        replace_block(DOCS, "export", "\n" + "\n".join(lines[2:]) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
