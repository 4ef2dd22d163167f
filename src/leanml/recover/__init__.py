"""leanml.recover - fine-tune a pruned model back to quality, keeping its sparsity, under a memory budget.

``recover(model, windows, RecoverConfig(...), teacher=...)`` trains with masked gradients and weights
re-masked after every optimizer step (the mask is the model's zeros), optionally distilling the dense
teacher's logits, under a memory strategy (Adacc's budget, checkpointing, or none), with checkpoints
to resume from. ``KeepMasksCallback`` keeps the mask under ``transformers.Trainer``. The command line
is ``leanml recover``.
"""

from leanml.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "leanml.recover.api": ("evaluate", "recover"),
    "leanml.recover.callback": ("KeepMasksCallback",),  # transformers' Trainer machinery
    "leanml.recover.config": ("RecoverConfig", "lr_factor", "recover_training"),
    "leanml.recover.distill": ("Objective", "distill_kl", "next_token_ce"),
    "leanml.recover.masks": ("MaskKeeper", "linear_sparsity", "masked_linears", "nm_violations"),
})
