"""Inference speed of a causal LM: prefill and decode tokens/s, peak memory, size on disk.

``measure_speed(model, ...)`` times one model; ``measure_speeds({name: model, ...})`` times several with
their runs interleaved (each repeat runs every model once, in turn), so load from other processes on a
shared machine hits them alike. Every figure is the median over ``repeats`` runs after ``warmup`` runs.

- **prefill**: one forward pass over ``batch_size x prompt_len`` random token ids with no KV cache and
  only the last position's logits computed (what ``generate`` does first); tokens/s = batch x prompt_len
  / seconds.
- **decode**: after a ``gen_prompt_len``-token prompt is prefilled into the KV cache (not timed), greedy
  generation of ``gen_len`` tokens one at a time; tokens/s = batch x gen_len / seconds.
- **peak memory**: on CUDA ``torch.cuda.max_memory_allocated`` over the measured runs (reset before);
  on CPU the process's peak resident set (``VmHWM``, reset before the runs where Linux allows it, else
  the peak since the process started: then it includes everything loaded before).

On CUDA the clocks are read only after ``torch.cuda.synchronize``. ``dir_size_bytes`` sums a model
directory's weight files (safetensors, bin, pt, gguf), dense or compressed.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from tqdm.auto import tqdm

from leanml.errors import LeanmlError
from leanml.models.shards import peak_rss_bytes

if TYPE_CHECKING:
    from leanml.eval.config import SpeedSettings

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def dir_size_bytes(path: str | os.PathLike, suffixes: Iterable[str] = WEIGHT_SUFFIXES) -> int:
    """Bytes of the weight files of a model directory (all levels; ``.gguf`` file: its size)."""
    path = Path(path).expanduser()
    if path.is_file():
        return path.stat().st_size
    if not path.is_dir():
        raise LeanmlError(f"{path} does not exist; pass a model directory or a .gguf file")
    suffixes = tuple(suffixes)
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and f.name.endswith(suffixes))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rss_peak_reset() -> bool:
    """Reset the kernel's peak-RSS counter of this process (Linux ``clear_refs`` 5); whether it worked."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _model_device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type != "cuda" or a.index == b.index:
        return True
    current = torch.cuda.current_device()
    return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)


def _forward_params(model: nn.Module) -> set[str]:
    import inspect

    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


def _forward_kwargs(model: nn.Module) -> dict[str, Any]:
    """``logits_to_keep=1`` where the model takes it (only the last position's logits are needed)."""
    return {"logits_to_keep": 1} if "logits_to_keep" in _forward_params(model) else {}


