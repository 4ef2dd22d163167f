"""``recover(model, windows, ...)``: fine-tune a pruned model under a memory strategy, keeping its mask.

Example::

    from leanml.models import load_model
    from leanml.data.text import load_text, token_windows
    from leanml.recover import RecoverConfig, recover

    model, tok = load_model("out/sgpt50")                     # written by `leanml prune`
    teacher, _ = load_model("smollm2-135m")                   # optional: distil from the dense model
    windows = token_windows(tok, load_text("shakespeare", "train"), 256)
    report = recover(model, windows, RecoverConfig(steps=200, memory="adacc", budget=0.5), teacher=teacher)
    assert report["sparsity"]["out"] == report["sparsity"]["in"]

One step: the teacher's forward (``no_grad``; its probabilities are the distillation targets), the
student's forward and backward (gradients are masked as they are accumulated), gradient clipping,
AdamW, the mask written back into the weights, the learning-rate schedule (linear warm-up, cosine
decay to ``min_lr_ratio``), then Adacc's drift check. Step times include the teacher's forward.

Memory: ``none`` (keep every activation), ``checkpoint`` / ``sac`` (every decoder layer), ``adacc``
(:class:`leanml.memory.Adacc` planned on the first batch with this objective, so the teacher's targets
count in its budget). Every ``measure_every`` steps, and on the step after each Adacc re-plan, the
step runs inside an :class:`~leanml.memory.ActivationMeter`; the report gives the largest peak seen.
An Adacc that meters every step itself (``measure_steps``) is read instead (``step_peaks``), so the
two meters never nest.

Resumption: with ``checkpoint_dir``, the model, optimizer, schedule, RNG, logs and the perplexities
before training are saved every ``checkpoint_every`` steps (atomically); a later call with the same
arguments continues from the last checkpoint. Batches are a function of the seed and the step, so a
resumed run with ``memory`` ``none``, ``checkpoint`` or ``sac`` is bit-identical to an uninterrupted
one on the same machine; with ``adacc`` the plan is solved again on resumption (lossy compressors may
then differ in their last bits).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from leanml.eval.perplexity import perplexity
from leanml.memory import ActivationMeter, Adacc, parse_budget
from leanml.memory.meter import param_tensors
from leanml.memory.runtime import apply_strategy, disable_kv_cache
from leanml.memory.structure import find_blocks
from leanml.memory.train import batches
from leanml.recover.distill import Objective
from leanml.recover.masks import MaskKeeper, linear_sparsity
from leanml.recover.source import MIN_UNDECLARED
from leanml.utils import LeanmlError, atomic_file

MEMORY = ("none", "checkpoint", "sac", "adacc")


@dataclass
class RecoverConfig:
    """One recovery run. ``budget``: Adacc's budget, a fraction of the unoptimized activation peak of this
    step (teacher targets included) or bytes / a size like ``"2GB"``. ``kd_weight``: weight ``w`` of the
    distillation term (used only with a teacher). ``keep_masks=False`` fine-tunes every weight (the
    dense reference)."""

    steps: int = 200
    batch_size: int = 2
    lr: float = 1e-4
    warmup: int = 10
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    memory: str = "adacc"
    budget: float | str = 0.5
    max_error: float = 0.05
    kd_weight: float = 0.5
    temperature: float = 1.0
    keep_masks: bool = True
    seed: int = 0
    checkpoint_every: int = 50
    measure_every: int = 10
    eval_batch_size: int = 4

    def check(self) -> None:
        """Raise :class:`LeanmlError` for settings no run can take."""
        if self.memory not in MEMORY:
            raise LeanmlError(f"unknown memory strategy {self.memory!r}; choose one of {', '.join(MEMORY)}")
        if self.steps < 1 or self.batch_size < 1:
            raise LeanmlError(f"--steps and --batch-size must be at least 1 (got {self.steps}, {self.batch_size})")
        if not self.lr > 0:
            raise LeanmlError(f"--lr must be positive, got {self.lr}")
        if self.warmup < 0 or not 0.0 <= self.min_lr_ratio <= 1.0:
            raise LeanmlError("--warmup must be >= 0 and --min-lr-ratio in [0, 1]")
        if not 0.0 <= self.kd_weight <= 1.0:
            raise LeanmlError(f"--kd-weight must be in [0, 1], got {self.kd_weight}")
        if not self.temperature > 0:
            raise LeanmlError(f"--kd-temperature must be positive, got {self.temperature}")
        if self.checkpoint_every < 1 or self.measure_every < 1:
            raise LeanmlError("--checkpoint-every and the measuring interval must be at least 1")
        parse_budget(self.budget)


def lr_factor(step: int, cfg: RecoverConfig) -> float:
    """Learning-rate multiplier at optimizer step ``step`` (0-based): linear warm-up over ``warmup`` steps,
    then cosine decay from 1 to ``min_lr_ratio`` at the last step."""
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    span = max(cfg.steps - cfg.warmup - 1, 1)
    progress = min((step - cfg.warmup) / span, 1.0)
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _fingerprint(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def evaluate(model: nn.Module, eval_sets: dict[str, torch.Tensor], batch_size: int, device: torch.device,
             progress: bool = True) -> dict[str, dict[str, Any]]:
    """Perplexity (SparseGPT protocol) on each named set of windows."""
    out = {}
    for name, windows in eval_sets.items():
        t0 = time.perf_counter()
        ppl = perplexity(model, windows, batch_size=batch_size, device=device, progress=progress)
        out[name] = {"ppl": ppl, "windows": int(windows.shape[0]), "seqlen": int(windows.shape[1]),
                     "seconds": time.perf_counter() - t0}
    return out


def _max_rss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


class _Memory:
    """The memory strategy installed on the student, and the measurements of the steps."""

    def __init__(self, model: nn.Module, cfg: RecoverConfig, objective: Objective) -> None:
        self.model, self.cfg, self.objective = model, cfg, objective
        self.adacc: Adacc | None = None
        self.applied = None
        self.unoptimized_peak: int | None = None
        self.budget_bytes: float | None = None
        self.peak = 0
        self.cuda_peak: int | None = None
        self.measured_steps: list[int] = []

    def setup(self, x: torch.Tensor) -> None:
        model, cfg = self.model, self.cfg
        disable_kv_cache(model)
        if cfg.memory == "adacc":
            # Adacc meters every step itself (``measure_steps``); a second meter of ours would shadow its own
            self.adacc = Adacc(model, budget=cfg.budget, loss_fn=self.objective, max_error=cfg.max_error,
                               measure_steps=True)
            record = self.adacc.prepare(input_ids=x)
            self.budget_bytes = float(record.budget_bytes)
            self.unoptimized_peak = int(self.adacc.profile.peak_bytes) if self.adacc.profile else None
            return
        if cfg.memory != "none":  # the unoptimized peak of this step, measured before the strategy goes in
            self.unoptimized_peak = self.measure_once(x)
        self.applied = apply_strategy(model, find_blocks(model), cfg.memory)

    def measure_once(self, x: torch.Tensor) -> int:
        meter = ActivationMeter(param_tensors(self.model))
        with meter:
            self.objective(self.model(input_ids=x)).backward()
        self.model.zero_grad(set_to_none=True)
        return meter.peak

    def wants_measure(self, step: int) -> bool:
        """Whether our meter runs on this step (never under Adacc, which measures every step itself)."""
        return self.adacc is None and (step % self.cfg.measure_every == 0 or not self.measured_steps)

    def record(self, step: int, meter: ActivationMeter) -> None:
        self.peak = max(self.peak, meter.peak)
        if meter.cuda_peak is not None:
            self.cuda_peak = max(self.cuda_peak or 0, meter.cuda_peak)
        self.measured_steps.append(step)

    def after_step(self, step: int) -> list[str]:
        if self.adacc is None:
            return []
        reasons = self.adacc.step()
        if self.adacc.step_peaks:  # the step's peak, as Adacc measured it
            self.peak = max(self.peak, int(self.adacc.step_peaks[-1]))
            if self.adacc.step_cuda_peaks:
                self.cuda_peak = max(self.cuda_peak or 0, int(self.adacc.step_cuda_peaks[-1]))
            self.measured_steps.append(step)
        return reasons

    def close(self) -> None:
        if self.applied is not None:
            self.applied.remove()
            self.applied = None
        if self.adacc is not None:
            self.adacc.remove()

    def report(self) -> dict[str, Any]:
        if self.cfg.memory == "none" and self.unoptimized_peak is None:
            self.unoptimized_peak = self.peak
        kind, value = parse_budget(self.cfg.budget)
        out: dict[str, Any] = {
            "strategy": self.cfg.memory,
            "budget": {"kind": kind, "value": value} if self.cfg.memory == "adacc" else None,
            "budget_fraction": (self.budget_bytes / self.unoptimized_peak
                                if self.budget_bytes and self.unoptimized_peak else None),
            "budget_bytes": self.budget_bytes,
            "peak_bytes": self.peak,
            "unoptimized_peak_bytes": self.unoptimized_peak,
            "within_budget": (self.peak <= self.budget_bytes) if self.budget_bytes is not None else None,
            "cuda_peak_bytes": self.cuda_peak,
            "measured_steps": self.measured_steps,
            "peak_definition": "saved-activation bytes of one training step (teacher targets included), "
                               "storages de-duplicated, parameters excluded; the largest over the measured steps",
        }
        if self.adacc is not None:
            rep = self.adacc.report()
            out["plan"] = rep.get("plan")
            out["history"] = rep.get("history")
        return out


def recover(
    model: nn.Module,
    windows: torch.Tensor,
    config: RecoverConfig | None = None,
    *,
    teacher: nn.Module | None = None,
    masks: MaskKeeper | None = None,
    eval_sets: dict[str, torch.Tensor] | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    device: str | torch.device | None = None,
    progress: bool = True,
    on_step: Callable[[int, dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Fine-tune ``model`` in place on ``windows`` (``(n, seqlen)`` token ids), keeping its mask.

    ``masks``: the mask to keep (default: the zeros of the model's linears, see
    :class:`~leanml.recover.masks.MaskKeeper`, which must be at least 1 % of the linear weights, else
    :class:`LeanmlError`; pass a keeper explicitly for a structured model whose pruned units are all
    removed). ``teacher``: a model with the student's vocabulary whose logits are distilled
    (weight ``config.kd_weight``); it is moved to ``device`` and frozen. ``eval_sets``: named windows
    whose perplexity is measured before and after. ``on_step(step, log)`` is called after every finished
    step (1-based). Returns the JSON-ready report (config, sparsity in/out, losses, memory, timings,
    perplexities). The model is left in eval mode on ``device`` with no hooks installed.
    """
    cfg = config or RecoverConfig()
    cfg.check()
    if windows.dim() != 2:
        raise LeanmlError(f"training windows must be (n, seqlen) token ids, got shape {tuple(windows.shape)}")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    t_total = time.perf_counter()
    model.to(device)
    if teacher is not None:
        teacher.to(device).eval().requires_grad_(False)
    keeper = masks
    if keeper is None and cfg.keep_masks:
        keeper = MaskKeeper.from_zeros(model)
        if keeper.fraction() < MIN_UNDECLARED:
            raise LeanmlError(f"the model has no pruned weights ({keeper.fraction():.2%} exact zeros in its linear "
                              f"layers) to keep; recover a pruned model, pass masks=MaskKeeper(...), or set "
                              f"keep_masks=False to fine-tune every weight")
    sparsity_in = linear_sparsity(model)
    data = batches(windows, cfg.batch_size, cfg.steps, cfg.seed)
    meta = {
        "config": asdict(cfg),
        "data": _fingerprint({"shape": list(windows.shape), "head": windows[:4, :16].tolist(),
                              "sum": int(windows.sum())}),
        "masks": _fingerprint(keeper.counts() if keeper is not None else None),
        "teacher": teacher is not None,
        "eval": sorted(eval_sets or {}),
    }
    fingerprint = _fingerprint(meta)

    params = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: lr_factor(s, cfg))
    log: dict[str, list] = {"loss": [], "ce": [], "kl": [], "lr": [], "step_s": [], "teacher_s": [], "cpu_s": []}
    start, before, elapsed, resumed_from = 0, None, 0.0, None
    ckpt = Path(checkpoint_dir) if checkpoint_dir is not None else None
    state_path = ckpt / "state.pt" if ckpt is not None else None
    if state_path is not None and state_path.exists():
        state = torch.load(state_path, map_location=device, weights_only=False)
        if state["fingerprint"] != fingerprint:
            raise LeanmlError(f"the checkpoint in {ckpt} was made with other settings or data; delete it "
                              f"or rerun with the settings of the interrupted run")
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        sched.load_state_dict(state["sched"])
        for key in ("model", "optim", "sched"):  # free the copies now
            state.pop(key)
        start, before, elapsed, log = state["step"], state["before"], state["elapsed"], state["log"]
        resumed_from = start
    else:
        state = None

    objective = Objective(kd_weight=cfg.kd_weight if teacher is not None else 0.0, temperature=cfg.temperature)
    memory = _Memory(model, cfg, objective)
    use_teacher = teacher is not None and cfg.kd_weight > 0

    def teacher_logits(x: torch.Tensor) -> torch.Tensor | None:
        if not use_teacher:
            return None
        with torch.no_grad():
            return teacher(input_ids=x, use_cache=False).logits

    if keeper is not None:
        keeper.attach()
    model.train()
    replans: list[dict[str, Any]] = []
    try:
        x0 = data[0].to(device)
        objective.set_batch(x0, teacher_logits(x0))
        t_setup = time.perf_counter()
        memory.setup(x0)
        setup_s = time.perf_counter() - t_setup
        objective.clear()
        # after the setup, so an infeasible budget fails before minutes of evaluation; the plan's hooks
        # act on saved activations only, and evaluation saves none
        t_eval = time.perf_counter()
        if before is None and eval_sets:
            before = evaluate(model, eval_sets, cfg.eval_batch_size, device, progress)
        eval_before_s = time.perf_counter() - t_eval
        if state is not None:  # after the setup, which may draw random numbers of its own
            torch.set_rng_state(state["rng"].cpu())
            if state.get("cuda_rng") is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state_all([r.cpu() for r in state["cuda_rng"]])
            memory.peak = state["memory_peak"]
            memory.measured_steps = list(state["measured_steps"])
            replans = list(state["replans"])
            del state
        bar = tqdm(range(start, cfg.steps), desc="recover", unit="step", disable=not progress,
                   initial=start, total=cfg.steps)
        for step in bar:
            x = data[step].to(device)
            t0, c0 = time.perf_counter(), time.process_time()
            meter = ActivationMeter(param_tensors(model)) if memory.wants_measure(step) else None
            with meter if meter is not None else contextlib.nullcontext():
                tl = teacher_logits(x)
                t_teacher = time.perf_counter() - t0
                objective.set_batch(x, tl)
                del tl
                if meter is not None and objective.probs is not None:
                    meter.track(objective.probs)
                loss = objective(model(input_ids=x))
                loss.backward()
            if cfg.max_grad_norm:
                torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            lr = optim.param_groups[0]["lr"]
            optim.step()
            if keeper is not None:
                keeper.enforce()
            sched.step()
            optim.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            step_s = time.perf_counter() - t0
            if meter is not None:
                memory.record(step, meter)
            reasons = memory.after_step(step)
            objective.clear()
            if reasons:
                replans.append({"step": step + 1, "reasons": reasons})
            entry = {"loss": float(loss.detach()), "ce": objective.last["ce"], "kl": objective.last["kl"],
                     "lr": lr, "step_s": step_s, "teacher_s": t_teacher if use_teacher else 0.0,
                     "cpu_s": time.process_time() - c0}
            for k, v in entry.items():
                log[k].append(v)
            elapsed += step_s
            bar.set_postfix(loss=f"{entry['loss']:.3f}")
            done = step + 1
            if state_path is not None and done % cfg.checkpoint_every == 0 and done < cfg.steps:
                _save_state(state_path, {
                    "fingerprint": fingerprint, "step": done, "model": model.state_dict(),
                    "optim": optim.state_dict(), "sched": sched.state_dict(), "rng": torch.get_rng_state(),
                    "cuda_rng": torch.cuda.get_rng_state_all() if device.type == "cuda" else None,
                    "before": before, "elapsed": elapsed, "log": log, "memory_peak": memory.peak,
                    "measured_steps": memory.measured_steps, "replans": replans,
                })
            if on_step is not None:
                on_step(done, entry)
        bar.close()
    finally:
        memory.close()
        if keeper is not None:
            keeper.detach()
        objective.clear()
        model.eval()

    if keeper is not None and keeper.violations():
        raise RuntimeError(f"{keeper.violations()} masked weights are non-zero after training")  # a bug, not input
    sparsity_out = linear_sparsity(model)
    t_after = time.perf_counter()
    after = evaluate(model, eval_sets, cfg.eval_batch_size, device, progress) if eval_sets else None
    eval_after_s = time.perf_counter() - t_after
    timed = log["step_s"][2:] or log["step_s"]
    tokens = cfg.batch_size * int(windows.shape[1])
    return {
        "config": asdict(cfg),
        "device": str(device),
        "data": {"windows": int(windows.shape[0]), "seqlen": int(windows.shape[1]),
                 "tokens_per_step": tokens, "tokens_seen": tokens * cfg.steps},
        "sparsity": {"in": sparsity_in, "out": sparsity_out, "masked_fraction":
                     keeper.fraction() if keeper is not None else 0.0, "kept_exactly": keeper is not None},
        "teacher": {"kd_weight": cfg.kd_weight, "temperature": cfg.temperature,
                    "params": sum(p.numel() for p in teacher.parameters()),
                    "param_bytes": sum(p.numel() * p.element_size() for p in teacher.parameters())}
        if teacher is not None else None,
        "losses": log,
        "loss_first": log["loss"][0] if log["loss"] else None,
        "loss_last10": statistics.mean(log["loss"][-10:]) if log["loss"] else None,
        "memory": memory.report() | {"max_rss_bytes": _max_rss_bytes(),
                                     "student_state_bytes": _state_bytes(model, optim)},
        "replans": replans,
        "perplexity_before": before,
        "perplexity_after": after,
        "timings": {
            "train_seconds": elapsed,
            "train_cpu_seconds": sum(log["cpu_s"]),
            "teacher_seconds": sum(log["teacher_s"]),
            "median_step_s": statistics.median(timed) if timed else None,
            "setup_seconds": setup_s,
            "eval_before_seconds": eval_before_s if resumed_from is None else None,
            "eval_after_seconds": eval_after_s,
            "total_seconds": time.perf_counter() - t_total,
        },
        "resumed_from_step": resumed_from,
    }


def _state_bytes(model: nn.Module, optim: torch.optim.Optimizer) -> int:
    """Bytes of the student's parameters, gradients and optimizer state (what training holds besides
    activations)."""
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    opt = sum(t.numel() * t.element_size() for s in optim.state.values() for t in s.values()
              if isinstance(t, torch.Tensor))
    return 2 * n + opt


def _save_state(path: Path, state: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as tmp:
        torch.save(state, tmp)
