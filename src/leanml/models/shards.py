"""Safetensors shards read and written tensor by tensor, for models larger than host memory.

- :class:`ShardIndex`: the tensors of a model directory (``model.safetensors`` or a sharded
  ``model.safetensors.index.json``), read from the headers alone; :meth:`ShardIndex.read` loads named
  tensors through ``safetensors.safe_open`` (memory-mapped: only the bytes of those tensors are read).
  A missing or truncated shard is reported with the first tensor it loses.
- :class:`ShardWriter`: writes one shard file per call, atomically (temporary file + rename), and at
  the end the ``model.safetensors.index.json`` that ``from_pretrained`` reads. Shards already written
  survive an interruption, so a resumed run keeps them.
- :func:`build_skeleton`: the model built from its config on the meta device (no weight memory; its buffers,
  such as rotary tables, real); :func:`assign` / :func:`to_meta` put real tensors into it and take them out again.
- :class:`LayerStore`: what the pruning engine calls to materialize a decoder layer before its turn
  and to write and free it afterwards (implemented by :class:`leanml.prune.stream.ShardStore`).
- :func:`gguf_to_safetensors`: a ``.gguf`` file converted tensor by tensor into safetensors shards.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from leanml.errors import LeanmlError
from leanml.finite import check_finite_tensors, check_finite_weights
from leanml.models.check import check_gguf, refuse_incomplete, safetensors_header
from leanml.outputs import atomic_file, write_json

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
#: bytes per element of the safetensors dtype names
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
               "F8_E4M3": 1, "F8_E5M2": 1}


class LayerStore(Protocol):
    """Where a streamed run's weights live. The engine calls, in its layer walk:
    ``load_outer``/``release_outer`` around the input capture (embeddings, final norm, head),
    ``load(idx, layer)`` before layer ``idx``'s work, ``release(idx, layer)`` once the layer is
    finished and checkpointed, and ``spill(idx, pruned, dense)`` on the activation streams entering
    the next layer (which may return disk-backed stand-ins)."""

    def load_outer(self, model: nn.Module) -> None: ...

    def release_outer(self, model: nn.Module) -> None: ...

    def load(self, idx: int, layer: nn.Module) -> None: ...

    def release(self, idx: int, layer: nn.Module) -> None: ...

    def spill(self, idx: int, pruned: Any, dense: Any) -> tuple[Any, Any]: ...


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far: ``VmHWM`` of ``/proc/self/status`` where Linux has
    it (the peak of this program image), else ``ru_maxrss``, which on Linux also counts the parent's
    resident set at the moment it forked this process (measured: a bench worker started by a parent
    holding 1.3 GB reported 1.3 GB before doing anything)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def io_bytes() -> dict[str, int]:
    """Bytes this process read from and wrote to storage (``/proc/self/io``; zeros where absent)."""
    out = {"read_bytes": 0, "write_bytes": 0}
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in out:
                out[key] = int(value)
    except OSError:
        pass
    return out


def read_header(path: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """The tensor entries of a safetensors file's header (``dtype``, ``shape``, ``data_offsets``);
    raises :class:`LeanmlError` naming the first tensor whose bytes the file does not hold."""
    path = Path(path)
    size = path.stat().st_size
    n, header = safetensors_header(path, fix="copy the shard again")
    header.pop("__metadata__", None)
    for name, entry in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        if 8 + n + entry["data_offsets"][1] > size:
            raise LeanmlError(f"{path.name} is truncated: tensor {name} is cut off "
                              f"({size:,} of {8 + n + entry['data_offsets'][1]:,} bytes); copy the shard again")
    return header


def _torch_dtype(name: str) -> torch.dtype:
    return {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
            "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
            "BOOL": torch.bool}[name]


class ShardIndex:
    """The safetensors tensors of a model directory, by name, without loading any of them."""

    def __init__(self, model_dir: str | os.PathLike) -> None:
        self.dir = Path(model_dir)
        index = self.dir / INDEX_NAME
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        elif (self.dir / SINGLE_NAME).is_file():
            weight_map = {}
        else:
            pickles = sorted(p.name for p in self.dir.glob("*.bin")) + sorted(p.name for p in self.dir.glob("*.pt"))
            if pickles:
                raise LeanmlError(
                    f"{self.dir} holds only pickled weights ({pickles[0]}), which cannot be read tensor by tensor; "
                    "convert them once with save_pretrained(safe_serialization=True), or run without stream",
                    fields=("stream",))
            raise LeanmlError(f"{self.dir} has no safetensors weights ({SINGLE_NAME} or {INDEX_NAME})")
        files = sorted(set(weight_map.values())) or [SINGLE_NAME]
        by_file: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            by_file.setdefault(file, []).append(name)
        #: tensor name -> (file name, header entry); :meth:`adopt_names` renames the keys
        self.entries: dict[str, tuple[str, dict[str, Any]]] = {}
        #: model name -> name in the file, for renamed tensors
        self.stored: dict[str, str] = {}
        for file in files:
            path = self.dir / file
            if not path.is_file():
                first = sorted(by_file.get(file, ["?"]))[0]
                raise LeanmlError(f"shard {file} is missing from {self.dir} (it holds {first} and "
                                  f"{len(by_file.get(file, [])) - 1} more tensors); copy it there")
            for name, entry in read_header(path).items():
                self.entries[name] = (file, entry)
        lost = sorted(set(weight_map) - set(self.entries))
        if lost:
            raise LeanmlError(f"tensor {lost[0]} is listed in {INDEX_NAME} but absent from {weight_map[lost[0]]}; "
                              "copy that shard again")

    def adopt_names(self, model: nn.Module) -> None:
        """Rename the stored tensors to ``model``'s parameter names the way ``from_pretrained`` does
        (``transformers``' checkpoint renamings, e.g. GPT-NeoX's ``embed_out`` to ``lm_head``); a
        checkpoint that needs more than renaming (tensors merged or split on load) is refused."""
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming

        transforms = get_model_conversion_mapping(model)
        renamed: dict[str, tuple[str, dict[str, Any]]] = {}
        self.stored = {}
        for stored, entry in self.entries.items():
            name = stored
            for t in transforms:
                new, matched = t.rename_source_key(name)
                if matched is not None and not isinstance(t, WeightRenaming):
                    raise LeanmlError(f"tensor {stored} is converted on load by transformers ({type(t).__name__}), "
                                      "which streaming does not do; run without stream", fields=("stream",))
                name = new
            renamed[name] = entry
            if name != stored:
                self.stored[name] = stored
        self.entries = renamed
        refuse_incomplete(self.dir, *self.compare(model))

    def compare(self, model: nn.Module) -> tuple[list[str], list[tuple[str, tuple, tuple]], list[str]]:
        """What the shards lack against ``model`` (a skeleton will do), as ``from_pretrained`` reports it:
        ``(missing, mismatched, unexpected)``. Missing: parameters none of whose names (tied ones share
        one tensor: tied embeddings are the documented exception) is stored, except those the model
        declares optional; mismatched: ``(name, stored shape, model shape)``; unexpected: stored names the
        model has no tensor of."""
        import re

        groups: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            groups.setdefault(id(p), []).append(name)
        optional = [re.compile(r) for r in getattr(model, "_keys_to_ignore_on_load_missing", None) or []]
        missing = [names[0] for names in groups.values()
                   if not any(n in self.entries or any(r.search(n) for r in optional) for n in names)]
        own = {**dict(model.named_buffers()), **dict(model.named_parameters(remove_duplicate=False))}
        mismatched = [(n, self.shape(n), tuple(t.shape)) for n, t in own.items()
                      if n in self.entries and self.shape(n) != tuple(t.shape)]
        ignored = [re.compile(r) for r in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
        unexpected = [n for n in self.entries if n not in own and not any(r.search(n) for r in ignored)]
        return missing, mismatched, unexpected

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def names(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name][1]["shape"])

    def nbytes(self, name: str, dtype: torch.dtype | None = None) -> int:
        """Bytes of tensor ``name`` as stored, or once cast to ``dtype`` (floating tensors only)."""
        _, entry = self.entries[name]
        numel = 1
        for d in entry["shape"]:
            numel *= d
        size = DTYPE_BYTES[entry["dtype"]]
        if dtype is not None and entry["dtype"].startswith(("F", "BF")):
            size = torch.empty((), dtype=dtype).element_size()
        return numel * size

    def read(self, names: Iterable[str], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The named tensors (floating ones cast to ``dtype``), each a fresh CPU tensor that owns its
        memory; one memory-mapped open per shard, so only these tensors' bytes are read."""
        from safetensors import SafetensorError, safe_open

        names = list(names)
        missing = [n for n in names if n not in self.entries]
        if missing:
            raise LeanmlError(f"tensor {missing[0]} is in no shard of {self.dir}; the model directory is incomplete")
        by_file: dict[str, list[str]] = {}
        for n in names:
            by_file.setdefault(self.entries[n][0], []).append(n)
        out: dict[str, torch.Tensor] = {}
        for file, group in by_file.items():
            path = self.dir / file
            try:
                with safe_open(str(path), framework="pt") as f:
                    for n in group:
                        t = f.get_tensor(self.stored.get(n, n))
                        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
                            out[n] = t.to(dtype)
                        else:
                            out[n] = t.clone()  # never a view of the mapped file
                        del t
            except (SafetensorError, OSError) as exc:
                if isinstance(exc, FileNotFoundError) or not path.is_file():
                    raise LeanmlError(f"shard {file} disappeared from {self.dir} while reading {group[0]}; "
                                      "copy it back and rerun with resume", fields=("resume",)) from exc
                read_header(path)  # names the tensor a truncated file lost
                raise LeanmlError(f"cannot read {group[0]} from {file}: {str(exc).splitlines()[0]}") from exc
        check_finite_weights(out.items(), self.dir)
        return out


