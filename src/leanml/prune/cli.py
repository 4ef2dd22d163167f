"""``leanml prune`` and ``leanml eval``."""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from leanml.utils import (
    LeanmlError,
    Timer,
    add_threads_arg,
    apply_threads,
    atomic_dir,
    check_output_dir,
    check_writable,
    clean_stale,
    clean_stale_in,
    float_in,
    int_at_least,
    machine_info,
    parse_device,
    write_json,
)

PRUNE_EPILOG = """examples:
  leanml prune --model smollm2-135m --method sparsegpt --sparsity 0.5 --out out/sgpt50
  leanml prune --model smollm2-135m --method wanda --pattern 2:4 --out out/wanda24
  leanml prune --model ./my-llama --method fista --sparsity 0.5 --calib shakespeare --nsamples 64 --out out/f
  leanml prune --model smollm2-135m --method fasp --sparsity 0.2 --out out/fasp20
  leanml prune --model smollm2-135m --method wanda --sparsity 0.7 --sparsity-profile owl --out out/owl70
  leanml prune --model smollm2-135m --method fista --calib-samples 0.5 --out out/f-mix   # half self-generated
  leanml prune --model ./big-model --dtype bfloat16 --device cuda --save-format compressed --out out/big
  torchrun --nproc_per_node=2 -m leanml prune --method fista --mode dense --out out/fista-par
  leanml prune ... --resume        # continue an interrupted run from its last finished layer
  leanml prune --model ./llama-70b --dtype bfloat16 --stream --max-memory 8GB --out out/big   # bigger than memory
"""

EVAL_EPILOG = """examples:
  leanml eval --model smollm2-135m --data shakespeare --seqlen 512
  leanml eval --model out/sgpt50 --data shakespeare --seqlen 512 --max-windows 20 --json ppl.json
  leanml eval --model ./big-model --dtype bfloat16 --device cuda   # layer by layer: the model stays on the CPU

eval prints the perplexity and writes nothing unless --json FILE is given.
"""


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="HF directory, .gguf file, hub id, or smollm2-135m")
    p.add_argument("--seqlen", type=int_at_least(2), default=512, help="tokens per window (512 on CPU)")
    p.add_argument("--batch-size", type=int_at_least(1), default=4, help="windows per forward pass")
    p.add_argument("--device", default=None,
                   help="where each decoder layer does its work: cpu or cuda (default: cuda when present); "
                        "the model's weights stay on the CPU and visit the device layer by layer")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weight dtype to load (statistics and solves stay float32; default float32)")
    add_threads_arg(p)


