"""The one save path of a sparse model: ``leanml prune`` and ``leanml recover`` both write their output
with :func:`save_pruned`, so the two record the same things the same way.

Into ``out``, atomically (a temporary sibling renamed when complete): the weights (plain safetensors, or
the sparse-bitmask layout of :mod:`leanml.models.compressed` whose config names the mask's structure),
the tokenizer, ``report.json`` with its ``save`` record (format, dtype, bytes, and the sparsity record:
the measured sparsity of the decoder linears and the structure, ``"4:8"``, ``"2:4"`` or
``"unstructured"``), and whatever else the caller writes beside it. A model holding a NaN or infinity is
refused before anything is written; a full disk or a permission error is one line naming the fix.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from leanml.faults import write_fault
from leanml.outputs import atomic_dir, write_json


@dataclass(frozen=True)
class SaveSpec:
    """How a sparse model is saved. ``pattern``: the mask's N:M pattern (``"4:8"``) or anything else for a
    mask without one (recorded as ``"unstructured"``). ``dtype``: the weights' dtype, recorded as given.
    ``need``: the bytes the save needs, named in a full-disk error. ``what``: the output in messages."""

    save_format: str = "safetensors"
    pattern: str | None = None
    dtype: str | None = None
    overwrite: bool = False
    need: int | None = None
    what: str = "the model"

    @property
    def structure(self) -> str:
        """The structure written into the compressed layout's config and the report: N:M or unstructured."""
        return self.pattern if self.pattern and re.fullmatch(r"\d+:\d+", self.pattern) else "unstructured"


def sparse_linears(model: nn.Module) -> tuple[list[str], float]:
    """The decoder linears holding zeros (full module names) and the fraction of zeros over every decoder
    linear's weight."""
    from leanml.models import decoder_linear_names

    names, zeros, total = [], 0, 0
    for name in decoder_linear_names(model):
        weight = model.get_submodule(name).weight
        n = int((weight == 0).sum())
        zeros, total = zeros + n, total + weight.numel()
        if n:
            names.append(name)
    return names, zeros / max(total, 1)


def save_pruned(model: nn.Module, tokenizer: Any, out: str | os.PathLike, report: dict[str, Any], spec: SaveSpec,
                write_more: Callable[[Path], None] | None = None) -> dict[str, Any]:
    """Write ``model``, ``tokenizer`` and ``report`` (its ``save`` record added) into ``out`` atomically;
    ``write_more(tmp)`` writes further files into the same directory before it appears. Returns the
    ``save`` record."""
    from leanml.models import save_model

    sparse, sparsity = sparse_linears(model)
    with atomic_dir(out, overwrite=spec.overwrite) as tmp:
        model.config.use_cache = True
        try:
            sizes = save_model(model, tokenizer, tmp, spec.save_format, sparse, sparsity, spec.structure)
        except Exception as exc:  # a full disk or a permission error, also inside safetensors' own error
            if isinstance(exc, OSError) or type(exc).__name__ == "SafetensorError":
                raise write_fault(exc, out, spec.need, spec.what) from exc
            raise
        record = {"format": spec.save_format, **({"dtype": spec.dtype} if spec.dtype is not None else {}),
                  **(sizes or {}), "weights_bytes": sum(f.stat().st_size for f in tmp.glob("*.safetensors")),
                  "sparsity": sparsity, "structure": spec.structure}
        report["save"] = record
        write_json(tmp / "report.json", report)
        if write_more is not None:
            write_more(tmp)
    return record
