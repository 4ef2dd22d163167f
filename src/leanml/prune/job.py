"""``leanml prune`` as a library call: :func:`run_job` checks every input before any work, loads the
model, draws the calibration windows, prunes with :func:`leanml.prune`, evaluates and saves the model
with ``report.json`` (atomically). Streamed runs (:mod:`leanml.prune.stream`) never hold the whole model."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from leanml.config import as_dict
from leanml.errors import LeanmlError
from leanml.faults import check_model_cache, check_space
from leanml.flags import flag_of
from leanml.machine import machine_info
from leanml.outputs import atomic_dir, write_json
from leanml.progress import Timer
from leanml.prune.config import PruneConfig, PruneJob
from leanml.prune.engine.checkpoint import CheckpointError, CheckpointMismatch, check_checkpoint


def measured_sparsity(model: torch.nn.Module, adapter: Any) -> float:
    """Fraction of zeros over all linears of the decoder layers (embeddings and lm_head excluded)."""
    zeros = total = 0
    for layer in adapter.layers():
        for lin in adapter.linears(layer).values():
            zeros += int((lin.weight == 0).sum())
            total += lin.weight.numel()
    return zeros / max(total, 1)


def peek_config(spec: str) -> dict[str, Any]:
    """``config.json`` of a local model directory as a dict (empty when there is none)."""
    path = Path(spec).expanduser() / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def check_model_type(spec: str, structured: bool) -> None:
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


def calibration(model: Any, tokenizer: Any, config: PruneConfig, device: torch.device) -> tuple[torch.Tensor, dict]:
    """The calibration windows: corpus windows only, or with a share sampled from the model itself.

    Sampling runs the whole model on ``device``: it visits the device for the sampling and goes back to
    the CPU, where the layer-wise engine expects it."""
    from leanml.data.sampling import CalibrationSet, calibration_with_samples
    from leanml.data.text import calibration_windows

    c = config
    if not c.calib_samples:
        return calibration_windows(tokenizer, c.calib, c.nsamples, c.seqlen, c.seed), {}
    on_cpu = device.type == "cpu"
    try:
        if not on_cpu:
            model.to(device)
        calib = CalibrationSet(c.calib, c.nsamples, c.seqlen, c.calib_samples, seed=c.seed)
        ids, info = calibration_with_samples(model, tokenizer, calib, device=device)
    except torch.cuda.OutOfMemoryError as exc:
        raise LeanmlError(f"the model does not fit on {device} to sample calibration windows from it; "
                          "drop calib_samples or sample on a larger device", fields=("calib_samples",)) from exc
    finally:
        if not on_cpu:
            model.to("cpu")
    print(f"calibration: {info['sampled_windows']} windows sampled from the model in "
          f"{info['sampling_seconds']:.1f} s, {info['corpus_windows']} from {c.calib}")
    return ids, info


def _check_inputs(job: PruneJob, rank: int) -> tuple[Path, Path, int, torch.device]:
    """Everything that can be checked before loading: output, checkpoint, device, model, corpora."""
    from leanml.data.text import check_corpus
    from leanml.device import parse_device
    from leanml.machine import apply_threads
    from leanml.models import check_dtype, parse_dtype
    from leanml.models.check import check_model_input
    from leanml.outputs import check_output_dir, clean_stale_in
    from leanml.prune.methods import pruner_class

    out = Path(job.out)
    if rank == 0:
        check_output_dir(out, job.overwrite)
    ckpt = out.with_name(out.name + ".ckpt")
    if rank == 0:
        clean_stale_in(ckpt)
    threads = apply_threads(job.threads)
    device = parse_device(job.config.device)
    check_dtype(parse_dtype(job.dtype), device)
    if job.save_format == "compressed":
        from leanml.models.compressed import require_compressed

        require_compressed()
    check_model_input(job.model, job.config.seqlen)
    check_model_cache(job.model)
    check_model_type(job.model, pruner_class(job.config.method).structured)
    check_corpus(job.config.calib, "calib", "calib")
    if job.eval:
        check_corpus(job.eval_data, "test", "eval_data")
    if rank == 0:  # last: only a run whose inputs pass clears a checkpoint (--overwrite)
        check_checkpoint(ckpt, job.resume, job.overwrite)
    return out, ckpt, threads, device


@contextlib.contextmanager
def clear_failed_checkpoint(ckpt: Path) -> Iterator[None]:
    """Remove the checkpoint ``ckpt`` when the run fails on its settings or its numbers (a refused option,
    a solver that cannot go on): resuming it would fail the same way, and a rerun with other settings
    must not find it in the way. Interrupts and I/O faults (a full disk) keep it for ``--resume``."""
    try:
        yield
    except (CheckpointError, CheckpointMismatch):  # the checkpoint itself was refused: kept, as the message says
        raise
    except (LeanmlError, torch.linalg.LinAlgError) as exc:
        io_fault = isinstance(exc.__cause__, OSError) or isinstance(exc.__context__, OSError)
        if not io_fault and int(os.environ.get("RANK", "0")) == 0:
            shutil.rmtree(ckpt, ignore_errors=True)
        raise


def run_job(job: PruneJob) -> dict[str, Any] | None:
    """Run ``leanml prune``; return the report (``None`` on the other ranks of a ``torchrun`` run)."""
    from leanml.eval.job import check_seqlen, evaluate_text
    from leanml.models import count_parameters, load_model, parse_dtype
    from leanml.models.layout import get_adapter
    from leanml.models.save import saved_bytes
    from leanml.models.saving import SaveSpec, save_pruned
    from leanml.prune import prune

    t_total = time.perf_counter()
    rank = int(os.environ.get("RANK", "0"))
    out, ckpt, threads, device = _check_inputs(job, rank)
    if job.streamed:
        return run_streamed(job, device, out, ckpt)
    c = job.config
    with Timer() as t_load:
        model, tokenizer = load_model(job.model, dtype=parse_dtype(job.dtype))  # stays on the CPU
    adapter = get_adapter(model)
    check_seqlen(model, c.seqlen, c)
    need = saved_bytes(model)
    if job.save_format == "safetensors" and rank == 0:  # before the work: the save needs about the weights' bytes
        check_space(out.parent, need, "the pruned model", "free space there or choose another out", ("out",))
    with Timer() as t_calib:
        calib, calib_info = calibration(model, tokenizer, c, device)
    params_before = count_parameters(model)

    def perplexity(when: str) -> dict[str, Any]:
        result = evaluate_text(model, tokenizer, job.eval_data, c.seqlen, job.eval_windows, c.batch_size, device)
        print(f"{when} perplexity {result['ppl']:.3f}")
        return result

    before = perplexity("dense") if job.eval and rank == 0 else None
    with clear_failed_checkpoint(ckpt):
        report = prune(model, calib, c, adapter=adapter, checkpoint_dir=ckpt, fingerprint=job.fingerprint())
    if report is None:  # another rank of a torchrun run: rank 0 saves
        return None
    after = perplexity("pruned") if job.eval else None
    sparsity = measured_sparsity(model, adapter)
    report.update({
        "config": as_dict(job),
        "model": {**adapter.describe(), "source": job.model, "dtype": job.dtype, "params_before": params_before,
                  "params_after": count_parameters(model)},
        "calibration": {"corpus": c.calib, "split": "calib", "nsamples": c.nsamples, "seqlen": c.seqlen,
                        "seed": c.seed, "note": "shakespeare stands in for WikiText-2 offline (split by play)"
                        if c.calib == "shakespeare" else "", **calib_info},
        "measured_sparsity": sparsity,
        "perplexity_before": before,
        "perplexity_after": after,
        "timings": {"load_seconds": t_load.seconds, "calib_seconds": t_calib.seconds,
                    "prune_seconds": report["prune_seconds"], "total_seconds": time.perf_counter() - t_total},
        "threads": threads,
        "machine": machine_info(),
    })
    # the mask's structure as written in the compressed format's config: "2:4", "4:8", ... or unstructured
    save_pruned(model, tokenizer, out, report, SaveSpec(job.save_format, c.spec.describe(), job.dtype, job.overwrite,
                                                        need, "the pruned model"))
    shutil.rmtree(ckpt, ignore_errors=True)
    report["out"] = str(out)
    return report


def run_streamed(job: PruneJob, device: torch.device, out: Path, ckpt: Path) -> dict[str, Any]:
    """``leanml prune --stream``: calibration from the tokenizer alone, the streamed prune into ``out``
    (atomically; the checkpoint ``ckpt`` keeps finished layers for ``--resume``), ``report.json``."""
    from transformers import AutoTokenizer

    from leanml.data.text import calibration_windows
    from leanml.models import parse_dtype
    from leanml.models.shards import ShardIndex
    from leanml.prune.engine import WalkSettings
    from leanml.prune.stream import parse_memory, stream_source, stream_walk

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise LeanmlError("stream runs in one process; drop torchrun or stream", fields=("stream",))
    c = job.config
    max_memory = parse_memory(job.max_memory)
    t0 = time.perf_counter()
    src = stream_source(job.model)
    index = ShardIndex(src)  # before the work: the shards written need about the weights' bytes at the output dtype
    need = sum(index.nbytes(name, parse_dtype(job.dtype)) for name in index.names())
    check_space(out.parent, need, "the pruned model", "free space there or choose another out", ("out",))
    tokenizer = AutoTokenizer.from_pretrained(src)
    calib = calibration_windows(tokenizer, c.calib, c.nsamples, c.seqlen, c.seed)
    if job.eval:
        print(f"{flag_of(PruneJob, 'stream')} does not evaluate (the model is never whole in memory): run leanml "
              "eval on the output")
    # the config checked itself when made (and the job refused what a streamed run cannot take)
    settings = WalkSettings.from_config(c, device=device, checkpoint_dir=ckpt, fingerprint=job.fingerprint())
    with atomic_dir(out, overwrite=job.overwrite) as tmp, clear_failed_checkpoint(ckpt):
        report = stream_walk(src, tmp, calib, settings, parse_dtype(job.dtype), max_memory)
        tokenizer.save_pretrained(tmp)
        report.update({"config": as_dict(job),
                       "calibration": {"corpus": c.calib, "nsamples": c.nsamples, "seqlen": c.seqlen, "seed": c.seed},
                       "timings": {"total_seconds": time.perf_counter() - t0}, "machine": machine_info()})
        write_json(tmp / "report.json", report)
    shutil.rmtree(ckpt, ignore_errors=True)
    report["out"] = str(out)
    return report