def register(sub: argparse._SubParsersAction) -> None:
    from leanml.prune.methods import available, pruner_class

    p = sub.add_parser(
        "prune",
        help="prune an LLM post-training (magnitude, wanda, sparsegpt, fista, fasp, ...)",
        description="Prune a causal LM layer by layer on calibration text and save a model that "
        "AutoModelForCausalLM.from_pretrained loads, with report.json.",
        epilog=PRUNE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_common(p)
    methods = available()
    p.add_argument("--method", default="sparsegpt", choices=methods, help="pruning method")
    p.add_argument("--sparsity", type=float_in(0, 1, low_open=True, high_open=True), default=0.5,
                   help="fraction of weights to remove, in (0, 1)")
    p.add_argument("--pattern", default=None, help="N:M semi-structured pattern, e.g. 2:4 (overrides --sparsity)")
    p.add_argument(
        "--scope", choices=["row", "layer"], default=None,
        help="unstructured mask: same count per output row, or one threshold per matrix (default: the method's)",
    )
    p.add_argument(
        "--sparsity-profile", choices=["uniform", "owl"], default="uniform",
        help="per-layer sparsity of unstructured methods: uniform, or owl (outlier-weighted, Yin et al. 2024; "
             "the total stays exact)",
    )
    p.add_argument("--owl-m", type=float_in(0, low_open=True), default=5.0, help="owl: outlier threshold M on |W|*||X|| (default 5)")
    p.add_argument("--owl-lambda", type=float_in(0, 1), default=0.08,
                   help="owl: largest deviation of a layer's sparsity from the target (default 0.08)")
    p.add_argument("--calib", default="shakespeare", help="calibration corpus (shakespeare, a .txt, wikitext2, c4, ptb)")
    p.add_argument("--nsamples", type=int_at_least(1), default=64, help="calibration windows")
    p.add_argument("--calib-samples", type=float_in(0, 1, what="a share of the calibration windows"), default=0.0, metavar="F",
                   help="share F in [0, 1] of the calibration windows sampled from the model itself (temperature 1, "
                        "from its BOS token; self-generated calibration beside --calib); default 0")
    p.add_argument("--seed", type=int, default=0, help="calibration sampling seed")
    p.add_argument(
        "--mode", choices=["sequential", "dense"], default="sequential",
        help="sequential: pruned outputs feed the next layer (default); dense: every layer sees dense inputs",
    )
    p.add_argument("--intra-layer", dest="intra_layer", action="store_true", default=None,
                   help="intra-layer cumulative error correction: later groups of a layer see the pruned "
                        "earlier ones (default: the method's; on for fista and structured methods)")
    p.add_argument("--no-intra-layer", dest="intra_layer", action="store_false",
                   help="gather a layer's statistics in one pass of the dense layer (default for magnitude, "
                        "wanda, sparsegpt)")
    p.add_argument("--eval-data", default="shakespeare", help="corpus whose test split gives perplexity")
    p.add_argument("--eval-windows", type=int_at_least(1), default=None,
                   help="evaluate on the first N test windows (default all)")
    p.add_argument("--no-eval", action="store_true", help="skip perplexity before/after")
    p.add_argument("--out", required=True, help="output directory (appears only when complete)")
    p.add_argument("--save-format", choices=["safetensors", "compressed"], default="safetensors",
                   help="safetensors (default; plain from_pretrained loads it) or compressed "
                        "(sparse-bitmask layout that leanml reloads: a 50%% model is 0.63x the dense directory; "
                        "python -m leanml.models.compressed writes the dense copy other tools read)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    p.add_argument("--resume", action="store_true", help="continue from the per-layer checkpoint of an interrupted run")
    p.add_argument("--checkpoint-interval", type=float_in(0), default=0.0, metavar="SECONDS",
                   help="write the activation streams for --resume at most every SECONDS (default 0: after every "
                        "layer); finished layers are always written; all writes run in the background")
    p.add_argument("--stream-device", choices=["auto", "device", "cpu"], default="auto",
                   help="where activations live between layers: auto (default: on the GPU while its free memory "
                        "allows, else pinned host memory), device, or cpu")
    p.add_argument("--stream", action="store_true",
                   help="never hold the whole model: read each layer from the safetensors shards, write it pruned, "
                        "free it (models bigger than memory; no perplexity)")
    p.add_argument("--max-memory", default=None, metavar="SIZE",
                   help="with --stream (implies it): host-memory cap, e.g. 1.2GB; activations spill to disk above it")
    for name in methods:
        pruner_class(name).add_args(p)
    p.set_defaults(func=run_prune)

    e = sub.add_parser(
        "eval",
        help="perplexity of a causal LM (SparseGPT protocol)",
        description="Perplexity over non-overlapping windows of the test split (SparseGPT's protocol).",
        epilog=EVAL_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_common(e)
    e.add_argument("--data", default="shakespeare", help="corpus (shakespeare, reviews, a .txt file, wikitext2, ptb, c4)")
    e.add_argument("--max-windows", type=int_at_least(1), default=None, help="evaluate the first N windows only")
    e.add_argument("--json", default=None, metavar="FILE",
                   help="also write the result as JSON to FILE (default: print it only, write nothing)")
    e.set_defaults(func=run_eval)


def _device(arg: str | None) -> torch.device:
    """``--device`` checked against this machine (see :func:`leanml.utils.parse_device`)."""
    return parse_device(arg)


def _check_seqlen(model: torch.nn.Module, seqlen: int) -> None:
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and seqlen > limit:
        raise LeanmlError(f"--seqlen {seqlen} is above the model's maximum of {limit} tokens")
    if seqlen < 2:
        raise LeanmlError(f"--seqlen must be at least 2, got {seqlen}")


def evaluate(model, tokenizer, data: str, seqlen: int, max_windows: int | None, batch_size: int, device,
             flag: str = "--max-windows") -> dict:
    """Perplexity on the test split of ``data``; returns a dict for reports. ``flag`` names the option
    that set ``max_windows`` in errors."""
    from leanml.data.text import load_text, token_windows
    from leanml.eval.perplexity import perplexity

    windows = token_windows(tokenizer, load_text(data, "test"), seqlen)
    if max_windows is not None:
        if max_windows < 1:
            raise LeanmlError(f"{flag} must be at least 1, got {max_windows}")
        windows = windows[:max_windows]
    layerwise = any(p.device != torch.device(device) for p in model.parameters())
    with Timer() as t:
        ppl = perplexity(model, windows, batch_size=batch_size, device=device, layerwise=layerwise)
    return {"ppl": ppl, "data": data, "split": "test", "seqlen": seqlen, "windows": int(windows.shape[0]),
            "seconds": t.seconds, "device": str(device), "layerwise": layerwise}


def check_json_out(path: str | None, flag: str = "--json") -> Path | None:
    """Refuse, before any work, a JSON output path that is a folder or cannot be written."""
    if path is None:
        return None
    out = Path(path).expanduser()
    if out.is_dir():
        raise LeanmlError(f"{flag} {out} is a folder; give a file path, e.g. {flag} {out / 'eval.json'}")
    check_writable(out.parent, flag)
    clean_stale(out)  # a temporary file a killed run left beside it
    return out


def run_eval(args: argparse.Namespace) -> int:
    from leanml.data.text import check_corpus
    from leanml.models import check_dtype, load_model, parse_dtype
    from leanml.models.check import check_model_input

    # every input is checked before the model is loaded
    json_out = check_json_out(args.json)
    threads = apply_threads(args.threads)
    device = _device(args.device)
    dtype = parse_dtype(args.dtype)
    check_dtype(dtype, device)
    check_model_input(args.model, args.seqlen)
    check_corpus(args.data, "test", "--data")
    model, tokenizer = load_model(args.model, dtype=dtype)  # stays on the CPU; layers visit the device
    _check_seqlen(model, args.seqlen)
    result = evaluate(model, tokenizer, args.data, args.seqlen, args.max_windows, args.batch_size, device)
    result.update({"model": args.model, "dtype": args.dtype, "threads": threads, "machine": machine_info()})
    if json_out is not None:
        write_json(json_out, result)
    print(f"perplexity {result['ppl']:.3f}  ({args.data} test, {result['windows']} x {args.seqlen} tokens)"
          + (f"  -> {json_out}" if json_out else ""))
    return 0


def measured_sparsity(model: torch.nn.Module, adapter: Any) -> float:
    """Fraction of zeros over all linears of the decoder layers (embeddings and lm_head excluded)."""
    zeros = total = 0
    for layer in adapter.layers():
        for lin in adapter.linears(layer).values():
            zeros += int((lin.weight == 0).sum())
            total += lin.weight.numel()
    return zeros / max(total, 1)


def _check_model_type(spec: str, structured: bool) -> None:
    """Refuse, before loading weights, a model whose config says leanml cannot prune it this way."""
    from leanml.models import peek_model_type
    from leanml.models.layout import MOE_KEYS, structured_model_types

    model_type = peek_model_type(spec)
    if model_type is None:
        return
    if structured and model_type not in structured_model_types():
        raise LeanmlError(
            f"no structured-pair layout for {model_type!r}; structured methods support: "
            f"{', '.join(structured_model_types())} (unstructured methods work on any decoder)"
        )
    config = peek_config(spec)
    moe = [k for k in MOE_KEYS if (config.get(k) or 0) > 1]
    if moe:
        raise LeanmlError(
            f"{model_type} is a mixture-of-experts model ({moe[0]}={config[moe[0]]}); leanml does not prune "
            "experts: use a dense model"
        )


def peek_config(spec: str) -> dict[str, Any]:
    """``config.json`` of a local model directory as a dict (empty when there is none)."""
    import json

    path = Path(spec).expanduser() / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _calibration(model: Any, tokenizer: Any, args: argparse.Namespace,
                 device: torch.device) -> tuple[torch.Tensor, dict[str, Any]]:
    """The calibration windows: corpus windows only, or with a share sampled from the model itself.

    Sampling runs the whole model on ``device``: it visits the device for the sampling and goes back to
    the CPU, where the layer-wise engine expects it."""
    from leanml.data.sampling import calibration_with_samples
    from leanml.data.text import calibration_windows

    if not args.calib_samples:
        return calibration_windows(tokenizer, args.calib, args.nsamples, args.seqlen, args.seed), {}
    on_cpu = device.type == "cpu"
    try:
        if not on_cpu:
            model.to(device)
        ids, info = calibration_with_samples(model, tokenizer, args.calib, args.nsamples, args.seqlen,
                                             args.calib_samples, seed=args.seed, device=device)
    except torch.cuda.OutOfMemoryError as exc:
        raise LeanmlError(f"the model does not fit on {device} to sample calibration windows from it; "
                          "drop --calib-samples or sample on a larger device") from exc
    finally:
        if not on_cpu:
            model.to("cpu")
    print(f"calibration: {info['sampled_windows']} windows sampled from the model in "
          f"{info['sampling_seconds']:.1f} s, {info['corpus_windows']} from {args.calib}")
    return ids, info


def run_prune(args: argparse.Namespace) -> int:
    from leanml.models import (
        check_dtype,
        count_parameters,
        decoder_linear_names,
        load_model,
        parse_dtype,
        save_model,
    )
    from leanml.models.check import check_model_input
    from leanml.models.layout import get_adapter
    from leanml.prune.engine import check_spec, prune_model
    from leanml.prune.masks import MaskSpec, parse_pattern
    from leanml.prune.methods import pruner_class

    t_total = time.perf_counter()
    # cheap checks first: nothing is loaded or written before the input is known to be good
    # (ranges of numeric options are checked by the parser)
    pattern = parse_pattern(args.pattern)
    cls = pruner_class(args.method)
    if args.sparsity_profile != "uniform" and (pattern is not None or cls.structured):
        what = f"the {args.pattern} pattern" if pattern is not None else f"structured {args.method}"
        raise LeanmlError(f"--sparsity-profile {args.sparsity_profile} sets unstructured per-layer sparsities; "
                          f"it does not apply to {what}: drop --sparsity-profile")
    pruner = cls.from_args(args)
    # the scope left open here is resolved by the pruner, exactly as for a Python caller
    spec = pruner.resolve_spec(MaskSpec(sparsity=args.sparsity, pattern=pattern, scope=args.scope))
    check_spec(pruner, spec)
    dtype = parse_dtype(args.dtype)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    out = Path(args.out)
    if rank == 0:
        check_output_dir(out, args.overwrite)
    ckpt = out.with_name(out.name + ".ckpt")
    if ckpt.exists() and not args.resume and rank == 0:
        raise LeanmlError(f"an interrupted run left a checkpoint in {ckpt}; add --resume to continue it, "
                          f"or delete {ckpt} to start over")
    if rank == 0:
        clean_stale_in(ckpt)
    threads = apply_threads(args.threads)
    device = _device(args.device)
    check_dtype(dtype, device)
    if args.save_format == "compressed":
        from leanml.models.compressed import require_compressed

        require_compressed()
    check_model_input(args.model, args.seqlen)
    _check_model_type(args.model, cls.structured)
    from leanml.data.text import check_corpus

    check_corpus(args.calib, "calib", "--calib")
    if not args.no_eval:
        check_corpus(args.eval_data, "test", "--eval-data")
    if args.stream or args.max_memory is not None:
        from leanml.prune.stream import run_streamed

        return run_streamed(args, pruner, spec, dtype, device, out, ckpt)

    with Timer() as t_load:
        model, tokenizer = load_model(args.model, dtype=dtype)  # stays on the CPU; layers visit the device
    adapter = get_adapter(model)
    _check_seqlen(model, args.seqlen)
    with Timer() as t_calib:
        calib, calib_info = _calibration(model, tokenizer, args, device)
    params_before = count_parameters(model)

    before = None
    if not args.no_eval and rank == 0:
        before = evaluate(model, tokenizer, args.eval_data, args.seqlen, args.eval_windows, args.batch_size, device,
                          flag="--eval-windows")
        print(f"dense perplexity {before['ppl']:.3f}")

    engine_kwargs = dict(
        adapter=adapter,
        sequential=args.mode == "sequential",
        intra_layer=args.intra_layer,
        batch_size=args.batch_size,
        device=device,
        sparsity_profile=args.sparsity_profile,
        owl={"m": args.owl_m, "lam": args.owl_lambda},
        stream_device=args.stream_device,
        checkpoint_interval=args.checkpoint_interval,
        fingerprint={"model": args.model, "calib": args.calib, "seed": args.seed, "seqlen": args.seqlen,
                     "dtype": args.dtype, "calib_samples": args.calib_samples},
    )
    if world > 1:
        from leanml.prune.parallel import prune_distributed

        report = prune_distributed(model, calib, pruner, spec, checkpoint_dir=ckpt, **engine_kwargs)
        if report is None:
            return 0
    else:
        try:
            report = prune_model(model, calib, pruner, spec, checkpoint_dir=ckpt, **engine_kwargs)
        except LeanmlError as exc:
            if args.resume and "different settings" in str(exc):  # name the fixes the next checks accept
                raise LeanmlError(f"the checkpoint in {ckpt} was made with other settings; rerun --resume with the "
                                  f"settings of the interrupted run, or delete {ckpt} to start over") from exc
            raise

    after = None
    if not args.no_eval:
        after = evaluate(model, tokenizer, args.eval_data, args.seqlen, args.eval_windows, args.batch_size, device,
                         flag="--eval-windows")
        print(f"pruned perplexity {after['ppl']:.3f}")

    sparsity = measured_sparsity(model, adapter)
    report.update({
        "config": {k: v for k, v in vars(args).items() if k != "func"},
        "model": {**adapter.describe(), "source": args.model, "dtype": args.dtype, "params_before": params_before,
                  "params_after": count_parameters(model)},
        "calibration": {"corpus": args.calib, "split": "calib", "nsamples": args.nsamples, "seqlen": args.seqlen,
                        "seed": args.seed,
                        "note": "shakespeare stands in for WikiText-2 offline (split by play)"
                        if args.calib == "shakespeare" else "", **calib_info},
        "measured_sparsity": sparsity,
        "perplexity_before": before,
        "perplexity_after": after,
        "timings": {"load_seconds": t_load.seconds, "calib_seconds": t_calib.seconds,
                    "prune_seconds": report["prune_seconds"],
                    "total_seconds": time.perf_counter() - t_total},
        "threads": threads,
        "machine": machine_info(),
    })
    sparse = [n for n in decoder_linear_names(model) if bool((model.get_submodule(n).weight == 0).any())]
    structure = "2:4" if pattern == (2, 4) else "unstructured"
    with atomic_dir(out, overwrite=args.overwrite) as tmp:
        model.config.use_cache = True
        sizes = save_model(model, tokenizer, tmp, args.save_format, sparse, sparsity, structure)
        report["save"] = {"format": args.save_format, **(sizes or {}),
                          "weights_bytes": sum(f.stat().st_size for f in tmp.glob("*.safetensors"))}
        write_json(tmp / "report.json", report)
    shutil.rmtree(ckpt, ignore_errors=True)
    ppl_txt = f", ppl {before['ppl']:.2f} -> {after['ppl']:.2f}" if before and after else ""
    if cls.structured:  # the zeros left are only the pruned attention dimensions: say what shrank
        what = f"parameters {params_before:,} -> {report['model']['params_after']:,} (zeros left {sparsity:.3f})"
    else:
        what = f"sparsity {sparsity:.3f}"
    size_txt = f", {report['save']['weights_bytes'] / 2**20:.1f} MiB on disk ({args.save_format})"
    print(f"{args.method}: {what}{ppl_txt}, pruned in {report['prune_seconds']:.1f} s{size_txt} -> {out}")
    return 0
