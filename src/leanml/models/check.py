"""Checks of a model before anything is loaded: its files are readable and complete, and it is a
decoder-only causal LM. Each failure is a :class:`LeanmlError` naming the file and the fix.

These read only headers (a safetensors file's JSON header and its size, a ``.bin`` file's zip
directory, a GGUF's magic bytes) and the small JSON files, so they take milliseconds even for big
models.
"""

from __future__ import annotations

import json
import os
import struct
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from leanml.utils import LeanmlError

#: JSON files of a model directory that loading reads
JSON_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "model.safetensors.index.json", "pytorch_model.bin.index.json",
              "report.json")

NOT_DECODER_ONLY_HINT = "leanml prunes and trains decoder-only causal LMs (LLaMA, Qwen, Mistral, OPT, ...)"


def read_json(path: Path, what: str = "") -> Any:
    """Parse a JSON file, raising :class:`LeanmlError` naming the file when it is unreadable or cut."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise LeanmlError(f"cannot read {path} ({exc.strerror}); check its permissions") from exc
    except UnicodeDecodeError as exc:
        raise LeanmlError(f"{path} is not UTF-8 text (byte {exc.start}); the file is damaged: "
                          f"restore it{what}") from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise LeanmlError(f"{path} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); the file "
                          f"is cut or damaged: restore it{what}") from exc


def safetensors_header(path: str | os.PathLike, fix: str = "copy or save the model again") -> tuple[int, dict[str, Any]]:
    """The header length and JSON header of a safetensors file (``__metadata__`` included); raises
    :class:`LeanmlError` when the file is unreadable, cut inside its header, or its header is damaged."""
    path = Path(path)
    fix = f"; the copy is incomplete or damaged: {fix}"
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise LeanmlError(f"{path} is truncated ({size} bytes, no header){fix}")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 100 * 2**20:
                raise LeanmlError(f"{path} is truncated or not a safetensors file (header of {n} bytes, file of "
                                  f"{size}){fix}")
            header = json.loads(f.read(n))
    except OSError as exc:
        raise LeanmlError(f"cannot read {path} ({exc.strerror}); check its permissions") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise LeanmlError(f"{path} has a damaged header{fix}") from exc
    if not isinstance(header, dict):
        raise LeanmlError(f"{path} has a damaged header{fix}")
    return n, header


def check_safetensors(path: Path) -> None:
    """Raise :class:`LeanmlError` when a safetensors file is unreadable, has a broken header, or is shorter
    than its header says."""
    fix = "; the copy is incomplete or damaged: copy or save the model again"
    n, header = safetensors_header(path)
    size = Path(path).stat().st_size
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            end = max(end, int(entry["data_offsets"][1]))
        except (TypeError, KeyError, IndexError, ValueError) as exc:
            raise LeanmlError(f"{path} has a damaged header (tensor {name!r}){fix}") from exc
    expected = 8 + n + end
    if size < expected:
        raise LeanmlError(f"{path} is truncated ({size:,} of {expected:,} bytes){fix}")


def check_torch_bin(path: Path) -> None:
    """Raise :class:`LeanmlError` when a ``pytorch_model.bin`` zip archive is cut (its directory is at the end)."""
    try:
        with zipfile.ZipFile(path) as z:
            z.namelist()
    except OSError as exc:
        raise LeanmlError(f"cannot read {path} ({exc.strerror}); check its permissions") from exc
    except zipfile.BadZipFile as exc:
        raise LeanmlError(f"{path} is truncated or damaged; copy or save the model again") from exc


def check_gguf(path: Path) -> None:
    """Raise :class:`LeanmlError` when a ``.gguf`` file is unreadable or does not start with the GGUF magic."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise LeanmlError(f"cannot read {path} ({exc.strerror}); check its permissions") from exc
    if magic != b"GGUF":
        raise LeanmlError(f"{path} is not a GGUF file (or is damaged); pass a .gguf model or a model directory")


def weight_files(folder: Path) -> list[Path]:
    """The weight files a model directory's loading reads (shards named by an index file included)."""
    for index_name, single in (("model.safetensors.index.json", "model.safetensors"),
                               ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        index = folder / index_name
        if index.is_file():
            shards = sorted(set((read_json(index).get("weight_map") or {}).values()))
            missing = [s for s in shards if not (folder / s).is_file()]
            if missing:
                raise LeanmlError(f"{folder} lists {len(shards)} weight shards in {index_name} but {missing[0]} is "
                                  f"missing; copy the whole model directory")
            return [folder / s for s in shards]
        if (folder / single).is_file():
            return [folder / single]
    found = sorted(folder.glob("*.safetensors"))
    if found:
        return found
    raise LeanmlError(f"{folder} has a config.json but no weights (model.safetensors or pytorch_model.bin); "
                      f"copy the whole model directory")


def check_decoder_config(config: dict[str, Any], where: str) -> None:
    """Raise :class:`LeanmlError` unless ``config`` (a ``config.json`` as a dict) is a decoder-only causal LM."""
    model_type = config.get("model_type")
    if not model_type:
        raise LeanmlError(f"{where} has no model_type; it is not a Hugging Face model config")
    if config.get("is_encoder_decoder"):
        raise LeanmlError(f"{where}: {model_type} is an encoder-decoder model; {NOT_DECODER_ONLY_HINT}")
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    archs = [a for a in config.get("architectures") or [] if isinstance(a, str)]
    causal_arch = any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs)
    # BERT-like encoders have a causal-LM class in transformers too (BertLMHeadModel), so the causal-LM
    # table alone accepts them: every family with a masked-LM head is refused
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        raise LeanmlError(f"{where}: {model_type} is an encoder (masked LM), not a decoder-only causal LM; "
                          f"{NOT_DECODER_ONLY_HINT}")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not causal_arch:
        raise LeanmlError(f"{where}: {model_type} has no causal-LM class in transformers; {NOT_DECODER_ONLY_HINT}")