def _cache_of(out: Any) -> Any:
    """The KV cache of a forward's output (``cache`` in newer transformers, ``past_key_values`` before)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


@torch.inference_mode()
def _prefill_seconds(model: nn.Module, ids: torch.Tensor, device: torch.device) -> float:
    kw = _forward_kwargs(model)
    _sync(device)
    t0 = time.perf_counter()
    model(input_ids=ids, use_cache=False, **kw)
    _sync(device)
    return time.perf_counter() - t0


@torch.inference_mode()
def greedy_decode(model: nn.Module, ids: torch.Tensor, gen_len: int) -> tuple[float, torch.Tensor]:
    """``gen_len`` timed greedy one-token steps after ``ids`` is put in the KV cache (not timed): the
    seconds the steps took and the ``(batch, gen_len + 1)`` tokens (the prefill's next token first)."""
    device = ids.device
    kw = _forward_kwargs(model)
    cache_arg = "cache" if "cache" in _forward_params(model) else "past_key_values"
    out = model(input_ids=ids, use_cache=True, **kw)
    past = _cache_of(out)
    nxt = out.logits[:, -1:].argmax(-1)
    tokens = [nxt]
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(gen_len):
        out = model(input_ids=nxt, use_cache=True, **{cache_arg: past}, **kw)
        past = _cache_of(out)
        nxt = out.logits[:, -1:].argmax(-1)
        tokens.append(nxt)
    _sync(device)
    return time.perf_counter() - t0, torch.cat(tokens, dim=1)


def measure_speeds(
    models: dict[str, nn.Module],
    device: str | torch.device | None = None,
    threads: int | None = None,
    progress: bool = True,
    vocab_size: int | None = None,
    **settings: Any,
) -> dict[str, dict[str, Any]]:
    """Speed of several models, their runs interleaved; ``{name: result}`` with the fields of
    :func:`measure_speed`. ``settings`` are the fields of :class:`~leanml.eval.config.SpeedSettings`
    (``prompt_len``, ``gen_len``, ``repeats``, ...). Each model runs where its parameters are unless
    ``device`` is given (then it is moved there). ``threads`` sets torch's CPU threads for the runs
    (restored after); token ids are drawn below ``vocab_size`` (default: the smallest ``config.vocab_size``)."""
    from leanml.eval.config import SpeedSettings

    st = SpeedSettings(**settings)
    if not models:
        raise LeanmlError("no models to measure")
    devices = {}
    for name, m in models.items():
        if device is not None and not _same_device(_model_device(m), torch.device(device)):
            m.to(device)  # (a model already there is left alone: tensor subclasses may not support .to)
        devices[name] = _model_device(m)
        m.eval()
    prompt, gen_prompt = _prompts(models, st, vocab_size)
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        runs = _timed_runs(models, devices, prompt, gen_prompt, st, progress)
    finally:
        torch.set_num_threads(old_threads)
    return {name: _speed_result(name, m, devices[name], st, threads, runs) for name, m in models.items()}


def _prompts(models: dict[str, nn.Module], st: SpeedSettings,
             vocab_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The seeded random prompts of the prefill and of the decode, below every model's vocabulary and
    within every model's positions."""
    from leanml.config import ConfigError
    from leanml.eval.config import SpeedSettings

    prompt_len, gen_len, gen_prompt_len = st.prompt_len, st.gen_len, st.gen_prompt_len
    vocab = min(int(getattr(m.config, "vocab_size", 32000)) for m in models.values())
    vocab = min(vocab, vocab_size or vocab)
    g = torch.Generator().manual_seed(st.seed)
    prompt = torch.randint(0, vocab, (st.batch_size, prompt_len), generator=g)
    gen_prompt = torch.randint(0, vocab, (st.batch_size, gen_prompt_len), generator=g)
    limit = min(int(getattr(m.config, "max_position_embeddings", 1 << 30) or 1 << 30) for m in models.values())
    if max(prompt_len, gen_prompt_len + gen_len + 1) > limit:
        raise ConfigError(f"prompt_len {prompt_len} / gen_len {gen_len} go past the model's {limit} positions; "
                          "use shorter lengths", SpeedSettings, ("prompt_len", "gen_len"))
    return prompt, gen_prompt


@dataclasses.dataclass
class _Runs:
    """Per model: the seconds of each timed prefill and decode, the peak memory, and whether the process's
    peak RSS could be reset before the runs."""

    prefill: dict[str, list[float]]
    decode: dict[str, list[float]]
    peaks: dict[str, int] = dataclasses.field(default_factory=dict)
    rss_reset: dict[str, bool] = dataclasses.field(default_factory=dict)


def _timed_runs(models: dict[str, nn.Module], devices: dict[str, torch.device], prompt: torch.Tensor,
                gen_prompt: torch.Tensor, st: SpeedSettings, progress: bool) -> _Runs:
    """Warm-up runs of every model, then ``repeats`` rounds that time each model in turn."""
    gen_len = st.gen_len
    runs = _Runs({k: [] for k in models}, {k: [] for k in models})
    for name, m in models.items():
        d = devices[name]
        for _ in range(st.warmup):
            _prefill_seconds(m, prompt.to(d), d)
            if gen_len:
                greedy_decode(m, gen_prompt.to(d), min(gen_len, 4))
    steps = tqdm(range(st.repeats), desc="speed", disable=not progress, leave=False)
    for _ in steps:
        for name, m in models.items():
            d = devices[name]
            if d.type == "cuda":
                torch.cuda.reset_peak_memory_stats(d)
            else:
                runs.rss_reset[name] = _rss_peak_reset()
            runs.prefill[name].append(_prefill_seconds(m, prompt.to(d), d))
            if gen_len:
                runs.decode[name].append(greedy_decode(m, gen_prompt.to(d), gen_len)[0])
            peak = torch.cuda.max_memory_allocated(d) if d.type == "cuda" else peak_rss_bytes()
            runs.peaks[name] = max(runs.peaks.get(name, 0), int(peak))
    return runs


def _speed_result(name: str, m: nn.Module, d: torch.device, st: SpeedSettings, threads: int | None,
                  runs: _Runs) -> dict[str, Any]:
    """One model's result: medians, tokens/s, every run, the settings and the peak memory."""
    batch_size, prompt_len, gen_len = st.batch_size, st.prompt_len, st.gen_len
    pre = statistics.median(runs.prefill[name])
    dec = statistics.median(runs.decode[name]) if gen_len else None
    return {
        "device": str(d),
        "dtype": str(next(m.parameters()).dtype).replace("torch.", ""),
        "batch_size": batch_size,
        "prompt_len": prompt_len,
        "gen_prompt_len": st.gen_prompt_len,
        "gen_len": gen_len,
        "repeats": st.repeats,
        "warmup": st.warmup,
        "torch_threads": torch.get_num_threads() if threads is None else threads,
        "prefill_seconds": pre,
        "prefill_tok_s": batch_size * prompt_len / pre,
        "decode_seconds": dec,
        "decode_tok_s": batch_size * gen_len / dec if dec else None,
        "prefill_runs_s": runs.prefill[name],
        "decode_runs_s": runs.decode[name],
        "peak_memory_bytes": runs.peaks[name],
        "peak_memory_kind": ("cuda max_memory_allocated" if d.type == "cuda" else
                             "process peak RSS" + ("" if runs.rss_reset.get(name) else " since start")),
    }


def measure_speed(
    model: nn.Module,
    tokenizer: Any = None,
    device: str | torch.device | None = None,
    threads: int | None = None,
    progress: bool = True,
    **settings: Any,
) -> dict[str, Any]:
    """Prefill and decode tokens/s and peak memory of one causal LM (median of ``repeats`` runs).

    ``settings`` are the fields of :class:`~leanml.eval.config.SpeedSettings`. Token ids are random
    (seeded), so ``tokenizer`` is not needed; when given, its vocabulary bounds the ids. Returns
    ``prefill_tok_s``, ``decode_tok_s``, their per-run seconds, ``peak_memory_bytes`` and the settings.
    Works on any in-memory model that takes ``input_ids`` and a KV cache.
    """
    vocab = len(tokenizer) if tokenizer is not None else None
    return measure_speeds({"model": model}, device, threads, progress, vocab, **settings)["model"]


def sparse_kernels_or_dense(model: nn.Module, spec: str) -> dict[str, Any] | None:
    """Put a 2:4 model on sparse kernels (its report), leave any other dense (``None``, with a line)."""
    from leanml.models.sparse import check_24, to_sparse_kernels

    try:
        check_24(model)
    except LeanmlError:
        print(f"{spec}: not 2:4 sparse, runs dense")
        return None
    return to_sparse_kernels(model, progress=False)


def run_speed_job(job: Any) -> dict[str, Any]:
    """``leanml speed`` (a :class:`~leanml.eval.config.SpeedJob`): load each model, time them interleaved,
    write the JSON report (its path under ``"json"``) and return it."""
    from leanml.device import parse_device
    from leanml.eval.config import SpeedJob
    from leanml.eval.job import check_json_out
    from leanml.flags import flag_of
    from leanml.machine import apply_threads, machine_info
    from leanml.models import BUNDLED, bundled_dir, check_dtype, count_parameters, load_model, parse_dtype
    from leanml.outputs import write_json

    device = parse_device(job.device)
    dtype = parse_dtype(job.dtype)
    check_dtype(dtype, device)
    name = "-".join(Path(s).name for s in job.models)[:80]
    json_path = check_json_out(job.json, flag_of(SpeedJob, "json")) or Path("runs") / f"speed-{name}.json"
    threads = apply_threads(job.threads)
    models: dict[str, Any] = {}
    info: dict[str, dict[str, Any]] = {}
    for spec in job.models:
        model, tok = load_model(spec, dtype=dtype, device=device, flag="models")
        where = bundled_dir(spec) if spec in BUNDLED else Path(spec).expanduser()
        info[spec] = {"params": count_parameters(model),
                      "disk_bytes": dir_size_bytes(where) if where.exists() else None,
                      "sparse_kernels": sparse_kernels_or_dense(model, spec) if job.sparse_kernels else None}
        models[spec] = model
        vocab = len(tok)
    if job.sparse_kernels and all(i["sparse_kernels"] is None for i in info.values()):
        raise LeanmlError("sparse_kernels: none of models is 2:4 sparse; prune one to the 2:4 pattern with "
                          "`leanml prune`, or drop sparse_kernels", fields=("sparse_kernels", "models"))
    results = measure_speeds(models, device=device, threads=threads, vocab_size=vocab,
                             **dataclasses.asdict(job.settings))
    report = {"models": [{"model": spec, **info[spec], **results[spec]} for spec in job.models],
              "dtype": job.dtype, "machine": machine_info()}
    write_json(json_path, report)
    return {**report, "json": str(json_path)}
