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

from leanml.errors import LeanmlError, option_fields
from leanml.hub import hub_offline, hub_reachable
from leanml.models.specs import BUNDLED, looks_like_path

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


def safetensors_header(path: str | os.PathLike,
                       fix: str = "copy or save the model again") -> tuple[int, dict[str, Any]]:
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


#: bytes of the fixed-size GGUF metadata value types (8 string and 9 array are read apart)
_GGUF_VALUE_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


class _GGUFHeader:
    """A bounds-checked reader of a GGUF header in a memory map; every read past the end raises
    ``ValueError`` saying what was cut."""

    def __init__(self, buf: Any) -> None:
        self.buf, self.pos, self.size = buf, 0, len(buf)

    def take(self, n: int, what: str) -> int:
        if n < 0 or self.pos + n > self.size:
            raise ValueError(f"the file ends inside {what} (byte {self.pos:,} of {self.size:,})")
        start, self.pos = self.pos, self.pos + n
        return start

    def uint(self, n: int, what: str) -> int:
        return int.from_bytes(self.buf[self.take(n, what) : self.pos], "little")

    def string(self, what: str) -> str:
        n = self.uint(8, what)
        start = self.take(n, what)
        return bytes(self.buf[start : self.pos]).decode("utf-8", errors="replace")

    def value(self, vtype: int, what: str) -> Any:
        if vtype in _GGUF_VALUE_BYTES:
            return self.uint(_GGUF_VALUE_BYTES[vtype], what)
        if vtype == 8:
            return self.string(what)
        if vtype == 9:
            item, count = self.uint(4, what), self.uint(8, what)
            if item in _GGUF_VALUE_BYTES:  # skipped in one step
                self.take(count * _GGUF_VALUE_BYTES[item], what)
            else:
                for _ in range(count):
                    self.value(item, what)
            return None
        raise ValueError(f"{what} has an unknown value type {vtype}")