def check_model_spec(spec: str, *, flag: str = "--model") -> None:
    """Check a model given on the command line before loading it: a local directory's JSON files parse,
    its weight files are complete, and it is a decoder-only causal LM; a ``.gguf`` file has the GGUF
    magic. Hub ids and the bundled model pass (they are checked when loaded)."""
    from leanml.models import BUNDLED, _looks_like_path

    if spec in BUNDLED:
        return
    path = Path(spec).expanduser()
    if path.suffix == ".gguf" and not path.is_dir():
        if not path.is_file():
            raise LeanmlError(f"{flag} {path} does not exist; pass an existing .gguf, a model directory, "
                              f"or smollm2-135m")
        check_gguf(path)
        return
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise LeanmlError(f"{flag} {path} is not a Hugging Face model directory (no config.json)")
        for name in JSON_FILES:
            if (path / name).is_file():
                read_json(path / name, ", or copy the model directory again")
        config = read_json(path / "config.json")
        if not isinstance(config, dict):
            raise LeanmlError(f"{path / 'config.json'} is not a model config (not a JSON object)")
        check_decoder_config(config, f"{flag} {path}")
        for f in weight_files(path):
            if f.suffix == ".safetensors":
                check_safetensors(f)
            elif f.suffix == ".bin":
                check_torch_bin(f)
        if not any((path / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
            raise LeanmlError(f"{flag} {path} has no tokenizer files; save the tokenizer next to the model")
        return
    if path.exists():
        raise LeanmlError(f"{flag} {path} is a file; pass a model directory, a .gguf file, a hub id, or smollm2-135m")
    if _looks_like_path(spec):
        what = "model" if flag == "--model" else flag
        raise LeanmlError(f"{what} path {spec} does not exist; pass a model directory, a .gguf file, a hub id, "
                          f"or smollm2-135m")
    check_hub_reachable(spec, flag)


def hub_offline() -> bool:
    """Whether the environment asks for offline mode (``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``)."""
    return any(os.environ.get(k, "").lower() in ("1", "true", "yes", "on")
               for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"))


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the model hub answers a TCP connection within ``timeout`` seconds (no request is sent)."""
    import socket
    from urllib.parse import urlparse

    try:
        from huggingface_hub import constants

        url = urlparse(constants.ENDPOINT)
    except Exception:  # noqa: BLE001 - no hub client: nothing to reach
        return False
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


def check_hub_reachable(spec: str, flag: str = "--model") -> None:
    """Refuse a hub id at once when the hub is off (offline mode or no connection) and it is not cached."""
    if not (hub_offline() or not hub_reachable()):
        return
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(spec, "config.json")
    except Exception:  # noqa: BLE001 - a malformed id
        cached = None
    if not isinstance(cached, str):
        raise LeanmlError(f"{flag} {spec}: no local directory by that name, and the model hub is not reachable "
                          f"(offline) with no cached copy; pass a local model directory, a .gguf file, or smollm2-135m")


def check_model_input(spec: str, seqlen: int, flag: str = "--seqlen") -> None:
    """What every LLM command checks before loading a model: :func:`check_model_spec`, and that a local
    model takes windows of ``seqlen`` tokens (its ``max_position_embeddings``; ``flag`` names the option)."""
    check_model_spec(spec)
    config = Path(spec).expanduser() / "config.json"
    limit = read_json(config).get("max_position_embeddings") if config.is_file() else None
    if isinstance(limit, int) and seqlen > limit:
        raise LeanmlError(f"{flag} {seqlen} is above the model's maximum of {limit} tokens; lower {flag}")


def _names(names: Sequence[str], k: int = 3) -> str:
    more = f" and {len(names) - k} more" if len(names) > k else ""
    return ", ".join(names[:k]) + more


def refuse_incomplete(where: str | os.PathLike, missing: Sequence[str], mismatched: Sequence[tuple[str, Any, Any]],
                      unexpected: Sequence[str] = ()) -> None:
    """Refuse weights that do not fill the model their ``config.json`` builds: ``missing`` tensor names
    (the model's, tied embeddings already accepted), ``mismatched`` ``(name, shape in the files, shape by
    the config)``. One line naming the first few; ``unexpected`` tensors (in the files, not in the
    model) are ignored as ``from_pretrained`` ignores them, with a one-line warning."""
    if mismatched:
        name, stored, wanted = mismatched[0]
        more = f" (and {len(mismatched) - 1} more: {_names([m[0] for m in mismatched[1:]])})" if len(mismatched) > 1 else ""
        raise LeanmlError(f"the config.json of {where} does not match its weights: tensor {name} has shape "
                          f"{tuple(stored)} in the files but {tuple(wanted)} by the config{more}; use the "
                          f"config.json saved with these weights")
    if missing:
        raise LeanmlError(f"the weights of {where} lack {len(missing)} tensor{'s' if len(missing) > 1 else ''} the "
                          f"model needs ({_names(missing)}); the directory is incomplete: copy or save the "
                          f"whole model again")
    if unexpected:
        import warnings

        warnings.warn(f"leanml: {where} holds {len(unexpected)} tensors the model does not use "
                      f"({_names(list(unexpected))}); they are ignored", stacklevel=3)
