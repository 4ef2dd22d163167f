"""Streamed pruning: models bigger than host memory, one decoder layer in memory at a time.

:func:`stream_walk` (and :func:`prune_streamed`, the same from a pruner and a mask) builds the model from
its config on the meta device (no weights), and hands the engine's walk
(:class:`~leanml.prune.engine.LayerWalk`) a :class:`~leanml.prune.engine.shard_store.ShardStore`,
which

- loads the embeddings, final norm and head from the safetensors shards only around the input
  capture, and frees them after;
- loads each decoder layer's tensors from the (memory-mapped) shards when its turn comes, and once the
  layer is pruned and checkpointed writes it as one output shard (atomically) and frees it;
- when the activation streams between layers exceed what ``max_memory`` leaves them, writes them to
  files in the checkpoint folder and lets the engine read them back batch by batch
  (:class:`~leanml.prune.engine.shard_store.DiskStream`).

So host memory holds about one layer, its working statistics, the activation streams (or one batch of
them) and, during the capture only, the embeddings. The arithmetic is the engine's, on the same
tensors in the same order: masks and weights are bit-identical to the in-memory run (tested on every
family). Layers after the last pruned one are copied shard to shard. Structured methods (FASP) shrink
the MLPs in a second pass over the written layers: the new width is the largest number of live units
of any layer, so it is known only at the end, and so is the output config. A killed run resumes from
its checkpoint: the layers already written stay in the staging folder.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from leanml.config import ConfigError
from leanml.errors import LeanmlError
from leanml.models.layout import get_adapter
from leanml.models.shards import (
    ShardIndex,
    ShardWriter,
    assign,
    build_skeleton,
    copy_side_files,
    io_bytes,
    peak_rss_bytes,
    to_meta,
)
from leanml.prune.base import Pruner
from leanml.prune.engine import LayerWalk, WalkSettings
from leanml.prune.engine.checkpoint import layer_path
from leanml.prune.engine.shard_store import ShardStore, bound_allocator, memory_floor
from leanml.prune.engine.walk import check_calib_ids
from leanml.prune.masks import MaskSpec

MB = 2**20


def mb(n: int) -> str:
    return f"{n / MB:,.1f} MB"


def parse_memory(text: str | int | None) -> int | None:
    """``"1.2GB"``, ``"800MB"``, ``"512MiB"`` or a byte count to bytes (``None`` stays ``None``)."""
    if text is None or isinstance(text, int):
        return text
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9,
             "tb": 10**12, "k": 10**3, "m": 10**6, "g": 10**9, "b": 1}
    t = text.strip().lower().replace(" ", "")
    for unit in sorted(units, key=len, reverse=True):
        if t.endswith(unit):
            number, scale = t[: -len(unit)], units[unit]
            break
    else:
        number, scale = t, 1
    try:
        value = float(number)
    except ValueError:
        raise LeanmlError(f"max_memory {text!r} is not a size; write e.g. 1.2GB, 800MB or 512MiB",
                          fields=("max_memory",)) from None
    if value <= 0:
        raise LeanmlError(f"max_memory must be positive, got {text!r}", fields=("max_memory",))
    return int(value * scale)


# --------------------------------------------------------------------------------------------------
# the process's floor


def resident_bytes() -> int:
    """This process's resident set now (``/proc/self/statm``; the peak where Linux has no statm)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()


def process_floor(floor: dict[str, Any], calib_ids: torch.Tensor, model: nn.Module, dtype: torch.dtype,
                  ) -> dict[str, Any]:
    """The smallest cap on this process's peak resident memory a streamed run can keep to, from the
    model's own sizes and what the process holds already (libraries, tokenizer, calibration tokens):
    the larger of

    - the capture: the outer tensors (embeddings, tied or not, norm, head: ``outer_bytes``) are read
      from the memory-mapped shards (the mapped pages count as resident), copied, and the copy cast,
      so up to three times their bytes at once, then the first layer's inputs (``nsamples x seqlen x
      hidden``) beside them;
    - a layer's step (:func:`memory_floor`); the activation streams spill to disk beyond what the cap
      leaves them.

    The resident set is read now, after the libraries, the tokenizer and the calibration tokens loaded."""
    width = int(getattr(model.config, "hidden_size", 0) or 0)
    streams = calib_ids.shape[0] * calib_ids.shape[-1] * width * torch.empty((), dtype=dtype).element_size()
    now = resident_bytes()
    capture = 3 * floor["outer_bytes"] + streams
    step = floor["floor_bytes"]
    phase = (f"reading the embeddings and head ({mb(floor['outer_bytes'])}) for the input capture"
             if capture >= step else f"layer {floor['layer']}'s step")
    total = now + max(capture, step)
    return {**floor, "process_bytes": now, "streams_bytes": streams, "capture_bytes": capture, "step_bytes": step,
            "total_bytes": total, "phase": phase}


