"""leanml.memory - Adacc: training-memory planning by per-group retain / recompute / compress.

``Adacc(model, budget=0.5)`` profiles a batch block by block, solves a MILP for the cheapest plan whose
peak saved activation memory fits the budget (optionally with layers run as compiled blocks at a
recomputation budget of the compiler), applies it with saved-tensor hooks and non-reentrant
checkpointing, measures every step's peak, plans each new input shape, and re-plans when compression
error, outliers or step time drift. ``AdaccCallback`` does the same inside a ``transformers.Trainer``.
"""

from leanml.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "leanml.memory.adacc": ("Adacc",),
    "leanml.memory.options": ("AdaccOptions",),
    "leanml.memory.budget": ("Budget",),
    "leanml.memory.compressors": ("make_compressor",),
    "leanml.memory.hf": ("AdaccCallback",),  # transformers' Trainer machinery
    "leanml.memory.meter": ("ActivationMeter",),
    "leanml.memory.planner": ("solve_plan",),
    "leanml.memory.problem": ("build_problem",),
})
