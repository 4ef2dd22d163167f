"""``Adacc``: per-tensor-group retain / recompute / compress under a memory budget, around a training loop.

Example::

    adacc = Adacc(model, budget=0.5)            # half of the unoptimized activation peak
    adacc.prepare(input_ids=x, labels=x)        # profile one step, solve the MILP, install the plan
    for x in batches:
        loss = model(input_ids=x, labels=x).loss
        loss.backward(); opt.step(); opt.zero_grad()
        adacc.step()                            # drift tracking; may re-profile and re-plan

Call :meth:`Adacc.prepare` before wrapping the model in ``DistributedDataParallel``; under
``torch.distributed`` rank 0's plan is broadcast so every rank runs the same plan.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from leanml.memory.compressors import FLOAT_COMPRESSORS
from leanml.memory.meter import ActivationMeter, param_tensors
from leanml.memory.planner import LayerSpec, Option, Problem, Solution, min_peak, solve_plan
from leanml.memory.policy import DriftMonitor, DriftThresholds
from leanml.memory.profiler import Profile, profile_step
from leanml.memory.runtime import BITPACK, RECOMPUTE, RETAIN, SELECTIVE, AppliedPlan, disable_kv_cache
from leanml.memory.structure import SELF, GroupKey, find_blocks
from leanml.utils import LeanmlError

log = logging.getLogger(__name__)

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_budget(budget: float | int | str) -> tuple[str, float]:
    """``("fraction", f)`` for a number in (0, 1] or ``("bytes", n)`` for bytes / a size like ``"2GB"``."""
    if isinstance(budget, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", budget)
        if not m or m.group(2).lower() not in _UNITS:
            raise LeanmlError(f"cannot read memory budget {budget!r}; use a fraction like 0.5, bytes, or a size like 2GB")
        value, unit = float(m.group(1)), m.group(2).lower()
        if unit == "" and value <= 1.0:
            return parse_budget(value)
        return ("bytes", value * _UNITS[unit])
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget <= 0:
        raise LeanmlError(f"memory budget must be positive, got {budget!r}")
    if budget <= 1.0:
        return ("fraction", float(budget))
    return ("bytes", float(budget))


def _cap(caps: dict[str, float], name: str, default: float) -> float:
    return caps.get(name, default)


def build_problem(profile: Profile, max_error: float = 0.05, caps: dict[str, float] | None = None,
                  compress_head: bool = False) -> tuple[Problem, list[list[tuple[GroupKey, list[str]]]], list[str]]:
    """Planner instance from a profile. Returns the problem, per layer the (group, option names) in the
    problem's order, and the option names of the ``post`` group."""
    caps = caps or {}
    layers: list[LayerSpec] = []
    names: list[list[tuple[GroupKey, list[str]]]] = []
    for layer in range(profile.n_layers):
        specs, layer_names = [], []
        total = 0
        biggest = 0
        for g in profile.layer_groups(layer):
            if g.bytes == 0:
                continue
            total += g.bytes
            biggest = max(biggest, g.max_tensor_bytes)
            opts = [Option(RETAIN, g.bytes)]
            if g.child != SELF:
                opts.append(Option(RECOMPUTE, g.input_bytes, g.bytes + g.max_tensor_bytes, g.fwd_s))
                sel_keep = g.input_bytes + g.sel_saved_bytes
                if sel_keep < g.bytes:  # recompute only the pointwise ops, keep matmul/attention outputs
                    opts.append(Option(SELECTIVE, sel_keep, g.bytes, g.sel_recompute_s))
            for name, st in g.compress.items():
                lossy = name != BITPACK
                if lossy and st.error > _cap(caps, name, max_error):
                    continue
                if st.payload_bytes >= g.bytes:
                    continue
                opts.append(Option(name, st.payload_bytes, st.max_out_bytes, st.pack_s + st.unpack_s, st.error))
            specs.append(opts)
            layer_names.append((g.key, [o.name for o in opts]))
        ck = None
        if specs:
            fwd = sum(g.fwd_s for g in profile.layer_groups(layer)) if profile.layer_fwd_s[layer] == 0 else \
                profile.layer_fwd_s[layer]
            ck = Option("checkpoint", profile.layer_input_bytes[layer], total + biggest, fwd)
        layers.append(LayerSpec(specs, ck))
        names.append(layer_names)
    pre = profile.groups.get(GroupKey(None, "pre"))
    post = profile.groups.get(GroupKey(None, "post"))
    post_opts: list[Option] = []
    post_names: list[str] = []
    if post is not None and post.bytes:
        post_opts.append(Option(RETAIN, post.bytes))
        post_names.append(RETAIN)
        if compress_head:
            for name, st in post.compress.items():
                if (name == BITPACK or st.error <= _cap(caps, name, max_error)) and st.payload_bytes < post.bytes:
                    post_opts.append(Option(name, st.payload_bytes, st.max_out_bytes, st.pack_s + st.unpack_s, st.error))
                    post_names.append(name)
    return Problem(layers, float(pre.bytes if pre else 0), post_opts), names, post_names


