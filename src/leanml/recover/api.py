"""``recover(model, windows, ...)``: fine-tune a pruned model under a memory strategy, keeping its mask.

Example::

    from leanml.models import load_model
    from leanml.data.text import load_text, token_windows
    from leanml.memory import Budget
    from leanml.train import TrainConfig
    from leanml.recover import RecoverConfig, recover

    model, tok = load_model("out/sgpt50")                     # written by `leanml prune`
    teacher, _ = load_model("smollm2-135m")                   # optional: distil from the dense model
    windows = token_windows(tok, load_text("shakespeare", "train"), 256)
    cfg = RecoverConfig(train=TrainConfig(steps=200, strategy="adacc", budget=Budget.parse(0.5)))
    report = recover(model, windows, cfg, teacher=teacher)
    assert report["sparsity"]["out"] == report["sparsity"]["in"]

The steps are taken by the one training runner (:class:`~leanml.train.runner.StrategyRunner`, which
``leanml train`` uses too) with the distillation objective of :mod:`leanml.recover.teacher`. One step:
the teacher's forward (``no_grad``; its probabilities are the distillation targets), the student's
forward and backward (gradients are masked as they are accumulated), Adacc's drift check, gradient
clipping, AdamW, the mask written back into the weights, the learning-rate schedule (linear warm-up,
cosine decay to ``min_lr_ratio``). Step times include the teacher's forward.

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

import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypedDict, Unpack

import torch
from torch import nn
from tqdm.auto import tqdm

from leanml.config import check_argument, check_token_ids
from leanml.errors import LeanmlError
from leanml.eval.job import evaluate_windows
from leanml.finite import check_finite_tensors, lr_hint
from leanml.outputs import atomic_file, fingerprint
from leanml.prune.engine.checkpoint import CheckpointError, check_settings, weights_fingerprint
from leanml.recover.config import RecoverConfig, lr_factor
from leanml.recover.masks import MaskKeeper, linear_sparsity
from leanml.recover.source import MIN_UNDECLARED
from leanml.recover.teacher import TeacherObjective
from leanml.train import StepOptions, StrategyRunner, batches

PEAK_DEFINITION = ("saved-activation bytes of one training step (teacher targets included), storages de-duplicated, "
                   "parameters excluded; the largest over the measured steps")


def evaluate(model: nn.Module, eval_sets: dict[str, torch.Tensor], batch_size: int, device: torch.device,
             progress: bool = True) -> dict[str, dict[str, Any]]:
    """Perplexity (SparseGPT protocol) on each named set of windows."""
    return {name: evaluate_windows(model, windows, batch_size, device, progress) for name, windows in eval_sets.items()}


def _max_rss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def memory_report(runner: StrategyRunner, cfg: RecoverConfig) -> dict[str, Any]:
    """The memory part of a recovery report: strategy, budget, the largest measured peak and the
    unoptimized one (for ``none``: the measured peak itself), Adacc's plan and history."""
    train = cfg.train
    peak = max(runner.peaks, default=0)
    unoptimized = runner.unoptimized_peak if runner.unoptimized_peak is not None else (
        peak if train.strategy == "none" else None)
    budget_bytes = float(runner.budget_bytes) if runner.budget_bytes is not None else None
    out: dict[str, Any] = {
        "strategy": train.strategy,
        "budget": train.memory_budget.to_json() if train.strategy == "adacc" else None,
        "budget_fraction": budget_bytes / unoptimized if budget_bytes and unoptimized else None,
        "budget_bytes": budget_bytes,
        "peak_bytes": peak,
        "unoptimized_peak_bytes": int(unoptimized) if unoptimized is not None else None,
        "within_budget": (peak <= budget_bytes) if budget_bytes is not None else None,
        "cuda_peak_bytes": max(runner.cuda_peaks) if runner.cuda_peaks else None,
        "measured_steps": runner.measured_steps,
        "peak_definition": PEAK_DEFINITION,
    }
    if runner.adacc is not None:
        rep = runner.adacc.report()
        out["plan"] = rep.get("plan")
        out["history"] = rep.get("history")
    return out


