"""Keep a pruned model's mask while ``transformers.Trainer`` (or any loop that calls the same events)
fine-tunes it.

Example::

    from transformers import Trainer
    from leanml.recover import KeepMasksCallback

    trainer = Trainer(model=pruned, args=args, train_dataset=ds, callbacks=[KeepMasksCallback()])
    trainer.train()     # the zeros of every linear stay exact zeros

On ``on_train_begin`` the mask is read from the model's zeros (or taken from ``masks``) and gradient
hooks are installed, so gradients are masked before clipping and the optimizer; ``on_optimizer_step``
writes the zeros back after every optimizer step; ``on_train_end`` removes the hooks and checks that no
masked weight moved. The callback touches no other state, so it composes with Adacc and any optimizer.
With ``check_finite`` (default) a NaN or infinite gradient or weight stops the run at that step, in one
line naming it (:func:`leanml.memory.hf.check_trainer_step`), before the Trainer saves it.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from transformers import TrainerCallback

from leanml.config import check_argument
from leanml.errors import LeanmlError
from leanml.memory.hf import check_trainer_step
from leanml.recover.masks import MaskKeeper
from leanml.recover.source import MIN_UNDECLARED


class KeepMasksCallback(TrainerCallback):
    """A ``TrainerCallback`` that keeps the zeros of a model's linears exactly zero during training.

    ``masks``: an explicit :class:`~leanml.recover.masks.MaskKeeper` (default: the model's zeros when
    training begins). ``require``: raise :class:`LeanmlError` if the model has no zeros to keep.
    """

    def __init__(self, masks: MaskKeeper | None = None, require: bool = True, check_finite: bool = True) -> None:
        check_argument(masks, "masks", (MaskKeeper, type(None)), "a leanml.recover.masks.MaskKeeper or None",
                       "the callback reads the model's zeros when training begins" if isinstance(masks, nn.Module)
                       else "")
        check_argument(require, "require", bool, "True or False")
        check_argument(check_finite, "check_finite", bool, "True or False")
        self.check_finite = check_finite
        self.keeper = masks
        self.require = require
        self.violations_at_end: int | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if self.keeper is None:
            if model is None:
                raise LeanmlError("KeepMasksCallback got no model from the trainer; pass masks=MaskKeeper(...)")
            self.keeper = MaskKeeper.from_zeros(model)
            # a dense checkpoint holds a few exact zeros by chance: the same threshold as `leanml recover`
            if self.require and self.keeper.fraction() < MIN_UNDECLARED:
                raise LeanmlError(f"the model has no pruned weights ({self.keeper.fraction():.2%} exact zeros in its "
                                  f"linear layers) to keep; train a pruned model, or use require=False")
        if self.require and len(self.keeper) == 0:
            raise LeanmlError("the mask is empty: no weight to keep at zero; pass a non-empty MaskKeeper "
                              "or use require=False")
        self.keeper.attach()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if self.keeper is not None:
            self.keeper.mask_grads()  # gradients that bypassed the hooks (e.g. set by hand)
        if self.check_finite:
            check_trainer_step(model, args, state, "grads", "KeepMasksCallback")

    def on_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if self.keeper is not None:
            self.keeper.enforce()
        if self.check_finite:
            check_trainer_step(model, args, state, "weights", "KeepMasksCallback")

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.keeper is not None:
            self.keeper.detach()
            self.violations_at_end = self.keeper.violations()