@dataclass
class PlanRecord:
    """A plan as applied: the solver's answer translated to groups."""

    layer_checkpoint: list[bool]
    options: dict[GroupKey, str]
    budget_bytes: float
    model_budget_bytes: float
    predicted_peak: float
    predicted_time_s: float
    status: str
    solve_s: float
    measured_peak: int | None = None

    def summary(self) -> dict[str, int]:
        """How many groups take each option (whole-layer checkpoints counted as ``checkpoint``)."""
        counts: dict[str, int] = {}
        for key, opt in self.options.items():
            if key.layer is not None and self.layer_checkpoint[key.layer]:
                continue
            counts[opt] = counts.get(opt, 0) + 1
        counts["checkpoint(layer)"] = sum(self.layer_checkpoint)
        return counts

    def to_json(self) -> dict[str, Any]:
        return {
            "layer_checkpoint": self.layer_checkpoint,
            "options": {k.label(): v for k, v in self.options.items()},
            "budget_bytes": self.budget_bytes,
            "model_budget_bytes": self.model_budget_bytes,
            "predicted_peak": self.predicted_peak,
            "predicted_time_s": self.predicted_time_s,
            "measured_peak": self.measured_peak,
            "status": self.status,
            "solve_s": self.solve_s,
            "summary": self.summary(),
        }


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


