"""The dense teacher of a recovery run: the distillation objective the training runner minimises, the
training windows sampled from the teacher, and the fingerprints that key checkpoints and caches.

:class:`TeacherObjective` is the runner's objective hook (see :class:`~leanml.train.runner.LMObjective`):
before each forward it runs the teacher (``no_grad``) and turns its logits into the targets of
:class:`~leanml.recover.distill.Objective`; the targets count in the step's activation peak and in
Adacc's budget, and are dropped after the step.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from leanml.errors import LeanmlError
from leanml.outputs import atomic_file, fingerprint
from leanml.recover.distill import Objective
from leanml.train.runner import LMObjective, measure_peak

if TYPE_CHECKING:
    from leanml.recover.config import RecoverConfig

#: sequences sampled at once (the samples depend on it: part of the cache key)
SAMPLE_BATCH = 32


class TeacherObjective(LMObjective):
    """``(1 - w) * CE + w * T^2 * KL(teacher || student)`` on the logits (:class:`Objective`); without a
    teacher, or with ``kd_weight`` 0, the plain next-token cross-entropy. The runner times :meth:`start`
    (the teacher's forward) as each step's ``target_times``."""

    def __init__(self, teacher: nn.Module | None, kd_weight: float, temperature: float) -> None:
        self.teacher = teacher if teacher is not None and kd_weight > 0 else None
        self.objective = Objective(kd_weight=kd_weight if teacher is not None else 0.0, temperature=temperature)

    def start(self, x: torch.Tensor) -> None:
        logits = None
        if self.teacher is not None:
            with torch.no_grad():
                logits = self.teacher(input_ids=x, use_cache=False).logits
        self.objective.set_batch(x, logits)

    def held(self) -> list[torch.Tensor]:
        return [self.objective.probs] if self.objective.probs is not None else []

    def inputs(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"input_ids": x}

    def loss_fn(self, output: Any) -> torch.Tensor:
        return self.objective(output)

    def finish(self) -> None:
        self.objective.clear()

    def unoptimized_peak(self, model: nn.Module, x: torch.Tensor, strategy: str) -> int | None:
        """One measured step of this objective before the strategy goes in; None for ``none``, whose
        measured steps are the unoptimized peak."""
        return None if strategy == "none" else measure_peak(model, x, objective=self)

    @property
    def last(self) -> dict[str, float | None]:
        """The parts of the latest loss (``ce``, ``kl``)."""
        return self.objective.last


def teacher_fingerprint(teacher: nn.Module) -> str:
    """SHA-256 over a model's parameters and buffers (names, dtypes, shapes, bytes), in name order."""
    h = hashlib.sha256()
    for name, t in sorted({**dict(teacher.named_parameters()), **dict(teacher.named_buffers())}.items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


@dataclass(frozen=True)
class TeacherSampling:
    """How many training windows the teacher writes and where its samples are kept: ``share`` of the
    windows training reads; ``checkpoint_dir`` keeps them for a resumed run; ``cache_dir`` (optional) keeps
    them for later runs with the same teacher weights and sampling settings."""

    share: float
    checkpoint_dir: Path
    cache_dir: str | Path | None = None


def mix_teacher_samples(windows: torch.Tensor, teacher: nn.Module, teacher_name: str, tokenizer: Any,
                        cfg: RecoverConfig, sampling: TeacherSampling,
                        device: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    """The training windows with a share ``sampling.share`` of the ``steps x batch_size`` windows training
    reads sampled from the teacher and the rest drawn (seeded) from the corpus. The samples are kept in
    the checkpoint directory ``sampling.checkpoint_dir``, so a resumed run trains on the same windows;
    samples of another teacher (``teacher_name``) or other settings are drawn again, and the run's
    checkpoint then refuses the data. ``sampling.cache_dir``: samples are also looked up in (and written
    to) this directory, keyed by a hash of the teacher's weights and the sampling settings, so runs with
    the same teacher sample once. ``seconds`` in the result is this run's time to get the samples;
    ``sampling_seconds`` the time the sampling took (in this run, or in the run that cached or
    checkpointed them)."""
    from leanml.data.sampling import Sampling, sample_windows, start_token

    share, ckpt, cache_dir = sampling.share, sampling.checkpoint_dir, sampling.cache_dir
    total, seed = cfg.train.steps * cfg.train.batch_size, cfg.train.seed
    n_teacher = min(total, max(1, round(share * total)))
    n_corpus = total - n_teacher
    if n_corpus > windows.shape[0]:
        raise LeanmlError(f"{n_corpus} corpus windows wanted beside the teacher's samples but the corpus has "
                          f"{windows.shape[0]}; lower steps or raise teacher_samples",
                          fields=("steps", "teacher_samples"))
    start = start_token(tokenizer)
    key = {"teacher": teacher_name, "n": n_teacher, "seqlen": int(windows.shape[1]), "seed": seed, "start": start}
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
                "seed": seed, "start": start, "batch_size": SAMPLE_BATCH, "temperature": 1.0}
        cache_file = Path(cache_dir) / f"teacher-samples-{fingerprint(ckey)}.pt"
        if samples is None and cache_file.exists():
            saved = torch.load(cache_file, weights_only=True)
            if saved.get("key") == ckey:  # the key holds the count and the length
                samples, cached, sampling_seconds = saved["windows"], str(cache_file), saved.get("sampling_seconds")
    if samples is None:
        samples = sample_windows(teacher, n_teacher, int(windows.shape[1]),
                                 Sampling(start, seed=seed, batch_size=SAMPLE_BATCH), device=device)
        sampling_seconds = time.perf_counter() - t0
    if cache_file is not None and not cache_file.exists():
        with atomic_file(cache_file) as tmp:
            torch.save({"key": ckey, "windows": samples, "sampling_seconds": sampling_seconds}, tmp)
    if not reused:
        ckpt.mkdir(parents=True, exist_ok=True)
        with atomic_file(path) as tmp:  # a run killed while saving leaves no half-written samples
            torch.save({"key": key, "windows": samples, "sampling_seconds": sampling_seconds}, tmp)
    seconds = time.perf_counter() - t0
    order = torch.randperm(windows.shape[0], generator=torch.Generator().manual_seed(seed))[:n_corpus]
    mixed = torch.cat([samples, windows[order]])
    return mixed, {"share": share, "windows": n_teacher, "corpus_windows": n_corpus, "seqlen": key["seqlen"],
                   "start_token": start, "seconds": seconds, "sampling_seconds": sampling_seconds,
                   "reused_from_checkpoint": reused, "reused_from_cache": cached}
