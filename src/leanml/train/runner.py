"""The one training runner: a model trained under a memory strategy, one step at a time.

``leanml train`` (:func:`leanml.train.run.run_training`), ``leanml recover``
(:func:`leanml.recover.recover`), the benchmark and the demo all step a :class:`StrategyRunner`. The
memory strategies are set up here and nowhere else: ``none``, ``checkpoint`` (every layer), ``sac``
(torch selective checkpointing, save matmuls), ``compile`` (``torch.compile`` with
``activation_memory_budget`` = the budget fraction) and ``adacc`` (optionally with compiled blocks among
its options: ``compile_blocks``).

What a step minimises is the runner's *objective* hook: :class:`LMObjective`, a causal LM's own
next-token loss, unless another is given (recovery passes one that distils a teacher's logits; its
targets are set before each forward, counted in the step's peak, and dropped after the step). The
optimizer step may be preceded by gradient clipping and followed by a hook (recovery re-applies its
masks there) and a learning-rate scheduler: those hooks are one :class:`StepOptions`.

Measurements (see :mod:`leanml.memory.meter`): the peak saved-activation bytes of every
``measure_every``-th step and of the first (on CUDA also ``torch.cuda.max_memory_allocated``); Adacc
meters every step itself. Every time is read with a :class:`~leanml.memory.timing.DeviceTimer` (waits
for the device before the clock is read), and compilation (``compile_s``) is timed apart from the steps.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from leanml.finite import check_finite_step, lr_hint
from leanml.memory.adacc import Adacc, default_loss
from leanml.memory.budget import Budget
from leanml.memory.compiled import budget_backend
from leanml.memory.devices import OOM_ERRORS, out_of_memory
from leanml.memory.meter import ActivationMeter, AllocatorPeak, param_tensors
from leanml.memory.profiler import unoptimized_peak
from leanml.memory.runtime import apply_strategy, disable_kv_cache
from leanml.memory.structure import find_blocks
from leanml.memory.timing import DeviceTimer

if TYPE_CHECKING:
    from leanml.train.config import TrainConfig

log = logging.getLogger(__name__)


class LMObjective:
    """The runner's objective hook: a causal LM's own next-token loss, ``model(input_ids=x, labels=x).loss``.

    Another objective overrides :meth:`start` (set the targets of batch ``x`` before its forward),
    :meth:`held` (tensors the step holds outside autograd, counted in its peak), :meth:`inputs`,
    :meth:`loss_fn` (the loss of a model output; Adacc plans with it), :meth:`finish` (drop the targets)
    and :meth:`unoptimized_peak` (what budgets and reports are measured against)."""

    def start(self, x: torch.Tensor) -> None:
        """Set the targets of batch ``x`` (before its forward)."""

    def held(self) -> list[torch.Tensor]:
        return []

    def inputs(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"input_ids": x, "labels": x}

    def loss_fn(self, output: Any) -> torch.Tensor:
        return default_loss(output)

    def finish(self) -> None:
        """Drop the batch's targets."""

    def loss(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(model(**self.inputs(x)))

    def unoptimized_peak(self, model: nn.Module, x: torch.Tensor, strategy: str) -> int | None:
        """The unoptimized activation peak on batch ``x``, before ``strategy`` is installed: computed block
        by block (no unoptimized step is run)."""
        return unoptimized_peak(model, find_blocks(model), lambda: self.loss(model, x))


def lm_unoptimized_peak(model: nn.Module, x: torch.Tensor) -> int:
    """The one unoptimized activation peak of a causal LM on batch ``x`` (block by block; no unoptimized
    step is run). Budget fractions of every strategy are converted against it."""
    disable_kv_cache(model)
    return LMObjective().unoptimized_peak(model, x, "none")  # type: ignore[return-value]


def measure_peak(model: nn.Module, x: torch.Tensor, forward: nn.Module | None = None,
                 objective: LMObjective | None = None) -> int:
    """Measured peak saved-activation bytes of one forward+backward (gradients are discarded)."""
    obj = objective if objective is not None else LMObjective()
    meter = ActivationMeter(param_tensors(model))
    with meter:
        obj.loss(forward if forward is not None else model, x).backward()
    model.zero_grad(set_to_none=True)
    return meter.peak


@dataclass(frozen=True)
class StepOptions:
    """What a step does besides the plain LM step. ``objective``: what it minimises (default
    :class:`LMObjective`). ``max_grad_norm`` (> 0: clip the gradients' norm), ``after_update`` (called after
    each optimizer step) and ``scheduler`` (stepped after it). ``measure_every``: meter every n-th step (and
    the first) when the strategy does not meter each step itself (Adacc does). ``hint``: the options a
    non-finite step names (default: the learning rate)."""

    objective: LMObjective | None = None
    max_grad_norm: float = 0.0
    after_update: Callable[[], None] | None = None
    scheduler: Any = None
    measure_every: int = 1
    hint: str | None = None


class StrategyRunner:
    """One model trained under one memory strategy, one step at a time (so several runners can be
    interleaved step by step and share the machine's load fairly). ``optimizer``: share one optimizer
    between runners whose models share weights (default: a new AdamW over every parameter). ``timer``:
    how steps are timed (default: a :class:`~leanml.memory.timing.DeviceTimer` of the model's device).
    ``options``: the step's objective, clipping, hooks, metering and hint (:class:`StepOptions`). Every
    step stops at a non-finite loss or gradient (before its optimizer step) with a
    :class:`~leanml.finite.NonFiniteError` naming the step and the hint, the options that likely caused it.

    On CUDA each measured step also records ``torch.cuda.max_memory_allocated`` over its forward and
    backward (``cuda_peaks``: above the step's start; ``cuda_max_allocated``: absolute), and ``result()``
    reports ``compile_s`` (compilation, outside the timed steps) beside ``setup_s``."""

    def __init__(self, model: nn.Module, cfg: TrainConfig, unoptimized_peak: int | None = None,
                 optimizer: torch.optim.Optimizer | None = None, profile: Any = None,
                 timer: DeviceTimer | None = None, options: StepOptions | None = None) -> None:
        opts = options if options is not None else StepOptions()
        self.model = model
        self.hint = opts.hint if opts.hint is not None else lr_hint(cfg.lr)
        self._named: list[tuple[str, torch.Tensor]] | None = None
        self.timer = timer if timer is not None else DeviceTimer.for_module(model)
        self.objective = opts.objective if opts.objective is not None else LMObjective()
        self.max_grad_norm, self.after_update, self.scheduler = opts.max_grad_norm, opts.after_update, opts.scheduler
        self.measure_every = opts.measure_every
        self.cuda_max_allocated: list[int] = []
        self._last_cuda_max = 0
        self.compile_s = 0.0
        self.cfg = cfg
        self.budget: Budget = cfg.memory_budget
        self.unoptimized_peak = unoptimized_peak
        self.adacc: Adacc | None = None
        self.applied = None
        self.forward: nn.Module = model
        self.steps_done = 0  # steps taken (a resumed run starts from its checkpoint's count)
        self.losses: list[float] = []
        self.times: list[float] = []
        self.replan_times: list[float] = []
        self.replans: list[dict[str, Any]] = []  # {"step": 1-based step, "reasons": [...]} per re-plan
        self.peaks: list[int] = []  # of the measured steps
        self.measured_steps: list[int] = []  # their 0-based indices
        self.cuda_peaks: list[int] = []
        self.cpu_times: list[float] = []
        self.target_times: list[float] = []  # per step: seconds to set the objective's targets
        self.lrs: list[float] = []
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
        self.objective.start(x)
        try:
            if cfg.strategy == "adacc":
                self._setup_adacc(x)
            else:
                if self.unoptimized_peak is None:
                    self.unoptimized_peak = self.objective.unoptimized_peak(model, x, cfg.strategy)
                if cfg.strategy == "compile":
                    self._setup_compile(x)
                else:
                    self.applied = apply_strategy(model, find_blocks(model), cfg.strategy)
        finally:
            self.objective.finish()
        if self.optim is None:
            self.optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        self.setup_s = self.timer.now() - t_setup

    def _setup_adacc(self, x: torch.Tensor) -> None:
        cfg = self.cfg
        self.adacc = Adacc(self.model, budget=self.budget, loss_fn=self.objective.loss_fn, max_error=cfg.max_error,
                           compile_blocks=cfg.compile_blocks, compress_layers=cfg.compress_layers,
                           profile=self.profile, pool_layers=cfg.pool_layers, timer=self.timer)
        record = self.adacc.prepare(**self.objective.inputs(x))
        assert self.adacc.profile is not None
        if self.unoptimized_peak is not None and self.unoptimized_peak != self.adacc.profile.peak_bytes:
            log.warning("unoptimized peak differs: given %d, Adacc's profile %d", self.unoptimized_peak,
                        self.adacc.profile.peak_bytes)
        self.unoptimized_peak = self.adacc.profile.peak_bytes
        self.budget_bytes = record.budget_bytes
        self.setup_peak = record.measured_peak
        # compiling (or loading from the compile cache) each profiled block at each compiler budget
        self.compile_s = float(sum(c.compile_s for stats in self.adacc.profile.compiled.values() for c in stats))

    def _setup_compile(self, x: torch.Tensor) -> None:
        assert self.unoptimized_peak is not None
        self.budget_bytes = self.budget.to_bytes(self.unoptimized_peak)
        self.forward = torch.compile(self.model, backend=budget_backend(self.budget.value))
        # compiles outside the timed steps: the first step's time is (almost all) compilation
        self.compile_s, self.setup_peak = self.timer.time(
            lambda: measure_peak(self.model, x, self.forward, self.objective))

    def step(self, x: torch.Tensor) -> float:
        """One optimizer step on batch ``x`` (its peak measured when due); returns the loss. A device
        out-of-memory error becomes a one-line :class:`LeanmlError` naming a smaller batch or budget."""
        t0, c0 = self.timer.now(), time.process_time()
        index = self.steps_done
        try:
            loss, peak, cuda_peak, budget = self._train_step(x, t0, measure=self._measures(index))
        except OOM_ERRORS as exc:
            self.model.zero_grad(set_to_none=True)
            self.objective.finish()
            raise out_of_memory(f"in a training step of {self.cfg.label} on a batch of shape "
                                f"{'x'.join(map(str, x.shape))}", exc, *self._oom_fix()) from None
        self.times.append(self.timer.now() - t0)
        self.cpu_times.append(time.process_time() - c0)
        self.replan_times.append(self.adacc.take_replan_seconds() if self.adacc is not None else 0.0)
        if peak is not None:
            self.peaks.append(peak)
            self.measured_steps.append(index)
        self.step_budgets.append(budget)
        self.step_tokens.append(x.numel())
        if cuda_peak is not None:
            self.cuda_peaks.append(cuda_peak)
            self.cuda_max_allocated.append(self._last_cuda_max)
        self.losses.append(loss)
        self.steps_done += 1
        return loss

    def _measures(self, index: int) -> bool:
        """Whether our meter runs on step ``index`` (never under Adacc, which meters every step itself)."""
        return self.adacc is None and (index % self.measure_every == 0 or not self.measured_steps)

    def _oom_fix(self) -> tuple[str, tuple[str, ...]]:
        """What to change after an out-of-memory step, and the option fields it names."""
        if self.cfg.strategy in ("adacc", "compile"):
            return (f"use a smaller batch (now {self.cfg.batch_size}) or a smaller memory budget "
                    f"(now {self.budget.label()})"), ()
        return (f"use a smaller batch (now {self.cfg.batch_size}), or a memory setting that holds less "
                "(strategy adacc with a budget, or checkpoint)"), ("strategy",)

    def allocator_step(self, x: torch.Tensor) -> int:
        """One more optimizer step on ``x``, untimed, under :class:`~leanml.memory.meter.AllocatorPeak`:
        the peak bytes the device allocator hands out during the step above its start (activations,
        gradients, optimizer state, compiled kernels' workspace). Stored as ``allocator_peak``; the
        step's loss, time and meter peak are not added to the timed record."""
        device = next(self.model.parameters()).device
        with AllocatorPeak(device) as alloc:
            _, peak, _, _ = self._train_step(x, self.timer.now(), measure=self.adacc is None, record=False)
        if self.adacc is not None:
            self.adacc.take_replan_seconds()
        self.allocator_peak, self.allocator_meter_peak = alloc.peak, peak
        return alloc.peak

    def _train_step(self, x: torch.Tensor, t0: float, measure: bool,
                    record: bool = True) -> tuple[float, int | None, int | None, float | None]:
        """Targets, forward, backward, optimizer step; returns (loss, meter peak or None when the step was
        not measured, CUDA peak, budget bytes). ``record``: keep the step's target time, learning rate
        and re-planning reasons."""
        assert self.optim is not None
        meter = ActivationMeter(param_tensors(self.model)) if measure else None
        with meter if meter is not None else contextlib.nullcontext():
            self.objective.start(x)
            t_targets = self.timer.now() - t0
            if meter is not None:
                for t in self.objective.held():
                    meter.track(t)
            loss = self.objective.loss(self.forward, x)
            loss.backward()
        reasons: list[str] = []
        n_peaks = len(self.adacc.step_peaks) if self.adacc is not None else 0
        if self.adacc is not None:
            # closes Adacc's per-step meter (the same forward+backward window as our meter's); may re-plan,
            # timed with the step
            reasons = self.adacc.step()
        check_finite_step(loss, self._named_params(), self.steps_done + 1, self.hint)
        if self.max_grad_norm:
            torch.nn.utils.clip_grad_norm_([p for g in self.optim.param_groups for p in g["params"]],
                                           self.max_grad_norm)
        lr = self.optim.param_groups[0]["lr"]
        self.optim.step()
        if self.after_update is not None:
            self.after_update()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optim.zero_grad(set_to_none=True)
        self.objective.finish()
        if record:
            self.target_times.append(t_targets)
            self.lrs.append(lr)
            if reasons:
                self.replans.append({"step": self.steps_done + 1, "reasons": reasons})
        if self.adacc is not None:
            a = self.adacc
            measured = len(a.step_peaks) > n_peaks
            self._last_cuda_max = a.step_cuda_max_allocated[-1] if a.step_cuda_max_allocated else 0
            # the budget in bytes of the plan this step ran (a fraction budget differs per input shape)
            return (loss.item(), a.step_peaks[-1] if measured else None,
                    a.step_cuda_peaks[-1] if measured and a.step_cuda_peaks else None,
                    a.step_budgets[-1] if a.step_budgets else None)
        if meter is None:
            return loss.item(), None, None, self.budget_bytes
        self._last_cuda_max = meter.cuda_max_allocated or 0
        return loss.item(), meter.peak, meter.cuda_peak, self.budget_bytes

    def _named_params(self) -> list[tuple[str, torch.Tensor]]:
        """The optimizer's parameters with the model's names (for a one-line error), listed once."""
        if self._named is None:
            assert self.optim is not None
            names = {id(p): n for n, p in self.model.named_parameters()}
            self._named = [(names.get(id(p), "a parameter"), p) for g in self.optim.param_groups for p in g["params"]]
        return self._named

    def close(self) -> None:
        """Remove hooks and wrappers, and the objective's targets."""
        self.objective.finish()
        if self.applied is not None:
            self.applied.remove()
            self.applied = None
        if self.adacc is not None:
            self.adacc.remove()

    def result(self) -> dict[str, Any]:
        """JSON-ready record of the run so far."""
        cfg = self.cfg
        w = cfg.timing_warmup if len(self.times) > cfg.timing_warmup else 0
        timed, budgets = self.times[w:], self.step_budgets[w:]
        # the meter's peaks cover the measured steps only (every ``measure_every``-th): the timed ones among them
        timed_k = [k for k, i in enumerate(self.measured_steps) if i >= w]
        timed_peaks = [self.peaks[k] for k in timed_k]
        peak_budgets = [self.step_budgets[self.measured_steps[k]] for k in timed_k]
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
            "peak_bytes": max(timed_peaks, default=max(self.peaks)),
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
            "steps_over_budget": sum(p > b for p, b in zip(timed_peaks, peak_budgets)) if budgeted else None,
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
            out.update(self._adacc_result(self.adacc))
        return out

    @staticmethod
    def _adacc_result(adacc: Adacc) -> dict[str, Any]:
        """Adacc's part of :meth:`result`: the plan, its history and what the planner saw."""
        assert adacc.plan is not None
        out: dict[str, Any] = {"plan": adacc.plan.to_json()}
        out["compiled_loss"] = adacc.compiled_loss
        out["history"] = adacc.history
        assert adacc.profile is not None
        out["profile_peak_bytes"] = adacc.profile.profile_peak_bytes
        out["profile_s"] = adacc.profile.profile_s
        out["profile_reused"] = bool(adacc.history and adacc.history[0].get("profile_reused"))
        prof = adacc.profile
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
        out["compile_error"] = adacc.profile.compile_error
        return out
