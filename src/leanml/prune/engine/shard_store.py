"""Layer storage of streamed runs: decoder layers read from safetensors shards one at a time and written
out when pruned, activation streams spilled to disk past a memory budget.

:class:`ShardStore` is the :class:`~leanml.models.shards.LayerStore` the engine's walk calls (load a
layer, release it after its checkpoint, spill the streams); :class:`DiskStream` is an activation
stream in a raw file, read back one batch at a time; :func:`memory_floor` the smallest host-memory
cap a streamed run can keep to.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from leanml.errors import LeanmlError
from leanml.models.layout import DecoderAdapter, layer_linears
from leanml.models.shards import ShardIndex, ShardWriter, assign, to_meta


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
                                  "raise max_memory, then rerun with resume (written layers are kept)",
                                  fields=("max_memory", "resume")) from exc
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
    """Keep freed layers from piling up in the C heap (glibc) under a memory cap: tensors of 1 MiB and more
    get their own mapping, returned to the system when freed. It costs time: every large temporary is a
    fresh mapping whose pages fault in again (measured, SmolLM2-135M shape, 8 x 512, 2 threads: wanda
    51.1 s and sparsegpt 57.3 s streamed against 10.8 s and 25.9 s with glibc's default adaptive
    threshold; in memory sparsegpt took 26.3 s). Without a cap glibc's default plus :func:`trim_heap` after
    each layer keeps the peak flat enough (557 -> 574 MB when the depth doubles from 15 to 30 layers); under
    a cap the default overshoots it (1.1B shape under 1.2 GB: 1.33 GB peak with a 32 MiB threshold, 1.06 GB
    with this one). The setting is process-wide and stays for the rest of the process."""
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
