"""Sparse checkpoints in the compressed-tensors ``sparse-bitmask`` format.

Each pruned linear's weight is stored as its non-zero values, a packed bitmask of their positions and
per-row offsets (``<module>.compressed``, ``.bitmask``, ``.row_offsets``, ``.shape``); everything else
is stored as is, and ``config.json`` gets the ``quantization_config`` block with the
``sparsity_config`` that compressed-tensors writes. A 50 % float32 model takes about 53 % of the dense
bytes for its pruned linears (values plus one bit per weight).

Writing and reading both go through the ``compressed-tensors`` package (:class:`ModelCompressor`, the
library llm-compressor uses). Reading: :func:`load_compressed` builds the model from its config and
decompresses the weights into it; ``leanml.models.load_model`` does so for any directory written here.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from leanml.utils import LeanmlError

FORMAT = "sparse-bitmask"


def _require() -> Any:
    try:
        with warnings.catch_warnings():  # its import trips torch's deprecation warnings
            warnings.simplefilter("ignore", DeprecationWarning)
            import compressed_tensors  # noqa: F401
            from compressed_tensors.compressors import ModelCompressor
            from compressed_tensors.config import BitmaskConfig
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise LeanmlError(
            "--save-format compressed needs the compressed-tensors package: pip install 'compressed-tensors==0.13.0'"
        ) from exc
    return ModelCompressor, BitmaskConfig


def is_compressed_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a model written in the sparse-bitmask format."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    qc = json.loads(config.read_text()).get("quantization_config") or {}
    return (qc.get("sparsity_config") or {}).get("format") == FORMAT


def save_compressed(
    model: nn.Module, out_dir: str | os.PathLike, targets: Iterable[str], global_sparsity: float,
    structure: str = "unstructured",
) -> dict[str, int]:
    """Save ``model`` into ``out_dir`` with the weights of the linears named in ``targets`` (full module
    names) bitmask-compressed. Returns the byte counts of the dense and compressed tensors."""
    ModelCompressor, BitmaskConfig = _require()
    targets = sorted(set(targets))
    modules = dict(model.named_modules())
    missing = [t for t in targets if not isinstance(modules.get(t), nn.Linear)]
    if missing:
        raise ValueError(f"not linears of this model: {missing[:3]}")
    # exact module names as targets: nothing else (lm_head, a tied embedding table) is touched
    cfg = BitmaskConfig(targets=targets, ignore=[], global_sparsity=float(global_sparsity),
                        sparsity_structure=structure)
    compressor = ModelCompressor(sparsity_config=cfg)
    dense = model.state_dict()
    dense_bytes = sum(dense[f"{t}.weight"].numel() * dense[f"{t}.weight"].element_size() for t in targets)
    packed = compressor.compress(model, dense)
    prefixes = tuple(t + "." for t in targets)
    packed_bytes = sum(v.numel() * v.element_size() for k, v in packed.items()
                       if k.startswith(prefixes) and not k.endswith(".bias"))
    model.save_pretrained(out_dir, state_dict=packed, safe_serialization=True)  # (consumes ``packed``)
    compressor.update_config(os.fspath(out_dir))
    return {"dense_bytes": dense_bytes, "compressed_bytes": packed_bytes}


def load_compressed(path: str | os.PathLike, dtype: torch.dtype | None = None) -> nn.Module:
    """A model saved by :func:`save_compressed` (or by llm-compressor in this format), decompressed."""
    ModelCompressor, _ = _require()
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    compressor = ModelCompressor.from_pretrained(os.fspath(path))
    compressor.decompress(os.fspath(path), model)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    return model.eval()
