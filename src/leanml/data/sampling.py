"""Windows of text sampled from a model itself, where a corpus covers one domain only.

A model distilled or calibrated on one corpus learns (or fits) the model where that corpus lives
(Shakespeare) and drifts elsewhere. Windows drawn from the model itself (ancestral sampling, temperature
1, no top-k/top-p, from the start token) carry its own distribution of text. Two users:

- ``leanml recover --teacher-samples F``: a share ``F`` of the training windows sampled from the
  teacher; the sampling time counts in the run's time;
- ``leanml prune --calib-samples F``: a share ``F`` of the calibration windows sampled from the model
  being pruned (self-generated calibration data), beside the calibration corpus.

Sampling uses the model's KV cache, one token per forward for the whole batch, and a seeded
:class:`torch.Generator`, so the windows depend on the model, the seed and the batch size only.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from leanml.errors import LeanmlError, option_fields


@dataclass(frozen=True)
class Sampling:
    """How windows are sampled: from the token ``start_id`` (not included in a window), seeded by ``seed``,
    at ``temperature``, ``batch_size`` windows per forward."""

    start_id: int
    seed: int = 0
    temperature: float = 1.0
    batch_size: int = 32


@dataclass(frozen=True)
class CalibrationSet:
    """Calibration windows with a share sampled from the model: ``nsamples`` windows of ``seqlen`` tokens,
    ``round(share * nsamples)`` of them sampled, the rest from the calibration split of ``corpus``; both
    seeded by ``seed``."""

    corpus: str
    nsamples: int
    seqlen: int
    share: float
    seed: int = 0


@torch.no_grad()
def sample_windows(
    teacher: nn.Module,
    n: int,
    seqlen: int,
    sampling: Sampling,
    *,
    device: str | torch.device | None = None,
    progress: bool = True,
    desc: str = "teacher samples",
) -> torch.Tensor:
    """``(n, seqlen)`` token ids sampled from ``teacher`` after ``sampling.start_id`` (not included in the
    window; see :class:`Sampling`).

    Every window is ``seqlen`` tokens long: an end-of-text token is sampled like any other token and the
    window goes on after it. ``device``: where the teacher runs (default: where its parameters are).
    """
    start_id, seed = sampling.start_id, sampling.seed
    temperature, batch_size = sampling.temperature, sampling.batch_size
    if n < 1 or seqlen < 1:
        raise LeanmlError(f"sampling needs at least one window of at least one token (got n={n}, seqlen={seqlen})")
    if not temperature > 0:
        raise LeanmlError(f"the sampling temperature must be positive, got {temperature}")
    if batch_size < 1:
        raise LeanmlError(f"the sampling batch size must be at least 1, got {batch_size}")
    device = torch.device(device) if device is not None else next(teacher.parameters()).device
    was_training = teacher.training
    teacher.eval()
    # transformers 5 renamed the KV cache argument and output from ``past_key_values`` to ``cache``
    cache_arg = "cache" if "cache" in inspect.signature(teacher.forward).parameters else "past_key_values"
    gen = torch.Generator().manual_seed(seed)
    out = torch.empty(n, seqlen, dtype=torch.long)
    bar = tqdm(total=n * seqlen, desc=desc, unit="tok", unit_scale=True, disable=not progress)
    try:
        for lo in range(0, n, batch_size):
            b = min(batch_size, n - lo)
            ids = torch.full((b, 1), int(start_id), dtype=torch.long, device=device)
            past = None
            for t in range(seqlen):
                res = teacher(input_ids=ids, use_cache=True, **{cache_arg: past})
                past = getattr(res, cache_arg)
                logits = res.logits[:, -1].float().cpu() / temperature
                nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)
                out[lo : lo + b, t] = nxt[:, 0]
                ids = nxt.to(device)
                bar.update(b)
    finally:
        bar.close()
        teacher.train(was_training)
    return out


def start_token(tokenizer: object, option: str = "teacher_samples") -> int:
    """The token a sample starts from: the tokenizer's BOS, else its EOS (a document boundary).
    ``option``: the option that asked for samples, named in the error: a field name (shown as its flag on
    the command line) or a flag."""
    for name in ("bos_token_id", "eos_token_id"):
        tid = getattr(tokenizer, name, None)
        if tid is not None:
            return int(tid)
    raise LeanmlError(f"the tokenizer has neither a BOS nor an EOS token to start samples from; drop {option}",
                      fields=option_fields(option))


def calibration_with_samples(
    model: nn.Module,
    tokenizer: object,
    calib: CalibrationSet,
    *,
    device: str | torch.device | None = None,
    progress: bool = True,
) -> tuple[torch.Tensor, dict]:
    """``calib.nsamples`` calibration windows (see :class:`CalibrationSet`): ``round(share * nsamples)``
    sampled from ``model`` itself (seeded by ``seed``), the rest seeded random windows of the calibration
    split of ``corpus``; samples first.

    Returns the ``(nsamples, seqlen)`` ids and what they are (counts, start token, sampling seconds).
    ``share`` 0 gives exactly :func:`leanml.data.text.calibration_windows`.
    """
    import time

    from leanml.data.text import calibration_windows

    corpus, nsamples, seqlen, share, seed = calib.corpus, calib.nsamples, calib.seqlen, calib.share, calib.seed
    if not 0.0 <= share <= 1.0:
        raise LeanmlError(f"the share of sampled calibration windows must be in [0, 1], got {share}")
    n_samples = round(share * nsamples)
    n_corpus = nsamples - n_samples
    parts, seconds, start = [], 0.0, None
    if n_samples:
        start = start_token(tokenizer, "calib_samples")
        t0 = time.perf_counter()
        parts.append(sample_windows(model, n_samples, seqlen, Sampling(start, seed=seed), device=device,
                                    progress=progress, desc="calibration samples"))
        seconds = time.perf_counter() - t0
    if n_corpus:
        parts.append(calibration_windows(tokenizer, corpus, n_corpus, seqlen, seed=seed))
    info = {"corpus": corpus, "corpus_windows": n_corpus, "sampled_windows": n_samples, "share": share,
            "start_token": start, "sampling_seconds": seconds}
    return torch.cat(parts), info