def gguf_tensor_extents(path: Path) -> list[tuple[str, int, int]]:
    """``(name, start, end)`` byte extents of every tensor of a ``.gguf`` file, read from its header
    (magic, version, metadata, tensor table, alignment); raises ``ValueError`` naming what is damaged.
    Only the header is read (memory-mapped)."""
    import mmap

    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        r = _GGUFHeader(buf)
        if bytes(buf[r.take(4, "the magic") : 4]) != b"GGUF":
            raise ValueError("no GGUF magic")
        version = r.uint(4, "the version")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (2 or 3 are read)")
        n_tensors, n_kv = r.uint(8, "the tensor count"), r.uint(8, "the metadata count")
        if n_tensors > r.size or n_kv > r.size:
            raise ValueError(f"impossible counts ({n_tensors:,} tensors, {n_kv:,} metadata entries)")
        alignment = 32
        for i in range(n_kv):
            key = r.string(f"metadata entry {i}")
            value = r.value(r.uint(4, f"metadata {key}"), f"metadata {key}")
            if key == "general.alignment" and isinstance(value, int) and value > 0:
                alignment = value
        table = []
        for i in range(n_tensors):
            name = r.string(f"the name of tensor {i}")
            dims = [r.uint(8, f"the shape of tensor {name}") for _ in range(r.uint(4, f"tensor {name}"))]
            ttype, offset = r.uint(4, f"tensor {name}"), r.uint(8, f"tensor {name}")
            try:
                block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
            except (ValueError, KeyError):
                raise ValueError(f"tensor {name} has an unknown type {ttype}") from None
            numel = 1
            for d in dims:
                numel *= d
            if numel % block:
                raise ValueError(f"tensor {name} of shape {dims} does not fill blocks of {block}")
            table.append((name, offset, numel // block * nbytes))
        data = -(-r.pos // alignment) * alignment
        return [(name, data + offset, data + offset + n) for name, offset, n in table]


def check_gguf(path: Path) -> None:
    """Raise :class:`LeanmlError` when a ``.gguf`` file is unreadable, lacks the GGUF magic, has a damaged
    header, or is shorter than its tensor table says (the first tensor it cuts is named). Reads the
    header only; without the ``gguf`` package (which converting needs anyway) only the magic is checked."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise LeanmlError(f"cannot read {path} ({exc.strerror}); check its permissions") from exc
    if magic != b"GGUF":
        raise LeanmlError(f"{path} is not a GGUF file (or is damaged); pass a .gguf model or a model directory")
    try:
        import gguf  # noqa: F401
    except ImportError:
        return
    fix = "copy the .gguf again, or pass a model directory"
    try:
        extents = gguf_tensor_extents(path)
    except ValueError as exc:
        raise LeanmlError(f"{path} is a damaged or truncated GGUF file ({exc}); {fix}") from exc
    size = path.stat().st_size
    cut = [(name, end) for name, _, end in extents if end > size]
    if cut:
        raise LeanmlError(f"{path} is truncated: tensor {cut[0][0]} ends at byte {cut[0][1]:,} of a "
                          f"{size:,}-byte file ({len(cut)} of {len(extents)} tensors cut); {fix}")
    if not extents:
        raise LeanmlError(f"{path} holds no tensors; {fix}")


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


def check_decoder_config(config: dict[str, Any], where: str, fields: tuple[str, ...] = ()) -> None:
    """Raise :class:`LeanmlError` unless ``config`` (a ``config.json`` as a dict) is a decoder-only causal LM.
    ``fields``: the options ``where`` names (shown as their flags on the command line)."""
    model_type = config.get("model_type")
    if not model_type:
        raise LeanmlError(f"{where} has no model_type; it is not a config.json of Hugging Face transformers",
                          fields=fields)
    if config.get("is_encoder_decoder"):
        raise LeanmlError(f"{where}: {model_type} is an encoder-decoder architecture; {NOT_DECODER_ONLY_HINT}",
                          fields=fields)
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
                          f"{NOT_DECODER_ONLY_HINT}", fields=fields)
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not causal_arch:
        raise LeanmlError(f"{where}: {model_type} has no causal-LM class in transformers; {NOT_DECODER_ONLY_HINT}",
                          fields=fields)


def _named(flag: str | None, field: str) -> tuple[str, tuple[str, ...]]:
    """The option a message names (``flag``: a flag, or a field name the command line shows as its flag;
    default ``field``) and the fields to give the error."""
    name = flag or field
    return name, option_fields(name)


def check_model_spec(spec: str, *, flag: str | None = None) -> None:
    """Check a model given on the command line before loading it: a local directory's JSON files parse,
    its weight files are complete, and it is a decoder-only causal LM; a ``.gguf`` file has the GGUF
    magic. Hub ids and the bundled model pass (they are checked when loaded). ``flag``: the option the
    errors name, a field name (default ``model``, shown as its flag on the command line) or a flag; the
    messages use the word only for it."""
    if spec in BUNDLED:
        return
    name, fields = _named(flag, "model")
    path = Path(spec).expanduser()
    shown = path.absolute()  # an absolute path: a relative one named like the option would read as its flag
    if path.suffix == ".gguf" and not path.is_dir():
        if not path.is_file():
            raise LeanmlError(f"{name} {shown} does not exist; pass an existing .gguf, a directory saved by "
                              "save_pretrained, or smollm2-135m", fields=fields)
        check_gguf(path)
        return
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise LeanmlError(f"{name} {shown} is not a directory saved by Hugging Face save_pretrained "
                              "(no config.json)", fields=fields)
        for json_name in JSON_FILES:
            if (path / json_name).is_file():
                read_json(path / json_name, ", or copy the model directory again")
        config = read_json(path / "config.json")
        if not isinstance(config, dict):
            raise LeanmlError(f"{path / 'config.json'} is not a model config (not a JSON object)")
        check_decoder_config(config, f"{name} {shown}", fields)
        for f in weight_files(path):
            if f.suffix == ".safetensors":
                check_safetensors(f)
            elif f.suffix == ".bin":
                check_torch_bin(f)
        if not any((path / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
            raise LeanmlError(f"{name} {shown} has no tokenizer files; save the tokenizer next to the weights",
                              fields=fields)
        return
    if path.exists():
        raise LeanmlError(f"{name} {shown} is a file; pass a directory saved by save_pretrained, a .gguf file, "
                          "a hub id, or smollm2-135m", fields=fields)
    if looks_like_path(spec):
        # "model path X" reads better than "--model path X": the default names no flag here
        what, named = (name, fields) if flag else ("model", ())
        raise LeanmlError(f"{what} path {spec} does not exist; pass a model directory, a .gguf file, a hub id, "
                          f"or smollm2-135m", fields=named)
    check_hub_reachable(spec, flag)


def check_hub_reachable(spec: str, flag: str | None = None) -> None:
    """Refuse a hub id at once when the hub is off (offline mode or no connection) and it is not cached.
    ``flag`` as in :func:`check_model_spec`."""
    if not (hub_offline() or not hub_reachable()):
        return
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(spec, "config.json")
    except Exception:  # noqa: BLE001 - a malformed id
        cached = None
    if not isinstance(cached, str):
        name, fields = _named(flag, "model")
        raise LeanmlError(f"{name} {spec}: no local directory by that name, and the Hugging Face hub is not "
                          "reachable (offline) with no cached copy; pass a local directory saved by "
                          "save_pretrained, a .gguf file, or smollm2-135m", fields=fields)


def check_model_input(spec: str, seqlen: int, flag: str | None = None) -> None:
    """What every LLM command checks before loading a model: :func:`check_model_spec`, and that a local
    model takes windows of ``seqlen`` tokens (its ``max_position_embeddings``; ``flag`` names the option:
    a field name, default ``seqlen``, shown as its flag on the command line, or a flag)."""
    check_model_spec(spec)
    config = Path(spec).expanduser() / "config.json"
    limit = read_json(config).get("max_position_embeddings") if config.is_file() else None
    if isinstance(limit, int) and seqlen > limit:
        name, fields = _named(flag, "seqlen")
        raise LeanmlError(f"{name} {seqlen} is above the model's maximum of {limit} tokens; lower {name}",
                          fields=fields)


def _names(names: Sequence[str], k: int = 3) -> str:
    more = f" and {len(names) - k} more" if len(names) > k else ""
    return ", ".join(names[:k]) + more


def refuse_incomplete(where: str | os.PathLike, missing: Sequence[str], mismatched: Sequence[tuple[str, Any, Any]],
                      unexpected: Sequence[str] = ()) -> None:
    """Refuse weights that do not fill the model their ``config.json`` builds: ``missing`` tensor names
    (the model's, tied embeddings already accepted), ``mismatched`` ``(name, shape in the files, shape by
    the config)``. One line naming the first few; ``unexpected`` tensors (in the files, not in the
    model) are ignored as ``from_pretrained`` ignores them, with a one-line warning."""
    gguf = str(where).endswith(".gguf")
    config, kind = ("metadata", "file") if gguf else ("config.json", "directory")
    if mismatched:
        name, stored, wanted = mismatched[0]
        more = (f" (and {len(mismatched) - 1} more: {_names([m[0] for m in mismatched[1:]])})"
                if len(mismatched) > 1 else "")
        raise LeanmlError(f"the {config} of {where} does not match its weights: tensor {name} has shape "
                          f"{tuple(stored)} in the files but {tuple(wanted)} by the config{more}; use the "
                          f"{config} saved with these weights")
    if missing:
        raise LeanmlError(f"the weights of {where} lack {len(missing)} tensor{'s' if len(missing) > 1 else ''} the "
                          f"model needs ({_names(missing)}); the {kind} is incomplete: copy or save the "
                          f"whole model again")
    if unexpected:
        import warnings

        warnings.warn(f"leanml: {where} holds {len(unexpected)} tensors the model does not use "
                      f"({_names(list(unexpected))}); they are ignored", stacklevel=3)