class RecoverRun(TypedDict, total=False):
    """How :func:`recover` runs, beside what it learns: its optional keywords. ``checkpoint_dir``: save
    checkpoints there and continue from the last one; ``device``: where to train (default: the model's);
    ``progress``: show a progress bar (default True); ``on_step(step, log)``: called after every finished
    step (1-based)."""

    checkpoint_dir: str | os.PathLike | None
    device: str | torch.device | None
    progress: bool
    on_step: Callable[[int, dict[str, Any]], None] | None


def recover(model: nn.Module, windows: torch.Tensor, config: RecoverConfig | None = None, *,
            teacher: nn.Module | None = None, masks: MaskKeeper | None = None,
            eval_sets: dict[str, torch.Tensor] | None = None, **run: Unpack[RecoverRun]) -> dict[str, Any]:
    """Fine-tune ``model`` in place on ``windows`` (``(n, seqlen)`` token ids), keeping its mask.

    ``masks``: the mask to keep (default: the zeros of the model's linears, see
    :class:`~leanml.recover.masks.MaskKeeper`, which must be at least 1 % of the linear weights, else
    :class:`LeanmlError`; pass a keeper explicitly for a structured model whose pruned units are all
    removed). ``teacher``: a model with the student's vocabulary whose logits are distilled
    (weight ``config.kd_weight``); it is moved to the device and frozen. ``eval_sets``: named windows
    whose perplexity is measured before and after. ``run``: ``checkpoint_dir``, ``device``, ``progress``,
    ``on_step`` (:class:`RecoverRun`). Returns the JSON-ready report (config, sparsity in/out, losses,
    memory, timings, perplexities). The model is left in eval mode on the device with no hooks installed.
    """
    _check_arguments(model, windows, config, teacher, masks, eval_sets, run)
    t_total = time.perf_counter()
    recovery = _Recovery(model, windows, config or RecoverConfig(), teacher, masks, eval_sets, run)
    recovery.train()
    return recovery.finish(t_total)


#: the per-step log of a recovery (``losses`` in its report, ``losses.csv``)
LOG_KEYS = ("loss", "ce", "kl", "lr", "step_s", "teacher_s", "cpu_s")


@dataclass
class _Progress:
    """What a recovery has done so far: kept in its checkpoints, read back on resumption."""

    start: int = 0
    before: dict[str, dict[str, Any]] | None = None
    elapsed: float = 0.0
    log: dict[str, list] = field(default_factory=lambda: {k: [] for k in LOG_KEYS})
    resumed_from: int | None = None
    eval_before_s: float = 0.0


