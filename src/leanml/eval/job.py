"""Perplexity of a model on a corpus, and the checks every command that evaluates shares: the sequence
length against the model's limit and a JSON output path. ``leanml eval`` is :func:`evaluate_job`."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from leanml.config import ConfigError
from leanml.errors import LeanmlError
from leanml.eval.config import EvalJob
from leanml.flags import flag_of
from leanml.outputs import check_writable, clean_stale


def check_seqlen(model: nn.Module, seqlen: int, owner: Any = None, name: str = "seqlen") -> None:
    """Refuse a window longer than the model's ``max_position_embeddings``. The message names ``name``;
    with ``owner`` (the options object holding it) the command line shows the flag that set it."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and seqlen > limit:
        raise ConfigError(f"{name} {seqlen} is above the model's maximum of {limit} tokens",
                          None if owner is None else type(owner), (name,))


def check_json_out(path: str | None, flag: str) -> Path | None:
    """Refuse, before any work, a JSON output path that is a folder or cannot be written; the errors name
    ``flag`` (the caller's, e.g. ``flag_of(EvalJob, "json")``: a field name would also match in ``*.json``)."""
    if path is None:
        return None
    out = Path(path).expanduser()
    if out.is_dir():
        raise LeanmlError(f"{flag} {out} is a folder; give a file path, e.g. {flag} {out / 'eval.json'}")
    check_writable(out.parent, flag)
    clean_stale(out)  # a temporary file a killed run left beside it
    return out


def evaluate_windows(model: nn.Module, windows: torch.Tensor, batch_size: int, device: torch.device | str,
                     progress: bool = True) -> dict[str, Any]:
    """Perplexity of ``model`` on ``windows`` (``(n, seqlen)`` ids) as a report record; a model whose weights
    are not on ``device`` runs layer by layer."""
    from leanml.eval.perplexity import on_device, perplexity

    layerwise = not on_device(model, torch.device(device))
    t0 = time.perf_counter()
    ppl = perplexity(model, windows, batch_size=batch_size, device=device, progress=progress, layerwise=layerwise)
    return {"ppl": ppl, "windows": int(windows.shape[0]), "seqlen": int(windows.shape[1]),
            "seconds": time.perf_counter() - t0, "device": str(device), "layerwise": layerwise}


def evaluate_text(model: nn.Module, tokenizer: Any, data: str, seqlen: int, max_windows: int | None,
                  batch_size: int, device: torch.device | str) -> dict[str, Any]:
    """Perplexity on the test split of corpus ``data`` (its first ``max_windows`` windows, or all)."""
    from leanml.data.text import load_text, token_windows

    windows = token_windows(tokenizer, load_text(data, "test"), seqlen)
    if max_windows is not None:
        windows = windows[:max_windows]
    return {**evaluate_windows(model, windows, batch_size, device), "data": data, "split": "test"}


def evaluate_job(job: EvalJob) -> dict[str, Any]:
    """``leanml eval``: every input checked before the model is loaded (the tasks' data built then), then
    the perplexity record and/or the tasks' accuracies under ``tasks`` (written to ``job.json`` when
    given)."""
    from leanml.data.text import check_corpus
    from leanml.device import parse_device
    from leanml.eval.sparsity import model_sparsity
    from leanml.faults import check_model_cache
    from leanml.machine import apply_threads, machine_info
    from leanml.models import check_dtype, load_model, parse_dtype
    from leanml.models.check import check_model_input, check_model_spec
    from leanml.outputs import write_json

    json_out = check_json_out(job.json, flag_of(EvalJob, "json"))
    threads = apply_threads(job.threads)
    device = parse_device(job.device)
    check_dtype(parse_dtype(job.dtype), device)
    if job.corpus is not None:
        check_model_input(job.model, job.seqlen)
        check_corpus(job.corpus, "test", "data")
    else:  # tasks only: --seqlen plays no part
        check_model_spec(job.model)
    check_model_cache(job.model)  # a first use converts the bundled model into the cache: writable, with room
    plan = None
    if job.tasks:
        from leanml.eval.tasks.runner import check_tasks

        plan = check_tasks(job.tasks)
    model, tokenizer = load_model(job.model, dtype=parse_dtype(job.dtype))  # stays on the CPU; layers visit
    result: dict[str, Any] = {}
    if job.corpus is not None:
        check_seqlen(model, job.seqlen, job)
        result = evaluate_text(model, tokenizer, job.corpus, job.seqlen, job.max_windows, job.batch_size, device)
    if plan is not None:
        result.update(evaluate_tasks(model, tokenizer, plan, job, device))
    result["sparsity"] = model_sparsity(model)  # of the weights evaluated, measured
    result.update({"model": job.model, "dtype": job.dtype, "threads": threads, "machine": machine_info()})
    if json_out is not None:
        write_json(json_out, result)
        result["json"] = str(json_out)
    return result


def evaluate_tasks(model: nn.Module, tokenizer: Any, plan: Any, job: EvalJob,
                   device: torch.device | str) -> dict[str, Any]:
    """The tasks' records (``tasks``: accuracy and stderr per task) through lm-eval; the whole model
    moves to ``device`` for them (lm-eval runs it whole, not layer by layer)."""
    from leanml.eval.tasks import LM_EVAL_VERSION
    from leanml.eval.tasks.runner import run_tasks

    model.to(device)
    t0 = time.perf_counter()
    tasks = run_tasks(model, tokenizer, plan, limit=job.limit, num_fewshot=job.num_fewshot,
                      batch_size=job.batch_size)
    return {"tasks": tasks, "tasks_seconds": time.perf_counter() - t0, "limit": job.limit,
            "lm_eval": LM_EVAL_VERSION}