def _write_error(exc: OSError, what: str, where: Path) -> LeanmlError:
    if exc.errno == errno.ENOSPC:
        return LeanmlError(f"disk full while writing {what} in {where}; free space there and rerun with resume "
                           "(what was written before is kept)", fields=("resume",))
    return LeanmlError(f"cannot write {what} in {where}: {exc.strerror or exc}")


class ShardWriter:
    """Output shards written one file at a time into ``out_dir``, atomically; :meth:`finish` writes the
    index over every shard present (also those of an earlier, interrupted run)."""

    def __init__(self, out_dir: str | os.PathLike) -> None:
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)

    def path(self, shard: str) -> Path:
        return self.dir / f"{shard}.safetensors"

    def has(self, shard: str) -> bool:
        return self.path(shard).is_file()

    def write(self, shard: str, tensors: dict[str, torch.Tensor]) -> Path:
        """Write ``tensors`` (contiguous CPU copies are made where needed) as shard ``shard``."""
        from safetensors.torch import save_file

        path = self.path(shard)
        check_finite_tensors(tensors.items(), f"shard {path.name}")
        data = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
        try:
            with atomic_file(path) as tmp:
                save_file(data, str(tmp), metadata={"format": "pt"})
        except OSError as exc:
            raise _write_error(exc, path.name, self.dir) from exc
        return path

    def remove(self, shard: str) -> None:
        self.path(shard).unlink(missing_ok=True)

    def finish(self, shards: Iterable[str] | None = None) -> dict[str, Any]:
        """Write ``model.safetensors.index.json`` for ``shards`` (default: every shard in the folder)."""
        paths = [self.path(s) for s in shards] if shards is not None else sorted(self.dir.glob("*.safetensors"))
        weight_map: dict[str, str] = {}
        total = 0
        for path in paths:
            for name, entry in read_header(path).items():
                weight_map[name] = path.name
                total += entry["data_offsets"][1] - entry["data_offsets"][0]
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        write_json(self.dir / INDEX_NAME, index)
        return index


