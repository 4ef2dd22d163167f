"""Streamed pruning: models bigger than host memory, one decoder layer in memory at a time.

:func:`prune_streamed` builds the model from its config on the meta device (no weights), and hands the
engine (:func:`leanml.prune.engine.prune_model`) a :class:`ShardStore`, which

- loads the embeddings, final norm and head from the safetensors shards only around the input
  capture, and frees them after;
- loads each decoder layer's tensors from the (memory-mapped) shards when its turn comes, and once the
  layer is pruned and checkpointed writes it as one output shard (atomically) and frees it;
- when the activation streams between layers exceed what ``max_memory`` leaves them, writes them to
  files in the checkpoint folder and lets the engine read them back batch by batch (:class:`DiskStream`).

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
import errno
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from leanml.models.layout import DecoderAdapter, get_adapter, layer_linears
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
from leanml.prune.masks import MaskSpec
from leanml.utils import LeanmlError

MB = 2**20


def _mb(n: int) -> str:
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
        raise LeanmlError(f"--max-memory {text!r} is not a size; write e.g. 1.2GB, 800MB or 512MiB") from None
    if value <= 0:
        raise LeanmlError(f"--max-memory must be positive, got {text!r}")
    return int(value * scale)


# --------------------------------------------------------------------------------------------------
# activation streams on disk


class DiskStream:
    """An activation stream ``(n, seqlen, hidden)`` in a raw file, read back one row range at a time.

    Stands in for the engine's stream tensors: ``shape``, ``dtype``, ``device`` (the CPU) and slicing
    by rows (``x[s:e]`` reads those rows into a fresh tensor). Pickles as its path, so a checkpoint
    that holds it stays small and a resumed run reads the same file."""

    def __init__(self, path: str | os.PathLike, shape: Sequence[int], dtype: torch.dtype) -> None:
        self.path = Path(path)
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.device = torch.device("cpu")
        self.row_bytes = torch.empty((), dtype=dtype).element_size()
        for d in self.shape[1:]:
            self.row_bytes *= d

    @classmethod
    def write(cls, x: torch.Tensor, path: str | os.PathLike, rows: int = 1) -> DiskStream:
        """``x`` written to ``path`` ``rows`` rows at a time (atomically); a full disk is a one-line error
        and leaves no partial file."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        try:
            with open(tmp, "wb") as f:
                for s in range(0, x.shape[0], rows):
                    f.write(x[s : s + rows].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
            tmp.replace(path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            if exc.errno == errno.ENOSPC:
                raise LeanmlError(f"disk full while spilling activations to {path.parent}; free space there or "
                                  "raise --max-memory, then rerun with --resume (written layers are kept)") from exc
            raise LeanmlError(f"cannot spill activations to {path}: {exc.strerror or exc}") from exc
        return cls(path, x.shape, x.dtype)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key: slice) -> torch.Tensor:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("a DiskStream is read by row ranges only")
        s, e, _ = key.indices(self.shape[0])
        out = torch.empty((max(e - s, 0), *self.shape[1:]), dtype=self.dtype)
        with open(self.path, "rb") as f:
            f.seek(s * self.row_bytes)
            f.readinto(out.view(torch.uint8).numpy().reshape(-1))
        return out

    def is_pinned(self) -> bool:
        return False

    def cpu(self) -> torch.Tensor:
        return self[:]

    def to(self, device: str | torch.device, **_: Any) -> DiskStream | torch.Tensor:
        return self if torch.device(device).type == "cpu" else self[:].to(device)

    def __reduce__(self) -> tuple[Any, ...]:
        return DiskStream, (str(self.path), tuple(self.shape), self.dtype)


# --------------------------------------------------------------------------------------------------
# the store


def _libc() -> Any:
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None
    except OSError:
        return None


def bound_allocator() -> None:
    """Keep freed layers from piling up in the C heap (glibc): tensors of 1 MiB and more get their own
    mapping, returned to the system when freed. Without it glibc's adaptive threshold lets each freed
    layer's memory stay in the heap, and the resident set grew by about one layer per layer (measured:
    542 -> 738 MB over SmolLM2-135M's 30 layers, flat at about 560 MB with it)."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(-3, 2**20)  # M_MMAP_THRESHOLD (fixed: also turns the adaptive threshold off)


def trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc ``malloc_trim``)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def _prefixes(model: nn.Module, adapter: DecoderAdapter) -> list[str]:
    names = {id(m): n for n, m in model.named_modules()}
    return [names[id(layer)] + "." for layer in adapter.layers()]


def _outer_params(model: nn.Module, adapter: DecoderAdapter) -> list[list[str]]:
    """The parameters outside the decoder layers, each as the list of its names (tied ones share one)."""
    inside = {id(p) for p in adapter.layers().parameters()}
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in inside:
            by_id.setdefault(id(p), []).append(name)
    return list(by_id.values())


class ShardStore:
    """:class:`~leanml.models.shards.LayerStore` over a model directory's safetensors shards; writes
    each finished layer to ``staging`` as ``layer-NNNNN.safetensors``."""

    def __init__(self, index: ShardIndex, model: nn.Module, adapter: DecoderAdapter, staging: Path,
                 dtype: torch.dtype, stream_budget: int | None, spill_dir: Path) -> None:
        self.index = index
        self.model = model
        self.adapter = adapter
        self.writer = ShardWriter(staging)
        self.dtype = dtype
        self.prefixes = _prefixes(model, adapter)
        self.stream_budget = stream_budget
        self.spill_dir = spill_dir
        self.spilled: dict[int, list[Path]] = {}
        #: layers whose output streams went to disk
        self.spilled_layers: list[int] = []
        self.load_seconds = 0.0
        self.write_seconds = 0.0

    def outer_names(self) -> list[tuple[list[str], str]]:
        """Each outer parameter's names and the one the shards hold it under."""
        out = []
        for names in _outer_params(self.model, self.adapter):
            stored = [n for n in names if n in self.index]
            if not stored:
                raise LeanmlError(f"tensor {names[0]} is in no shard of {self.index.dir}; the model directory is "
                                  "incomplete")
            out.append((names, stored[0]))
        return out

    def load_outer(self, model: nn.Module) -> None:
        t = time.perf_counter()
        pairs = self.outer_names()
        tensors = self.index.read([s for _, s in pairs], self.dtype)
        for names, stored in pairs:
            p = nn.Parameter(tensors[stored], requires_grad=False)
            for n in names:  # tied names share the one parameter
                owner, leaf = model.get_submodule(n.rpartition(".")[0]), n.rpartition(".")[2]
                owner._parameters[leaf] = p  # noqa: SLF001
        self.load_seconds += time.perf_counter() - t

    def release_outer(self, model: nn.Module) -> None:
        for names, _ in self.outer_names():
            p = model.get_parameter(names[0])
            meta = nn.Parameter(p.data.to("meta"), requires_grad=False)
            for n in names:
                owner, leaf = model.get_submodule(n.rpartition(".")[0]), n.rpartition(".")[2]
                owner._parameters[leaf] = meta  # noqa: SLF001

    def layer_keys(self, idx: int) -> list[str]:
        return list(self.adapter.layers()[idx].state_dict())

    def load(self, idx: int, layer: nn.Module) -> None:
        t = time.perf_counter()
        prefix = self.prefixes[idx]
        tensors = self.index.read([prefix + k for k in layer.state_dict()], self.dtype)
        for key, value in tensors.items():
            assign(layer, key[len(prefix):], value)
        self.load_seconds += time.perf_counter() - t

    def release(self, idx: int, layer: nn.Module) -> None:
        t = time.perf_counter()
        prefix = self.prefixes[idx]
        self.writer.write(f"layer-{idx:05d}", {prefix + k: v for k, v in layer.state_dict().items()})
        to_meta(layer)
        trim_heap()
        # the checkpoint names the streams of layer idx - 1 or idx now: older spill files are unused
        for old in [i for i in self.spilled if i < idx - 1]:
            for path in self.spilled.pop(old):
                path.unlink(missing_ok=True)
        self.write_seconds += time.perf_counter() - t

    @contextlib.contextmanager
    def dense_walk(self) -> Iterator[None]:
        """For a method's own pass over the dense model before pruning (FASP's score allocation): while
        open, :func:`leanml.models.layerwise.layer_on` and ``outer_on`` load the weights they move from
        the shards and free them afterwards, so that pass also holds one layer at a time."""
        from leanml.models import layerwise

        real_layer_on, real_outer_on = layerwise.layer_on, layerwise.outer_on
        index_of = {id(layer): i for i, layer in enumerate(self.adapter.layers())}

        @contextlib.contextmanager
        def layer_on(layer: nn.Module, device: torch.device) -> Iterator[nn.Module]:
            self.load(index_of[id(layer)], layer)
            try:
                with real_layer_on(layer, device):
                    yield layer
            finally:
                to_meta(layer)

        @contextlib.contextmanager
        def outer_on(model: nn.Module, adapter: DecoderAdapter, device: torch.device | str) -> Iterator[None]:
            self.load_outer(model)
            try:
                with real_outer_on(model, adapter, device):
                    yield
            finally:
                self.release_outer(model)

        layerwise.layer_on, layerwise.outer_on = layer_on, outer_on
        try:
            yield
        finally:
            layerwise.layer_on, layerwise.outer_on = real_layer_on, real_outer_on

    def spill(self, idx: int, pruned: Any, dense: Any) -> tuple[Any, Any]:
        """The streams as they are while they fit ``stream_budget``, else written to disk."""
        tensors = [x for x in (pruned, dense) if isinstance(x, torch.Tensor)]
        size = sum(x.numel() * x.element_size() for x in tensors)
        if self.stream_budget is None or size <= self.stream_budget:
            return pruned, dense
        self.spill_dir.mkdir(parents=True, exist_ok=True)
        self.spilled_layers.append(idx)
        out = []
        for name, x in (("pruned", pruned), ("dense", dense)):
            if isinstance(x, torch.Tensor):
                x = DiskStream.write(x, self.spill_dir / f"stream-{idx:05d}-{name}.bin")
                self.spilled.setdefault(idx, []).append(x.path)
            out.append(x)
        return out[0], out[1]


# --------------------------------------------------------------------------------------------------
# memory floor


def memory_floor(index: ShardIndex, model: nn.Module, adapter: DecoderAdapter, dtype: torch.dtype) -> dict[str, Any]:
    """The smallest ``max_memory`` a streamed run can keep to: the outer tensors during the capture, or
    the largest layer twice (its weights and the snapshot written out) plus the float32 working set of
    its widest linear (the weight and two ``n x n`` statistics), whichever is larger."""
    prefixes = _prefixes(model, adapter)
    layers = []
    for i, layer in enumerate(adapter.layers()):
        size = sum(index.nbytes(prefixes[i] + k, dtype) for k in layer.state_dict())
        work = max(4 * (lin.out_features * lin.in_features + 2 * lin.in_features**2)
                   for lin in layer_linears(layer).values())
        layers.append((2 * size + work, i, size))
    need, worst, size = max(layers)
    outer = 0
    for names in _outer_params(model, adapter):
        stored = [n for n in names if n in index]
        outer += index.nbytes(stored[0], dtype) if stored else 0
    return {"floor_bytes": max(need, outer), "layer": worst, "layer_bytes": size, "outer_bytes": outer}


# --------------------------------------------------------------------------------------------------
# the driver


def _recover_layer(store: ShardStore, ckpt: Path | None, idx: int, layer: nn.Module) -> None:
    """A layer that was checkpointed but not yet written out (a kill in between): write it now."""
    path = ckpt / f"layer_{idx:03d}.pt" if ckpt is not None else None
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
    device: str | torch.device = "cpu",
    checkpoint_dir: str | os.PathLike | None = None,
    progress: bool = True,
    **engine_kwargs: Any,
) -> dict[str, Any]:
    """Prune the safetensors model in ``model_dir`` layer by layer from its shards into ``out_dir``
    (shards, ``model.safetensors.index.json``, config, tokenizer files); returns the engine's report
    with a ``"stream"`` section (peak RSS, bytes read and written, on CUDA the peak device memory).

    ``max_memory`` (bytes): host-memory cap; below :func:`memory_floor` it is refused with the smallest
    cap that works; above it, the activation streams spill to disk once they exceed what the cap leaves.
    ``checkpoint_dir``: per-layer checkpoint and the staging shards; a rerun with the same settings
    resumes. ``engine_kwargs`` go to :func:`leanml.prune.engine.prune_model` (``sequential``,
    ``intra_layer``, ``layers``, ``batch_size``, ``fingerprint``, ...). OWL profiles are refused: they
    need a full pass over the dense model before pruning.
    """
    from leanml.prune.engine import prune_model

    if engine_kwargs.get("sparsity_profile", "uniform") == "owl":
        raise LeanmlError("--sparsity-profile owl is not streamed (it needs a pass over the whole dense model first); "
                          "drop --stream or use --sparsity-profile uniform")
    t0 = time.perf_counter()
    io0 = io_bytes()
    bound_allocator()
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    index = ShardIndex(model_dir)
    model = build_skeleton(model_dir, dtype)
    index.adopt_names(model)
    adapter = get_adapter(model)
    floor = memory_floor(index, model, adapter, dtype)
    if max_memory is not None and max_memory < floor["floor_bytes"]:
        raise LeanmlError(
            f"--max-memory {_mb(max_memory)} is below what one step needs; the smallest cap that works is "
            f"{_mb(floor['floor_bytes'])} (layer {floor['layer']}: {_mb(floor['layer_bytes'])} of weights plus its "
            "working set); raise --max-memory"
        )
    out = Path(out_dir)
    own_ckpt = checkpoint_dir is None
    ckpt = Path(checkpoint_dir) if checkpoint_dir is not None else out.with_name(out.name + ".stream-tmp")
    staging = ckpt / "shards"
    budget = None if max_memory is None else max_memory - floor["floor_bytes"]
    store = ShardStore(index, model, adapter, staging, dtype, budget, ckpt / "streams")
    n_layers = len(adapter.layers())
    resuming = not own_ckpt and (ckpt / "state.pt").exists()  # the engine restores the pruner's state then
    prepare_info: dict[str, Any] = {}
    if pruner.structured and not resuming:  # the engine leaves a streamed run's dense pre-pass to us
        with store.dense_walk():
            prepare_info = pruner.prepare(model, adapter, calib_ids, batch_size=engine_kwargs.get("batch_size", 8),
                                          device=device, spec=pruner.resolve_spec(spec), progress=progress) or {}
    report = prune_model(model, calib_ids, pruner, spec, adapter=adapter, device=device, finalize=False,
                         checkpoint_dir=None if own_ckpt else ckpt, progress=progress, layer_store=store,
                         **engine_kwargs)
    last = max(engine_kwargs.get("layers") or range(n_layers))
    layers = adapter.layers()
    for i in range(n_layers):  # layers after the walk: copied; a kill between checkpoint and write: recovered
        if store.writer.has(f"layer-{i:05d}"):
            continue
        if i > last:
            store.load(i, layers[i])
            store.release(i, layers[i])
        else:
            _recover_layer(store, None if own_ckpt else ckpt, i, layers[i])
    out.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(out)
    if pruner.structured:
        report["finalize"] = _finalize_structured(store, writer, n_layers, bool(getattr(pruner, "shrink", True)),
                                                  progress)
    else:
        for i in range(n_layers):
            os.replace(store.writer.path(f"layer-{i:05d}"), writer.path(f"layer-{i:05d}"))
        report["finalize"] = {}
    writer.write("outer", store.index.read([s for _, s in store.outer_names()], dtype))
    writer.finish([f"layer-{i:05d}" for i in range(n_layers)] + ["outer"])
    config = model.config
    config.use_cache = True
    config.dtype = dtype
    config.save_pretrained(out)
    copy_side_files(model_dir, out)
    shutil.rmtree(staging, ignore_errors=True)
    shutil.rmtree(ckpt / "streams", ignore_errors=True)
    if own_ckpt:
        shutil.rmtree(ckpt, ignore_errors=True)
    io1 = io_bytes()
    report["stream"] = {
        "max_memory_bytes": max_memory,
        "floor": floor,
        "peak_rss_bytes": peak_rss_bytes(),
        "peak_device_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "read_bytes": io1["read_bytes"] - io0["read_bytes"],
        "write_bytes": io1["write_bytes"] - io0["write_bytes"],
        "weights_bytes": sum(index.nbytes(n, dtype) for n in index.names()),
        "spilled_layers": store.spilled_layers,
        "prepare": prepare_info,
        "load_seconds": store.load_seconds,
        "write_seconds": store.write_seconds,
        "seconds": time.perf_counter() - t0,
    }
    return report


