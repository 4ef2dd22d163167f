"""A plain causal-LM training loop with a memory strategy, shared by ``leanml train``, the benchmark and
the demo. Strategies: ``none``, ``checkpoint`` (every layer), ``sac`` (torch selective checkpointing,
save matmuls), ``compile`` (``torch.compile`` with ``activation_memory_budget`` = the budget fraction)
and ``adacc`` (optionally with compiled blocks among its options: ``compile_blocks``).

Measurements (see :mod:`leanml.memory.meter`): the peak saved-activation bytes of EVERY step (the
meter; on CUDA also ``torch.cuda.max_memory_allocated``), against one unoptimized peak computed block
by block (:func:`leanml.memory.profiler.unoptimized_peak`, the same number Adacc's profile gives).
Step times include any re-planning done during the step; ``tokens_s`` also counts it. Every time is read
with a :class:`~leanml.memory.timing.DeviceTimer` (waits for the device before the clock is read), and
compilation (``compile_s``) is timed apart from the steps.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from leanml.memory.api import OOM_ERRORS, Adacc, out_of_memory
from leanml.memory.budget import Budget, BudgetLike
from leanml.memory.compiled import budget_backend
from leanml.memory.meter import ActivationMeter, AllocatorPeak, param_tensors
from leanml.memory.profiler import unoptimized_peak
from leanml.memory.runtime import apply_strategy, disable_kv_cache
from leanml.memory.structure import find_blocks
from leanml.memory.timing import DeviceTimer
from leanml.utils import EtaBar, LeanmlError

log = logging.getLogger(__name__)

STRATEGIES = ("none", "checkpoint", "sac", "compile", "adacc")


@dataclass
class TrainConfig:
    """One training run. ``budget`` is parsed once by :meth:`check` into a
    :class:`~leanml.memory.budget.Budget`; for ``compile`` it must be a fraction (the compiler's
    ``activation_memory_budget``)."""

    strategy: str = "adacc"
    budget: BudgetLike = 0.5
    batch_size: int = 4
    steps: int = 20
    lr: float = 1e-4
    warmup: int = 2
    seed: int = 0
    max_error: float = 0.05
    progress: bool = True
    compile_blocks: bool | tuple[float, ...] = False
    compress_layers: list[int] | None = None
    pool_layers: bool = True  # Adacc plans from times pooled over identical layers (False: each layer's own)

    def check(self) -> None:
        if self.strategy not in STRATEGIES:
            raise LeanmlError(f"unknown memory strategy {self.strategy!r}; choose one of {', '.join(STRATEGIES)}")
        if self.batch_size < 1 or self.steps < 1:
            raise LeanmlError(f"batch size and steps must be at least 1 (got {self.batch_size}, {self.steps})")
        if self.warmup >= self.steps:
            self.warmup = 0
        self.budget = Budget.parse(self.budget)
        if self.strategy == "compile" and self.budget.kind != "fraction":
            raise LeanmlError(f"the compile strategy takes a fraction (its activation_memory_budget), got {self.budget.label()}")

    @property
    def label(self) -> str:
        """``adacc@50%``, ``compile@25%``, ``checkpoint``..."""
        assert isinstance(self.budget, Budget)
        name = self.strategy + ("+compile" if self.strategy == "adacc" and self.compile_blocks else "")
        name += f"@{self.budget.label()}" if self.strategy in ("adacc", "compile") else ""
        return name + (" per-layer" if self.strategy == "adacc" and not self.pool_layers else "")


def remap_vocab(windows: torch.Tensor, vocab: int) -> torch.Tensor:
    """Map the ``vocab - 1`` most frequent token ids to ``0..vocab-2`` and every other id to ``vocab-1``
    (lets a small model with a small output layer train on real tokenized text)."""
    counts = torch.bincount(windows.flatten())
    top = torch.argsort(counts, descending=True)[: vocab - 1]
    table = torch.full((counts.numel(),), vocab - 1, dtype=torch.long)
    table[top] = torch.arange(top.numel())
    return table[windows]


def batches(windows: torch.Tensor, batch_size: int, steps: int, seed: int) -> list[torch.Tensor]:
    """``steps`` batches of windows in a seeded shuffled order (cycling when the data runs out)."""
    if windows.shape[0] < batch_size:
        raise LeanmlError(f"only {windows.shape[0]} windows of text for a batch of {batch_size}; lower --batch-size or --seqlen")
    gen = torch.Generator().manual_seed(seed)
    order: list[int] = []
    while len(order) < steps * batch_size:
        order += torch.randperm(windows.shape[0], generator=gen).tolist()
    return [windows[order[i * batch_size : (i + 1) * batch_size]] for i in range(steps)]


def _lm_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(input_ids=x, labels=x).loss


def lm_unoptimized_peak(model: nn.Module, x: torch.Tensor) -> int:
    """The one unoptimized activation peak of a causal LM on batch ``x`` (block by block; no unoptimized
    step is run). Budget fractions of every strategy are converted against it."""
    disable_kv_cache(model)
    return unoptimized_peak(model, find_blocks(model), lambda: _lm_loss(model, x))


def measure_peak(model: nn.Module, x: torch.Tensor, forward: nn.Module | None = None) -> int:
    """Measured peak saved-activation bytes of one forward+backward (gradients are discarded)."""
    fwd = forward if forward is not None else model
    meter = ActivationMeter(param_tensors(model))
    with meter:
        _lm_loss(fwd, x).backward()
    model.zero_grad(set_to_none=True)
    return meter.peak


def shared_weights_copy(model: nn.Module) -> nn.Module:
    """A second module tree of the same Hugging Face model class sharing every parameter and buffer with
    ``model`` (so several strategies, each with its own hooks or compiled code, train one set of weights)."""
    with torch.device("meta"):
        twin = type(model)(model.config)
    twin.load_state_dict(model.state_dict(keep_vars=True), assign=True, strict=True)
    mods = dict(model.named_modules())
    for name, mod in twin.named_modules():  # non-persistent buffers and tensor attributes (rotary tables)
        src = mods[name]
        for bname, buf in list(mod._buffers.items()):
            if buf is not None and buf.is_meta:
                mod._buffers[bname] = src._buffers[bname]
        for attr, val in list(vars(mod).items()):
            if isinstance(val, torch.Tensor) and val.is_meta:
                setattr(mod, attr, getattr(src, attr))
    left = [n for n, t in [*twin.named_parameters(), *twin.named_buffers()] if t.is_meta]
    if left:
        raise LeanmlError(f"could not share {left[0]} of {type(model).__name__} between copies")
    twin.train(model.training)
    return twin


class StrategyRunner:
    """One model trained under one memory strategy, one step at a time (so several runners can be
    interleaved step by step and share the machine's load fairly). ``optimizer``: share one optimizer
    between runners whose models share weights (default: a new AdamW). ``timer``: how steps are timed
    (default: a :class:`~leanml.memory.timing.DeviceTimer` of the model's device).

    On CUDA each step also records ``torch.cuda.max_memory_allocated`` over its forward and backward
    (``cuda_peaks``: above the step's start; ``cuda_max_allocated``: absolute), and ``result()`` reports
    ``compile_s`` (compilation, outside the timed steps) beside ``setup_s``."""

    def __init__(self, model: nn.Module, cfg: TrainConfig, unoptimized_peak: int | None = None,
                 optimizer: torch.optim.Optimizer | None = None, profile: Any = None,
                 timer: DeviceTimer | None = None) -> None:
        cfg.check()
        self.model = model
        self.timer = timer if timer is not None else DeviceTimer.for_module(model)
        self.cuda_max_allocated: list[int] = []
        self._last_cuda_max = 0
        self.compile_s = 0.0
        self.cfg = cfg
        self.budget: Budget = cfg.budget  # type: ignore[assignment]
        self.unoptimized_peak = unoptimized_peak
        self.adacc: Adacc | None = None
        self.applied = None
        self.forward: nn.Module = model
        self.losses: list[float] = []
        self.times: list[float] = []
        self.replan_times: list[float] = []
        self.peaks: list[int] = []
        self.cuda_peaks: list[int] = []
        self.cpu_times: list[float] = []
        self.setup_peak: int | None = None
        self.budget_bytes: float | None = None
        self.step_budgets: list[float | None] = []  # the budget in bytes each step ran under
        self.step_tokens: list[int] = []
        self.allocator_peak: int | None = None
        self.allocator_meter_peak: int | None = None
        self.optim = optimizer
        self.profile = profile  # an Adacc profile of the same model and batch shape to plan from
        self.setup_s = 0.0

    def setup(self, x: torch.Tensor) -> None:
        """Install the strategy on batch ``x`` (Adacc plans here; compile compiles here)."""
        cfg, model = self.cfg, self.model
        t_setup = self.timer.now()
        model.train()
        disable_kv_cache(model)
        if cfg.strategy == "adacc":
            self.adacc = Adacc(model, budget=self.budget, max_error=cfg.max_error, compile_blocks=cfg.compile_blocks,
                               compress_layers=cfg.compress_layers, profile=self.profile, pool_layers=cfg.pool_layers,
                               timer=self.timer)
            record = self.adacc.prepare(input_ids=x, labels=x)
            assert self.adacc.profile is not None
            if self.unoptimized_peak is not None and self.unoptimized_peak != self.adacc.profile.peak_bytes:
                log.warning("unoptimized peak differs: given %d, Adacc's profile %d", self.unoptimized_peak,
                            self.adacc.profile.peak_bytes)
            self.unoptimized_peak = self.adacc.profile.peak_bytes
            self.budget_bytes = record.budget_bytes
            self.setup_peak = record.measured_peak
            # compiling (or loading from the compile cache) each profiled block at each compiler budget
            self.compile_s = float(sum(c.compile_s for stats in self.adacc.profile.compiled.values() for c in stats))
        else:
            if self.unoptimized_peak is None:
                self.unoptimized_peak = lm_unoptimized_peak(model, x)
            if cfg.strategy == "compile":
                self.budget_bytes = self.budget.to_bytes(self.unoptimized_peak)
                self.forward = torch.compile(model, backend=budget_backend(self.budget.value))
                # compiles outside the timed steps: the first step's time is (almost all) compilation
                self.compile_s, self.setup_peak = self.timer.time(lambda: measure_peak(model, x, self.forward))
            else:
                self.applied = apply_strategy(model, find_blocks(model), cfg.strategy)
        if self.optim is None:
            self.optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        self.setup_s = self.timer.now() - t_setup

    def step(self, x: torch.Tensor) -> float:
        """One optimizer step on batch ``x`` with its peak measured; returns the loss. A device
        out-of-memory error becomes a one-line :class:`LeanmlError` naming a smaller batch or budget."""
        t0, c0 = self.timer.now(), time.process_time()
        try:
            loss, peak, cuda_peak, budget = self._train_step(x)
        except OOM_ERRORS as exc:
            self.model.zero_grad(set_to_none=True)
            raise out_of_memory(f"in a training step of {self.cfg.label} on a batch of shape "
                                f"{'x'.join(map(str, x.shape))}", exc, self._oom_fix()) from None
        self.times.append(self.timer.now() - t0)
        self.cpu_times.append(time.process_time() - c0)
        self.replan_times.append(self.adacc.take_replan_seconds() if self.adacc is not None else 0.0)
        self.peaks.append(peak)
        self.step_budgets.append(budget)
        self.step_tokens.append(x.numel())
        if cuda_peak is not None:
            self.cuda_peaks.append(cuda_peak)
            self.cuda_max_allocated.append(self._last_cuda_max)
        self.losses.append(loss)
        return loss

    def _oom_fix(self) -> str:
        if self.cfg.strategy in ("adacc", "compile"):
            return (f"use a smaller batch (now {self.cfg.batch_size}) or a smaller memory budget "
                    f"(now {self.budget.label()})")
        return (f"use a smaller batch (now {self.cfg.batch_size}), or a memory strategy that holds less "
                "(--memory adacc with a budget, or checkpoint)")

    def allocator_step(self, x: torch.Tensor) -> int:
        """One more optimizer step on ``x``, untimed, under :class:`~leanml.memory.meter.AllocatorPeak`:
        the peak bytes the device allocator hands out during the step above its start (activations,
        gradients, optimizer state, compiled kernels' workspace). Stored as ``allocator_peak``; the
        step's loss, time and meter peak are not added to the timed record."""
        device = next(self.model.parameters()).device
        with AllocatorPeak(device) as alloc:
            _, peak, _, _ = self._train_step(x)
        if self.adacc is not None:
            self.adacc.take_replan_seconds()
        self.allocator_peak, self.allocator_meter_peak = alloc.peak, peak
        return alloc.peak

    def _train_step(self, x: torch.Tensor) -> tuple[float, int, int | None, float | None]:
        """Forward, backward and optimizer step; returns (loss, meter peak, CUDA peak, budget bytes)."""
        assert self.optim is not None
        meter = None if self.adacc is not None else ActivationMeter(param_tensors(self.model))
        if meter is not None:
            with meter:
                loss = _lm_loss(self.forward, x)
                loss.backward()
        else:
            assert self.adacc is not None
            loss = _lm_loss(self.forward, x)
            loss.backward()
            # closes Adacc's per-step meter (the same forward+backward window as the other strategies');
            # may re-plan, timed with the step
            self.adacc.step()
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        if self.adacc is not None:
            self._last_cuda_max = self.adacc.step_cuda_max_allocated[-1] if self.adacc.step_cuda_max_allocated else 0
            # the budget in bytes of the plan this step ran (a fraction budget differs per input shape)
            return (loss.item(), self.adacc.step_peaks[-1],
                    self.adacc.step_cuda_peaks[-1] if self.adacc.step_cuda_peaks else None, self.adacc.step_budgets[-1])
        assert meter is not None
        self._last_cuda_max = meter.cuda_max_allocated or 0
        return loss.item(), meter.peak, meter.cuda_peak, self.budget_bytes

    def close(self) -> None:
        """Remove hooks and wrappers."""
        if self.applied is not None:
            self.applied.remove()
            self.applied = None
        if self.adacc is not None:
            self.adacc.remove()

    def result(self) -> dict[str, Any]:
        """JSON-ready record of the run so far."""
        cfg = self.cfg
        w = cfg.warmup if len(self.times) > cfg.warmup else 0
        timed, timed_peaks, budgets = self.times[w:], self.peaks[w:], self.step_budgets[w:]
        tokens = statistics.fmean(self.step_tokens[w:])
        step_s = statistics.median(timed)
        replan_s = sum(self.replan_times[w:])
        tail = self.losses[-min(10, len(self.losses)) :]
        budgeted = cfg.strategy in ("adacc", "compile")
        grad_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad)
        out: dict[str, Any] = {
            "strategy": cfg.strategy,
            "label": cfg.label,
            "compile_blocks": bool(cfg.compile_blocks),
            "pool_layers": cfg.pool_layers if cfg.strategy == "adacc" else None,
            "compile_budgets": list(self.adacc.compile_budgets) if self.adacc is not None else None,
            "budget_fraction": self.budget.fraction_of(self.unoptimized_peak or 1) if budgeted else None,
            "peak_bytes": max(timed_peaks),
            "peak_measured_every_step": len(self.peaks) == len(self.times),
            "step_peaks": self.peaks,
            "cuda_step_peaks": self.cuda_peaks or None,
            # CUDA, timed steps: max_memory_allocated over forward+backward above the step's start (activations,
            # gradients and kernels' workspace), absolute, and the steps whose peak less the gradients' bytes
            # exceeds the (activation) budget
            "cuda_peak_bytes": max(self.cuda_peaks[w:]) if self.cuda_peaks[w:] else None,
            "cuda_max_allocated": self.cuda_max_allocated or None,
            "grad_bytes": grad_bytes,
            "cuda_steps_over_budget": (sum(p - grad_bytes > b for p, b in zip(self.cuda_peaks[w:], budgets))
                                       if budgeted and self.cuda_peaks else None),
            "steps_over_budget": sum(p > b for p, b in zip(timed_peaks, budgets)) if budgeted else None,
            "step_budget_bytes": self.step_budgets if budgeted else None,
            "allocator_peak_bytes": self.allocator_peak,
            "allocator_step_meter_peak_bytes": self.allocator_meter_peak,
            "setup_peak_bytes": self.setup_peak,
            "budget_bytes": self.budget_bytes if budgeted else None,
            "unoptimized_peak_bytes": self.unoptimized_peak,
            "step_s": step_s,
            "step_cpu_s": statistics.median(self.cpu_times[w:]),
            "replan_s": replan_s,
            # mean tokens per step over the median step plus every second re-planning took, spread over the
            # timed steps (a step that re-planned is also in the median's sample: conservative)
            "tokens_s": tokens * len(timed) / (step_s * len(timed) + replan_s),
            "final_loss": sum(tail) / len(tail),
            "steps": len(self.losses),
            "warmup": w,
            "setup_s": self.setup_s,
            "compile_s": self.compile_s,
            "losses": self.losses,
            "step_times": self.times,
        }
        if self.adacc is not None and self.adacc.plan is not None:
            out["plan"] = self.adacc.plan.to_json()
            out["compiled_loss"] = self.adacc.compiled_loss
            out["history"] = self.adacc.history
            assert self.adacc.profile is not None
            out["profile_peak_bytes"] = self.adacc.profile.profile_peak_bytes
            out["profile_s"] = self.adacc.profile.profile_s
            out["profile_reused"] = bool(self.adacc.history and self.adacc.history[0].get("profile_reused"))
            prof = self.adacc.profile
            out["layer0"] = {  # what the planner saw for one layer: eager bytes and time, compiled variants
                "eager_bytes": sum(g.bytes for g in prof.layer_groups(0)),
                "eager_fwd_s": prof.layer_fwd_s[0],
                "eager_fwd_bwd_s": prof.layer_eager_s[0] if prof.layer_eager_s else None,
                "compiled": [{"budget": c.budget, "bytes": c.bytes, "time_s": c.time_s, "compile_s": c.compile_s}
                             for c in prof.compiled.get(0, [])],
            }
            # per measured layer, the compiled blocks' forward+backward time against the eager block, per
            # compiler budget, as profiled (before any pooling): how far apart identical layers are timed
            out["compiled_time_s"] = {str(i): {f"{c.budget:g}": c.time_s for c in prof.compiled[i]}
                                      for i in prof.measured_layers if i in prof.compiled}
            out["compile_error"] = self.adacc.profile.compile_error
        return out


def run_training(model: nn.Module, windows: torch.Tensor, cfg: TrainConfig,
                 unoptimized_peak: int | None = None) -> dict[str, Any]:
    """Train ``model`` in place with ``cfg.strategy``; returns a JSON-ready record of the run."""
    cfg.check()
    device = next(model.parameters()).device
    data = [b.to(device) for b in batches(windows, cfg.batch_size, cfg.steps, cfg.seed)]
    runner = StrategyRunner(model, cfg, unoptimized_peak)
    try:
        runner.setup(data[0])
        # a bar updated by hand: it prints the estimated time for the rest after the first step
        bar = EtaBar(total=len(data), desc=f"train[{cfg.label}]", unit="step", disable=not cfg.progress, leave=False)
        for x in data:
            bar.set_postfix(loss=f"{runner.step(x):.3f}")
            bar.update(1)
        bar.close()
    finally:
        runner.close()
    out = runner.result()
    out["batch_size"] = cfg.batch_size
    out["seqlen"] = int(data[0].shape[1])
    return out
