"""Sparse checkpoints that are smaller on disk: the sparse-bitmask layout.

Each pruned linear's weight is stored as its non-zero values in row-major order
(``<module>.compressed``), a bitmask of their positions packed 8 per byte along each row, least
significant bit first (``.bitmask``, ``rows x ceil(cols / 8)`` uint8), each row's first index into the
values (``.row_offsets``, int64) and the dense shape (``.shape``, int64). This is the tensor layout of
compressed-tensors' ``sparse-bitmask`` format; everything else is stored as is. A float32 model at
50 % takes about 0.53x of its pruned linears' dense bytes, bfloat16 about 0.56x (values plus one bit
per weight).

Who reads it: compressed-tensors dropped its sparse compressors in 0.15 and transformers 5 requires
compressed-tensors 0.15 or newer, so no release of either decompresses sparse checkpoints any more
(and vLLM dropped its 2:4 sparse support in 0.19.1). leanml therefore packs and unpacks the layout
itself, without that package:

- :func:`save_compressed` writes ``sparse-bitmask.safetensors`` (sharded as
  ``sparse-bitmask-0000i-of-0000n.safetensors`` plus an index for big models) and records the format
  under ``"leanml_compressed"`` in ``config.json``. The weight file deliberately does not carry the
  name ``from_pretrained`` looks for: a reader that cannot decompress it fails at once instead of
  loading a model whose pruned linears are random.
- :func:`load_compressed` (and ``leanml.models.load_model``) reads it back exactly, and also reads
  directories written in this format by compressed-tensors up to 0.14 (``model.safetensors`` with a
  ``quantization_config.sparsity_config`` of format ``sparse-bitmask``).
- :func:`decompress_dir` writes a plain dense copy that stock ``from_pretrained`` loads:
  ``python -m leanml.models.compressed SPARSE_DIR DENSE_DIR``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from leanml.config import ConfigError
from leanml.errors import LeanmlError
from leanml.finite import check_finite_tensors
from leanml.models.check import refuse_incomplete
from leanml.outputs import atomic_dir

FORMAT = "sparse-bitmask"
CONFIG_KEY = "leanml_compressed"
WEIGHTS_NAME = "sparse-bitmask.safetensors"
PARTS = ("compressed", "bitmask", "row_offsets", "shape")


def require_compressed() -> None:
    """Kept for callers that check the format can be written before a long run: the format needs only
    ``safetensors`` and ``numpy`` (dependencies of leanml), so this raises only if those are broken."""
    try:
        import safetensors.torch  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigError("save_format compressed needs the safetensors package: pip install safetensors", None,
                          ("save_format",)) from exc


def bitmask_pack(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """A 2-D tensor to its sparse-bitmask parts (``compressed``, ``bitmask``, ``row_offsets``, ``shape``)."""
    if weight.dim() != 2:
        raise ValueError(f"sparse-bitmask packs 2-D weights, got shape {tuple(weight.shape)}")
    w = weight.detach().cpu().contiguous()
    mask = w != 0
    counts = mask.sum(dim=1)
    return {
        "compressed": w[mask].contiguous(),
        "bitmask": torch.from_numpy(np.packbits(mask.numpy(), axis=1, bitorder="little")),
        "row_offsets": torch.cumsum(counts, 0) - counts,
        "shape": torch.tensor(list(w.shape), dtype=torch.int64),
    }


def bitmask_unpack(compressed: torch.Tensor, bitmask: torch.Tensor, shape: Iterable[int],
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    """The dense tensor of ``shape`` from its sparse-bitmask parts."""
    rows, cols = (int(s) for s in shape)
    mask = np.unpackbits(bitmask.numpy(), axis=1, count=cols, bitorder="little").astype(bool)
    if mask.shape != (rows, cols) or int(mask.sum()) != compressed.numel():
        raise LeanmlError(f"corrupt sparse-bitmask tensor: bitmask {tuple(bitmask.shape)} with {compressed.numel()} "
                          f"values does not describe shape ({rows}, {cols}); save the model again")
    out = torch.zeros(rows, cols, dtype=dtype or compressed.dtype)
    out[torch.from_numpy(mask)] = compressed.to(out.dtype)
    return out


def _sparsity_block(path: Path) -> dict[str, Any] | None:
    config = path / "config.json"
    if not config.is_file():
        return None
    data = json.loads(config.read_text())
    block = data.get(CONFIG_KEY) or ((data.get("quantization_config") or {}).get("sparsity_config") or {})
    return block if block.get("format") == FORMAT else None


def is_compressed_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a model in the sparse-bitmask layout (written by leanml, or by
    compressed-tensors up to 0.14)."""
    return _sparsity_block(Path(path)) is not None


def save_compressed(
    model: nn.Module, out_dir: str | os.PathLike, targets: Iterable[str], global_sparsity: float,
    structure: str = "unstructured", max_shard_size: int | str | None = None,
) -> dict[str, int]:
    """Save ``model`` into ``out_dir`` with the weights of the linears named in ``targets`` (full module
    names) in the sparse-bitmask layout. Returns the byte counts of those weights dense and packed.
    ``max_shard_size``: as in ``save_pretrained`` (default: its own)."""
    targets = sorted(set(targets))
    modules = dict(model.named_modules())
    missing = [t for t in targets if not isinstance(modules.get(t), nn.Linear)]
    if missing:
        raise ValueError(f"not linears of this model: {missing[:3]}")
    state = dict(model.state_dict())
    dense_bytes = packed_bytes = 0
    for t in targets:
        w = state.pop(f"{t}.weight")
        dense_bytes += w.numel() * w.element_size()
        for part, tensor in bitmask_pack(w).items():
            state[f"{t}.{part}"] = tensor
            if part != "shape":
                packed_bytes += tensor.numel() * tensor.element_size()
    out = Path(out_dir)
    shard = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out, state_dict=state, safe_serialization=True, **shard)
    _rename_weights(out)
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config", None)
    config[CONFIG_KEY] = {"format": FORMAT, "targets": targets, "global_sparsity": float(global_sparsity),
                          "sparsity_structure": structure}
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return {"dense_bytes": dense_bytes, "compressed_bytes": packed_bytes}


