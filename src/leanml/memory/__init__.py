"""leanml.memory - Adacc: training-memory planning by per-group retain / recompute / compress.

``Adacc(model, budget=0.5)`` profiles a batch block by block, solves a MILP for the cheapest plan whose
peak saved activation memory fits the budget (optionally with layers run as compiled blocks at a
recomputation budget of the compiler), applies it with saved-tensor hooks and non-reentrant
checkpointing, measures every step's peak, plans each new input shape, and re-plans when compression
error, outliers or step time drift. ``AdaccCallback`` does the same inside a ``transformers.Trainer``.
"""

from typing import Any

from leanml.memory.adacc import Adacc, AdaccOptions
from leanml.memory.budget import Budget
from leanml.memory.compressors import make_compressor
from leanml.memory.meter import ActivationMeter
from leanml.memory.planner import solve_plan
from leanml.memory.problem import build_problem

__all__ = ["Adacc", "AdaccCallback", "AdaccOptions", "ActivationMeter", "Budget", "build_problem", "make_compressor", "solve_plan"]


def __getattr__(name: str) -> Any:
    if name == "AdaccCallback":  # imports transformers' Trainer machinery only when asked for
        from leanml.memory.hf import AdaccCallback

        return AdaccCallback
    raise AttributeError(f"module 'leanml.memory' has no attribute {name!r}")