# --------------------------------------------------------------------------------------------------
# the driver


def _recover_layer(store: ShardStore, ckpt: Path | None, idx: int, layer: nn.Module) -> None:
    """A layer that was checkpointed but not yet written out (a kill in between): write it now."""
    path = layer_path(ckpt, idx) if ckpt is not None else None
    if path is None or not path.is_file():
        raise LeanmlError(f"layer {idx} is neither in the staging shards nor in the checkpoint; delete "
                          f"{ckpt} and start again")
    for key, value in torch.load(path, weights_only=True).items():
        assign(layer, key, value)
    store.release(idx, layer)


def _load_staged(writer: ShardWriter, name: str, layer: nn.Module, prefix: str) -> None:
    from safetensors.torch import load_file

    tensors = load_file(str(writer.path(name)))
    own = layer.state_dict()
    for key in own:
        value = tensors.get(prefix + key)
        if value is None:  # a bias a method added in another layer: zeros (exact)
            value = torch.zeros(own[key].shape, dtype=own[key].dtype)
        assign(layer, key, value)


def _finalize_structured(store: ShardStore, out: ShardWriter, n_layers: int, shrink: bool,
                         progress: bool) -> dict[str, Any]:
    """FASP's finalize, streamed: bias flags from the skeleton, then the MLP width from every written
    layer's live units (one pass), then each layer cut to that width and written (second pass)."""
    from leanml.models import surgery

    model, adapter, writer = store.model, store.adapter, store.writer
    params_before = surgery.count_parameters(model)
    flags = surgery.ensure_bias_format(model, adapter)  # meta zeros where a flag now needs a bias
    layers = adapter.layers()
    lives: list[torch.Tensor] = []
    group_of = {}
    for i in tqdm(range(n_layers), desc="finalize: live units", unit="layer", disable=not progress):
        _load_staged(writer, f"layer-{i:05d}", layers[i], store.prefixes[i])
        g = next((g for g in adapter.pairs(layers[i]) if g.name == "mlp_out"), None) if adapter.mlp_out else None
        if g is not None:
            lives.append(surgery.live_units(g))
            group_of[i] = g
        to_meta(layers[i])
    width = max((int(lv.numel()) for lv in lives), default=None)
    old = lives and next(iter(group_of.values())).units.n_units
    for i in tqdm(range(n_layers), desc="finalize: shrink", unit="layer", disable=not progress):
        layer = layers[i]
        _load_staged(writer, f"layer-{i:05d}", layer, store.prefixes[i])
        if shrink and width is not None and width != old and i in group_of:
            g = next(g for g in adapter.pairs(layer) if g.name == "mlp_out")
            surgery.cut_mlp(layer, g, _padded(lives[i], g.units.n_units, width))
        out.write(f"layer-{i:05d}", {store.prefixes[i] + k: v for k, v in layer.state_dict().items()})
        to_meta(layer)
    if shrink and width is not None and width != old:
        setattr(model.config, adapter.intermediate_size_key, width)
    return {"params_before": params_before, "params_after": surgery.count_parameters(model),
            "intermediate_size": width if shrink else old, "mlp_live_units": [int(lv.numel()) for lv in lives],
            "bias_flags_enabled": flags, "streamed": True,
            "attention": "pruned value/output dimensions kept as exact zeros (stock shapes)"}


def _padded(live: torch.Tensor, n_units: int, width: int) -> torch.Tensor:
    """``live`` units plus the first dead ones, so the layer has ``width`` units (dead padding is exact)."""
    if live.numel() >= width:
        return live
    dead = torch.ones(n_units, dtype=torch.bool)
    dead[live] = False
    return torch.cat([live, dead.nonzero().flatten()[: width - live.numel()]]).sort().values


