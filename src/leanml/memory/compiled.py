"""Decoder blocks run by compiled kernels, with the compiler's own budgeted recomputation.

``torch.compile``'s partitioner decides, for one compiled graph, which intermediate tensors to save for
backward and which to recompute: ``torch._functorch.config.activation_memory_budget`` (a ratio between
"recompute the whole region" = 0 and "save what the fastest backward needs" = 1) bounds what it
saves, and a 0-1 knapsack over the recomputable ops, priced by their FLOP counts, picks what to
recompute. Adacc uses that as one more per-layer option of its MILP: a layer may run as a compiled
block at budget ``b`` (``compiled@b``), possibly with the saved tensors of the compiled graph
compressed (``compiled@b+int8-token``).

The global config is read when a graph is compiled, and ``torch.compile`` does not re-compile when it
changes, so :func:`budget_backend` makes one inductor backend per budget: the compile cache keeps one
entry per (block code, backend), blocks of one class share their compiled code, and different layers
can run at different budgets.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch._functorch.config as _functorch_config
from torch import nn

from leanml.errors import LeanmlError

log = logging.getLogger(__name__)

#: the compiler budgets that ``compile_blocks=True`` stands for (each layer may run compiled at one of them)
DEFAULT_COMPILE_BUDGETS = (1.0, 0.5, 0.0)
_BACKENDS: dict[float, Callable] = {}


def has_memory_budget() -> bool:
    """Whether this torch's partitioner has the ``activation_memory_budget`` knob (a private config:
    detected, never assumed). Without it the compiler saves what its fastest backward needs (budget 1)."""
    return hasattr(_functorch_config, "activation_memory_budget")


def supported_budgets(budgets: tuple[float, ...]) -> tuple[float, ...]:
    """The compile budgets this torch can honour: all of them with the knob, else only 1.0 (logged)."""
    if has_memory_budget():
        return tuple(budgets)
    kept = tuple(b for b in budgets if b == 1.0)
    if kept != tuple(budgets):
        log.warning("adacc: this torch's compiler has no activation_memory_budget; compiled blocks only at budget 1")
    return kept


def budget_backend(budget: float) -> Callable:
    """The inductor backend that compiles with ``activation_memory_budget = budget`` (one per budget).
    Raises :class:`LeanmlError` for a budget below 1 on a torch without that knob."""
    if not 0.0 <= budget <= 1.0:
        raise ValueError(f"a compile recomputation budget is in [0, 1], got {budget}")
    budget = float(budget)
    knob = has_memory_budget()
    if not knob and budget != 1.0:
        raise LeanmlError(f"torch {torch.__version__} has no compiler activation_memory_budget, so compile budget "
                          f"{budget:g} cannot be honoured; use budget 1.0, another memory strategy, or a newer torch")
    if budget not in _BACKENDS:
        def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
            from torch._inductor.compile_fx import compile_fx

            if not knob:
                return compile_fx(gm, example_inputs)
            with _functorch_config.patch(activation_memory_budget=budget):
                return compile_fx(gm, example_inputs)

        backend.__name__ = f"inductor_budget_{budget:g}"
        _BACKENDS[budget] = backend
    return _BACKENDS[budget]


def compile_module_forward(module: nn.Module, budget: float) -> Callable[[], None]:
    """Replace ``module.forward`` by its compiled version at recomputation ``budget``; returns an undo.

    The module's own forward hooks keep running eagerly around the compiled forward; hooks on its
    children would be traced into the graph, so callers keep the children hook-free."""
    orig = module.__dict__.get("forward")
    compiled = torch.compile(module.forward, backend=budget_backend(budget))
    module.forward = compiled

    def undo() -> None:
        if module.__dict__.get("forward") is compiled:
            if orig is None:
                del module.forward
            else:
                module.forward = orig

    return undo


class CompiledLoss:
    """A model's ``loss_function`` replaced by its compiled version (:func:`compile_loss_function`).

    When compiling fails (no working compiler here, an op the compiler cannot take) and the eager loss runs
    on the same inputs, the eager loss is used from then on and ``error`` says why; an error the eager loss
    raises as well (bad labels) is the caller's and propagates. :meth:`undo` restores the model."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._had = "_loss_function" in model.__dict__
        self._before = model.__dict__.get("_loss_function")
        self.eager: Callable = model.loss_function
        self._compiled = torch.compile(self.eager, backend=budget_backend(1.0))
        self.error: str | None = None
        model.loss_function = self

    @property
    def active(self) -> bool:
        """Whether the loss still runs compiled."""
        return self.error is None

    def __call__(self, *args: object, **kwargs: object) -> torch.Tensor:
        if self.error is None:
            try:
                return self._compiled(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - the eager loss decides whose error it is
                out = self.eager(*args, **kwargs)
                self.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                log.warning("adacc: compiling the loss failed (%s); it runs eagerly", self.error)
                return out
        return self.eager(*args, **kwargs)

    def undo(self) -> None:
        """Put back the loss function the model had."""
        if self._model.__dict__.get("_loss_function") is not self:
            return
        if self._had:
            self._model.__dict__["_loss_function"] = self._before
        else:
            del self._model.__dict__["_loss_function"]


def compile_loss_function(model: nn.Module) -> CompiledLoss | None:
    """Run a Hugging Face model's loss (``model.loss_function``: the log-softmax and NLL over the vocabulary
    after the last block) as compiled kernels; None for a model without a settable ``loss_function``.
    Compiled at the full budget: the graph saves what the fastest backward needs (the logits and one
    log-sum-exp per token, as many bytes as the eager log-probabilities), so the post-block activations the
    planner sees keep their size and only their time drops."""
    cls_attr = getattr(type(model), "loss_function", None)
    if not isinstance(cls_attr, property) or cls_attr.fset is None:
        return None
    return CompiledLoss(model)


def compiled_option_name(budget: float, compressor: str | None = None) -> str:
    """``compiled@0.5`` or ``compiled@0.5+int8-token``."""
    return f"compiled@{budget:g}" + (f"+{compressor}" if compressor else "")


def parse_compiled_option(name: str) -> tuple[float, str | None] | None:
    """Inverse of :func:`compiled_option_name`; None for other option names."""
    if not name.startswith("compiled@"):
        return None
    rest = name[len("compiled@"):]
    budget, _, comp = rest.partition("+")
    return float(budget), (comp or None)
