"""leanml.train - the one training runner that ``leanml train`` and ``leanml recover`` share.

:class:`TrainConfig` holds the options of a run under a memory strategy (``none``, ``checkpoint``,
``sac``, ``compile``, ``adacc``); :class:`StrategyRunner` sets the strategy up and takes one optimizer
step at a time, metering activation peaks, with an objective hook (:class:`LMObjective`, a causal LM's
own loss, by default) and the hooks of :class:`StepOptions`; :func:`batches` are the seeded batches both
commands read; :func:`run_training` is ``leanml train``'s plain run. Adacc itself (profiling, planning,
hooks) lives in :mod:`leanml.memory`.
"""

from leanml.train.config import STRATEGIES, TrainConfig, parse_compile_budgets
from leanml.train.data import batches, remap_vocab
from leanml.train.run import run_training, shared_weights_copy
from leanml.train.runner import LMObjective, StepOptions, StrategyRunner, lm_unoptimized_peak, measure_peak

__all__ = [
    "LMObjective", "STRATEGIES", "StepOptions", "StrategyRunner", "TrainConfig", "batches", "lm_unoptimized_peak",
    "measure_peak", "parse_compile_budgets", "remap_vocab", "run_training", "shared_weights_copy",
]
