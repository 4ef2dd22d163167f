"""``leanml train``: fine-tune a causal LM on a text corpus under a training-memory strategy.

The options are the fields of :class:`~leanml.memory.job.TrainJob` (and the
:class:`~leanml.train.config.TrainConfig` it holds); the work is :func:`~leanml.memory.job.run_train_job`."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING

from leanml.flags import add_command

if TYPE_CHECKING:
    from leanml.memory.job import TrainJob

EPILOG = """examples:
  leanml train --model smollm2-135m --data shakespeare --memory adacc --memory-budget 0.5
  leanml train --model smollm2-135m --memory adacc --memory-budget 0.25 --compile-blocks
  leanml train --model smollm2-135m --memory adacc --memory-budget 0.25 --compile-blocks 1,0.5,0.25,0
  leanml train --model smollm2-135m --dtype bfloat16 --memory adacc --memory-budget 0.5
  leanml train --model smollm2-135m --batch-size 2 --seqlen 128 --steps 20 --memory checkpoint
  leanml train --model ./my-llama --memory adacc --memory-budget 2GB --out out/ft --save

memory strategies:
  none        keep every activation autograd saves
  checkpoint  recompute every decoder layer in backward (non-reentrant checkpointing)
  sac         torch selective checkpointing: save matmul and attention outputs, recompute pointwise ops
  compile     torch.compile with activation_memory_budget = --memory-budget (a fraction)
  adacc       per-group retain / recompute / compress, planned by a MILP to fit --memory-budget
              (--compile-blocks: layers may also run as compiled blocks, chosen by the same MILP)

--memory-budget is a fraction of the unoptimized activation peak in (0, 1] (0.5) or a size with its unit
(2GB, 512MiB, 3000000B).
Every step's peak is measured; the run fails with the smallest feasible budget if the budget cannot hold.
Writes DIR/report.json (config, machine, plan, per-step loss, time and peak) and DIR/losses.csv.
"""



def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``train`` subcommand."""
    from leanml.memory.job import TrainJob

    add_command(sub, "train", TrainJob, run,
                help="fine-tune a causal LM under a training-memory strategy (Adacc)",
                description="Fine-tune a causal LM on a text corpus with a training-memory strategy and report the "
                "peak saved-activation memory, step time, tokens/s and loss.",
                epilog=EPILOG)


def run(job: TrainJob) -> int:
    """Run ``leanml train``."""
    from leanml.memory.job import run_train_job

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    result = run_train_job(job)["result"]
    mib = 2**20
    budget = result["budget_bytes"]
    print(f"memory={job.train.strategy} peak={result['peak_bytes'] / mib:.1f} MiB "
          f"(unoptimized {result['unoptimized_peak_bytes'] / mib:.1f} MiB"
          + (f", budget {budget / mib:.1f} MiB" if budget else "") + ")")
    over = result["steps_over_budget"]
    print(f"peak measured on all {result['steps']} steps" + (f", {over} over budget" if over is not None else ""))
    print(f"step {result['step_s']:.3f} s (median), {result['tokens_s']:.0f} tokens/s (re-planning included), "
          f"loss {result['losses'][0]:.4f} -> {result['final_loss']:.4f} (mean of last 10)")
    print(f"report: {job.out_dir}/report.json")
    return 0
