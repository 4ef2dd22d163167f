"""``Adacc``: per-tensor-group retain / recompute / compress under a memory budget, around a training loop.

Example::

    adacc = Adacc(model, budget=0.5)            # half of the unoptimized activation peak
    adacc.prepare(input_ids=x, labels=x)        # optional: plan now (else on the first training forward)
    for x in batches:
        loss = model(input_ids=x, labels=x).loss
        loss.backward(); opt.step(); opt.zero_grad()
        adacc.step()                            # per-step peak, drift tracking; may re-plan

The budget is a promise: a budget below the smallest feasible plan, or one calibration cannot meet,
raises :class:`~leanml.errors.LeanmlError` naming the smallest budget that holds; every training step's
peak is measured (``adacc.step_peaks``), and a step over the budget tightens the plan (or raises when
no tighter plan exists); a batch of a new shape is planned before it runs (plans are cached per shape)
or, with ``on_new_shape="error"``, refused. Profiling runs block by block and never holds more than full
checkpointing does. With ``compile_blocks``, layers may also run as compiled blocks at a recomputation
budget of the compiler, chosen by the same MILP.

Call :meth:`Adacc.prepare` before wrapping the model in ``DistributedDataParallel``; under
``torch.distributed`` rank 0's plan is broadcast so every rank runs the same plan (ranks must change
batch shapes together).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from leanml.config import check_argument
from leanml.errors import LeanmlError
from leanml.memory.budget import Budget
from leanml.memory.calibrate import MIB, Calibration
from leanml.memory.compiled import (
    CompiledLoss,
    compile_loss_function,
    supported_budgets,
)
from leanml.memory.costs import Profile, pool_timings
from leanml.memory.devices import OOM_ERRORS, max_over_ranks, out_of_memory
from leanml.memory.meter import ActivationMeter, param_tensors
from leanml.memory.milp import min_peak
from leanml.memory.options import AdaccOptions, with_values
from leanml.memory.policy import DriftMonitor
from leanml.memory.problem import build_problem
from leanml.memory.profiler import ProfileOptions, profile_step
from leanml.memory.records import PlanRecord, ShapePlan
from leanml.memory.runtime import AppliedPlan, Compression, disable_kv_cache
from leanml.memory.structure import find_blocks, tensors_in
from leanml.memory.timing import DeviceTimer

log = logging.getLogger(__name__)


def default_loss(output: Any) -> torch.Tensor:
    """``output.loss`` (Hugging Face), else the mean square of the first output (for plain stacks)."""
    loss = getattr(output, "loss", None)
    if loss is not None:
        return loss
    if isinstance(output, (tuple, list)):
        output = output[0]
    if isinstance(output, dict):
        output = next(iter(output.values()))
    return output.float().square().mean()


def _layers(layers: list[int] | tuple[int, ...] | None) -> list[int] | None:
    return None if layers is None else list(layers)


def shape_signature(args: tuple, kwargs: dict) -> str:
    """The shapes and dtypes of a forward call's tensor inputs, e.g. ``input_ids=2x256:int64 labels=...``."""
    parts = []
    for i, a in enumerate(args):
        parts += [f"{i}={_shape(t)}" for t in tensors_in(a)]
    for k in sorted(kwargs):
        parts += [f"{k}={_shape(t)}" for t in tensors_in(kwargs[k])]
    return " ".join(parts)


def _shape(t: torch.Tensor) -> str:
    return "x".join(str(d) for d in t.shape) + ":" + str(t.dtype).removeprefix("torch.")


