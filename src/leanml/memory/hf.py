"""Adacc inside a Hugging Face ``transformers.Trainer``.

Example::

    from leanml.memory import AdaccCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[AdaccCallback(budget=0.5)])
    trainer.train()           # plans on the first training batch, keeps the budget every step

The callback creates an :class:`~leanml.memory.adacc.Adacc` on the model when training begins (it plans
lazily, on the first training forward, from the batch the Trainer passes), calls
:meth:`~leanml.memory.adacc.Adacc.step` after every optimizer step, adds the measured peak and
re-planning time to the Trainer's logs, and writes ``adacc.json`` (the Adacc report) into
``args.output_dir`` when training ends. The model must compute its loss (batches carry ``labels``),
or pass ``loss_fn=`` as for ``Adacc``. Do not combine with ``torch_compile=True`` (use
``compile_blocks=`` instead).

Both Trainer callbacks of leanml (this one and :class:`~leanml.recover.KeepMasksCallback`) stop a run whose
numbers diverge (:func:`check_trainer_step`): a NaN or infinite gradient before the optimizer step, or a
NaN or infinite weight after it, raises :class:`~leanml.finite.NonFiniteError`, one line naming the step,
the tensor and the learning rate, before the Trainer saves or logs that step, so no diverged model is saved.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn
from transformers import TrainerCallback

from leanml.config import check_argument
from leanml.finite import NonFiniteError, first_bad_grad, first_non_finite
from leanml.memory.adacc import Adacc
from leanml.memory.budget import DEFAULT_BUDGET, Budget, BudgetLike
from leanml.outputs import write_json

MIB = 2**20


def check_trainer_step(model: nn.Module | None, args: Any, state: Any, phase: str, who: str) -> None:
    """Stop a ``transformers.Trainer`` run at its first non-finite number: ``phase`` ``"grads"`` (call it from
    ``on_pre_optimizer_step``, after clipping) checks the gradients, ``"weights"`` (from ``on_optimizer_step``)
    the parameters the step wrote. Raises :class:`NonFiniteError`: one line naming ``who`` (the callback),
    the step (1-based), the first bad tensor and the learning rate. Under fp16 mixed precision the
    gradient scaler skips steps with infinite gradients itself, so only the weights are checked there."""
    if model is None or (phase == "grads" and getattr(args, "fp16", False)):
        return
    step = int(getattr(state, "global_step", 0)) + 1
    lr = getattr(args, "learning_rate", None)
    fix = (f"lower the learning rate (TrainingArguments learning_rate={lr:g})" if isinstance(lr, (int, float))
           else "lower the learning rate")
    if phase == "grads":
        bad = first_bad_grad(model.named_parameters())
        if bad is not None:
            raise NonFiniteError(f"{who}: the gradient of {bad} is not finite at step {step} (the loss or its "
                                 f"backward overflowed): {fix}; stopped before the optimizer step, so no "
                                 "non-finite weight was saved")
        return
    hit = first_non_finite(model.named_parameters())
    if hit is not None:
        name, count, numel = hit
        raise NonFiniteError(f"{who}: the optimizer step {step} made {count} of {numel} values of {name} NaN or "
                             f"infinite: {fix}; stopped before the Trainer saved the step")


class AdaccCallback(TrainerCallback):
    """Keeps a ``Trainer``'s activation memory under ``budget`` with Adacc. ``report_name``: file written
    into ``args.output_dir`` at the end of training (None: none). Other keyword arguments go to
    :class:`~leanml.memory.adacc.Adacc`."""

    def __init__(self, budget: BudgetLike = DEFAULT_BUDGET, report_name: str | None = "adacc.json",
                 check_finite: bool = True, **adacc_kwargs: Any) -> None:
        check_argument(budget, "budget", (Budget, float, int, str),
                       "a fraction in (0, 1], a size like '2GB' or a Budget")
        check_argument(report_name, "report_name", (str, type(None)), "a file name or None")
        check_argument(check_finite, "check_finite", bool, "True or False")
        if report_name is not None and (not report_name.strip() or "/" in report_name or "\\" in report_name):
            raise ValueError(f"report_name must be a file name (written into args.output_dir), got {report_name!r}")
        self.budget = Budget.parse(budget)
        self.report_name = report_name
        self.check_finite = check_finite
        self.adacc_kwargs = adacc_kwargs
        self.adacc: Adacc | None = None
        self._logged_replan_s = 0.0

    def on_train_begin(self, args, state, control, model=None, **kwargs):  # noqa: ANN001, ANN201
        if model is None:
            raise ValueError("AdaccCallback needs the model (the Trainer passes it to its callbacks)")
        self.adacc = Adacc(model, budget=self.budget, **self.adacc_kwargs)

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):  # noqa: ANN001, ANN201
        if self.check_finite:
            check_trainer_step(model, args, state, "grads", "AdaccCallback")

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):  # noqa: ANN001, ANN201
        if self.check_finite:
            check_trainer_step(model, args, state, "weights", "AdaccCallback")

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
        if self.adacc is not None:
            self.adacc.step()

    def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001, ANN201
        a = self.adacc
        if a is None or logs is None or a.plan is None:
            return
        if a.step_peaks:
            logs["adacc_peak_mib"] = round(a.step_peaks[-1] / MIB, 2)
        logs["adacc_budget_mib"] = round(a.plan.budget_bytes / MIB, 2)
        logs["adacc_replan_s"] = round(a.replan_s - self._logged_replan_s, 3)
        self._logged_replan_s = a.replan_s

    def on_train_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
        if self.adacc is None:
            return
        report = self.adacc.report()
        self.adacc.remove()
        if self.report_name and state.is_world_process_zero and args.output_dir:
            out = Path(args.output_dir)
            out.mkdir(parents=True, exist_ok=True)
            write_json(out / self.report_name, report)
