"""``leanml train``: fine-tune a causal LM on a text corpus under a training-memory strategy."""

from __future__ import annotations

import argparse
import csv
import logging
import sys

from leanml.utils import (
    LeanmlError,
    add_threads_arg,
    apply_threads,
    atomic_dir,
    float_in,
    int_at_least,
    machine_info,
    write_json,
)

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
    p = sub.add_parser(
        "train",
        help="fine-tune a causal LM under a training-memory strategy (Adacc)",
        description="Fine-tune a causal LM on a text corpus with a training-memory strategy and report the "
        "peak saved-activation memory, step time, tokens/s and loss.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m, a model directory, a .gguf file or a hub id")
    p.add_argument("--data", default="shakespeare", help="text corpus (training split)")
    p.add_argument("--batch-size", type=int_at_least(1), default=4)
    p.add_argument("--seqlen", type=int_at_least(2), default=256)
    p.add_argument("--steps", type=int_at_least(1), default=50)
    p.add_argument("--memory", choices=["none", "checkpoint", "sac", "compile", "adacc"], default="adacc")
    p.add_argument("--compile-blocks", nargs="?", const="1,0.5,0", default=None, metavar="BUDGETS",
                   help="adacc: also offer each layer as a compiled block (torch.compile; minutes of compile time) at "
                   "these recomputation budgets of the compiler (comma-separated, default 1,0.5,0)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="weights and activations dtype")
    p.add_argument("--memory-budget", default="0.5", help="fraction of the unoptimized peak in (0, 1], or a size with its unit like 2GB or 3000000B")
    p.add_argument("--max-error", type=float_in(0, 1, low_open=True), default=0.05,
                   help="cap on the relative error of lossy compressors")
    p.add_argument("--lr", type=float_in(0, low_open=True), default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output directory (default out/train-<memory>)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    p.add_argument("--save", action="store_true", help="also save the fine-tuned model into the output directory")
    add_threads_arg(p)
    p.set_defaults(func=run)


def parse_compile_budgets(spec: str | None) -> tuple[float, ...]:
    """``"1,0.5,0"`` -> ``(1.0, 0.5, 0.0)``; None -> ``()`` (no compiled blocks). Raises
    :class:`LeanmlError` on anything but comma-separated numbers in [0, 1]."""
    if spec is None:
        return ()
    try:
        budgets = tuple(float(b) for b in spec.split(","))
    except ValueError:
        budgets = ()
    if not budgets or not all(0.0 <= b <= 1.0 for b in budgets):
        raise LeanmlError(f"--compile-blocks takes comma-separated compiler budgets in [0, 1] (like 1,0.5,0), got {spec!r}")
    return budgets


def run(args: argparse.Namespace) -> int:
    """Run ``leanml train``."""
    import torch

    from leanml.data.text import check_corpus, load_text, token_windows
    from leanml.memory.train import TrainConfig, run_training
    from leanml.models import check_dtype, load_model, save_model
    from leanml.models.check import check_model_input
    from leanml.utils import check_output_dir, default_device

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    cfg = TrainConfig(strategy=args.memory, budget=args.memory_budget, batch_size=args.batch_size,
                      steps=args.steps, lr=args.lr, seed=args.seed, max_error=args.max_error,
                      compile_blocks=parse_compile_budgets(args.compile_blocks))
    cfg.check()
    if cfg.compile_blocks and args.memory != "adacc":
        raise LeanmlError(f"--compile-blocks is an option of --memory adacc, not of --memory {args.memory}")
    out = args.out or f"out/train-{args.memory}"
    check_output_dir(out, args.overwrite)
    threads = apply_threads(args.threads)
    device = default_device()
    dtype = getattr(torch, args.dtype)
    check_dtype(dtype, device)
    check_model_input(args.model, args.seqlen)
    check_corpus(args.data, "train", "--data")
    model, tokenizer = load_model(args.model, dtype=dtype, device=device)
    windows = token_windows(tokenizer, load_text(args.data, "train"), args.seqlen)
    torch.manual_seed(args.seed)
    result = run_training(model, windows, cfg)
    with atomic_dir(out, overwrite=args.overwrite) as tmp:
        report = {"config": vars(args) | {"func": None}, "threads": threads, "machine": machine_info(),
                  "result": result}
        write_json(tmp / "report.json", report)
        with open(tmp / "losses.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["step", "loss", "step_s", "peak_bytes"])
            for i, (loss, t, pk) in enumerate(zip(result["losses"], result["step_times"], result["step_peaks"])):
                w.writerow([i, f"{loss:.6f}", f"{t:.4f}", pk])
        if args.save:
            save_model(model, tokenizer, tmp / "model")
    mib = 2**20
    budget = result["budget_bytes"]
    print(f"memory={args.memory} peak={result['peak_bytes'] / mib:.1f} MiB "
          f"(unoptimized {result['unoptimized_peak_bytes'] / mib:.1f} MiB"
          + (f", budget {budget / mib:.1f} MiB" if budget else "") + ")")
    over = result["steps_over_budget"]
    print(f"peak measured on all {result['steps']} steps" + (f", {over} over budget" if over is not None else ""))
    print(f"step {result['step_s']:.3f} s (median), {result['tokens_s']:.0f} tokens/s (re-planning included), "
          f"loss {result['losses'][0]:.4f} -> {result['final_loss']:.4f} (mean of last 10)")
    print(f"report: {out}/report.json")
    return 0
