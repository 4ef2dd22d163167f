"""leanml.memory - Adacc: training-memory planning by per-group retain / recompute / compress.

``Adacc(model, budget=0.5)`` profiles one step, solves a MILP for the cheapest plan whose peak saved
activation memory fits the budget, applies it with saved-tensor hooks and non-reentrant checkpointing,
and re-plans when compression error, outliers or step time drift.
"""

from leanml.memory.api import Adacc, build_problem, parse_budget
from leanml.memory.compressors import make_compressor
from leanml.memory.meter import ActivationMeter
from leanml.memory.planner import solve_plan

__all__ = ["Adacc", "ActivationMeter", "build_problem", "make_compressor", "parse_budget", "solve_plan"]
