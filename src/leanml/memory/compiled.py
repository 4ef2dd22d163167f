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

from collections.abc import Callable

import torch
from torch import nn

_BACKENDS: dict[float, Callable] = {}


def budget_backend(budget: float) -> Callable:
    """The inductor backend that compiles with ``activation_memory_budget = budget`` (one per budget)."""
    if not 0.0 <= budget <= 1.0:
        raise ValueError(f"a compile recomputation budget is in [0, 1], got {budget}")
    budget = float(budget)
    if budget not in _BACKENDS:
        def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
            import torch._functorch.config as fcfg
            from torch._inductor.compile_fx import compile_fx

            with fcfg.patch(activation_memory_budget=budget):
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


def compile_loss_function(model: nn.Module) -> Callable[[], None] | None:
    """Run a Hugging Face model's loss (``model.loss_function``: the log-softmax and NLL over the vocabulary
    after the last block) as compiled kernels; returns an undo, or None for a model without a settable
    ``loss_function``. Compiled at the full budget: the graph saves what the fastest backward needs (the
    logits and one log-sum-exp per token, as many bytes as the eager log-probabilities), so the post-block
    activations the planner sees keep their size and only their time drops."""
    cls_attr = getattr(type(model), "loss_function", None)
    if not isinstance(cls_attr, property) or cls_attr.fset is None:
        return None
    had = "_loss_function" in model.__dict__
    before = model.__dict__.get("_loss_function")
    compiled = torch.compile(model.loss_function, backend=budget_backend(1.0))
    model.loss_function = compiled

    def undo() -> None:
        if model.__dict__.get("_loss_function") is not compiled:
            return
        if had:
            model.__dict__["_loss_function"] = before
        else:
            del model.__dict__["_loss_function"]

    return undo


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
