"""Saving a model and its tokenizer: plain safetensors, or the sparse-bitmask layout for its pruned linears."""

from __future__ import annotations

import os

import torch
from torch import nn

from leanml.config import ConfigError
from leanml.finite import check_finite_tensors
from leanml.models.layout import get_adapter, layer_linears

SAVE_FORMATS = ("safetensors", "compressed")


def save_model(
    model: nn.Module,
    tokenizer,
    out_dir: str | os.PathLike,
    save_format: str = "safetensors",
    sparse_linears: list[str] | None = None,
    sparsity: float = 0.0,
    structure: str = "unstructured",
) -> dict[str, int] | None:
    """Save model and tokenizer into ``out_dir``.

    ``save_format="safetensors"`` (default): plain safetensors that ``AutoModelForCausalLM.from_pretrained``
    loads. ``"compressed"``: the sparse-bitmask layout (leanml's own packer) for the linears named in
    ``sparse_linears`` (full module names), read back by :func:`load_model`; returns the dense and
    compressed byte counts of those weights. A model holding a NaN or infinity is refused before anything
    is written (:class:`~leanml.finite.NonFiniteError` naming the first such tensor).
    """
    if save_format not in SAVE_FORMATS:
        raise ConfigError(f"unknown save_format {save_format!r}; choose one of: {', '.join(SAVE_FORMATS)}", None,
                          ("save_format",))
    check_finite_tensors(model.state_dict().items(), "the model")
    sizes = None
    if save_format == "compressed":
        from leanml.models.compressed import save_compressed

        sizes = save_compressed(model, out_dir, sparse_linears or [], sparsity, structure)
    else:
        model.save_pretrained(out_dir, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return sizes


def saved_bytes(model: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Bytes of ``model``'s tensors as saved: a tensor shared by several names (tied embeddings) once, the
    floating ones at ``dtype`` when given (the save's dtype), else at their own."""
    seen = {(t.data_ptr(), t.numel()): t for t in model.state_dict().values()}
    return sum(t.numel() * (dtype.itemsize if dtype is not None and t.is_floating_point() else t.element_size())
               for t in seen.values())


def decoder_linear_names(model: nn.Module) -> list[str]:
    """Full module names of every linear inside the decoder layers (what unstructured methods prune)."""
    adapter = get_adapter(model)
    prefix = {id(layer): name for name, layer in model.named_modules()}
    return [f"{prefix[id(layer)]}.{n}" for layer in adapter.layers() for n in layer_linears(layer)]
