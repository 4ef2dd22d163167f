"""Sparsity masks for recovery fine-tuning: read from the weights, kept exactly while training.

The mask of a pruned model is its **zeros**: every ``nn.Linear`` of the model except the output head
(``get_output_embeddings()``) is masked where its weight is exactly zero, and a bias entry is masked
where its whole weight row is zero (a dead unit stays dead). Embeddings, norms and the head are never
masked. Reading the mask from the weights works for any model a pruner wrote (``leanml prune``,
llm-compressor, SparseGPT scripts) and survives any save format that loads back to dense tensors; a
``report.json`` written by ``leanml prune`` only declares what the zeros must satisfy (see
:mod:`leanml.recover.source`).

:class:`MaskKeeper` keeps them: gradients are zeroed at the masked entries as soon as they are
accumulated (``register_post_accumulate_grad_hook``, so clipping and every optimizer see masked
gradients), and :meth:`MaskKeeper.enforce` writes the zeros back after each optimizer step (weight
decay, Adam's epsilon and mixed precision can otherwise move a masked weight).

The numeric helpers are pure functions of tensors.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from leanml.errors import LeanmlError


# ---------------------------------------------------------------------------- pure cores
def dead_mask(weight: torch.Tensor) -> torch.Tensor:
    """Boolean mask of the pruned (exactly zero) entries of ``weight``."""
    return weight.detach() == 0


def dead_rows(weight_dead: torch.Tensor) -> torch.Tensor:
    """Rows (output units) whose every weight is pruned: shape ``(out,)``."""
    return weight_dead.reshape(weight_dead.shape[0], -1).all(dim=1)


def nm_violations(dead: torch.Tensor, n: int, m: int) -> int:
    """Number of groups of ``m`` consecutive inputs (per output row) with more than ``n`` kept weights.

    ``dead`` is a 2-D mask of pruned entries; an input dimension not divisible by ``m`` counts every
    row as violating.
    """
    rows, cols = dead.shape
    if cols % m:
        return rows
    kept = (~dead).reshape(rows, cols // m, m).sum(-1)
    return int((kept > n).sum())


def masked_linears(model: nn.Module) -> Iterator[tuple[str, nn.Linear]]:
    """Every ``nn.Linear`` of ``model`` except its output head, with qualified names, in module order."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and module is not head:
            yield name, module


def linear_sparsity(model: nn.Module) -> float:
    """Measured fraction of exact zeros over the weights of :func:`masked_linears` (head excluded)."""
    zeros = total = 0
    for _, lin in masked_linears(model):
        zeros += int((lin.weight == 0).sum())
        total += lin.weight.numel()
    return zeros / max(total, 1)


