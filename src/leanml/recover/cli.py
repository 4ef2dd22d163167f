"""``leanml recover``: fine-tune a model written by ``leanml prune``, keeping its sparsity, under a memory budget."""

from __future__ import annotations

import argparse
import csv
import logging
import shutil
import sys
from pathlib import Path
from typing import Any

from leanml.utils import LeanmlError, add_threads_arg, float_in, int_at_least

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
one step in (0, 1], or a size with its unit (2GB, 3000000B); a budget below the smallest feasible plan is refused before training.

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
    from leanml.models import DTYPES, SAVE_FORMATS

    p = sub.add_parser(
        "recover",
        help="fine-tune a pruned model keeping its sparsity, with optional distillation, under a memory budget",
        description="Fine-tune a model written by `leanml prune` on a text corpus, keeping its mask exactly "
        "(unstructured, N:M, structured), optionally distilling a dense teacher, under a training-memory "
        "strategy; report perplexity before and after, time and peak memory.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help="the pruned model: a directory written by leanml prune (or any HF dir)")
    p.add_argument("--teacher", default=None, help="dense teacher to distil: a model spec, or 'source' (the model pruned)")
    p.add_argument("--data", default="shakespeare", help="training corpus; its train split is used (shakespeare: every play but Hamlet)")
    p.add_argument("--steps", type=int_at_least(1), default=200, help="optimizer steps")
    p.add_argument("--batch-size", type=int_at_least(1), default=2, help="windows per step")
    p.add_argument("--seqlen", type=int_at_least(2), default=256, help="tokens per training window")
    p.add_argument("--lr", type=float_in(0, low_open=True), default=1e-4, help="peak learning rate (AdamW)")
    p.add_argument("--warmup", type=int_at_least(0), default=10, help="linear warm-up steps, then cosine decay")
    p.add_argument("--min-lr-ratio", type=float_in(0, 1), default=0.1, help="final learning rate / peak")
    p.add_argument("--weight-decay", type=float_in(0), default=0.0)
    p.add_argument("--max-grad-norm", type=float_in(0), default=1.0, help="gradient clipping (0: off)")
    p.add_argument("--memory", choices=["none", "checkpoint", "sac", "adacc"], default="adacc",
                   help="training-memory strategy")
    p.add_argument("--memory-budget", default=None,
                   help="Adacc budget: fraction of the unoptimized peak in (0, 1], or a size with its unit like 2GB (default 0.5)")
    p.add_argument("--max-error", type=float_in(0, 1, low_open=True), default=0.05, help="Adacc: cap on the relative error of lossy compressors")
    p.add_argument("--kd-weight", type=float_in(0, 1), default=0.5, help="weight of the distillation term, in [0, 1]")
    p.add_argument("--kd-temperature", type=float_in(0, low_open=True), default=1.0, help="distillation temperature")
    p.add_argument("--teacher-samples", type=float_in(0, 1, what="a share of the training windows"), default=0.0,
                   help="share of the training windows sampled from the teacher instead of read from --data, "
                        "in [0, 1] (needs --teacher; default 0)")
    p.add_argument("--teacher-samples-cache", default=None, metavar="DIR",
                   help="keep the teacher's samples in DIR and reuse them in later runs with the same teacher "
                        "weights, window count, length, seed and start token (the report keeps the sampling time)")
    p.add_argument("--pattern", default=None, help="N:M pattern the zeros must follow (checked; default: report.json's)")
    p.add_argument("--no-mask", action="store_true", help="train every weight (a dense fine-tune; sparsity is not kept)")
    p.add_argument("--eval-data", default="shakespeare,reviews",
                   help="comma-separated corpora whose test split gives perplexity before/after")
    p.add_argument("--eval-seqlen", type=int_at_least(2), default=512, help="tokens per evaluation window")
    p.add_argument("--eval-windows", type=int_at_least(1), default=None, help="evaluate the first N test windows of each corpus")
    p.add_argument("--no-eval", action="store_true", help="skip the perplexities")
    p.add_argument("--checkpoint-every", type=int_at_least(1), default=50, help="steps between checkpoints (DIR.ckpt)")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint of an interrupted run")
    p.add_argument("--seed", type=int, default=0, help="batch order seed")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--out", required=True, help="output directory (appears only when complete)")
    p.add_argument("--save-format", choices=list(SAVE_FORMATS), default="safetensors",
                   help="safetensors (default; plain from_pretrained loads it) or compressed "
                        "(sparse-bitmask layout that leanml reloads: a 50%% model is 0.63x the dense directory; "
                        "python -m leanml.models.compressed writes the dense copy other tools read)")
    p.add_argument("--dtype", choices=list(DTYPES), default=None,
                   help="dtype of the saved model (default: the input's); training is float32")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    add_threads_arg(p)
    p.set_defaults(func=run)


def _device(arg: str | None):  # noqa: ANN202
    from leanml.utils import parse_device

    return parse_device(arg)


def _check_seqlen(model: Any, seqlen: int, flag: str) -> None:
    limit = getattr(model.config, "max_position_embeddings", None)
    if seqlen < 2:
        raise LeanmlError(f"{flag} must be at least 2, got {seqlen}")
    if limit is not None and seqlen > limit:
        raise LeanmlError(f"{flag} {seqlen} is above the model's maximum of {limit} tokens")


def _input_dtype(spec: str) -> str:
    """The dtype a model directory was saved in (its config.json), else float32."""
    from leanml.models import DTYPES

    config = Path(spec).expanduser() / "config.json"
    if config.is_file():
        import json

        raw = json.loads(config.read_text())
        name = str(raw.get("dtype") or raw.get("torch_dtype") or "float32").replace("torch.", "")
        if name in DTYPES:
            return name
    return "float32"


def _check_save_format(fmt: str) -> None:
    if fmt == "compressed":
        from leanml.models.compressed import require_compressed

        require_compressed()


def run(args: argparse.Namespace) -> int:
    """Run ``leanml recover``."""
    from leanml.recover.api import RecoverConfig
    from leanml.recover.source import parse_nm
    from leanml.utils import apply_threads, check_output_dir, check_writable, clean_stale_in

    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    # cheap checks first: nothing is loaded or written before the input is known to be good
    if args.memory_budget is not None and args.memory != "adacc":
        raise LeanmlError(f"--memory-budget sets Adacc's budget; --memory {args.memory} takes none: "
                          f"drop --memory-budget or use --memory adacc")
    budget = args.memory_budget if args.memory_budget is not None else "0.5"
    cfg = RecoverConfig(
        steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup=args.warmup,
        min_lr_ratio=args.min_lr_ratio, weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm,
        memory=args.memory, budget=budget, max_error=args.max_error, kd_weight=args.kd_weight,
        temperature=args.kd_temperature, keep_masks=not args.no_mask, seed=args.seed,
        checkpoint_every=args.checkpoint_every,
    )
    cfg.check()
    if args.teacher_samples > 0 and args.teacher is None:
        raise LeanmlError("--teacher-samples draws training windows from the teacher: pass --teacher too")
    if args.teacher_samples_cache is not None and not args.teacher_samples > 0:
        raise LeanmlError("--teacher-samples-cache keeps the teacher's samples: pass --teacher-samples too")
    if args.teacher_samples_cache is not None and Path(args.teacher_samples_cache).is_file():
        raise LeanmlError(f"--teacher-samples-cache {args.teacher_samples_cache} is a file; it must be a directory")
    if args.teacher_samples_cache is not None:
        check_writable(args.teacher_samples_cache, "--teacher-samples-cache")
    if args.no_mask and args.pattern:
        raise LeanmlError("--no-mask trains every weight, so --pattern cannot be kept; drop one of them")
    parse_nm(args.pattern)
    _check_save_format(args.save_format)
    out = check_output_dir(args.out, args.overwrite)
    ckpt = out.with_name(out.name + ".ckpt")
    if ckpt.exists() and not args.resume:
        raise LeanmlError(f"an interrupted run left a checkpoint in {ckpt}; add --resume to continue it, "
                          f"or delete {ckpt} to start over")
    eval_names = [] if args.no_eval else [c.strip() for c in args.eval_data.split(",") if c.strip()]
    threads = apply_threads(args.threads)
    device = _device(args.device)
    _check_inputs(args, eval_names)
    clean_stale_in(ckpt)
    # from here on a refused run removes the checkpoint folder it made (teacher samples) before training began
    fresh_ckpt = not ckpt.exists()
    try:
        return _run(args, cfg, out, ckpt, eval_names, device, threads)
    except LeanmlError:
        if fresh_ckpt and ckpt.is_dir() and not (ckpt / "state.pt").exists():
            shutil.rmtree(ckpt, ignore_errors=True)
        raise


def _check_inputs(args: argparse.Namespace, eval_names: list[str]) -> None:
    """Everything checkable before a model is loaded: the model's and teacher's files, window lengths,
    the corpora."""
    from leanml.data.text import check_corpus
    from leanml.models.check import check_model_input, check_model_spec
    from leanml.recover.source import declaration, read_report

    check_model_input(args.model, args.seqlen)
    if eval_names:
        check_model_input(args.model, args.eval_seqlen, "--eval-seqlen")
    teacher = args.teacher
    if teacher == "source":
        teacher = declaration(read_report(args.model)).source_model  # none: refused after loading, as before
    if teacher:
        check_model_spec(teacher, flag="--teacher")
    check_corpus(args.data, "train", "--data")
    for name in eval_names:
        check_corpus(name, "test", "--eval-data")


def _run(args: argparse.Namespace, cfg: Any, out: Path, ckpt: Path, eval_names: list[str], device: Any,
         threads: int) -> int:
    from leanml.data.text import load_text, token_windows
    from leanml.models import count_parameters, decoder_linear_names, load_model, parse_dtype, save_model
    from leanml.recover.api import recover
    from leanml.recover.masks import MaskKeeper, cast_keeping_zeros
    from leanml.recover.source import check_masks, check_teacher, declaration, read_report
    from leanml.utils import announce_eta, atomic_dir, machine_info, write_json

    save_dtype = args.dtype or _input_dtype(args.model)
    model, tokenizer = load_model(args.model)  # float32: training keeps float32 weights and optimizer state
    report_in = read_report(args.model)
    decl = declaration(report_in, args.pattern)
    mask_info: dict[str, Any] = {"source": None, **decl.to_json()}
    keeper = None
    if not args.no_mask:
        keeper = MaskKeeper.from_zeros(model)
        mask_info = check_masks(keeper, decl, args.model)
    _check_seqlen(model, args.seqlen, "--seqlen")
    if eval_names:
        _check_seqlen(model, args.eval_seqlen, "--eval-seqlen")
    teacher = None
    teacher_spec = args.teacher
    if teacher_spec == "source":
        if not decl.source_model:
            raise LeanmlError(f"--teacher source: {args.model} has no report.json naming the model it was pruned "
                              f"from; pass the dense model itself as --teacher")
        teacher_spec = decl.source_model
    if teacher_spec is not None:
        teacher, teacher_tok = load_model(teacher_spec)
        check_teacher(model, tokenizer, teacher, teacher_tok, where=f"teacher {teacher_spec}")

    windows = token_windows(tokenizer, load_text(args.data, "train"), args.seqlen)
    samples_info = None
    if args.teacher_samples > 0:
        windows, samples_info = _mix_teacher_samples(windows, teacher, teacher_spec, tokenizer, cfg,
                                                     args.teacher_samples, ckpt, device,
                                                     cache_dir=args.teacher_samples_cache)
    eval_sets = {}
    for name in eval_names:
        w = token_windows(tokenizer, load_text(name, "test"), args.eval_seqlen)
        eval_sets[name] = w[: args.eval_windows] if args.eval_windows else w
    params = count_parameters(model)

    first: dict[str, Any] = {}

    def say_eta(done: int, entry: dict[str, Any]) -> None:  # one plain line after the first step
        if not first:
            first["done"] = done
            line = announce_eta("recover", 1, cfg.steps - done + 1, entry["step_s"], "step")
            if line:
                print(line, file=sys.stderr, flush=True)

    result = recover(model, windows, cfg, teacher=teacher, masks=keeper, eval_sets=eval_sets,
                     checkpoint_dir=ckpt, device=device, on_step=say_eta)

    pattern = mask_info.get("pattern") or ("structured" if decl.structured else "unstructured")
    report = {
        "command": "recover",
        "config": {k: v for k, v in vars(args).items() if k != "func"},
        "method": decl.method,
        "mask": {"pattern": pattern if not args.no_mask else "dense", "sparsity": result["sparsity"]["out"],
                 "structured": decl.structured, "kept": not args.no_mask},
        "mask_check": mask_info,
        "model": {"source": decl.source_model or args.model, "recovered_from": args.model, "params": params},
        "teacher_model": teacher_spec,
        "data": {"corpus": args.data, "split": "train", **result["data"],
                 "note": "shakespeare train = every play except Hamlet (the test split)"
                 if args.data == "shakespeare" else "", "teacher_samples": samples_info},
        "eval": {"corpora": eval_names, "split": "test", "seqlen": args.eval_seqlen},
        "input_report": {k: report_in.get(k) for k in ("method", "mask", "measured_sparsity", "finalize")}
        if report_in else None,
        **{k: v for k, v in result.items() if k not in ("data", "config")},
        "recover_config": result["config"],
        "threads": threads,
        "machine": machine_info(),
    }
    dtype = parse_dtype(save_dtype)
    if dtype != next(model.parameters()).dtype:
        underflow = cast_keeping_zeros(model, dtype)
        report["save_cast"] = {"dtype": save_dtype, "kept_weights_raised_from_underflow": underflow}
    sparse = [n for n in decoder_linear_names(model) if bool((model.get_submodule(n).weight == 0).any())]
    structure = "2:4" if mask_info.get("pattern") == "2:4" and not args.no_mask else "unstructured"
    with atomic_dir(out, overwrite=args.overwrite) as tmp:
        model.config.use_cache = True
        sizes = save_model(model, tokenizer, tmp, args.save_format, sparse, result["sparsity"]["out"], structure)
        report["save"] = {"format": args.save_format, "dtype": save_dtype, **(sizes or {}),
                          "weights_bytes": sum(f.stat().st_size for f in tmp.glob("*.safetensors"))}
        write_json(tmp / "report.json", report)
        _write_losses(tmp / "losses.csv", result["losses"])
    shutil.rmtree(ckpt, ignore_errors=True)
    _print_summary(args, result, out, report["save"])
    return 0


#: sequences sampled at once (the samples depend on it: part of the cache key)
SAMPLE_BATCH = 32


def teacher_fingerprint(teacher: Any) -> str:
    """SHA-256 over a model's parameters and buffers (names, dtypes, shapes, bytes), in name order."""
    import hashlib

    import torch

    h = hashlib.sha256()
    for name, t in sorted({**dict(teacher.named_parameters()), **dict(teacher.named_buffers())}.items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _mix_teacher_samples(windows: Any, teacher: Any, teacher_name: str, tokenizer: Any, cfg: Any, share: float,
                         ckpt: Path, device: Any, cache_dir: str | Path | None = None) -> tuple[Any, dict[str, Any]]:
    """The training windows with a share ``share`` of the ``steps x batch_size`` windows training reads
    sampled from the teacher and the rest drawn (seeded) from the corpus. The samples are kept in the
    checkpoint directory, so a resumed run trains on the same windows; samples of another teacher
    (``teacher_name``) or other settings are drawn again, and the run's checkpoint then refuses the data.
    ``cache_dir``: samples are also looked up in (and written to) this directory, keyed by a hash of the
    teacher's weights and the sampling settings, so runs with the same teacher sample once. ``seconds``
    in the result is this run's time to get the samples; ``sampling_seconds`` the time the sampling took
    (in this run, or in the run that cached or checkpointed them)."""
    import time

    import torch

    from leanml.data.sampling import sample_windows, start_token
    from leanml.recover.api import _fingerprint
    from leanml.utils import atomic_file

    total = cfg.steps * cfg.batch_size
    n_teacher = min(total, max(1, round(share * total)))
    n_corpus = total - n_teacher
    if n_corpus > windows.shape[0]:
        raise LeanmlError(f"{n_corpus} corpus windows wanted beside the teacher's samples but the corpus has "
                          f"{windows.shape[0]}; lower --steps or raise --teacher-samples")
    start = start_token(tokenizer)
    key = {"teacher": teacher_name, "n": n_teacher, "seqlen": int(windows.shape[1]), "seed": cfg.seed, "start": start}
    path = ckpt / "teacher_samples.pt"
    t0 = time.perf_counter()
    samples, reused, cached, sampling_seconds = None, False, None, None
    if path.exists():
        saved = torch.load(path, weights_only=True)
        if saved.get("key") == key:
            samples, reused, sampling_seconds = saved["windows"], True, saved.get("sampling_seconds")
    cache_file = None
    if cache_dir is not None:
        ckey = {"teacher_sha256": teacher_fingerprint(teacher), "n": n_teacher, "seqlen": key["seqlen"],
                "seed": cfg.seed, "start": start, "batch_size": SAMPLE_BATCH, "temperature": 1.0}
        cache_file = Path(cache_dir) / f"teacher-samples-{_fingerprint(ckey)}.pt"
        if samples is None and cache_file.exists():
            saved = torch.load(cache_file, weights_only=True)
            if saved.get("key") == ckey:  # the key holds the count and the length
                samples, cached, sampling_seconds = saved["windows"], str(cache_file), saved.get("sampling_seconds")
    if samples is None:
        samples = sample_windows(teacher, n_teacher, int(windows.shape[1]), start_id=start, seed=cfg.seed,
                                 batch_size=SAMPLE_BATCH, device=device)
        sampling_seconds = time.perf_counter() - t0
    if cache_file is not None and not cache_file.exists():
        with atomic_file(cache_file) as tmp:
            torch.save({"key": ckey, "windows": samples, "sampling_seconds": sampling_seconds}, tmp)
    if not reused:
        ckpt.mkdir(parents=True, exist_ok=True)
        with atomic_file(path) as tmp:  # a run killed while saving leaves no half-written samples
            torch.save({"key": key, "windows": samples, "sampling_seconds": sampling_seconds}, tmp)
    seconds = time.perf_counter() - t0
    order = torch.randperm(windows.shape[0], generator=torch.Generator().manual_seed(cfg.seed))[:n_corpus]
    mixed = torch.cat([samples, windows[order]])
    return mixed, {"share": share, "windows": n_teacher, "corpus_windows": n_corpus, "seqlen": key["seqlen"],
                   "start_token": start, "seconds": seconds, "sampling_seconds": sampling_seconds,
                   "reused_from_checkpoint": reused, "reused_from_cache": cached}


def _write_losses(path: Path, log: dict[str, list]) -> None:
    keys = list(log)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", *keys])
        for i, row in enumerate(zip(*(log[k] for k in keys))):
            w.writerow([i + 1, *("" if v is None else f"{v:.6g}" for v in row)])


def _print_summary(args: argparse.Namespace, result: dict[str, Any], out: Path, save: dict[str, Any]) -> None:
    mib = 2**20
    sp, mem, tm = result["sparsity"], result["memory"], result["timings"]
    print(f"sparsity {sp['in']:.4f} -> {sp['out']:.4f}" + (" (kept exactly)" if sp["kept_exactly"] else ""))
    before, after = result["perplexity_before"] or {}, result["perplexity_after"] or {}
    for name in after:
        b = before.get(name, {}).get("ppl")
        print(f"perplexity {name}: " + (f"{b:.2f} -> " if b is not None else "") + f"{after[name]['ppl']:.2f}")
    budget = mem["budget_bytes"]
    print(f"memory={mem['strategy']} peak {mem['peak_bytes'] / mib:.1f} MiB"
          + (f" (unoptimized {mem['unoptimized_peak_bytes'] / mib:.1f} MiB)" if mem["unoptimized_peak_bytes"] else "")
          + (f", budget {budget / mib:.1f} MiB, {'within' if mem['within_budget'] else 'OVER'}" if budget else ""))
    print(f"loss {result['loss_first']:.4f} -> {result['loss_last10']:.4f} (mean of last 10); "
          f"{args.steps} steps in {tm['train_seconds']:.1f} s (median {tm['median_step_s']:.2f} s/step)")
    print(f"saved {save['weights_bytes'] / mib:.1f} MiB ({save['format']}, {save['dtype']}) -> {out}")
