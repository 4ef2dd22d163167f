"""A plain causal-LM training run (``leanml train``): :func:`run_training` steps the one runner,
:class:`~leanml.train.runner.StrategyRunner`, over seeded batches; :func:`shared_weights_copy` gives
several strategies one set of weights (the benchmark)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from leanml.errors import LeanmlError
from leanml.progress import EtaBar
from leanml.train.config import TrainConfig
from leanml.train.data import batches
from leanml.train.runner import StrategyRunner


def shared_weights_copy(model: nn.Module) -> nn.Module:
    """A second module tree of the same Hugging Face model class sharing every parameter and buffer with
    ``model`` (so several strategies, each with its own hooks or compiled code, train one set of weights)."""
    with torch.device("meta"):
        twin = type(model)(model.config)
    twin.load_state_dict(model.state_dict(keep_vars=True), assign=True, strict=True)
    mods = dict(model.named_modules())
    for name, mod in twin.named_modules():  # non-persistent buffers and tensor attributes (rotary tables)
        src = mods[name]
        for bname, buf in list(mod._buffers.items()):
            if buf is not None and buf.is_meta:
                mod._buffers[bname] = src._buffers[bname]
        for attr, val in list(vars(mod).items()):
            if isinstance(val, torch.Tensor) and val.is_meta:
                setattr(mod, attr, getattr(src, attr))
    left = [n for n, t in [*twin.named_parameters(), *twin.named_buffers()] if t.is_meta]
    if left:
        raise LeanmlError(f"could not share {left[0]} of {type(model).__name__} between copies")
    twin.train(model.training)
    return twin


def run_training(model: nn.Module, windows: torch.Tensor, cfg: TrainConfig,
                 unoptimized_peak: int | None = None) -> dict[str, Any]:
    """Train ``model`` in place with ``cfg.strategy``; returns a JSON-ready record of the run."""
    device = next(model.parameters()).device
    data = [b.to(device) for b in batches(windows, cfg.batch_size, cfg.steps, cfg.seed)]
    runner = StrategyRunner(model, cfg, unoptimized_peak)
    try:
        runner.setup(data[0])
        # a bar updated by hand: it prints the estimated time for the rest after the first step
        bar = EtaBar(total=len(data), desc=f"train[{cfg.label}]", unit="step", disable=not cfg.progress, leave=False)
        try:
            for x in data:
                bar.set_postfix(loss=f"{runner.step(x):.3f}")
                bar.update(1)
        finally:  # also on an error (a diverged step): the bar's line is cleared before the error is printed
            bar.close()
    finally:
        runner.close()
    out = runner.result()
    out["batch_size"] = cfg.batch_size
    out["seqlen"] = int(data[0].shape[1])
    return out
