"""Compressor kernels, eager vs torch.compile: is compiling Adacc's pack/unpack worth it?

    python bench/memory_kernels.py            # writes bench/results/memory_kernels.{json,md}

Times pack and unpack of each compressor on SmolLM2-shaped activations (tokens x hidden 576 and
tokens x MLP 1536, float32 and bfloat16), eager and compiled with inductor (compile time reported
apart), median of repeated calls, modes interleaved.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from leanml.machine import machine_info, machine_line
from leanml.memory.compressors import make_compressor
from leanml.outputs import write_json

RESULTS = Path(__file__).resolve().parent / "results"


def _time(fn: Any, arg: Any, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(arg)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    records = []
    load_before = os.getloadavg()
    for dtype in (torch.float32, torch.bfloat16):
        for width in (576, 1536):
            torch.manual_seed(0)
            x = torch.randn(args.tokens, width).to(dtype)
            for name in ("bf16", "fp8-e4m3", "int8-token", "int8-channel", "int4-token"):
                comp = make_compressor(name, outlier_frac=0.01)
                if not comp.applies(x):
                    continue
                torch._dynamo.reset()  # a fresh cache per case: no case falls back to eager at the recompile limit
                cpack = torch.compile(comp.pack_fn, dynamic=False)
                cunpack = torch.compile(comp.unpack_fn, dynamic=False)
                t0 = time.perf_counter()
                try:
                    with torch.no_grad():
                        cunpack(cpack(x))
                except Exception as exc:  # noqa: BLE001 - a kernel the compiler cannot take is recorded
                    records.append({"dtype": str(dtype).removeprefix("torch."), "shape": [args.tokens, width],
                                    "compressor": name, "error": f"{type(exc).__name__}: {str(exc)[:160]}"})
                    continue
                compile_s = time.perf_counter() - t0
                with torch.no_grad():
                    p = comp.pack_fn(x)
                    rec = {"dtype": str(dtype).removeprefix("torch."), "shape": [args.tokens, width],
                           "compressor": name, "compile_s": compile_s}
                    for _ in range(2):  # interleave the modes
                        rec.setdefault("eager_pack_s", []).append(_time(comp.pack_fn, x, args.reps))
                        rec.setdefault("compiled_pack_s", []).append(_time(cpack, x, args.reps))
                        rec.setdefault("eager_unpack_s", []).append(_time(comp.unpack_fn, p, args.reps))
                        rec.setdefault("compiled_unpack_s", []).append(_time(cunpack, p, args.reps))
                    for k in ("eager_pack_s", "compiled_pack_s", "eager_unpack_s", "compiled_unpack_s"):
                        rec[k] = min(rec[k])
                    same = torch.equal(cunpack(cpack(x)), comp.unpack_fn(comp.pack_fn(x)))
                rec["same_result"] = same
                records.append(rec)
                print(rec, file=sys.stderr)
    out = Path(args.out)
    payload = {"command": "python bench/memory_kernels.py " + " ".join(sys.argv[1:]), "machine": machine_info(),
               "machine_line": machine_line(), "threads": args.threads, "reps": args.reps,
               "load_before": load_before, "load_after": os.getloadavg(), "records": records,
               "seconds": time.perf_counter() - t_start}
    write_json(out / "memory_kernels.json", payload)
    lines = ["# Adacc compressor kernels: eager vs torch.compile", "",
             f"Machine: {machine_line()}, {args.threads} threads, load average {load_before[0]:.1f} -> "
             f"{payload['load_after'][0]:.1f}. Command: `{payload['command']}`. Median of {args.reps} calls, best of "
             "2 interleaved rounds.", "",
             "| dtype | shape | compressor | eager pack ms | compiled pack ms | eager unpack ms | compiled unpack ms | "
             "pack+unpack speed-up | compile s | same result |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        if r.get("error"):
            lines.append(f"| {r['dtype']} | {r['shape'][0]}x{r['shape'][1]} | {r['compressor']} | did not compile: "
                         f"{r['error']} | | | | | | |")
            continue
        e = r["eager_pack_s"] + r["eager_unpack_s"]
        c = r["compiled_pack_s"] + r["compiled_unpack_s"]
        lines.append(f"| {r['dtype']} | {r['shape'][0]}x{r['shape'][1]} | {r['compressor']} | "
                     f"{r['eager_pack_s'] * 1e3:.2f} | "
                     f"{r['compiled_pack_s'] * 1e3:.2f} | {r['eager_unpack_s'] * 1e3:.2f} | "
                     f"{r['compiled_unpack_s'] * 1e3:.2f} | {e / c:.2f}x | {r['compile_s']:.0f} | {r['same_result']} |")
    (out / "memory_kernels.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