def prune_streamed(
    model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    calib_ids: torch.Tensor,
    pruner: Pruner,
    spec: MaskSpec,
    *,
    dtype: torch.dtype = torch.float32,
    max_memory: int | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Prune the safetensors model in ``model_dir`` layer by layer from its shards into ``out_dir``:
    :func:`stream_walk` with the settings of ``pruner`` at ``spec`` and ``options`` (the fields of
    :class:`~leanml.prune.engine.WalkSettings`: ``device``, default cpu, ``checkpoint_dir``,
    ``progress``, ``sequential``, ``intra_layer``, ``layers``, ``batch_size``, ``fingerprint``, ...),
    checked here. OWL profiles are refused: they need a full pass over the dense model before pruning.
    """
    if options.get("sparsity_profile", "uniform") == "owl":
        raise ConfigError("sparsity_profile owl is not streamed (it needs a pass over the whole dense model first); "
                          "drop stream or use sparsity_profile uniform", None, ("sparsity_profile", "stream"))
    check_calib_ids(calib_ids)
    return stream_walk(model_dir, out_dir, calib_ids, WalkSettings.checked(pruner, spec, **options), dtype, max_memory)


def stream_walk(
    model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    calib_ids: torch.Tensor,
    settings: WalkSettings,
    dtype: torch.dtype = torch.float32,
    max_memory: int | None = None,
) -> dict[str, Any]:
    """Prune the safetensors model in ``model_dir`` layer by layer from its shards into ``out_dir``
    (shards, ``model.safetensors.index.json``, config, tokenizer files) with ``settings`` (its
    ``device``: default cpu); returns the engine's report with a ``"stream"`` section (peak RSS, bytes
    read and written, on CUDA the peak device memory).

    ``max_memory`` (bytes): host-memory cap; below :func:`memory_floor` it is refused with the smallest
    cap that works; above it, the activation streams spill to disk once they exceed what the cap leaves.
    ``settings.checkpoint_dir``: per-layer checkpoint and the staging shards; a rerun with the same
    settings resumes (without one, a staging folder beside ``out_dir``, removed at the end).
    """
    t0 = time.perf_counter()
    io0 = io_bytes()
    if max_memory is not None:  # only a cap is worth the allocator's cost (see bound_allocator)
        bound_allocator()
    device = torch.device(settings.device if settings.device is not None else "cpu")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    out = Path(out_dir)
    own_ckpt = settings.checkpoint_dir is None
    ckpt = out.with_name(out.name + ".stream-tmp") if own_ckpt else Path(settings.checkpoint_dir)
    store, floor = open_store(model_dir, calib_ids, dtype, max_memory, ckpt)
    engine_ckpt = None if own_ckpt else ckpt
    report, prepare_info = walk_shards(store, calib_ids, replace(
        settings, adapter=store.adapter, device=device, finalize=False, checkpoint_dir=engine_ckpt,
        layer_store=store))
    n_layers = len(store.adapter.layers())
    write_rest(store, engine_ckpt, max(settings.layers or range(n_layers)))
    out.mkdir(parents=True, exist_ok=True)
    report["finalize"] = assemble(store, out, settings.pruner, model_dir, settings.progress)
    shutil.rmtree(ckpt / "shards", ignore_errors=True)  # the staging shards
    shutil.rmtree(ckpt / "streams", ignore_errors=True)
    if own_ckpt:
        shutil.rmtree(ckpt, ignore_errors=True)
    io1 = io_bytes()
    report["stream"] = {
        "max_memory_bytes": max_memory,
        "allocator": "bounded" if max_memory is not None else "default",
        "floor": floor,
        "peak_rss_bytes": peak_rss_bytes(),
        "cap_held": None if max_memory is None else peak_rss_bytes() <= max_memory,
        "peak_device_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "read_bytes": io1["read_bytes"] - io0["read_bytes"],
        "write_bytes": io1["write_bytes"] - io0["write_bytes"],
        "weights_bytes": sum(store.index.nbytes(n, dtype) for n in store.index.names()),
        "spilled_layers": store.spilled_layers,
        "prepare": prepare_info,
        "load_seconds": store.load_seconds,
        "write_seconds": store.write_seconds,
        "seconds": time.perf_counter() - t0,
    }
    return report


#: headroom of the cap a refusal names: what the process holds is measured, and a rerun's libraries and
#: allocator land a few MiB apart, so the named cap must still pass a rerun's own check
CAP_HEADROOM_MIB = 8


def suggested_cap_mib(total_bytes: int) -> int:
    """The cap a refusal names, in MiB: the floor plus :data:`CAP_HEADROOM_MIB`, rounded up to a multiple of it."""
    step = CAP_HEADROOM_MIB
    need = -(-total_bytes // MB) + step
    return -(-need // step) * step


def open_store(model_dir: str | os.PathLike, calib_ids: torch.Tensor, dtype: torch.dtype, max_memory: int | None,
               ckpt: Path) -> tuple[ShardStore, dict[str, Any]]:
    """The model's skeleton over its shards (a :class:`ShardStore` staging into ``ckpt``) and the
    process's floor; a ``max_memory`` below the floor is refused with the smallest cap that works."""
    index = ShardIndex(model_dir)
    model = build_skeleton(model_dir, dtype)
    index.adopt_names(model)
    adapter = get_adapter(model)
    floor = process_floor(memory_floor(index, model, adapter, dtype), calib_ids, model, dtype)
    if max_memory is not None and max_memory < floor["total_bytes"]:
        raise ConfigError(
            f"max_memory {mb(max_memory)} is below this run's peak resident memory; the smallest cap that works "
            f"is {suggested_cap_mib(floor['total_bytes'])}MiB (this process holds {mb(floor['process_bytes'])} "
            f"already: libraries, tokenizer, calibration tokens; then {floor['phase']}); raise max_memory",
            None, ("max_memory",)
        )
    # what the activation streams may hold in memory beside one layer's step before they spill to disk
    budget = None if max_memory is None else max_memory - floor["process_bytes"] - floor["floor_bytes"]
    return ShardStore(index, model, adapter, ckpt / "shards", dtype, budget, ckpt / "streams"), floor


