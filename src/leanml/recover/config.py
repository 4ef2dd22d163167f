"""The options of one recovery run: a :class:`~leanml.memory.train.TrainConfig` (memory strategy and
budget, steps, batch size, learning rate, seed) plus what recovery adds (schedule, clipping,
distillation, masks, checkpoints), each declared once (see :mod:`leanml.config`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from leanml.config import option, require
from leanml.memory.train import TrainConfig

#: the memory strategies recovery offers
MEMORY = ("none", "checkpoint", "sac", "adacc")


def recover_training(**changes: Any) -> TrainConfig:
    """The training options of a recovery run: 200 steps of 2 windows unless ``changes`` say otherwise
    (``recover_training(steps=50, strategy="checkpoint")``)."""
    return TrainConfig(**{"steps": 200, "batch_size": 2, **changes})


@dataclass(frozen=True)
class RecoverConfig:
    """One recovery run. ``train``: the memory strategy (``adacc``'s ``budget`` is a fraction of the
    unoptimized activation peak of this step, teacher targets included, or a size), steps, batch size,
    peak learning rate and seed. ``kd_weight``: weight ``w`` of the distillation term (used only with a
    teacher). ``keep_masks=False`` fine-tunes every weight (the dense reference)."""

    train: TrainConfig = option(default_factory=recover_training, prefix="")
    warmup: int = option(10, "linear warm-up steps, then cosine decay")
    min_lr_ratio: float = option(0.1, "final learning rate / peak")
    weight_decay: float = option(0.0, "AdamW weight decay")
    max_grad_norm: float = option(1.0, "gradient clipping (0: off)")
    kd_weight: float = option(0.5, "weight of the distillation term, in [0, 1]")
    temperature: float = option(1.0, "distillation temperature", flag="--kd-temperature")
    keep_masks: bool = option(True, "keep the model's zeros exactly (--no-mask: train every weight, a dense "
                                    "fine-tune; sparsity is not kept)", flag="--mask")
    checkpoint_every: int = option(50, "steps between checkpoints (DIR.ckpt)")
    measure_every: int = option(10, "steps between activation-peak measurements", cli=False)
    eval_batch_size: int = option(4, "windows per forward pass of the perplexity", cli=False)

    def __post_init__(self) -> None:
        train = self.train
        require(train, train.strategy in MEMORY, "strategy",
                f"strategy {train.strategy} is not offered by recovery; choose one of {', '.join(MEMORY)}")
        require(train, train.budget is None or train.strategy == "adacc", ("budget", "strategy"),
                f"budget is Adacc's memory limit; strategy {train.strategy} takes none: drop budget or use "
                "strategy adacc")
        require(self, self.warmup >= 0, "warmup", f"must be at least 0, got {self.warmup}")
        require(self, 0.0 <= self.min_lr_ratio <= 1.0, "min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        require(self, self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}")
        require(self, self.max_grad_norm >= 0, "max_grad_norm", f"must be >= 0, got {self.max_grad_norm}")
        require(self, 0.0 <= self.kd_weight <= 1.0, "kd_weight", f"must be in [0, 1], got {self.kd_weight}")
        require(self, self.temperature > 0, "temperature", f"must be > 0, got {self.temperature}")
        require(self, self.checkpoint_every >= 1, "checkpoint_every", f"must be at least 1, got {self.checkpoint_every}")
        require(self, self.measure_every >= 1, "measure_every", f"must be at least 1, got {self.measure_every}")
        require(self, self.eval_batch_size >= 1, "eval_batch_size", f"must be at least 1, got {self.eval_batch_size}")


def lr_factor(step: int, cfg: RecoverConfig) -> float:
    """Learning-rate multiplier at optimizer step ``step`` (0-based): linear warm-up over ``warmup`` steps,
    then cosine decay from 1 to ``min_lr_ratio`` at the last step."""
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    span = max(cfg.train.steps - cfg.warmup - 1, 1)
    progress = min((step - cfg.warmup) / span, 1.0)
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