def build_skeleton(model_dir: str | os.PathLike, dtype: torch.dtype) -> nn.Module:
    """The causal LM of ``model_dir``'s config with every parameter on the meta device (buffers such as
    rotary tables are real), tied weights tied, in eval mode, ``use_cache`` off."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    config.use_cache = False
    return build_skeleton_from_config(config, dtype)


def _owner(module: nn.Module, key: str) -> tuple[nn.Module, str]:
    path, _, leaf = key.rpartition(".")
    return (module.get_submodule(path) if path else module), leaf


def assign(module: nn.Module, key: str, tensor: torch.Tensor) -> None:
    """Put ``tensor`` in place of parameter or buffer ``key`` of ``module`` (a meta one included)."""
    owner, leaf = _owner(module, key)
    if leaf in owner._parameters:  # noqa: SLF001 - a meta parameter cannot take real data through .data
        owner._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)  # noqa: SLF001
    elif leaf in owner._buffers:  # noqa: SLF001
        owner._buffers[leaf] = tensor  # noqa: SLF001
    else:
        raise LeanmlError(f"the model has no parameter or buffer {key}; the weights belong to another architecture")


def to_meta(module: nn.Module) -> None:
    """Free every parameter and persistent buffer of ``module`` (back to meta tensors of their shape)."""
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):  # noqa: SLF001
            if p is not None and p.device.type != "meta":
                sub._parameters[name] = nn.Parameter(p.data.to("meta"), requires_grad=False)  # noqa: SLF001
        for name, b in list(sub._buffers.items()):  # noqa: SLF001
            if b is not None and name not in sub._non_persistent_buffers_set and b.device.type != "meta":  # noqa: SLF001
                sub._buffers[name] = b.to("meta")  # noqa: SLF001


def copy_side_files(src: str | os.PathLike, dst: str | os.PathLike) -> list[str]:
    """Copy a model directory's files other than weights and index (tokenizer, generation config)."""
    copied = []
    for p in sorted(Path(src).iterdir()):
        if p.is_file() and p.suffix not in (".safetensors", ".bin", ".pt", ".gguf") and p.name not in (
                INDEX_NAME, "config.json"):
            shutil.copy2(p, Path(dst) / p.name)
            copied.append(p.name)
    return copied