def _rename_weights(out: Path) -> None:
    """``model*.safetensors`` (and the shard index) to the sparse-bitmask names."""
    index = out / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        renames = {name: name.replace("model", "sparse-bitmask", 1) for name in set(data["weight_map"].values())}
        data["weight_map"] = {k: renames[v] for k, v in data["weight_map"].items()}
        for old, new in renames.items():
            (out / old).rename(out / new)
        (out / f"{WEIGHTS_NAME}.index.json").write_text(json.dumps(data, indent=2) + "\n")
        index.unlink()
    else:
        (out / "model.safetensors").rename(out / WEIGHTS_NAME)


def _weight_files(path: Path) -> list[Path]:
    for name in (WEIGHTS_NAME, "model.safetensors"):
        if (path / name).is_file():
            return [path / name]
        index = path / f"{name}.index.json"
        if index.is_file():
            return [path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    raise LeanmlError(f"{path} has no {WEIGHTS_NAME} (or model.safetensors) weights; save the model again")


def read_state_dict(path: str | os.PathLike, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The dense state dict of a sparse-bitmask directory (packed weights unpacked)."""
    from safetensors.torch import load_file

    path = Path(path)
    raw: dict[str, torch.Tensor] = {}
    for f in _weight_files(path):
        raw.update(load_file(f))
    state: dict[str, torch.Tensor] = {}
    packed: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in raw.items():
        prefix, _, part = key.rpartition(".")
        if part in PARTS and f"{prefix}.bitmask" in raw:
            packed.setdefault(prefix, {})[part] = tensor
        else:
            state[key] = tensor if dtype is None or not tensor.is_floating_point() else tensor.to(dtype)
    for prefix, parts in packed.items():
        state[f"{prefix}.weight"] = bitmask_unpack(parts["compressed"], parts["bitmask"], parts["shape"].tolist(),
                                                   dtype=dtype)
    return state


def _no_init() -> Any:
    """transformers' context that skips weight initialisation (its module moved between versions)."""
    import contextlib
    import importlib

    for module in ("transformers.initialization", "transformers.modeling_utils"):
        with contextlib.suppress(ImportError, AttributeError):
            return importlib.import_module(module).no_init_weights()
    return contextlib.nullcontext()


def load_compressed(path: str | os.PathLike, dtype: torch.dtype | None = None) -> nn.Module:
    """A model saved by :func:`save_compressed` (or by compressed-tensors <= 0.14 in this format), unpacked."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    for key in ("quantization_config", CONFIG_KEY):
        if hasattr(config, key):
            delattr(config, key)
    with _no_init():  # every weight is overwritten below: skip the random initialisation
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = read_state_dict(path, dtype=dtype)
    own = model.state_dict()
    tied = {k for k in own if k not in state and getattr(config, "tie_word_embeddings", False) and "lm_head" in k}
    refuse_incomplete(path, [k for k in own if k not in state and k not in tied],
                      [(k, tuple(v.shape), tuple(own[k].shape)) for k, v in state.items()
                       if k in own and tuple(v.shape) != tuple(own[k].shape)])
    unexpected = [k for k in state if k not in own]
    if unexpected:
        raise LeanmlError(f"{path}: the weights do not fit the model in config.json ({unexpected[0]} ...); "
                          "save it again")
    model.load_state_dict(state, strict=False)
    if tied:
        model.tie_weights()
    return model.eval()


def decompress_dir(src: str | os.PathLike, dst: str | os.PathLike, overwrite: bool = False) -> Path:
    """Write a plain dense copy of a sparse-bitmask directory (weights, config without the sparsity
    block, tokenizer and other files) that stock ``from_pretrained`` loads."""
    src, dst = Path(src), Path(dst)
    if not is_compressed_dir(src):
        raise LeanmlError(f"{src} is not a sparse-bitmask model directory (config.json names no {FORMAT} format)")
    stored = json.loads((src / "config.json").read_text()).get("dtype")
    model = load_compressed(src, dtype=getattr(torch, stored) if isinstance(stored, str) else None)
    check_finite_tensors(model.state_dict().items(), f"the dense copy of {src}")
    with atomic_dir(dst, overwrite=overwrite) as tmp:
        for f in src.iterdir():
            if f.is_file() and f.name != "config.json" and not f.name.startswith(("sparse-bitmask", "model")):
                shutil.copy2(f, tmp / f.name)
        model.save_pretrained(tmp, safe_serialization=True)
    return dst


def main(argv: list[str] | None = None) -> int:
    """``python -m leanml.models.compressed SPARSE_DIR DENSE_DIR``: a dense copy for stock readers."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m leanml.models.compressed SPARSE_DIR DENSE_DIR", file=sys.stderr)
        return 2
    try:
        out = decompress_dir(args[0], args[1])
    except LeanmlError as exc:
        print(f"leanml: error: {exc}", file=sys.stderr)
        return 2
    print(f"dense copy of {args[0]} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
