"""The options of one recovery run: a :class:`~leanml.train.config.TrainConfig` (memory strategy and
budget, steps, batch size, learning rate, seed) plus what recovery adds (schedule, clipping,
distillation, masks, checkpoints), each declared once (see :mod:`leanml.config`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from leanml.config import Bounds, Form, default, given, option, require
from leanml.flags import flag_of
from leanml.train import TrainConfig

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

    train: TrainConfig = option(default_factory=recover_training, form=Form(prefix=""))
    warmup: int = option(10, "linear warm-up steps, then cosine decay", bounds=Bounds(ge=0))
    min_lr_ratio: float = option(0.1, "final learning rate / peak", bounds=Bounds(ge=0, le=1))
    weight_decay: float = option(0.0, "AdamW weight decay", bounds=Bounds(ge=0))
    max_grad_norm: float = option(1.0, "gradient clipping (0: off)", bounds=Bounds(ge=0))
    kd_weight: float = option(default(0.5), "weight of the distillation term, in [0, 1] (needs a teacher)",
                              bounds=Bounds(ge=0, le=1))
    temperature: float = option(default(1.0), "distillation temperature (needs a teacher)", flag="--kd-temperature",
                                bounds=Bounds(gt=0))
    keep_masks: bool = option(True, "keep the model's zeros exactly (off: train every weight, a dense "
                                    "fine-tune; sparsity is not kept)", flag="--mask")
    checkpoint_every: int = option(50, "steps between checkpoints (DIR.ckpt)", bounds=Bounds(ge=1))
    measure_every: int = option(10, "steps between activation-peak measurements", cli=False,
                                bounds=Bounds(ge=1))
    eval_batch_size: int = option(4, "windows per forward pass of the perplexity", cli=False,
                                  bounds=Bounds(ge=1))

    def __post_init__(self) -> None:
        train = self.train
        require(train, train.strategy in MEMORY, "strategy",
                f"strategy {train.strategy} is not offered by recovery; choose one of {', '.join(MEMORY)}")
        require(train, train.budget is None or train.strategy == "adacc", ("budget", "strategy"),
                f"budget is Adacc's memory limit; strategy {train.strategy} takes none: drop budget or use "
                "strategy adacc")

    def check_teacher(self, teacher: Any) -> None:
        """The boundary check of :func:`leanml.recover`'s ``teacher`` against these options: ``kd_weight`` or
        ``temperature`` given (not their defaults) set a distillation, which needs a teacher; ``ValueError``
        naming ``teacher`` and the options, as ``leanml recover`` refuses ``--kd-weight`` without ``--teacher``."""
        set_ = [f"config.{n}={getattr(self, n)!r}" for n in ("kd_weight", "temperature") if given(getattr(self, n))]
        if teacher is None and set_:
            raise ValueError(f"teacher is None, but {' and '.join(set_)} set a distillation from a teacher: pass "
                             "teacher=the dense model, or leave kd_weight and temperature at their defaults")


def no_mask_flag() -> str:
    """The flag that trains every weight (``keep_masks`` off)."""
    return flag_of(RecoverConfig, "keep_masks", negative=True)


def lr_factor(step: int, cfg: RecoverConfig) -> float:
    """Learning-rate multiplier at optimizer step ``step`` (0-based): linear warm-up over ``warmup`` steps,
    then cosine decay from 1 to ``min_lr_ratio`` at the last step."""
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    span = max(cfg.train.steps - cfg.warmup - 1, 1)
    progress = min((step - cfg.warmup) / span, 1.0)
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