class _Recovery:
    """One call of :func:`recover` in named steps: made (the mask to keep, the batches, the settings that
    key checkpoints, optimizer, schedule, a checkpoint resumed, the runner), :meth:`train`,
    :meth:`finish` (the checks after training and the report)."""

    def __init__(self, model: nn.Module, windows: torch.Tensor, cfg: RecoverConfig, teacher: nn.Module | None,
                 masks: MaskKeeper | None, eval_sets: dict[str, torch.Tensor] | None, run: RecoverRun) -> None:
        device = run.get("device")
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.model, self.windows, self.cfg, self.teacher = model, windows, cfg, teacher
        self.eval_sets = eval_sets or {}
        self.show_progress, self.on_step = run.get("progress", True), run.get("on_step")
        model.to(self.device)
        if teacher is not None:
            teacher.to(self.device).eval().requires_grad_(False)
        self.keeper = masks if masks is not None or not cfg.keep_masks else _zeros_keeper(model)
        self.sparsity_in = linear_sparsity(model)
        train = cfg.train
        self.data = batches(windows, train.batch_size, train.steps, train.seed)
        self.meta = self._settings()
        params = [p for p in model.parameters() if p.requires_grad]
        self.optim = torch.optim.AdamW(params, lr=train.lr, weight_decay=cfg.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.optim, lambda s: lr_factor(s, cfg))
        ckpt = run.get("checkpoint_dir")
        self.state_path = Path(ckpt) / "state.pt" if ckpt is not None else None
        self.done = _Progress()
        self.state = self._load_checkpoint()
        self.objective = TeacherObjective(teacher, cfg.kd_weight, cfg.temperature)
        self.runner = StrategyRunner(model, train, optimizer=self.optim, options=StepOptions(
            objective=self.objective, max_grad_norm=cfg.max_grad_norm,
            after_update=self.keeper.enforce if self.keeper is not None else None, scheduler=self.sched,
            measure_every=cfg.measure_every, hint=divergence_hint(cfg, teacher is not None)))

    def _settings(self) -> dict[str, Any]:
        """What a checkpoint must have been made with to be resumed: options, data, mask, weights."""
        windows, keeper, teacher = self.windows, self.keeper, self.teacher
        return {
            "config": asdict(self.cfg),
            "data": fingerprint({"shape": list(windows.shape), "head": windows[:4, :16].tolist(),
                                 "sum": int(windows.sum())}),
            "masks": fingerprint(keeper.counts() if keeper is not None else None),
            "teacher": weights_fingerprint(teacher) if teacher is not None else None,
            "weights": weights_fingerprint(self.model),
            "eval": sorted(self.eval_sets),
        }

    def _load_checkpoint(self) -> dict[str, Any] | None:
        """The state of an interrupted run (its model, optimizer and schedule loaded now, its progress read
        into :attr:`done`), or None when there is none to continue."""
        path = self.state_path
        if path is None or not path.exists():
            return None
        try:
            state = torch.load(path, map_location=self.device, weights_only=False)
        except Exception as exc:  # a truncated or foreign file
            raise CheckpointError(f"the checkpoint in {path.parent} cannot be resumed: its state.pt is corrupt or "
                                  f"truncated; pass overwrite instead of resume to clear it") from exc
        check_settings(path.parent, state.get("settings") if isinstance(state, dict) else None, self.meta)
        self.model.load_state_dict(state["model"])
        self.optim.load_state_dict(state["optim"])
        self.sched.load_state_dict(state["sched"])
        for key in ("model", "optim", "sched"):  # free the copies now
            state.pop(key)
        done = self.done
        done.start, done.before, done.elapsed, done.log = state["step"], state["before"], state["elapsed"], state["log"]
        done.resumed_from = done.start
        return state

    def train(self) -> None:
        """Set the strategy up, measure the perplexities before, take the steps; the mask's hooks and the
        strategy's are removed after, also on an error."""
        keeper, model, done = self.keeper, self.model, self.done
        if keeper is not None:
            keeper.attach()
        model.train()
        try:
            self.runner.setup(self.data[0].to(self.device))
            # after the setup, so an infeasible budget fails before minutes of evaluation; the plan's hooks
            # act on saved activations only, and evaluation saves none
            t_eval = time.perf_counter()
            if done.before is None and self.eval_sets:
                done.before = evaluate(model, self.eval_sets, self.cfg.eval_batch_size, self.device,
                                       self.show_progress)
            done.eval_before_s = time.perf_counter() - t_eval
            if self.state is not None:  # after the setup, which may draw random numbers of its own
                self._restore_runner(self.state)
                self.state = None
            self._steps()
        finally:
            self.runner.close()
            if keeper is not None:
                keeper.detach()
            model.eval()

    def _restore_runner(self, state: dict[str, Any]) -> None:
        """The random state and the runner's records of a resumed run, as its checkpoint left them."""
        torch.set_rng_state(state["rng"].cpu())
        if state.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([r.cpu() for r in state["cuda_rng"]])
        runner = self.runner
        runner.steps_done = self.done.start
        runner.peaks, runner.measured_steps = list(state["peaks"]), list(state["measured_steps"])
        runner.cuda_peaks, runner.replans = list(state["cuda_peaks"]), list(state["replans"])

    def _steps(self) -> None:
        """The remaining steps, each logged, checkpointed when due and announced to ``on_step``."""
        train, done = self.cfg.train, self.done
        bar = tqdm(range(done.start, train.steps), desc="recover", unit="step", disable=not self.show_progress,
                   initial=done.start, total=train.steps)
        for step in bar:
            loss = self.runner.step(self.data[step].to(self.device))
            entry = self._entry(loss)
            for k, v in entry.items():
                done.log[k].append(v)
            done.elapsed += entry["step_s"]
            bar.set_postfix(loss=f"{loss:.3f}")
            finished = step + 1
            if self.state_path is not None and finished % self.cfg.checkpoint_every == 0 and finished < train.steps:
                self._save_checkpoint(self.state_path, finished)
            if self.on_step is not None:
                self.on_step(finished, entry)
        bar.close()

    def _entry(self, loss: float) -> dict[str, Any]:
        """The log entry of the step just taken."""
        runner, objective = self.runner, self.objective
        return {"loss": loss, "ce": objective.last["ce"], "kl": objective.last["kl"], "lr": runner.lrs[-1],
                "step_s": runner.times[-1],
                "teacher_s": runner.target_times[-1] if objective.teacher is not None else 0.0,
                "cpu_s": runner.cpu_times[-1]}

    def _save_checkpoint(self, path: Path, step: int) -> None:
        runner, done = self.runner, self.done
        _save_state(path, {
            "settings": self.meta, "fingerprint": fingerprint(self.meta), "step": step,
            "model": self.model.state_dict(), "optim": self.optim.state_dict(), "sched": self.sched.state_dict(),
            "rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if self.device.type == "cuda" else None,
            "before": done.before, "elapsed": done.elapsed, "log": done.log, "peaks": runner.peaks,
            "measured_steps": runner.measured_steps, "cuda_peaks": runner.cuda_peaks, "replans": runner.replans,
        })

    def finish(self, t_total: float) -> dict[str, Any]:
        """Check the mask held, measure the perplexities after; the report (``t_total``: when the call began)."""
        keeper, model = self.keeper, self.model
        if keeper is not None and keeper.violations():
            raise RuntimeError(f"{keeper.violations()} masked weights are non-zero after training")  # a bug, not input
        sparsity_out = linear_sparsity(model)
        t_after = time.perf_counter()
        after = evaluate(model, self.eval_sets, self.cfg.eval_batch_size, self.device,
                         self.show_progress) if self.eval_sets else None
        report = self._report(sparsity_out, after)
        report["timings"] = self._timings(time.perf_counter() - t_after) | {
            "total_seconds": time.perf_counter() - t_total}
        report["resumed_from_step"] = self.done.resumed_from
        return report

    def _report(self, sparsity_out: float, after: dict[str, dict[str, Any]] | None) -> dict[str, Any]:
        cfg, windows, keeper, log, teacher = self.cfg, self.windows, self.keeper, self.done.log, self.teacher
        tokens = cfg.train.batch_size * int(windows.shape[1])
        return {
            "config": asdict(cfg),
            "device": str(self.device),
            "data": {"windows": int(windows.shape[0]), "seqlen": int(windows.shape[1]),
                     "tokens_per_step": tokens, "tokens_seen": tokens * cfg.train.steps},
            "sparsity": {"in": self.sparsity_in, "out": sparsity_out, "masked_fraction":
                         keeper.fraction() if keeper is not None else 0.0, "kept_exactly": keeper is not None},
            "teacher": {"kd_weight": cfg.kd_weight, "temperature": cfg.temperature,
                        "params": sum(p.numel() for p in teacher.parameters()),
                        "param_bytes": sum(p.numel() * p.element_size() for p in teacher.parameters())}
            if teacher is not None else None,
            "losses": log,
            "loss_first": log["loss"][0] if log["loss"] else None,
            "loss_last10": statistics.mean(log["loss"][-10:]) if log["loss"] else None,
            "memory": memory_report(self.runner, cfg) | {"max_rss_bytes": _max_rss_bytes(),
                                                         "student_state_bytes": _state_bytes(self.model, self.optim)},
            "replans": self.runner.replans,
            "perplexity_before": self.done.before,
            "perplexity_after": after,
        }

    def _timings(self, eval_after_s: float) -> dict[str, Any]:
        log, done = self.done.log, self.done
        timed = log["step_s"][self.cfg.train.timing_warmup:]
        return {
            "train_seconds": done.elapsed,
            "train_cpu_seconds": sum(log["cpu_s"]),
            "teacher_seconds": sum(log["teacher_s"]),
            "median_step_s": statistics.median(timed) if timed else None,
            "setup_seconds": self.runner.setup_s,
            "eval_before_seconds": done.eval_before_s if done.resumed_from is None else None,
            "eval_after_seconds": eval_after_s,
        }