# --------------------------------------------------------------------------------------------------
# GGUF


def _gguf_tensors(path: Path) -> Iterator[tuple[str, Any]]:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))  # memory-maps the file
    for t in reader.tensors:
        yield t.name, t


def gguf_to_safetensors(path: str | os.PathLike, out_dir: str | os.PathLike, shard_bytes: int = 2**30,
                        progress: bool = True) -> Path:
    """Convert a ``.gguf`` file into a float32 safetensors model directory, one shard at a time.

    The file is memory-mapped; each tensor is dequantized on its own, renamed and un-permuted the way
    ``transformers`` does it, and added to the current shard, which is written once it holds
    ``shard_bytes``. Config and tokenizer come from ``transformers``' GGUF reader (metadata only).
    Returns ``out_dir``."""
    from leanml.models import GGUF_ERRORS, gguf_error

    path = Path(path)
    check_gguf(path)  # magic, header and tensor extents, before anything is read or written
    try:
        return _gguf_to_safetensors(path, Path(out_dir), shard_bytes, progress)
    except GGUF_ERRORS as exc:
        raise gguf_error(path, exc) from exc


def _gguf_to_safetensors(path: Path, out: Path, shard_bytes: int, progress: bool) -> Path:
    from gguf.quants import dequantize
    from tqdm.auto import tqdm
    from transformers import AutoConfig, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    skeleton = build_skeleton_from_config(config, torch.float32)
    arch = config.model_type
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    name_map = get_gguf_hf_weights_map(skeleton, processor)
    wanted = {n: tuple(p.shape) for n, p in skeleton.named_parameters()}  # tied ones once
    written: set[str] = set()
    writer = ShardWriter(out)
    shard: dict[str, torch.Tensor] = {}
    size = 0
    count = 0
    parsed: dict[str, Any] = {"config": config.to_dict(), "tensors": {}}
    for gname, t in tqdm(list(_gguf_tensors(path)), desc="gguf -> safetensors", unit="tensor", disable=not progress):
        weights = dequantize(t.data, t.tensor_type).copy()
        result = processor.process(weights=weights, name=gname, tensor_key_mapping=name_map, parsed_parameters=parsed)
        name = result.name
        if name not in name_map:
            continue
        hf_name = name_map[name]
        if hf_name not in wanted:
            continue
        tensor = torch.from_numpy(result.weights.copy()).float()
        if tuple(tensor.shape) != wanted[hf_name]:  # refused at once: nothing more is converted
            refuse_incomplete(path, [], [(hf_name, tuple(tensor.shape), wanted[hf_name])])
        written.add(hf_name)
        shard[hf_name] = tensor
        size += tensor.numel() * 4
        if size >= shard_bytes:
            writer.write(f"model-{count:05d}", shard)
            count += 1
            shard, size = {}, 0
    if shard:
        writer.write(f"model-{count:05d}", shard)
    refuse_incomplete(path, [n for n in wanted if n not in written], [])
    writer.finish()
    config.save_pretrained(out)
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(out)
    return out


