"""What a pruned model declares about its mask, and the checks that refuse bad input.

The mask itself always comes from the weights' zeros (:mod:`leanml.recover.masks`). A ``report.json``
next to the weights (written by ``leanml prune``) *declares* what those zeros must satisfy, and
recovery checks it before training:

- an N:M pattern (``mask.pattern`` = ``"2:4"``): every group of M consecutive inputs of every linear
  holds at most N weights;
- unstructured sparsity ``s`` (``mask.sparsity``): the measured zeros reach ``s`` (within 1 %), so a
  model fine-tuned densely after pruning, or a dense model with a copied report, is refused;
- a structured method (FASP and its baselines, recognised by the parameter count shrinking or the MLP
  width rewritten): nothing beyond the zeros left in attention, which are kept.

Without a ``report.json`` the zeros are taken as they are if they are at least 1 % of the linear weights
(a dense checkpoint holds a few exact zeros by chance: SmolLM2's dequantized weights 0.03 %);
``--pattern N:M`` declares a pattern to check for models from other tools.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from leanml.errors import LeanmlError
from leanml.recover.config import no_mask_flag
from leanml.recover.masks import MaskKeeper

#: tolerance on the declared unstructured sparsity (fraction of all linear weights)
SPARSITY_TOLERANCE = 0.01
#: least fraction of zeros that makes a model without a declaration count as pruned
MIN_UNDECLARED = 0.01


def parse_nm(text: str | None) -> tuple[int, int] | None:
    """``"2:4"`` -> ``(2, 4)``; ``None`` / ``"unstructured"`` / ``"dense"`` -> ``None``."""
    if text is None or text.strip().lower() in ("", "unstructured", "none", "dense"):
        return None
    match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text)
    if not match or not 0 < int(match.group(1)) < int(match.group(2)):
        raise LeanmlError(f"malformed pattern {text!r}: use N:M with integers 0 < N < M, e.g. 2:4")
    return int(match.group(1)), int(match.group(2))


@dataclass
class MaskDeclaration:
    """What the input says its mask is. ``by`` names where it came from (``report.json``, the pattern option)."""

    by: str | None = None
    method: str | None = None
    pattern: tuple[int, int] | None = None
    sparsity: float | None = None
    structured: bool = False
    source_model: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "declared_by": self.by,
            "method": self.method,
            "pattern": f"{self.pattern[0]}:{self.pattern[1]}" if self.pattern else None,
            "declared_sparsity": self.sparsity,
            "structured": self.structured,
            "source_model": self.source_model,
        }


def read_report(model_dir: str | Path) -> dict[str, Any] | None:
    """The ``report.json`` next to a model directory's weights, or None (also for non-directories)."""
    path = Path(model_dir).expanduser() / "report.json"
    if not path.is_file():
        return None
    try:
        report = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise LeanmlError(f"cannot read {path} ({type(exc).__name__}); repair or delete it") from exc
    check_report_types(report, path)
    return report


#: the fields of a prune report that recovery reads, and the JSON types each may have (None: null)
REPORT_FIELDS: dict[str, tuple[type, ...]] = {
    "method": (str,), "mask": (dict,), "model": (dict,), "finalize": (dict,), "config": (dict,),
    "mask.pattern": (str,), "mask.sparsity": (int, float), "mask.structured": (bool,),
    "model.params_before": (int,), "model.params_after": (int,), "model.source": (str,),
    "finalize.intermediate_size": (int,), "config.model": (str,),
}


def check_report_types(report: Any, path: Path) -> None:
    """Refuse (one line) a ``report.json`` that is valid JSON but not a report: not an object, or a field
    recovery reads holding another type (``"mask": "2:4"``, ``"sparsity": "half"``)."""
    if not isinstance(report, dict):
        raise LeanmlError(f"{path} is not a leanml report (a JSON {type(report).__name__}, not an object); repair "
                          "or delete it")
    for name, kinds in REPORT_FIELDS.items():
        owner, _, key = name.rpartition(".")
        holder = report.get(owner) if owner else report
        value = holder.get(key) if isinstance(holder, dict) else None
        if value is None:
            continue
        bad = not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds)
        if bad:
            wanted = " or ".join({"str": "a string", "dict": "an object", "int": "an integer", "float": "a number",
                                  "bool": "true or false"}[k.__name__] for k in kinds)
            raise LeanmlError(f"{path}: field {name} is {json.dumps(value)[:40]} ({type(value).__name__}), "
                              f"expected {wanted}; repair or delete it")


