"""The recovery objective: next-token cross-entropy, optionally mixed with distillation from a teacher.

``loss = (1 - w) * CE(student, next tokens) + w * T^2 * KL(softmax(teacher / T) || softmax(student / T))``

The KL is summed over the vocabulary and averaged over every position of the batch (each position's
logits predict the next token; the teacher's prediction is a target even at the last position, which
has no label). ``T^2`` keeps the gradient scale independent of the temperature (Hinton et al.).

Memory: the teacher's logits are turned into probabilities at once (under ``no_grad``) and the raw
logits freed, so distillation holds one ``(tokens, vocab)`` tensor for the teacher; ``KL = sum p_t log p_t
- sum p_t log p_s`` with the first term a constant computed with the probabilities. At ``T = 1`` the
student's log-probabilities are shared by the CE and the KL. All functions are pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@torch.no_grad()
def teacher_targets(teacher_logits: torch.Tensor, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(p, c)``: teacher probabilities ``softmax(logits / T)`` (float32) and the constant
    ``c = mean over positions of sum_v p log p`` (minus the teacher's mean entropy)."""
    logp = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    probs = logp.exp()
    const = (probs * logp).sum(-1).mean()
    return probs, const


def kl_to_targets(student_logp: torch.Tensor, probs: torch.Tensor, const: torch.Tensor,
                  temperature: float = 1.0) -> torch.Tensor:
    """``T^2 * mean over positions of KL(p || exp(student_logp))`` given :func:`teacher_targets`."""
    if student_logp.shape != probs.shape:
        raise ValueError(f"student {tuple(student_logp.shape)} and teacher {tuple(probs.shape)} logits differ in shape")
    cross = (probs * student_logp).sum(-1).mean()
    return (const - cross) * temperature**2


def distill_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Mean over positions of ``T^2 * KL(softmax(teacher / T) || softmax(student / T))`` (float32)."""
    probs, const = teacher_targets(teacher_logits, temperature)
    return kl_to_targets(F.log_softmax(student_logits.float() / temperature, dim=-1), probs, const, temperature)


def next_token_ce(logp: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting ``ids[:, 1:]`` from log-probabilities ``logp[:, :-1]``
    (what a Hugging Face causal LM returns as ``loss`` for ``labels=ids``)."""
    return -logp[:, :-1].gather(-1, ids[:, 1:].unsqueeze(-1)).mean()


@dataclass
class Objective:
    """The training loss as a function of the model output, for the batch set by :meth:`set_batch`.

    Callable on a model output (``.logits``), as Adacc's ``loss_fn`` expects; :attr:`last` holds the
    detached parts of the latest loss (``ce``, ``kl``) for logging.
    """

    kd_weight: float = 0.0
    temperature: float = 1.0

    def __post_init__(self) -> None:
        self.ids: torch.Tensor | None = None
        self.probs: torch.Tensor | None = None
        self.const: torch.Tensor | None = None
        self.last: dict[str, float | None] = {"ce": None, "kl": None}

    def set_batch(self, ids: torch.Tensor, teacher_logits: torch.Tensor | None = None) -> None:
        """Targets of the next forward: the token ids, and the teacher's logits on them (or None)."""
        self.ids = ids
        if teacher_logits is None:
            self.probs = self.const = None
        else:
            self.probs, self.const = teacher_targets(teacher_logits, self.temperature)

    def clear(self) -> None:
        """Drop the batch's targets (frees the teacher's probabilities)."""
        self.ids = self.probs = self.const = None

    def __call__(self, output: Any) -> torch.Tensor:
        assert self.ids is not None, "Objective.set_batch must be called before the forward pass"
        logits = output.logits if hasattr(output, "logits") else output[0]
        logp = F.log_softmax(logits.float(), dim=-1)
        ce = next_token_ce(logp, self.ids)
        kl = None
        if self.probs is not None and self.kd_weight > 0:
            t = self.temperature
            student = logp if t == 1.0 else F.log_softmax(logits.float() / t, dim=-1)
            kl = kl_to_targets(student, self.probs, self.const, t)
        self.last = {"ce": float(ce.detach()), "kl": float(kl.detach()) if kl is not None else None}
        if kl is None:
            return ce
        return (1.0 - self.kd_weight) * ce + self.kd_weight * kl