def build_skeleton_from_config(config: Any, dtype: torch.dtype) -> nn.Module:
    """:func:`build_skeleton` from a config object: built under ``torch.device("meta")``, then its buffers made
    real (:func:`materialize_buffers`)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    materialize_buffers(model)
    model.tie_weights()
    return model.eval()


def _unset(like: torch.Tensor) -> torch.Tensor:
    """A CPU tensor shaped like ``like`` holding a value no initialiser writes (NaN, or the integer minimum)."""
    if like.dtype.is_floating_point:
        return torch.full_like(like, float("nan"), device="cpu")
    if like.dtype == torch.bool:
        return torch.zeros_like(like, device="cpu")
    return torch.full_like(like, torch.iinfo(like.dtype).min, device="cpu")


def _still_unset(buf: torch.Tensor) -> bool:
    if buf.dtype == torch.bool or buf.numel() == 0:
        return False  # no value tells a bool buffer apart; an empty one has nothing to set
    if buf.dtype.is_floating_point:
        return bool(buf.isnan().any())
    return bool((buf == torch.iinfo(buf.dtype).min).all())


@torch.no_grad()
def materialize_buffers(model: nn.Module) -> list[str]:
    """Give every meta buffer of ``model`` (built on the meta device) its real value, as transformers does
    after loading: a CPU tensor filled by the model's own ``_init_weights`` of the module that holds it (rotary
    ``inv_freq`` tables, Gemma's ``embed_scale``). Parameters stay on meta. Returns the buffers' names; a buffer
    the model's initialiser leaves unset is refused in one line."""
    owners: dict[int, nn.Module] = {}
    names = []
    for key, buf in list(model.named_buffers()):
        if buf.device.type == "meta":
            owner, leaf = _owner(model, key)
            owner._buffers[leaf] = _unset(buf)  # noqa: SLF001
            owners[id(owner)] = owner
            names.append(key)
    for owner in owners.values():
        model._init_weights(owner)  # noqa: SLF001 - the initialiser transformers itself runs on these buffers
    for key in names:
        if _still_unset(model.get_buffer(key)):
            raise LeanmlError(f"{type(model).__name__}'s initialiser leaves buffer {key} unset on the meta device, "
                              "so it cannot be built layer by layer; load it whole (drop stream)", fields=("stream",))
    return names
