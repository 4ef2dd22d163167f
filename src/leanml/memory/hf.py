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
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from leanml.memory.adacc import Adacc
from leanml.memory.budget import DEFAULT_BUDGET, Budget, BudgetLike
from leanml.utils import write_json

MIB = 2**20


class AdaccCallback(TrainerCallback):
    """Keeps a ``Trainer``'s activation memory under ``budget`` with Adacc. ``report_name``: file written
    into ``args.output_dir`` at the end of training (None: none). Other keyword arguments go to
    :class:`~leanml.memory.adacc.Adacc`."""

    def __init__(self, budget: BudgetLike = DEFAULT_BUDGET, report_name: str | None = "adacc.json", **adacc_kwargs: Any) -> None:
        self.budget = Budget.parse(budget)
        self.report_name = report_name
        self.adacc_kwargs = adacc_kwargs
        self.adacc: Adacc | None = None
        self._logged_replan_s = 0.0

    def on_train_begin(self, args, state, control, model=None, **kwargs):  # noqa: ANN001, ANN201
        if model is None:
            raise ValueError("AdaccCallback needs the model (the Trainer passes it to its callbacks)")
        self.adacc = Adacc(model, budget=self.budget, **self.adacc_kwargs)

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
