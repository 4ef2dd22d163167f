"""Post-training LLM pruning: a layer-wise engine, masks, and pruning methods.

The entry point is the package itself, callable as ``leanml.prune(model, calibration, config)``
(also importable as :func:`prune`)::

    import leanml
    from leanml.prune.config import PruneConfig

    report = leanml.prune(model, calib_ids, PruneConfig(method="wanda", sparsity=0.5))
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any


def prune(model: Any, calibration: Any, config: Any = None, *, adapter: Any = None,
          checkpoint_dir: str | os.PathLike | None = None, fingerprint: dict[str, Any] | None = None,
          progress: bool = True) -> dict[str, Any]:
    """Prune ``model`` in place with ``config`` (a :class:`~leanml.prune.config.PruneConfig`; None: its
    defaults) on ``calibration`` (``(nsamples, seqlen)`` token ids); return the engine's report.

    ``checkpoint_dir``: keep each finished layer there and resume from it (the checkpoint must match
    ``fingerprint`` and the config). Under ``torchrun`` (``WORLD_SIZE`` > 1) the layers are split over the
    ranks (:func:`leanml.prune.parallel.distributed_walk`); the other ranks return ``None``.
    """
    import torch

    from leanml.config import check_argument, check_token_ids
    from leanml.device import parse_device
    from leanml.prune.config import PruneConfig
    from leanml.prune.engine import LayerWalk, WalkSettings

    swapped = "the order is leanml.prune(model, calibration, config)"
    check_argument(model, "model", torch.nn.Module, "a torch.nn.Module (a causal LM)",
                   swapped if isinstance(model, torch.Tensor) else "")
    check_token_ids(calibration, "calibration", "(nsamples, seqlen)",
                    swapped if isinstance(calibration, (torch.nn.Module, PruneConfig)) else "")
    check_argument(config, "config", (PruneConfig, type(None)), "a leanml.prune.config.PruneConfig or None",
                   "build one with PruneConfig(**options)" if isinstance(config, dict) else "")
    check_argument(checkpoint_dir, "checkpoint_dir", (str, os.PathLike, type(None)), "a path or None")
    check_argument(fingerprint, "fingerprint", (dict, type(None)), "a dict or None")
    check_argument(progress, "progress", bool, "True or False")
    config = PruneConfig() if config is None else config
    # the config checked its mask and profile when it was made: the settings are built, not checked again
    settings = WalkSettings.from_config(config, adapter=adapter, device=parse_device(config.device),
                                        checkpoint_dir=checkpoint_dir, fingerprint=fingerprint, progress=progress)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from leanml.prune.parallel import distributed_walk

        return distributed_walk(model, calibration, settings)
    return LayerWalk(model, calibration, settings).run()


class _Package(types.ModuleType):
    """This package, callable: ``leanml.prune(...)`` is :func:`prune`."""

    def __call__(self, model: Any, calibration: Any, config: Any = None, **kwargs: Any) -> dict[str, Any]:
        return prune(model, calibration, config, **kwargs)


sys.modules[__name__].__class__ = _Package