def declaration(report: dict[str, Any] | None, pattern: str | None = None, by: str = "pattern") -> MaskDeclaration:
    """The mask declaration of a ``leanml prune`` (or ``leanml recover``) report; ``pattern`` (from the
    option ``by`` names: the job passes its flag) overrides the report's pattern."""
    decl = MaskDeclaration()
    if report is not None:
        mask = report.get("mask") or {}
        model = report.get("model") or {}
        finalize = report.get("finalize") or {}
        decl.by = "report.json"
        decl.method = report.get("method")
        decl.pattern = parse_nm(mask.get("pattern"))
        before, after = model.get("params_before"), model.get("params_after")
        decl.structured = bool(mask.get("structured")) or finalize.get("intermediate_size") is not None or (
            isinstance(before, int) and isinstance(after, int) and after < before)
        if decl.pattern is None and not decl.structured and mask.get("sparsity") is not None:
            decl.sparsity = float(mask["sparsity"])
        decl.source_model = model.get("source") or (report.get("config") or {}).get("model")
    if pattern is not None:
        decl.pattern = parse_nm(pattern)
        decl.by = by
        if decl.pattern is not None:
            decl.sparsity = None
    return decl


def check_masks(keeper: MaskKeeper, decl: MaskDeclaration, where: str) -> dict[str, Any]:
    """Refuse a model whose zeros do not carry the mask it needs; returns the mask facts for the report.

    A structured model needs no zeros (its pruned units may all be removed). Otherwise the zeros must
    follow the declared N:M pattern, reach the declared sparsity, or, with nothing declared, be at least
    :data:`MIN_UNDECLARED` of the linear weights (dense checkpoints hold a few exact zeros by chance).
    """
    measured = keeper.fraction()
    facts = {"source": "zeros of the weights", **decl.to_json(), "masked_fraction": measured,
             "linears_masked": len(keeper)}
    if decl.structured:
        return facts
    if decl.pattern is None and decl.sparsity is None and measured < MIN_UNDECLARED:
        raise LeanmlError(
            f"{where} has no pruned weights ({measured:.2%} exact zeros in its linear layers, no report.json "
            f"declaring a mask); recover a model written by `leanml prune`, declare its pattern with "
            f"pattern N:M, or pass {no_mask_flag()} to fine-tune every weight", fields=("pattern",)
        )
    if decl.pattern is not None:
        n, m = decl.pattern
        bad = keeper.nm_violations(n, m)
        if bad:
            name, count = next(iter(bad.items()))
            raise LeanmlError(
                f"{where}: {count} groups of {m} inputs of {name} (and {len(bad) - 1} more linears) hold more than "
                f"{n} weights, so the zeros do not follow the {n}:{m} pattern its {decl.by} declares; "
                "re-prune it to that pattern"
            )
    if decl.sparsity is not None and measured < decl.sparsity - SPARSITY_TOLERANCE:
        raise LeanmlError(
            f"{where} has {measured:.1%} zeros in its linear layers but its {decl.by} declares "
            f"{decl.sparsity:.0%} sparsity: the weights changed after pruning; re-prune it, or pass {no_mask_flag()}"
        )
    return facts


def vocab_size(model: nn.Module) -> int:
    """Number of logits the model outputs."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and hasattr(head, "weight"):
        return int(head.weight.shape[0])
    return int(model.config.vocab_size)


def check_teacher(student: nn.Module, student_tok: Any, teacher: nn.Module, teacher_tok: Any,
                  where: str = "the teacher") -> None:
    """Refuse a teacher whose vocabulary or tokenizer differs from the student's (one-line error)."""
    vs, vt = vocab_size(student), vocab_size(teacher)
    if vs != vt:
        raise LeanmlError(
            f"{where} outputs {vt} logits per token, the student {vs}: distillation needs the same vocabulary; "
            f"pass the dense model the student was pruned from as teacher", fields=("teacher",)
        )
    if student_tok is not None and teacher_tok is not None:
        a, b = student_tok.get_vocab(), teacher_tok.get_vocab()
        if a != b:
            differ = len(set(a.items()) ^ set(b.items())) // 2 or abs(len(a) - len(b))
            raise LeanmlError(
                f"{where} has another tokenizer than the student ({differ} tokens differ of {len(a)}): "
                f"distillation needs the same tokens; pass the dense model the student was pruned from as teacher",
                fields=("teacher",)
            )