class Adacc:
    """Plans and applies retain / recompute / compress per activation group under ``options.budget``.

    ``options``: an :class:`AdaccOptions`; its fields may also be given by name (``Adacc(model,
    budget=0.5, compressors=("bf16",))``), alone or as changes to ``options``. The real objects:
    ``blocks`` (the repeated layers; default: found in the model), ``loss_fn`` (the loss of a forward's
    output), ``profile``: a profile of the same architecture and input shape (``other.profile``, e.g. from
    an Adacc on a model sharing these weights, with the same compressors and ``compile_blocks``) to plan the
    first batch of that shape from instead of profiling again, and ``timer``: how device work is timed
    (default: a :class:`~leanml.memory.timing.DeviceTimer` of the model's device, which waits for the device
    before reading the clock).
    """

    def __init__(self, model: nn.Module, options: AdaccOptions | None = None, *,
                 blocks: list[nn.Module] | None = None, loss_fn: Callable[[Any], torch.Tensor] = default_loss,
                 profile: Profile | None = None, timer: DeviceTimer | None = None, **option_values: Any) -> None:
        self.options = with_values(options, option_values)
        check_argument(model, "model", nn.Module, "a torch.nn.Module")
        check_argument(profile, "profile", (Profile, type(None)), "a Profile (another Adacc's .profile) or None")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        self.model = model
        self.timer = timer if timer is not None else DeviceTimer.for_module(model)
        self.blocks = blocks if blocks is not None else find_blocks(model)
        if not self.blocks:
            raise LeanmlError("Adacc needs at least one block; pass blocks=[...] with the model's repeated layers")
        self.loss_fn = loss_fn
        self.compile_budgets: tuple[float, ...] = supported_budgets(self.options.compile_budgets)
        self.monitor = DriftMonitor(self.options.thresholds)
        self.profile: Profile | None = None
        self.plan: PlanRecord | None = None
        self.history: list[dict[str, Any]] = []
        self.step_peaks: list[int] = []
        self.step_budgets: list[float] = []  # the budget in bytes each measured step ran under
        # CUDA: max_memory_allocated over each step's forward+backward, above its start
        self.step_cuda_peaks: list[int] = []
        self.step_cuda_max_allocated: list[int] = []  # the same, absolute
        self.replan_s = 0.0  # all time spent profiling, solving and calibrating (initial plan included)
        self.last_step_replan_s = 0.0  # of that, what the most recent training step spent
        self._given_profile = profile
        self._plans: dict[str, ShapePlan] = {}
        self._sig: str | None = None
        self._applied: AppliedPlan | None = None
        self._inputs: tuple[tuple, dict] | None = None
        self._steps = 0
        self._last_step_t: float | None = None
        self._sampling = False
        self._busy = False
        self._step_meter: ActivationMeter | None = None
        self._last_loss: torch.Tensor | None = None
        disable_kv_cache(model)
        self._loss = self._compiled_loss(model)
        self._handles = [
            model.register_forward_pre_hook(self._pre_forward, with_kwargs=True),
            model.register_forward_hook(self._post_forward, always_call=True),
        ]

    def _compiled_loss(self, model: nn.Module) -> CompiledLoss | None:
        compile_loss = self.options.compile_loss
        if not (bool(self.compile_budgets) if compile_loss is None else compile_loss):
            return None
        loss = compile_loss_function(model)
        if loss is None:
            log.info("adacc: the model has no settable loss_function; its loss runs eagerly")
        return loss

    @property
    def budget(self) -> Budget:
        """The budget (parsed): ``options.budget``."""
        return self.options.budget  # type: ignore[return-value]

    @property
    def compiled_loss(self) -> bool:
        """Whether the model's loss runs (after :meth:`remove`: ran) as compiled kernels (``compile_loss``, and
        compiling it worked)."""
        return self._loss is not None and self._loss.active

    # ------------------------------------------------------------------ model hooks
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled() or self._busy:
            return
        self._inputs = (args, kwargs)
        sig = shape_signature(args, kwargs)
        if sig != self._sig:
            t0 = self.timer.now()
            if sig in self._plans:
                self._switch(sig)
            elif self.plan is None and not self._plans:
                self._plan(sig, "first training step")
            elif self.options.on_new_shape == "error":
                raise LeanmlError(
                    f"input shape changed from [{self._sig}] to [{sig}] and re-planning is off "
                    "(on_new_shape='error'); keep batch shapes fixed (pad or drop the last batch), plan each shape "
                    "with prepare(...), or use on_new_shape='replan'")
            else:
                self._plan(sig, "new input shape")
            self.last_step_replan_s += self.timer.now() - t0
        if self.options.measure_steps and self._step_meter is None:
            self._step_meter = ActivationMeter(param_tensors(self.model))
            self._step_meter.__enter__()
        if self._applied is not None:
            self._applied.enter()

    def _post_forward(self, module: nn.Module, args: tuple, output: object) -> None:
        if self._applied is not None:
            self._applied.exit()
        loss = getattr(output, "loss", None)
        if not self._busy and torch.is_grad_enabled() and isinstance(loss, torch.Tensor):
            self._last_loss = loss.detach()

    def _check_loss(self) -> None:
        """A non-finite training loss under a plan that compresses lossily is reported as such."""
        loss, self._last_loss = self._last_loss, None
        if loss is None or self.plan is None or bool(torch.isfinite(loss).all()):
            return
        lossy = self.plan.lossy()
        if lossy:
            raise LeanmlError(
                f"the training loss became {loss.flatten()[0].item()} at step {self._steps} under a plan that "
                f"compresses activations ({', '.join(lossy)}); lower max_error, drop those compressors "
                "(compressors=...), or check that the unoptimized run stays finite")

    def _run(self, args: tuple, kwargs: dict) -> torch.Tensor:
        return self.loss_fn(self.model(*args, **kwargs))

    def _isolated(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` without disturbing the parameters' gradients, the RNG streams or the hooks."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        busy = self._busy
        self._busy = True
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        try:
            with torch.random.fork_rng(devices=devices):
                return fn()
        finally:
            self._busy = busy
            for p, g in zip(params, grads):
                p.grad = g

    # ------------------------------------------------------------------ planning
    def budget_bytes(self) -> float:
        """The budget in bytes for the current shape (needs a plan for a fraction budget)."""
        if self.budget.kind == "bytes":
            return self.budget.value
        if self.profile is None:
            raise LeanmlError("a fractional budget needs a profile first; call prepare(...) with a training batch")
        return self.budget.to_bytes(self.profile.peak_bytes)

    def prepare(self, *args: Any, **kwargs: Any) -> PlanRecord:
        """Profile one batch (block by block), solve the plan, calibrate it and install it. Plans for
        other shapes stay cached."""
        t0 = self.timer.now()
        self._inputs = (args, kwargs)
        record = self._plan(shape_signature(args, kwargs), "initial plan")
        self.last_step_replan_s = 0.0
        log.debug("adacc: prepared in %.1fs", self.timer.now() - t0)
        return record

    def _plan(self, sig: str, reason: str) -> PlanRecord:
        if self._inputs is None:
            raise LeanmlError("Adacc has no inputs to profile; call prepare(...) with a training batch first")
        t0 = self.timer.now()
        args, kwargs = self._inputs
        self.remove_plan()
        given, self._given_profile = self._given_profile, None
        try:
            if given is not None and given.shape == sig and given.n_layers == len(self.blocks):
                profile = given
            else:
                profile = self._profile(args, kwargs)
            profile.shape = sig
            self._plan_from(profile, sig, reason, t0)
        except OOM_ERRORS as exc:
            self.remove_plan()
            raise out_of_memory(f"while Adacc profiled and planned inputs [{sig}]", exc,
                                "use a smaller batch (profiling holds about what full checkpointing holds), or "
                                "a smaller memory budget if the plan's own measurement ran out") from None
        self.history[-1]["profile_reused"] = profile is given
        return self.plan  # type: ignore[return-value]

    def _profile(self, args: tuple, kwargs: dict) -> Profile:
        o = self.options
        measure = ProfileOptions(o.compressors, o.outlier_frac, _layers(o.compress_layers),
                                 measure_outside=o.compress_head, compile_budgets=self.compile_budgets)
        return self._isolated(lambda: profile_step(self.model, self.blocks, lambda: self._run(args, kwargs), measure,
                                                   progress=o.progress, timer=self.timer))

    def _plan_from(self, profile: Profile, sig: str, reason: str, t0: float) -> None:
        budget = self.budget.to_bytes(profile.peak_bytes)
        problem, names, post_names = build_problem(pool_timings(profile) if self.options.pool_layers else profile,
                                                   self.options.max_error, self.options.error_caps or {},
                                                   self.options.compress_head)
        entry = ShapePlan(profile, None, problem, names, post_names, min_peak(problem))  # type: ignore[arg-type]
        entry.record = self._calibration().plan(entry, budget)
        self._plans[sig] = entry
        self._sig = sig
        self.profile, self.plan = profile, entry.record
        self._reset_monitor()
        seconds = self.timer.now() - t0
        self.replan_s += seconds
        self.history.append({"step": self._steps, "reason": reason, "shape": sig, "plan": entry.record.summary(),
                             "measured_peak": entry.record.measured_peak, "budget_bytes": budget,
                             "profile_peak_bytes": profile.profile_peak_bytes, "seconds": seconds})
        log.info("adacc plan (%s, %.1fs): %s", reason, seconds, entry.record.summary())

    def _calibration(self) -> Calibration:
        """How plans are tried: installed on this model, measured on the inputs being planned."""
        def measure() -> int:
            args, kwargs = self._inputs  # type: ignore[misc]
            return self.measure(*args, **kwargs)

        return Calibration(self._install, self.remove_plan, measure, self.options.time_limit,
                           self.options.max_calibrations, self.options.calibrate)

    def _install(self, record: PlanRecord, profile: Profile) -> None:
        self.remove_plan()
        masks = {k for k, g in profile.groups.items() if g.mask_bytes}
        modes = [m if m.startswith("compiled@") else "" for m in record.layer_modes]
        self._applied = AppliedPlan(self.model, self.blocks, record.layer_checkpoint, record.options,
                                    Compression(self.options.outlier_frac, masks), layer_modes=modes, model_hooks=False)

    def _switch(self, sig: str) -> None:
        """Install the cached plan of another input shape."""
        entry = self._plans[sig]
        self._install(entry.record, entry.profile)
        self._sig = sig
        self.profile, self.plan = entry.profile, entry.record
        self._reset_monitor()

    def _reset_monitor(self) -> None:
        assert self.profile is not None and self.plan is not None
        self.monitor.reset(*self.plan.drift_references(self.profile, self.options.error_caps or {},
                                                       self.options.max_error))

    # ------------------------------------------------------------------ measuring
    def measure(self, *args: Any, **kwargs: Any) -> int:
        """Peak saved-activation bytes of one forward+backward on these inputs under the current plan."""
        def run() -> int:
            meter = ActivationMeter(param_tensors(self.model))
            with meter:
                if self._applied is not None:
                    self._applied.enter()
                try:
                    loss = self._run(args, kwargs)
                finally:
                    if self._applied is not None:
                        self._applied.exit()
                if not torch.isfinite(loss.detach()).all():
                    raise LeanmlError(f"the loss is {loss.item()} under the memory plan; lower max_error (compression "
                                      "too lossy) or check the model and data")
                loss.backward()
            return meter.peak
        return self._isolated(run)

    # ------------------------------------------------------------------ training loop
    def step(self) -> list[str]:
        """Call once per training step (after backward). Records the step's measured peak, keeps the
        budget, tracks drift. Returns the reasons if it re-planned."""
        t_step = self.timer.now()
        if self._last_step_t is not None:
            self.monitor.add_step_time(t_step - self._last_step_t)
        self._steps += 1
        reasons: list[str] = []
        peak = self._close_step_meter()
        self._check_loss()
        if peak is not None and self.plan is not None:
            over = max_over_ranks(peak - self.plan.budget_bytes)
            if over > 0:
                reasons.append(f"step peak {peak / MIB:.1f} MiB over the budget {self.plan.budget_bytes / MIB:.1f} MiB")
                self._tighten(over)
        hooks = self._applied.hooks if self._applied is not None else None
        sampled = hooks is not None and self._sampling
        checked = sampled or bool(self.options.check_every and self._steps % self.options.check_every == 0)
        drift: list[str] = []
        if sampled:
            hooks.sample = False
            self._sampling = False
            drift = self.monitor.check(hooks.drift.error, hooks.drift.outlier)
            hooks.drift.error.clear()
            hooks.drift.outlier.clear()
        elif checked:
            drift = self.monitor.check({}, {})
        # checks fall on the same steps on every rank; re-planning (a collective) must too
        if checked and max_over_ranks(float(bool(drift))) > 0 and not drift:
            drift = ["drift on another rank"]
        if checked and not sampled and hooks is not None and not drift:
            hooks.sample = True  # sample the next step's compressed tensors
            self._sampling = True
        if drift:
            log.info("adacc: re-planning at step %d: %s", self._steps, "; ".join(drift))
            assert self._sig is not None
            self._plans.pop(self._sig, None)
            self._plan(self._sig, "; ".join(drift))
            self.history[-1]["step"] = self._steps
        reasons += drift
        self.last_step_replan_s += self.timer.now() - t_step if reasons else 0.0
        self._last_step_t = self.timer.now()
        return reasons

    def take_replan_seconds(self) -> float:
        """Seconds spent re-planning since the last call (inside forwards and in :meth:`step`); callers that
        time steps add them to the step they belong to."""
        s, self.last_step_replan_s = self.last_step_replan_s, 0.0
        return s

    def _close_step_meter(self) -> int | None:
        meter, self._step_meter = self._step_meter, None
        if meter is None:
            return None
        meter.__exit__(None, None, None)
        self.step_peaks.append(meter.peak)
        self.step_budgets.append(self.plan.budget_bytes if self.plan is not None else float("inf"))
        if meter.cuda_peak is not None:
            self.step_cuda_peaks.append(meter.cuda_peak)
            self.step_cuda_max_allocated.append(meter.cuda_max_allocated or 0)
        return meter.peak

    def _tighten(self, over: float) -> None:
        """A training step measured over the budget: re-solve with the planner's budget lowered by the
        overshoot (no new profile). Raises when the plan is already the smallest."""
        assert self.plan is not None and self._sig is not None
        t0 = self.timer.now()
        entry = self._plans[self._sig]
        record = self._calibration().tightened(entry, self.plan, over)
        entry.record = self.plan = record
        self._reset_monitor()
        seconds = self.timer.now() - t0
        self.replan_s += seconds
        self.history.append({"step": self._steps, "reason": f"step peak {over / MIB:.1f} MiB over budget",
                             "shape": self._sig, "plan": record.summary(), "measured_peak": None,
                             "budget_bytes": self.plan.budget_bytes if self.plan else None, "seconds": seconds})

    def remove_plan(self) -> None:
        """Uninstall the current plan (the model runs unoptimized until the next forward plans again)."""
        if self._applied is not None:
            self._applied.remove()
            self._applied = None

    def remove(self) -> None:
        """Uninstall everything Adacc added to the model."""
        self._close_step_meter()
        self.remove_plan()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._loss is not None:  # kept: compiled_loss still says how the loss ran
            self._loss.undo()

    def report(self) -> dict[str, Any]:
        """Budget, profile, plan (per shape), measured step peaks and history as JSON-ready data."""
        peaks = self.step_peaks
        return {
            "budget": self.budget.to_json(),
            "budget_bytes": self.plan.budget_bytes if self.plan else None,
            "unoptimized_peak_bytes": self.profile.peak_bytes if self.profile else None,
            "profile_peak_bytes": self.profile.profile_peak_bytes if self.profile else None,
            "plan": self.plan.to_json() if self.plan else None,
            "plans": {sig: e.record.to_json() for sig, e in self._plans.items()},
            "steps": {"measured": len(peaks), "max_peak_bytes": max(peaks) if peaks else None,
                      "over_budget": sum(p > b for p, b in zip(peaks, self.step_budgets)),
                      "max_cuda_peak_bytes": max(self.step_cuda_peaks) if self.step_cuda_peaks else None},
            "replan_s": self.replan_s,
            "compiled_loss": self.compiled_loss,
            "history": self.history,
            "profile": self.profile.to_json() if self.profile else None,
        }
