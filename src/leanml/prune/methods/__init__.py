"""Registry of pruning methods: name -> ``module:Class`` of a :class:`leanml.prune.base.Pruner`.

Classes are imported lazily so a method's heavy dependencies load only when it is used.
"""

from __future__ import annotations

import importlib
import importlib.util

from leanml.errors import LeanmlError
from leanml.prune.base import Pruner

METHODS: dict[str, str] = {
    "magnitude": "leanml.prune.methods.baselines:MagnitudePruner",
    "wanda": "leanml.prune.methods.baselines:WandaPruner",
    "sparsegpt": "leanml.prune.methods.baselines:SparseGPTPruner",
    "fista": "leanml.prune.methods.fista:FistaPruner",
    "fasp": "leanml.prune.methods.fasp:FaspPruner",
    "magnitude-sp": "leanml.prune.methods.fasp:MagnitudeStructuredPruner",
    "wanda-sp": "leanml.prune.methods.fasp:WandaStructuredPruner",
    "flap": "leanml.prune.methods.fasp:FlapPruner",
    "taylor": "leanml.prune.methods.taylor:TaylorPruner",
}


def pruner_class(name: str) -> type[Pruner]:
    """The class registered under ``name``."""
    if name not in METHODS:
        raise LeanmlError(f"unknown pruning method {name!r}; choose one of: {', '.join(available())}")
    module, cls = METHODS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def available() -> list[str]:
    """Registered methods whose module is present."""
    names = []
    for name, target in METHODS.items():
        module = target.split(":")[0]
        if importlib.util.find_spec(module) is not None:
            names.append(name)
    return names
