"""``leanml speed``: prefill/decode tokens/s, peak memory and size on disk of model directories."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from leanml.flags import add_command

if TYPE_CHECKING:
    from leanml.eval.config import SpeedJob

SPEED_EPILOG = """examples:
  leanml speed --model smollm2-135m
  leanml speed --model smollm2-135m out/fasp30 --repeats 5 --threads 1      # interleaved, side by side
  leanml speed --model dense-dir out/fista24 --device cuda --dtype bfloat16 --sparse-kernels  # dense vs 2:4
  leanml speed --model out/sgpt50 --prompt-len 512 --gen-len 64 --json runs/speed-sgpt50.json
"""


def register(sub: argparse._SubParsersAction) -> None:
    from leanml.eval.config import SpeedJob

    add_command(sub, "speed", SpeedJob, run_speed,
                help="prefill/decode tokens/s, peak memory and disk size of models",
                description="Time prefill (one forward over a random prompt, no KV cache) and greedy decode (one "
                "token at a time after a cached prompt) of each model, median of --repeats runs, models "
                "interleaved; report peak memory (CUDA allocator peak, or process peak RSS on CPU) and "
                "the bytes of each model directory's weight files. Writes a JSON report.",
                epilog=SPEED_EPILOG)


def run_speed(job: SpeedJob) -> int:
    from leanml.eval.speed import run_speed_job

    report = run_speed_job(job)
    base = report["models"][0]
    print(f"{'model':<30} {'prefill tok/s':>14} {'decode tok/s':>13} {'peak MiB':>9} {'disk MiB':>9}")
    for r in report["models"]:
        ratio = f" ({r['prefill_tok_s'] / base['prefill_tok_s']:.2f}x)" if r is not base else ""
        dec = "-" if r["decode_tok_s"] is None else f"{r['decode_tok_s']:.1f}"
        disk = "-" if r["disk_bytes"] is None else f"{r['disk_bytes'] / 2**20:.1f}"
        print(f"{r['model'][-30:]:<30} {r['prefill_tok_s']:>14.1f} {dec:>13} "
              f"{r['peak_memory_bytes'] / 2**20:>9.0f} {disk:>9}{ratio}")
    print(f"-> {report['json']}")
    return 0