def cast_tensor_keeping_zeros(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """``weight`` cast to ``dtype`` with exactly its zeros: an entry that is non-zero but underflows to
    zero in ``dtype`` becomes the smallest normal number of ``dtype`` with its sign. Returns the cast
    tensor and how many entries were raised so."""
    out = weight.detach().to(dtype)
    lost = (out == 0) & (weight.detach() != 0)
    n = int(lost.sum())
    if n:
        tiny = torch.finfo(dtype).tiny
        out = torch.where(lost, torch.sign(weight.detach()).to(dtype) * tiny, out)
    return out, n


def cast_keeping_zeros(model: nn.Module, dtype: torch.dtype) -> int:
    """Cast ``model`` to ``dtype`` in place keeping the zeros of :func:`masked_linears` exactly (see
    :func:`cast_tensor_keeping_zeros`); returns the number of kept weights raised from underflow."""
    raised = 0
    for _, lin in masked_linears(model):
        cast, n = cast_tensor_keeping_zeros(lin.weight, dtype)
        lin.weight.data = cast
        raised += n
    model.to(dtype)  # everything else
    return raised


# ---------------------------------------------------------------------------- the keeper
@dataclass
class LinearMask:
    """The mask of one linear: pruned weight entries, and bias entries of dead rows (or None)."""

    weight: torch.Tensor
    bias: torch.Tensor | None


class MaskKeeper:
    """Keeps the zeros of a model's linears while it trains.

    Build with :meth:`from_zeros` (the usual way) or from explicit boolean masks of pruned entries
    (``{qualified linear name: mask}``). :meth:`attach` installs the gradient hooks; call
    :meth:`enforce` after every optimizer step; :meth:`detach` removes the hooks.
    """

    def __init__(self, model: nn.Module, masks: dict[str, torch.Tensor]) -> None:
        self.model = model
        linears = dict(masked_linears(model))
        self.masks: dict[str, LinearMask] = {}
        for name, dead in masks.items():
            if name not in linears:
                raise LeanmlError(f"mask for {name!r}, which is not a linear layer of the model (head excluded)")
            lin = linears[name]
            if tuple(dead.shape) != tuple(lin.weight.shape):
                raise LeanmlError(
                    f"mask for {name} has shape {tuple(dead.shape)}, the weight {tuple(lin.weight.shape)}"
                )
            dead = dead.to(device=lin.weight.device, dtype=torch.bool)
            bias = None
            if lin.bias is not None:
                rows = dead_rows(dead)
                bias = rows if bool(rows.any()) else None
            self.masks[name] = LinearMask(dead, bias)
        self._linears = {name: linears[name] for name in self.masks}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    @classmethod
    def from_zeros(cls, model: nn.Module) -> MaskKeeper:
        """Masks = the exact zeros of every linear's weight (linears without zeros get no mask)."""
        masks = {}
        for name, lin in masked_linears(model):
            dead = dead_mask(lin.weight)
            if bool(dead.any()):
                masks[name] = dead
        return cls(model, masks)

    # ------------------------------------------------------------------ facts
    def __len__(self) -> int:
        return len(self.masks)

    def fraction(self) -> float:
        """Masked fraction over ALL linear weights of the model (head excluded): the sparsity kept."""
        masked = sum(int(m.weight.sum()) for m in self.masks.values())
        total = sum(lin.weight.numel() for _, lin in masked_linears(self.model))
        return masked / max(total, 1)

    def counts(self) -> dict[str, int]:
        """Masked weight entries per linear (a fingerprint that resumption checks)."""
        return {name: int(m.weight.sum()) for name, m in self.masks.items()}

    def nm_violations(self, n: int, m: int) -> dict[str, int]:
        """Per linear (all linears, masked or not), groups of ``m`` inputs holding more than ``n`` weights."""
        out = {}
        for name, lin in masked_linears(self.model):
            mask = self.masks.get(name)
            dead = mask.weight if mask is not None else torch.zeros_like(lin.weight, dtype=torch.bool)
            bad = nm_violations(dead.reshape(dead.shape[0], -1), n, m)
            if bad:
                out[name] = bad
        return out

    def violations(self) -> int:
        """Masked entries that are not zero in the live weights (0 while the masks are kept)."""
        bad = 0
        for name, mask in self.masks.items():
            lin = self._linears[name]
            bad += int((lin.weight.detach()[mask.weight] != 0).sum())
            if mask.bias is not None:
                bad += int((lin.bias.detach()[mask.bias] != 0).sum())
        return bad

    # ------------------------------------------------------------------ keeping
    def _hook(self, name: str, part: str):  # noqa: ANN202
        def hook(param: torch.Tensor) -> None:
            if param.grad is not None:
                dead = getattr(self.masks[name], part)
                if dead.device != param.device:
                    self._follow_device()
                    dead = getattr(self.masks[name], part)
                param.grad.masked_fill_(dead, 0)
        return hook

    def _follow_device(self) -> None:
        """Move masks to their weights' device (the model may have moved since the masks were read)."""
        for name, mask in self.masks.items():
            device = self._linears[name].weight.device
            if mask.weight.device != device:
                mask.weight = mask.weight.to(device)
                mask.bias = mask.bias.to(device) if mask.bias is not None else None

    def attach(self) -> MaskKeeper:
        """Zero the masked entries of every gradient as soon as it is accumulated. Idempotent."""
        if self._handles:
            return self
        self._follow_device()
        for name, mask in self.masks.items():
            lin = self._linears[name]
            self._handles.append(lin.weight.register_post_accumulate_grad_hook(self._hook(name, "weight")))
            if mask.bias is not None:
                self._handles.append(lin.bias.register_post_accumulate_grad_hook(self._hook(name, "bias")))
        return self

    def detach(self) -> None:
        """Remove the gradient hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []

    @torch.no_grad()
    def mask_grads(self) -> None:
        """Zero the masked entries of the current gradients (the hooks do this already when attached)."""
        self._follow_device()
        for name, mask in self.masks.items():
            lin = self._linears[name]
            if lin.weight.grad is not None:
                lin.weight.grad.masked_fill_(mask.weight, 0)
            if mask.bias is not None and lin.bias.grad is not None:
                lin.bias.grad.masked_fill_(mask.bias, 0)

    @torch.no_grad()
    def enforce(self) -> None:
        """Write the zeros back into the weights (call after every optimizer step)."""
        self._follow_device()
        for name, mask in self.masks.items():
            lin = self._linears[name]
            lin.weight.masked_fill_(mask.weight, 0)
            if mask.bias is not None:
                lin.bias.masked_fill_(mask.bias, 0)
