"""A plain causal-LM training loop with a memory strategy, shared by ``leanml train``, the benchmark and
the demo. Strategies: ``none``, ``checkpoint`` (every layer), ``sac`` (torch selective checkpointing,
save matmuls), ``compile`` (``torch.compile`` with ``activation_memory_budget``) and ``adacc``.

Measurements (see :mod:`leanml.memory.meter`): the peak saved-activation bytes of one step under the
strategy, and of the unoptimized model on the same batch; step time is the median over the timed steps
after ``warmup``.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from leanml.memory.api import Adacc, parse_budget
from leanml.memory.meter import ActivationMeter, param_tensors
from leanml.memory.runtime import apply_strategy, disable_kv_cache
from leanml.memory.structure import find_blocks
from leanml.utils import LeanmlError

log = logging.getLogger(__name__)

STRATEGIES = ("none", "checkpoint", "sac", "compile", "adacc")


@dataclass
class TrainConfig:
    """One training run."""

    strategy: str = "adacc"
    budget: float | str = 0.5
    batch_size: int = 4
    steps: int = 20
    lr: float = 1e-4
    warmup: int = 2
    seed: int = 0
    max_error: float = 0.05
    progress: bool = True

    def check(self) -> None:
        if self.strategy not in STRATEGIES:
            raise LeanmlError(f"unknown memory strategy {self.strategy!r}; choose one of {', '.join(STRATEGIES)}")
        if self.batch_size < 1 or self.steps < 1:
            raise LeanmlError(f"batch size and steps must be at least 1 (got {self.batch_size}, {self.steps})")
        if self.warmup >= self.steps:
            self.warmup = 0
        parse_budget(self.budget)


def remap_vocab(windows: torch.Tensor, vocab: int) -> torch.Tensor:
    """Map the ``vocab - 1`` most frequent token ids to ``0..vocab-2`` and every other id to ``vocab-1``
    (lets a small model with a small output layer train on real tokenized text)."""
    counts = torch.bincount(windows.flatten())
    top = torch.argsort(counts, descending=True)[: vocab - 1]
    table = torch.full((counts.numel(),), vocab - 1, dtype=torch.long)
    table[top] = torch.arange(top.numel())
    return table[windows]


def batches(windows: torch.Tensor, batch_size: int, steps: int, seed: int) -> list[torch.Tensor]:
    """``steps`` batches of windows in a seeded shuffled order (cycling when the data runs out)."""
    if windows.shape[0] < batch_size:
        raise LeanmlError(f"only {windows.shape[0]} windows of text for a batch of {batch_size}; lower --batch-size or --seqlen")
    gen = torch.Generator().manual_seed(seed)
    order: list[int] = []
    while len(order) < steps * batch_size:
        order += torch.randperm(windows.shape[0], generator=gen).tolist()
    return [windows[order[i * batch_size : (i + 1) * batch_size]] for i in range(steps)]


def _lm_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(input_ids=x, labels=x).loss


def measure_peak(model: nn.Module, x: torch.Tensor, forward: nn.Module | None = None) -> int:
    """Peak saved-activation bytes of one forward+backward (gradients are discarded)."""
    fwd = forward if forward is not None else model
    meter = ActivationMeter(param_tensors(model))
    with meter:
        _lm_loss(fwd, x).backward()
    model.zero_grad(set_to_none=True)
    return meter.peak


class StrategyRunner:
    """One model trained under one memory strategy, one step at a time (so several runners can be
    interleaved step by step and share the machine's load fairly)."""

    def __init__(self, model: nn.Module, cfg: TrainConfig, unoptimized_peak: int | None = None) -> None:
        cfg.check()
        self.model = model
        self.cfg = cfg
        self.unoptimized_peak = unoptimized_peak
        self.adacc: Adacc | None = None
        self.applied = None
        self.forward: nn.Module = model
        self._prev_budget: float | None = None
        self.losses: list[float] = []
        self.times: list[float] = []
        self.peak: int | None = None
        self.budget_bytes: float | None = None
        self.optim: torch.optim.Optimizer | None = None
        self.tokens = 0
        self.setup_s = 0.0

    def setup(self, x: torch.Tensor) -> None:
        """Install the strategy, measuring the unoptimized and the optimized peak on batch ``x``."""
        cfg, model = self.cfg, self.model
        t_setup = time.perf_counter()
        model.train()
        disable_kv_cache(model)
        self.tokens = x.numel()
        if self.unoptimized_peak is None:
            self.unoptimized_peak = measure_peak(model, x)
        kind, value = parse_budget(cfg.budget)
        self.budget_bytes = value * self.unoptimized_peak if kind == "fraction" else value
        self.budget_fraction = value if kind == "fraction" else self.budget_bytes / self.unoptimized_peak
        if cfg.strategy == "adacc":
            self.adacc = Adacc(model, budget=cfg.budget, max_error=cfg.max_error)
            record = self.adacc.prepare(input_ids=x, labels=x)
            self.budget_bytes = record.budget_bytes
            self.peak = record.measured_peak
        elif cfg.strategy == "compile":
            import torch._functorch.config as fcfg

            torch._dynamo.reset()
            self._prev_budget = fcfg.activation_memory_budget
            fcfg.activation_memory_budget = self.budget_fraction
            self.forward = torch.compile(model)
            _lm_loss(self.forward, x).backward()  # compile outside the measured step
            model.zero_grad(set_to_none=True)
            self.peak = measure_peak(model, x, self.forward)
        else:
            self.applied = apply_strategy(model, find_blocks(model), cfg.strategy)
            self.peak = measure_peak(model, x)
        self.optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        self.setup_s = time.perf_counter() - t_setup

    def step(self, x: torch.Tensor) -> float:
        """One optimizer step on batch ``x``; returns the loss."""
        assert self.optim is not None
        if self._prev_budget is not None:
            import torch._functorch.config as fcfg

            fcfg.activation_memory_budget = self.budget_fraction
        t0 = time.perf_counter()
        loss = _lm_loss(self.forward, x)
        loss.backward()
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - t0)
        if self.adacc is not None:
            self.adacc.step()
        self.losses.append(loss.item())
        return self.losses[-1]

    def close(self) -> None:
        """Remove hooks and wrappers; restore global settings."""
        if self.applied is not None:
            self.applied.remove()
            self.applied = None
        if self.adacc is not None:
            self.adacc.remove()
        if self._prev_budget is not None:
            import torch._functorch.config as fcfg

            fcfg.activation_memory_budget = self._prev_budget
            self._prev_budget = None

    def result(self) -> dict[str, Any]:
        """JSON-ready record of the run so far."""
        cfg = self.cfg
        timed = self.times[cfg.warmup :] or self.times
        step_s = statistics.median(timed)
        tail = self.losses[-min(10, len(self.losses)) :]
        budgeted = cfg.strategy in ("adacc", "compile")
        out: dict[str, Any] = {
            "strategy": cfg.strategy,
            "budget_fraction": self.budget_fraction if budgeted else None,
            "peak_bytes": self.peak,
            "budget_bytes": self.budget_bytes if budgeted else None,
            "unoptimized_peak_bytes": self.unoptimized_peak,
            "step_s": step_s,
            "tokens_s": self.tokens / step_s,
            "final_loss": sum(tail) / len(tail),
            "steps": len(self.losses),
            "setup_s": self.setup_s,
            "losses": self.losses,
            "step_times": self.times,
        }
        if self.adacc is not None and self.adacc.plan is not None:
            out["plan"] = self.adacc.plan.to_json()
            out["history"] = self.adacc.history
        return out


def run_training(model: nn.Module, windows: torch.Tensor, cfg: TrainConfig,
                 unoptimized_peak: int | None = None) -> dict[str, Any]:
    """Train ``model`` in place with ``cfg.strategy``; returns a JSON-ready record of the run."""
    cfg.check()
    device = next(model.parameters()).device
    data = [b.to(device) for b in batches(windows, cfg.batch_size, cfg.steps, cfg.seed)]
    runner = StrategyRunner(model, cfg, unoptimized_peak)
    try:
        runner.setup(data[0])
        bar = tqdm(data, desc=f"train[{cfg.strategy}]", disable=not cfg.progress, leave=False)
        for x in bar:
            bar.set_postfix(loss=f"{runner.step(x):.3f}")
    finally:
        runner.close()
    out = runner.result()
    out["batch_size"] = cfg.batch_size
    out["seqlen"] = int(data[0].shape[1])
    return out