class Adacc:
    """Plans and applies retain / recompute / compress per activation group under ``budget``.

    ``budget``: bytes, a size string ("2GB", "512MiB") or a fraction in (0, 1] of the unoptimized
    activation peak measured by the profile. ``max_error`` caps the relative error of any lossy
    compressor (``error_caps`` overrides it per compressor). ``compress_head`` allows compressing the
    activations after the last block (log-probabilities of the loss; off by default because small
    relative errors there become large errors in probabilities).
    """

    def __init__(
        self,
        model: nn.Module,
        budget: float | int | str = 0.5,
        blocks: list[nn.Module] | None = None,
        loss_fn: Callable[[Any], torch.Tensor] = default_loss,
        max_error: float = 0.05,
        error_caps: dict[str, float] | None = None,
        compressors: tuple[str, ...] = FLOAT_COMPRESSORS,
        outlier_frac: float = 0.01,
        compress_head: bool = False,
        time_limit: float = 5.0,
        check_every: int = 50,
        thresholds: DriftThresholds | None = None,
        calibrate: bool = True,
        compress_layers: list[int] | None = None,
    ) -> None:
        self.model = model
        self.budget_spec = parse_budget(budget)
        self.blocks = blocks if blocks is not None else find_blocks(model)
        self.loss_fn = loss_fn
        self.max_error = max_error
        self.error_caps = dict(error_caps or {})
        self.compressors = tuple(compressors)
        self.outlier_frac = outlier_frac
        self.compress_head = compress_head
        self.time_limit = time_limit
        self.check_every = check_every
        self.calibrate = calibrate
        self.compress_layers = compress_layers
        self.monitor = DriftMonitor(thresholds or DriftThresholds())
        self.profile: Profile | None = None
        self.plan: PlanRecord | None = None
        self.history: list[dict[str, Any]] = []
        self._applied: AppliedPlan | None = None
        self._inputs: tuple[tuple, dict] | None = None
        self._steps = 0
        self._last_step_t: float | None = None
        self._sampling = False
        disable_kv_cache(model)
        self._capture = model.register_forward_pre_hook(self._capture_inputs, with_kwargs=True)

    # ------------------------------------------------------------------ inputs
    def _capture_inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if torch.is_grad_enabled():
            self._inputs = (args, kwargs)

    def _run(self, args: tuple, kwargs: dict) -> torch.Tensor:
        return self.loss_fn(self.model(*args, **kwargs))

    def _isolated(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` (which calls backward) without disturbing the parameters' gradients."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            return fn()
        finally:
            for p, g in zip(params, grads):
                p.grad = g

    # ------------------------------------------------------------------ planning
    def budget_bytes(self) -> float:
        kind, value = self.budget_spec
        if kind == "bytes":
            return value
        assert self.profile is not None
        return value * self.profile.peak_bytes

    def prepare(self, *args: Any, **kwargs: Any) -> PlanRecord:
        """Profile one training step on these inputs, solve the plan and install it."""
        self._inputs = (args, kwargs)
        return self._replan("initial plan")

    def _replan(self, reason: str) -> PlanRecord:
        if self._inputs is None:
            raise LeanmlError("Adacc has no inputs to profile; call prepare(...) with a training batch first")
        args, kwargs = self._inputs
        self.remove_plan()
        self.profile = self._isolated(lambda: profile_step(
            self.model, self.blocks, lambda: self._run(args, kwargs), self.compressors, self.outlier_frac,
            self.compress_layers, measure_outside=self.compress_head))
        budget = self.budget_bytes()
        problem, names, post_names = build_problem(self.profile, self.max_error, self.error_caps, self.compress_head)
        floor = min_peak(problem)
        if budget < floor:
            raise LeanmlError(
                f"memory budget {budget / 2**20:.1f} MiB is below the smallest feasible plan "
                f"{floor / 2**20:.1f} MiB ({floor / self.profile.peak_bytes:.1%} of the unoptimized peak "
                f"{self.profile.peak_bytes / 2**20:.1f} MiB); raise the budget to at least that"
            )
        model_budget = budget
        record = None
        for _ in range(4 if self.calibrate else 1):
            try:
                sol = solve_plan(problem, model_budget, self.time_limit)
            except ValueError as exc:
                raise LeanmlError(f"no plan fits the budget after calibration: {exc}") from exc
            if sol.status == "greedy":
                log.warning("planner: MILP time limit reached without a solution, using the greedy plan")
            sol = _broadcast(sol)
            record = self._to_record(sol, names, post_names, budget, model_budget)
            self._install(record)
            if not self.calibrate:
                break
            record.measured_peak = self.measure(*args, **kwargs)
            # every rank must take the same decision, or their broadcasts no longer pair up
            over = _max_over_ranks(record.measured_peak - budget)
            if over <= 0:
                break
            log.info("plan measured %d bytes over budget; tightening the planner's budget", over)
            model_budget = max(floor, model_budget - over - 0.01 * budget)
            self.remove_plan()
        assert record is not None
        self.plan = record
        self._reset_monitor()
        self.history.append({"step": self._steps, "reason": reason, "plan": record.summary(),
                             "measured_peak": record.measured_peak, "budget_bytes": budget})
        log.info("adacc plan (%s): %s", reason, record.summary())
        return record

    def _to_record(self, sol: Solution, names: list, post_names: list[str], budget: float,
                   model_budget: float) -> PlanRecord:
        options: dict[GroupKey, str] = {}
        for layer, layer_names in enumerate(names):
            for (key, opts), idx in zip(layer_names, sol.choices[layer]):
                options[key] = RETAIN if sol.checkpoint[layer] else opts[idx]
        if post_names:
            options[GroupKey(None, "post")] = post_names[sol.post]
        return PlanRecord(list(sol.checkpoint), options, budget, model_budget, sol.peak, sol.time, sol.status,
                          sol.solve_s)

    def _install(self, record: PlanRecord) -> None:
        self.remove_plan()
        masks = {k for k, g in self.profile.groups.items() if g.mask_bytes} if self.profile else set()
        self._applied = AppliedPlan(self.model, self.blocks, record.layer_checkpoint, record.options,
                                    self.outlier_frac, mask_groups=masks)

    def _reset_monitor(self) -> None:
        assert self.profile is not None and self.plan is not None
        errs, caps, outl = {}, {}, {}
        for key, opt in self.plan.options.items():
            g = self.profile.groups.get(key)
            if g is None or opt in (RETAIN, RECOMPUTE, SELECTIVE, BITPACK) or opt not in g.compress:
                continue
            errs[key.label()] = g.compress[opt].error
            caps[key.label()] = _cap(self.error_caps, opt, self.max_error)
            outl[key.label()] = g.outlier_ratio
        self.monitor.reset(errs, caps, outl)

    # ------------------------------------------------------------------ measuring
    def measure(self, *args: Any, **kwargs: Any) -> int:
        """Peak saved-activation bytes of one forward+backward on these inputs under the current plan."""
        def run() -> int:
            meter = ActivationMeter(param_tensors(self.model))
            with meter:
                loss = self._run(args, kwargs)
                loss.backward()
            return meter.peak
        return self._isolated(run)

    # ------------------------------------------------------------------ training loop
    def step(self) -> list[str]:
        """Call once per training step (after backward). Returns the drift reasons if it re-planned."""
        now = time.perf_counter()
        if self._last_step_t is not None:
            self.monitor.add_step_time(now - self._last_step_t)
        self._steps += 1
        hooks = self._applied.hooks if self._applied is not None else None
        reasons: list[str] = []
        sampled = hooks is not None and self._sampling
        checked = sampled or bool(self.check_every and self._steps % self.check_every == 0)
        if sampled:
            hooks.sample = False
            self._sampling = False
            reasons = self.monitor.check(hooks.drift.error, hooks.drift.outlier)
            hooks.drift.error.clear()
            hooks.drift.outlier.clear()
        elif checked:
            reasons = self.monitor.check({}, {})
        # checks fall on the same steps on every rank; re-planning (a collective) must too
        if checked and _max_over_ranks(float(bool(reasons))) > 0 and not reasons:
            reasons = ["drift on another rank"]
        if checked and not sampled and hooks is not None and not reasons:
            hooks.sample = True  # sample the next step's compressed tensors
            self._sampling = True
        if reasons:
            log.info("adacc: re-planning at step %d: %s", self._steps, "; ".join(reasons))
            self._replan("; ".join(reasons))
            self.history[-1]["step"] = self._steps
        self._last_step_t = time.perf_counter()
        return reasons

    def remove_plan(self) -> None:
        """Uninstall the current plan (the model runs unoptimized)."""
        if self._applied is not None:
            self._applied.remove()
            self._applied = None

    def remove(self) -> None:
        """Uninstall everything Adacc added to the model."""
        self.remove_plan()
        self._capture.remove()

    def report(self) -> dict[str, Any]:
        """Profile, plan and history as JSON-ready data."""
        return {
            "budget": {"kind": self.budget_spec[0], "value": self.budget_spec[1]},
            "unoptimized_peak_bytes": self.profile.peak_bytes if self.profile else None,
            "plan": self.plan.to_json() if self.plan else None,
            "history": self.history,
            "profile": self.profile.to_json() if self.profile else None,
        }


def _max_over_ranks(value: float) -> float:
    """Under torch.distributed, the largest ``value`` over all ranks; else ``value``."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        nccl = torch.distributed.get_backend() == "nccl"  # NCCL reduces CUDA tensors only
        t = torch.tensor([float(value)], dtype=torch.float64, device="cuda" if nccl else "cpu")
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return float(t.item())
    return value


def _broadcast(sol: Solution) -> Solution:
    """Under torch.distributed, every rank takes rank 0's plan."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        box = [sol]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]
    return sol
