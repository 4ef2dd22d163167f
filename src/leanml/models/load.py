"""Loading a causal LM and its tokenizer: the bundled model, a model directory (plain or sparse-bitmask), a
``.gguf`` file or a hub id; dtypes and what a device can run."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from leanml.config import ConfigError
from leanml.data.offline import smollm2_gguf
from leanml.errors import LeanmlError
from leanml.finite import check_finite_tensors, check_finite_weights
from leanml.models.check import check_gguf, check_model_spec, refuse_incomplete
from leanml.models.compressed import is_compressed_dir, load_compressed
from leanml.models.specs import BUNDLED, looks_like_path
from leanml.outputs import atomic_dir, cache_dir

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"float32"``/``"bfloat16"``/``"float16"`` (or a dtype) to a ``torch.dtype``."""
    if isinstance(name, torch.dtype):
        if name not in DTYPES.values():
            raise ConfigError(f"dtype {name} is not supported; choose one of: {', '.join(DTYPES)}", None, ("dtype",))
        return name
    if name not in DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; choose one of: {', '.join(DTYPES)}", None, ("dtype",))
    return DTYPES[name]


def check_dtype(dtype: torch.dtype, device: str | torch.device) -> None:
    """Raise :class:`LeanmlError` when ``device`` cannot run ``dtype`` matrix products."""
    device = torch.device(device)
    name = str(dtype).replace("torch.", "")
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"dtype bfloat16 is not supported by {torch.cuda.get_device_name(device)}; "
                          "use dtype float16 or float32", None, ("dtype",))
    try:
        a = torch.ones(4, 4, dtype=dtype, device=device)
        (a @ a).sum().item()
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"dtype {name} cannot run on {device} ({str(exc).splitlines()[0]}); "
                          "use dtype float32", None, ("dtype",)) from exc


def _quiet_transformers() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.logging.set_verbosity_error()


def load_model(
    spec: str, dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu",
    sparse_kernels: bool = False, flag: str | None = None,
):
    """Load a causal LM and its tokenizer; returns ``(model, tokenizer)`` with the model in eval mode
    on ``device`` with weights in ``dtype`` (``float32``, ``bfloat16`` or ``float16``). ``flag``: the
    option a refused ``spec`` is named by (see :func:`~leanml.models.check.check_model_spec`).

    ``sparse_kernels=True``: the model must be 2:4 sparse; its decoder linears then run on
    semi-structured sparse kernels (CUDA sm80+, float16/bfloat16; on the CPU the model stays dense with
    a one-line warning), see :func:`leanml.models.sparse.to_sparse_kernels`."""
    dtype = parse_dtype(dtype)
    if spec not in BUNDLED:
        check_model_spec(spec, flag=flag)  # files complete and a decoder-only causal LM, before any weight is read
    _quiet_transformers()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if spec in BUNDLED:
        path = bundled_dir(spec)
    else:
        path = Path(spec).expanduser()
    if spec not in BUNDLED and path.suffix == ".gguf":
        if not path.is_file():
            raise LeanmlError(f"model file {path} does not exist; pass an existing .gguf, a model directory, "
                              "or smollm2-135m")
        model = _from_gguf(path, dtype)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    elif path.is_dir():
        if not (path / "config.json").exists():
            raise LeanmlError(f"{path} is not a Hugging Face model directory (no config.json)")
        try:
            if is_compressed_dir(path):
                model = load_compressed(path, dtype=dtype)
            else:
                model = _loaded(path, *AutoModelForCausalLM.from_pretrained(
                    path, dtype=dtype, output_loading_info=True, ignore_mismatched_sizes=True))
        except ValueError as exc:
            raise LeanmlError(f"cannot load {path}: {str(exc).splitlines()[0]}") from exc
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError, TypeError) as exc:
            raise LeanmlError(f"{path} has no usable tokenizer files; save the tokenizer next to the model") from exc
    elif looks_like_path(spec):
        raise LeanmlError(
            f"model path {spec} does not exist; pass a model directory, a .gguf file, a hub id, or smollm2-135m"
        )
    else:
        try:
            model, info = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype, output_loading_info=True,
                                                               ignore_mismatched_sizes=True)
            tokenizer = AutoTokenizer.from_pretrained(spec)
        except (OSError, ValueError) as exc:
            raise LeanmlError(
                f"could not load {spec!r} from the hub (offline, or no such model): use a local model "
                f"directory, a .gguf file, or the bundled smollm2-135m"
            ) from exc
        model = _loaded(spec, model, info)
    check_finite_weights(model.named_parameters(), spec)
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.use_cache = False
    model = model.to(device).eval()
    if sparse_kernels:
        from leanml.models.sparse import to_sparse_kernels

        to_sparse_kernels(model, progress=False)
    return model, tokenizer


def _loaded(where: str | os.PathLike, model: nn.Module, info: dict) -> nn.Module:
    """``model`` as ``from_pretrained(..., output_loading_info=True, ignore_mismatched_sizes=True)`` loaded it,
    refused (one line naming the first few) when a tensor was missing from the files or had another shape
    than the config gives it (tied embeddings are not missing; unexpected tensors are ignored)."""
    order = {name: i for i, name in enumerate(model.state_dict())}

    def rank(name: str) -> tuple[int, str]:  # the model's own order: layer 0 first
        return order.get(name, len(order)), name

    refuse_incomplete(where, sorted(info.get("missing_keys") or (), key=rank),
                      sorted(info.get("mismatched_keys") or (), key=lambda m: rank(m[0])),
                      sorted(info.get("unexpected_keys") or (), key=rank))
    return model


def peek_model_type(spec: str) -> str | None:
    """``config.model_type`` of a local model directory or the bundled model, without loading weights."""
    if spec in BUNDLED:
        return "llama"
    config = Path(spec).expanduser() / "config.json"
    if config.is_file():
        import json

        return json.loads(config.read_text()).get("model_type")
    return None


#: what transformers raises on a ``.gguf`` whose header is sound but whose metadata or tensors do not
#: describe a model it can build
GGUF_ERRORS = (ValueError, KeyError, IndexError, RuntimeError, TypeError, AttributeError)


def _from_gguf(path: Path, dtype: torch.dtype) -> nn.Module:
    """The model of a ``.gguf`` file (its header checked first), refused like a model directory when
    a tensor is missing or has another shape than its metadata gives it."""
    from transformers import AutoModelForCausalLM

    check_gguf(path)
    try:
        loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype,
                                                      output_loading_info=True, ignore_mismatched_sizes=True)
    except GGUF_ERRORS as exc:
        raise gguf_error(path, exc) from exc
    return _loaded(path, *loaded)


def gguf_error(path: Path, exc: BaseException) -> LeanmlError:
    """The one-line error of a ``.gguf`` file that transformers cannot turn into a model."""
    first = (str(exc).splitlines() or [""])[0][:200]
    return LeanmlError(f"cannot convert {path}: its metadata does not describe a model transformers can build "
                       f"({type(exc).__name__}: {first}); pass another .gguf or a model directory")


def bundled_dir(name: str) -> Path:
    """The cached safetensors copy of a bundled model, converting it on first use."""
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
    check_finite_tensors(model.state_dict().items(), f"the conversion of {gguf.name}")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    with atomic_dir(target, overwrite=True) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return target


