"""``leanml speed``: prefill/decode tokens/s, peak memory and size on disk of model directories."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from leanml.utils import LeanmlError, add_threads_arg, apply_threads, int_at_least, machine_info, write_json

SPEED_EPILOG = """examples:
  leanml speed --model smollm2-135m
  leanml speed --model smollm2-135m out/fasp30 --repeats 5 --threads 1      # interleaved, side by side
  leanml speed --model dense-dir out/fista24 --device cuda --dtype bfloat16 --sparse-kernels  # dense vs 2:4
  leanml speed --model out/sgpt50 --prompt-len 512 --gen-len 64 --json runs/speed-sgpt50.json
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "speed",
        help="prefill/decode tokens/s, peak memory and disk size of models",
        description="Time prefill (one forward over a random prompt, no KV cache) and greedy decode (one token "
                    "at a time after a cached prompt) of each model, median of --repeats runs, models "
                    "interleaved; report peak memory (CUDA allocator peak, or process peak RSS on CPU) and "
                    "the bytes of each model directory's weight files. Writes a JSON report.",
        epilog=SPEED_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", nargs="+", default=["smollm2-135m"],
                   help="one or more HF directories, .gguf files, hub ids, or smollm2-135m")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weight dtype (default float32; sparse kernels need bfloat16 or float16)")
    p.add_argument("--prompt-len", type=int_at_least(1), default=256, help="prefill tokens per sequence")
    p.add_argument("--gen-len", type=int_at_least(0), default=32, help="decode steps timed (0: skip decode)")
    p.add_argument("--gen-prompt-len", type=int_at_least(1), default=32,
                   help="prompt put in the KV cache before decoding")
    p.add_argument("--batch-size", type=int_at_least(1), default=1, help="sequences per run")
    p.add_argument("--repeats", type=int_at_least(1), default=5, help="timed runs per model (median reported)")
    p.add_argument("--warmup", type=int_at_least(0), default=1, help="untimed runs per model first")
    add_threads_arg(p)
    p.add_argument("--sparse-kernels", action="store_true",
                   help="run the 2:4-sparse models among --model on semi-structured sparse kernels (CUDA, "
                        "bfloat16/float16; on the CPU they stay dense with a warning); the others run dense")
    p.add_argument("--json", default=None, help="where to write the JSON report (default runs/speed-*.json)")
    p.set_defaults(func=run_speed)


def _sparse_kernels(model: Any, spec: str) -> dict[str, Any] | None:
    """Put a 2:4 model on sparse kernels (its report), leave any other dense (``None``, with a line)."""
    from leanml.models.sparse import check_24, to_sparse_kernels

    try:
        check_24(model)
    except LeanmlError:
        print(f"{spec}: not 2:4 sparse, runs dense")
        return None
    return to_sparse_kernels(model, progress=False)


def run_speed(args: argparse.Namespace) -> int:
    from leanml.eval.job import check_json_out
    from leanml.eval.speed import dir_size_bytes, measure_speeds
    from leanml.models import BUNDLED, bundled_dir, check_dtype, count_parameters, load_model, parse_dtype
    from leanml.utils import parse_device

    device = parse_device(args.device)
    dtype = parse_dtype(args.dtype)
    check_dtype(dtype, device)
    if len(set(args.model)) != len(args.model):
        raise LeanmlError("the same --model is given twice; list each model once")
    name = "-".join(Path(s).name for s in args.model)[:80]
    json_path = check_json_out(args.json) or Path("runs") / f"speed-{name}.json"
    threads = apply_threads(args.threads)
    models: dict[str, Any] = {}
    info: dict[str, dict[str, Any]] = {}
    for spec in args.model:
        model, tok = load_model(spec, dtype=dtype, device=device)
        where = bundled_dir(spec) if spec in BUNDLED else Path(spec).expanduser()
        info[spec] = {"params": count_parameters(model),
                      "disk_bytes": dir_size_bytes(where) if where.exists() else None,
                      "sparse_kernels": _sparse_kernels(model, spec) if args.sparse_kernels else None}
        models[spec] = model
        vocab = len(tok)
    if args.sparse_kernels and all(i["sparse_kernels"] is None for i in info.values()):
        raise LeanmlError("--sparse-kernels: no --model is 2:4 sparse; prune one with --pattern 2:4 or drop the flag")
    results = measure_speeds(models, device=device, prompt_len=args.prompt_len, gen_len=args.gen_len,
                             repeats=args.repeats, batch_size=args.batch_size, gen_prompt_len=args.gen_prompt_len,
                             warmup=args.warmup, threads=threads, vocab_size=vocab)
    report = {"models": [{"model": spec, **info[spec], **results[spec]} for spec in args.model],
              "dtype": args.dtype, "machine": machine_info()}
    write_json(json_path, report)
    base = report["models"][0]
    print(f"{'model':<30} {'prefill tok/s':>14} {'decode tok/s':>13} {'peak MiB':>9} {'disk MiB':>9}")
    for r in report["models"]:
        ratio = f" ({r['prefill_tok_s'] / base['prefill_tok_s']:.2f}x)" if r is not base else ""
        dec = "-" if r["decode_tok_s"] is None else f"{r['decode_tok_s']:.1f}"
        disk = "-" if r["disk_bytes"] is None else f"{r['disk_bytes'] / 2**20:.1f}"
        print(f"{r['model'][-30:]:<30} {r['prefill_tok_s']:>14.1f} {dec:>13} "
              f"{r['peak_memory_bytes'] / 2**20:>9.0f} {disk:>9}{ratio}")
    print(f"-> {json_path}")
    return 0