def walk_shards(store: ShardStore, calib_ids: torch.Tensor, settings: WalkSettings,
                ) -> tuple[dict[str, Any], dict[str, Any]]:
    """A structured method's dense pre-pass over the shards (the engine leaves a streamed run's to us;
    not when resuming: the engine restores the pruner's state then), then the walk; returns its report
    and the pre-pass's record."""
    pruner = settings.pruner
    ckpt = settings.checkpoint_dir
    resuming = ckpt is not None and (Path(ckpt) / "state.pt").exists()
    prepare_info: dict[str, Any] = {}
    if pruner.structured and not resuming:
        with store.dense_walk():
            prepare_info = pruner.prepare(store.model, store.adapter, calib_ids, batch_size=settings.batch_size,
                                          device=settings.device, spec=settings.spec,
                                          progress=settings.progress) or {}
    return LayerWalk(store.model, calib_ids, settings).run(), prepare_info


def write_rest(store: ShardStore, ckpt: Path | None, last: int) -> None:
    """The layers the walk did not write: those after ``last`` copied; a layer killed between its
    checkpoint and its write recovered from the checkpoint."""
    layers = store.adapter.layers()
    for i in range(len(layers)):
        if store.writer.has(f"layer-{i:05d}"):
            continue
        if i > last:
            store.load(i, layers[i])
            store.release(i, layers[i])
        else:
            _recover_layer(store, ckpt, i, layers[i])


def assemble(store: ShardStore, out: Path, pruner: Pruner, model_dir: str | os.PathLike,
             progress: bool) -> dict[str, Any]:
    """The output directory from the staged layers (FASP: shrunk to one MLP width first), the outer
    tensors, the config and the side files; returns the finalize record."""
    n_layers = len(store.adapter.layers())
    writer = ShardWriter(out)
    if pruner.structured:
        final = _finalize_structured(store, writer, n_layers, bool(getattr(pruner.options, "shrink", True)), progress)
    else:
        for i in range(n_layers):
            os.replace(store.writer.path(f"layer-{i:05d}"), writer.path(f"layer-{i:05d}"))
        final = {}
    writer.write("outer", store.index.read([s for _, s in store.outer_names()], store.dtype))
    writer.finish([f"layer-{i:05d}" for i in range(n_layers)] + ["outer"])
    config = store.model.config
    config.use_cache = True
    config.dtype = store.dtype
    config.save_pretrained(out)
    copy_side_files(model_dir, out)
    return final


def stream_source(spec: str, progress: bool = True) -> Path:
    """The safetensors directory a streamed run reads: a model directory as it is, the bundled model's
    cached copy, or a ``.gguf`` file converted once, tensor by tensor, into the cache."""
    from leanml.models import BUNDLED, bundled_dir
    from leanml.models.shards import gguf_to_safetensors
    from leanml.outputs import atomic_dir, cache_dir

    if spec in BUNDLED:
        return bundled_dir(spec)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        target = cache_dir() / "gguf" / f"{path.stem}-{path.stat().st_size}"
        if not (target / "config.json").exists():
            from leanml.faults import check_cache, gguf_dense_bytes
            from leanml.models.check import check_gguf

            check_gguf(path)  # a fake or cut file: one line, before the cache is touched
            check_cache(gguf_dense_bytes(path), f"the converted {path.name}")  # writable, with room for float32
            print(f"converting {path.name} to safetensors in {target} (once, tensor by tensor)")
            try:
                with atomic_dir(target, overwrite=True) as tmp:
                    gguf_to_safetensors(path, tmp, progress=progress)
            except BaseException:  # a refused file leaves nothing in the cache, not even an empty folder
                with contextlib.suppress(OSError):
                    target.parent.rmdir()
                raise
        return target
    if not path.is_dir():
        raise ConfigError(f"stream reads a local model directory, a .gguf file or smollm2-135m, not {spec!r}", None,
                          ("stream",))
    return path