def _zeros_keeper(model: nn.Module) -> MaskKeeper:
    """The mask of the model's zeros, refused when they are too few to be a pruned model's."""
    keeper = MaskKeeper.from_zeros(model)
    if keeper.fraction() < MIN_UNDECLARED:
        raise LeanmlError(f"the model has no pruned weights ({keeper.fraction():.2%} exact zeros in its linear "
                          f"layers) to keep; recover a pruned model, pass masks=MaskKeeper(...), or set "
                          f"keep_masks=False to fine-tune every weight")
    return keeper


def _check_arguments(model: Any, windows: Any, config: Any, teacher: Any, masks: Any, eval_sets: Any,
                     run: dict[str, Any]) -> None:
    """:func:`recover`'s arguments, each of the kind it takes (``TypeError``/``ValueError`` naming it)."""
    unknown = sorted(set(run) - set(RecoverRun.__annotations__))
    if unknown:
        raise TypeError(f"recover() got an unexpected keyword argument {unknown[0]!r}; it takes teacher, masks, "
                        f"eval_sets, {', '.join(RecoverRun.__annotations__)}")
    checkpoint_dir, device = run.get("checkpoint_dir"), run.get("device")
    progress, on_step = run.get("progress", True), run.get("on_step")
    swapped = "the order is recover(model, windows, config)"
    none = type(None)
    check_argument(model, "model", nn.Module, "a torch.nn.Module (a causal LM)",
                   swapped if isinstance(model, torch.Tensor) else "")
    check_token_ids(windows, "windows", hint=swapped if isinstance(windows, (nn.Module, RecoverConfig)) else "")
    check_argument(config, "config", (RecoverConfig, none), "a leanml.recover.config.RecoverConfig or None",
                   "build one with RecoverConfig(**options)" if isinstance(config, dict) else "")
    check_argument(teacher, "teacher", (nn.Module, none), "a torch.nn.Module or None")
    if config is not None:
        config.check_teacher(teacher)  # distillation options with no teacher would be ignored
    check_argument(masks, "masks", (MaskKeeper, none), "a leanml.recover.masks.MaskKeeper or None")
    check_argument(eval_sets, "eval_sets", (dict, none), "a dict of name -> token ids (n, seqlen), or None")
    for name, ids in (eval_sets or {}).items():
        check_token_ids(ids, f"eval_sets[{name!r}]")
    check_argument(checkpoint_dir, "checkpoint_dir", (str, os.PathLike, none), "a path or None")
    check_argument(device, "device", (str, torch.device, none), "a str, a torch.device or None")
    check_argument(progress, "progress", bool, "True or False")
    if on_step is not None and not callable(on_step):
        raise TypeError(f"on_step must be a function (step, log) or None, got {type(on_step).__name__}")


def _state_bytes(model: nn.Module, optim: torch.optim.Optimizer) -> int:
    """Bytes of the student's parameters, gradients and optimizer state (what training holds besides
    activations)."""
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    opt = sum(t.numel() * t.element_size() for s in optim.state.values() for t in s.values()
              if isinstance(t, torch.Tensor))
    return 2 * n + opt


def divergence_hint(cfg: RecoverConfig, distils: bool) -> str:
    """The options that likely made a recovery diverge: the learning rate, then a weight decay and a
    distillation temperature when they act."""
    extra, fields = ([f"weight_decay {cfg.weight_decay:g}"], ["weight_decay"]) if cfg.weight_decay else ([], [])
    if distils and cfg.kd_weight:
        extra.append(f"temperature {cfg.temperature:g}")
        fields.append("temperature")
    return lr_hint(cfg.train.lr, ", ".join(extra), tuple(fields))


def _save_state(path: Path, state: dict[str, Any]) -> None:
    check_finite_tensors(state["model"].items(), f"the recovery checkpoint {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as tmp:
        torch.save(state, tmp)