# --------------------------------------------------------------------------------------------------
# the command line (``leanml prune --stream`` / ``--max-memory``)


def stream_source(spec: str, progress: bool = True) -> Path:
    """The safetensors directory a streamed run reads: a model directory as it is, the bundled model's
    cached copy, or a ``.gguf`` file converted once, tensor by tensor, into the cache."""
    from leanml.models import BUNDLED, bundled_dir
    from leanml.models.shards import gguf_to_safetensors
    from leanml.utils import atomic_dir, cache_dir

    if spec in BUNDLED:
        return bundled_dir(spec)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        target = cache_dir() / "gguf" / f"{path.stem}-{path.stat().st_size}"
        if not (target / "config.json").exists():
            print(f"converting {path.name} to safetensors in {target} (once, tensor by tensor)")
            with atomic_dir(target, overwrite=True) as tmp:
                gguf_to_safetensors(path, tmp, progress=progress)
        return target
    if not path.is_dir():
        raise LeanmlError(f"--stream reads a local model directory, a .gguf file or smollm2-135m, not {spec!r}")
    return path


def run_streamed(args: Any, pruner: Pruner, spec: MaskSpec, dtype: torch.dtype, device: torch.device, out: Path,
                 ckpt: Path) -> int:
    """``leanml prune --stream``: calibration from the tokenizer alone, the streamed prune into ``out``
    (atomically; the checkpoint ``ckpt`` keeps finished layers for ``--resume``), ``report.json``."""
    from transformers import AutoTokenizer

    from leanml.data.text import calibration_windows
    from leanml.utils import atomic_dir, machine_info, write_json

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise LeanmlError("--stream runs in one process; drop torchrun or --stream")
    if args.calib_samples:
        raise LeanmlError("--calib-samples samples from the whole model, which --stream never holds; drop one of them")
    if args.save_format != "safetensors":
        raise LeanmlError("--stream writes safetensors shards; drop --save-format compressed")
    max_memory = parse_memory(args.max_memory)
    t0 = time.perf_counter()
    src = stream_source(args.model)
    tokenizer = AutoTokenizer.from_pretrained(src)
    calib = calibration_windows(tokenizer, args.calib, args.nsamples, args.seqlen, args.seed)
    if not args.no_eval:
        print("--stream does not evaluate (the model is never whole in memory): run leanml eval on the output")
    with atomic_dir(out, overwrite=args.overwrite) as tmp:
        report = prune_streamed(
            src, tmp, calib, pruner, spec, dtype=dtype, max_memory=max_memory, device=device, checkpoint_dir=ckpt,
            sequential=args.mode == "sequential", intra_layer=args.intra_layer, batch_size=args.batch_size,
            sparsity_profile=args.sparsity_profile,
            fingerprint={"model": args.model, "calib": args.calib, "seed": args.seed, "seqlen": args.seqlen,
                         "dtype": args.dtype, "stream": True},
        )
        tokenizer.save_pretrained(tmp)
        report.update({"config": {k: v for k, v in vars(args).items() if k != "func"},
                       "calibration": {"corpus": args.calib, "nsamples": args.nsamples, "seqlen": args.seqlen,
                                       "seed": args.seed},
                       "timings": {"total_seconds": time.perf_counter() - t0}, "machine": machine_info()})
        write_json(tmp / "report.json", report)
    shutil.rmtree(ckpt, ignore_errors=True)
    st = report["stream"]
    cap = f" (cap {_mb(max_memory)})" if max_memory else ""
    print(f"{args.method} streamed: peak RSS {_mb(st['peak_rss_bytes'])}{cap} for {_mb(st['weights_bytes'])} of "
          f"weights, {st['seconds']:.1f} s -> {out}")
    return 0
