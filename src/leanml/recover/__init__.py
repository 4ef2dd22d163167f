"""leanml.recover - fine-tune a pruned model back to quality, keeping its sparsity, under a memory budget.

``recover(model, windows, RecoverConfig(...), teacher=...)`` trains with masked gradients and weights
re-masked after every optimizer step (the mask is the model's zeros), optionally distilling the dense
teacher's logits, under a memory strategy (Adacc's budget, checkpointing, or none), with checkpoints
to resume from. ``KeepMasksCallback`` keeps the mask under ``transformers.Trainer``. The command line
is ``leanml recover``.
"""

from leanml.recover.api import evaluate, recover
from leanml.recover.config import RecoverConfig, lr_factor, recover_training
from leanml.recover.distill import Objective, distill_kl, next_token_ce
from leanml.recover.masks import MaskKeeper, linear_sparsity, masked_linears, nm_violations

__all__ = [
    "KeepMasksCallback", "MaskKeeper", "Objective", "RecoverConfig", "distill_kl", "evaluate", "linear_sparsity",
    "lr_factor", "masked_linears", "next_token_ce", "nm_violations", "recover", "recover_training",
]


def __getattr__(name: str):  # the Trainer callback imports transformers' Trainer machinery: load it on demand
    if name == "KeepMasksCallback":
        from leanml.recover.callback import KeepMasksCallback

        return KeepMasksCallback
    raise AttributeError(name)
