"""``leanml recover``: fine-tune a model written by ``leanml prune``, keeping its sparsity, under a memory budget.

The options are the fields of :class:`~leanml.recover.job.RecoverJob` (and the
:class:`~leanml.recover.config.RecoverConfig` and :class:`~leanml.train.config.TrainConfig` it holds);
the work is :func:`~leanml.recover.job.run_recover_job`."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING, Any

from leanml.flags import add_command

if TYPE_CHECKING:
    from leanml.recover.job import RecoverJob

EPILOG = """examples:
  leanml prune --model smollm2-135m --method sparsegpt --sparsity 0.5 --out out/sgpt50
  leanml recover --model out/sgpt50 --steps 200 --memory adacc --memory-budget 0.5 --out out/sgpt50-rec
  leanml recover --model out/sgpt24 --teacher smollm2-135m --kd-weight 0.5 --out out/sgpt24-kd
  leanml recover --model out/fasp30 --teacher source --memory checkpoint --out out/fasp30-rec
  leanml recover --model out/fasp30 --teacher smollm2-135m --kd-weight 1 --teacher-samples 0.5 --out out/f30-mix
  leanml recover --model out/sgpt50 --teacher smollm2-135m --kd-weight 1 --teacher-samples 0.5 \
      --teacher-samples-cache out/samples --out out/s50-mix   # a later run with the same teacher reuses them
  leanml recover --model smollm2-135m --no-mask --steps 200 --out out/dense-ft   # the dense reference
  leanml recover --model out/sgpt50 --save-format compressed --dtype bfloat16 --out out/sgpt50-rec-small
  leanml recover ... --resume        # continue a killed run from its last checkpoint (DIR.ckpt)

the mask:
  The mask is the model's zeros: every linear layer except the output head keeps its exact zeros (the
  gradients are masked, and the weights re-masked after every optimizer step); a bias entry of a row
  whose weights are all zero stays zero. report.json next to the weights (written by leanml prune)
  declares what the zeros must satisfy and is checked first: an N:M pattern in every group of M inputs,
  or the unstructured sparsity. Structured (FASP) models train at their smaller size. --pattern N:M
  declares a pattern for models without report.json; --no-mask trains every weight.

distillation:
  --teacher DENSE adds T^2 * KL(teacher || student) on the logits with weight --kd-weight:
  loss = (1 - w) * CE + w * KL. The teacher must have the student's tokenizer; "source" means the model
  the input was pruned from (its report.json). Its forward counts in the step time, its targets in the
  activation peak and Adacc's budget. --teacher-samples F replaces a share F of the steps x batch-size
  training windows with windows sampled from the teacher (temperature 1, from its BOS token), so the
  student learns the teacher beyond the domain of --data; the sampling time counts in the run's time.
  --teacher-samples-cache DIR keeps the samples (keyed by a hash of the teacher's weights, the window
  count and length, the seed and the start token) so that runs with the same teacher sample once; a run
  that reuses them reports the seconds the sampling took where it was done.

--memory-budget (--memory adacc only; default 0.5) is a fraction of the unoptimized activation peak of
one step in (0, 1], or a size with its unit (2GB, 3000000B); a budget below the smallest feasible plan is
refused before training.

output: DIR (model + tokenizer, report.json, losses.csv), written atomically. Training keeps float32
weights and optimizer state; the model is saved in --dtype (default: the input's dtype; a kept weight
too small for float16 is stored as its smallest normal number, so the zeros stay exactly the input's), as
plain safetensors that from_pretrained loads, or with --save-format compressed in the sparse-bitmask
layout (what leanml prune --save-format compressed writes; leanml loads it back).
Checkpoints go to DIR.ckpt every --checkpoint-every steps and are removed when DIR is written.
Every input (model files, corpora, teacher, output folder, options) is checked before the model is
loaded; a run refused later (e.g. a budget below the smallest plan) leaves no DIR.ckpt behind.
"""



def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``recover`` subcommand."""
    from leanml.recover.job import RecoverJob

    add_command(sub, "recover", RecoverJob, run, skip=("compile_blocks",),
                help="fine-tune a pruned model keeping its sparsity, with optional distillation, under a memory "
                "budget",
                description="Fine-tune a model written by `leanml prune` on a text corpus, keeping its mask exactly "
                "(unstructured, N:M, structured), optionally distilling a dense teacher, under a training-memory "
                "strategy; report perplexity before and after, time and peak memory.",
                epilog=EPILOG)


def run(job: RecoverJob) -> int:
    """Run ``leanml recover``."""
    from leanml.recover.job import run_recover_job

    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    report = run_recover_job(job)
    print_summary(report, job.out)
    return 0


def print_summary(report: dict[str, Any], out: str) -> None:
    mib = 2**20
    sp, mem, tm, save = report["sparsity"], report["memory"], report["timings"], report["save"]
    print(f"sparsity {sp['in']:.4f} -> {sp['out']:.4f}" + (" (kept exactly)" if sp["kept_exactly"] else ""))
    before, after = report["perplexity_before"] or {}, report["perplexity_after"] or {}
    for name in after:
        b = before.get(name, {}).get("ppl")
        print(f"perplexity {name}: " + (f"{b:.2f} -> " if b is not None else "") + f"{after[name]['ppl']:.2f}")
    budget = mem["budget_bytes"]
    print(f"memory={mem['strategy']} peak {mem['peak_bytes'] / mib:.1f} MiB"
          + (f" (unoptimized {mem['unoptimized_peak_bytes'] / mib:.1f} MiB)" if mem["unoptimized_peak_bytes"] else "")
          + (f", budget {budget / mib:.1f} MiB, {'within' if mem['within_budget'] else 'OVER'}" if budget else ""))
    print(f"loss {report['loss_first']:.4f} -> {report['loss_last10']:.4f} (mean of last 10); "
          f"{len(report['losses']['loss'])} steps in {tm['train_seconds']:.1f} s "
          f"(median {tm['median_step_s']:.2f} s/step)")
    print(f"saved {save['weights_bytes'] / mib:.1f} MiB ({save['format']}, {save['dtype']}) -> {out}")
