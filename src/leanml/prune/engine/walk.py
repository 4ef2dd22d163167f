"""The layer walk: a :class:`LayerWalk` takes one :class:`WalkSettings` (checked once, where it is made:
:meth:`WalkSettings.checked` for a pruner and a mask, :meth:`WalkSettings.from_config` for a
:class:`~leanml.prune.config.PruneConfig`, which checked itself), allocates, captures the inputs of the
first decoder layer, then prunes the layers one at a time (:func:`~leanml.prune.engine.layer.prune_layer`),
each visiting ``device`` for its work while the model stays where it is, with resume checkpoints
(:mod:`.checkpoint`) and the activation streams placed by :mod:`.placement`. :func:`prune_model` is the
walk as one call."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from leanml.config import ConfigError
from leanml.errors import LeanmlError
from leanml.models.layerwise import capture_layer_inputs, layer_on, to_device
from leanml.models.layout import DecoderAdapter, Group, get_adapter, layer_linears
from leanml.models.shards import LayerStore
from leanml.outputs import fingerprint as settings_fingerprint  # the walk has a fingerprint parameter
from leanml.progress import EtaBar
from leanml.prune.base import Pruner
from leanml.prune.engine.allocation import check_profile, layer_sparsities, linear_specs
from leanml.prune.engine.capture import forward_stream
from leanml.prune.engine.checkpoint import (
    CHECKPOINT_VERSION,
    Checkpointer,
    restore_layers,
    resume_state,
    weights_fingerprint,
    windows_fingerprint,
)
from leanml.prune.engine.finished import nbytes
from leanml.prune.engine.layer import prune_layer
from leanml.prune.engine.placement import LayerFeed, Place, Streams, stream_home, sync_device
from leanml.prune.masks import MaskSpec

#: out of device memory (``torch.OutOfMemoryError`` where torch has it)
OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


def check_spec(pruner: Pruner | type[Pruner], spec: MaskSpec) -> None:
    """Settings no layer can take: a pattern for a structured method or one the method refuses (reads
    only class attributes, so a pruner class does too)."""
    if pruner.structured and spec.pattern is not None:
        raise ConfigError(f"{pruner.name} removes whole units and takes no N:M mask: drop pattern", None, ("pattern",))
    if spec.pattern is not None and not pruner.supports_pattern:
        raise ConfigError(f"{pruner.name} does not support N:M masks: drop pattern", None, ("pattern",))


def check_layers(adapter: DecoderAdapter, todo: Sequence[int], pruner: Pruner, spec: MaskSpec) -> None:
    """Fail before any calibration pass: patterns the linears cannot take, pairs a method cannot cut."""
    for idx in sorted(todo):
        layer = adapter.layers()[idx]
        if pruner.structured:
            pruner.check_layer(adapter.pairs(layer), spec)
            continue
        linears = layer_linears(layer)
        if spec.pattern is not None:
            n, m = spec.pattern
            bad = [f"{name} ({lin.in_features} inputs)" for name, lin in linears.items() if lin.in_features % m]
            if bad:
                raise LeanmlError(
                    f"the {n}:{m} pattern needs input widths divisible by {m}; layer {idx} has {', '.join(bad[:3])}"
                )
        pruner.check_layer([Group(name, {name: lin}) for name, lin in linears.items()], spec)


def check_calib_ids(calib_ids: torch.Tensor) -> None:
    """Refuse calibration ids that are not ``(nsamples, seqlen)``."""
    if calib_ids.dim() != 2:
        raise LeanmlError(f"calibration ids must be (nsamples, seqlen), got shape {tuple(calib_ids.shape)}")


@dataclass(frozen=True)
class WalkSettings:
    """Everything a :class:`LayerWalk` needs besides the model and the calibration ids.

    ``pruner``: the method. ``spec``: the mask, its scope resolved (:meth:`checked` resolves an open
    one with ``pruner.resolve_spec``, the same choice as the CLI's).
    ``sequential``: the pruned outputs feed the next layer (else every layer sees dense inputs).
    ``intra_layer``: intra-layer correction; ``None`` uses the method's default
    (``pruner.default_intra_layer``).
    ``layers``: prune only these indices (the layers before them are forwarded unchanged; the walk ends
    after the last one). ``batch_size``: windows per forward pass.
    ``sparsity_profile``: ``"uniform"`` (every layer at ``spec.sparsity``), ``"owl"`` (outlier-weighted
    layer sparsities, :mod:`leanml.prune.engine.allocation`, options in ``owl``: ``m``, ``lam``) or one
    sparsity per decoder layer; unstructured methods only, without an N:M pattern. For unstructured
    masks the total over all pruned linears is exact: ``round(sum_l s_l * numel_l)`` weights (see
    :func:`linear_specs`).
    ``dense_cache_bytes``: with intra-layer correction and a dense target, the dense inputs of a layer's
    groups are kept beside the streams when they fit in this many bytes (one dense pass instead of one
    partial pass per group); larger layers fall back to the partial passes.
    ``stream_device``: where the activation streams live between layers (:func:`stream_home`):
    ``"auto"`` keeps them on a GPU while its free memory allows, else in pinned host memory.
    ``device``: where each layer does its work (default: where the model's first parameter is); the
    model's parameters stay where they are.
    ``checkpoint_dir``: save each finished layer and the activation streams there and resume from them
    when present (the checkpoint must match ``fingerprint``, the caller's settings besides the walk's).
    ``checkpoint_interval``: with ``checkpoint_dir``, every finished layer is written at once and the
    activation streams at most every this many seconds (0: after every layer); all writes run on a
    background thread (:class:`Checkpointer`).
    ``progress``: a progress bar. ``finalize``: run the method's ``finalize`` after the walk.
    ``adapter``: the model's layout (default: :func:`get_adapter`).
    ``layer_store``: streamed runs (:mod:`leanml.prune.stream`): the model is a meta-device skeleton and
    the store materializes the outer modules around the input capture and each layer for its turn, then
    writes and frees it; ``None``: the weights are in the model.
    """

    pruner: Pruner
    spec: MaskSpec
    sequential: bool = True
    intra_layer: bool | None = None
    layers: Sequence[int] | None = None
    batch_size: int = 8
    sparsity_profile: str | Sequence[float] = "uniform"
    owl: dict[str, float] | None = None
    dense_cache_bytes: int = 2**31
    stream_device: str = "auto"
    device: str | torch.device | None = None
    checkpoint_dir: str | os.PathLike | None = None
    checkpoint_interval: float = 0.0
    fingerprint: dict[str, Any] | None = None
    progress: bool = True
    finalize: bool = True
    adapter: DecoderAdapter | None = None
    layer_store: LayerStore | None = None

    @classmethod
    def checked(cls, pruner: Pruner, spec: MaskSpec, **options: Any) -> WalkSettings:
        """The settings of ``pruner`` at ``spec`` with the walk's ``options`` (this class's fields),
        checked here, once: the mask's open scope resolved to the method's, a pattern the method cannot
        take and a profile that does not apply refused."""
        settings = cls(pruner, pruner.resolve_spec(spec), **options)
        check_spec(pruner, settings.spec)
        check_profile(settings.sparsity_profile, settings.spec, pruner)
        return settings

    @classmethod
    def from_config(cls, config: Any, **options: Any) -> WalkSettings:
        """The settings of a :class:`~leanml.prune.config.PruneConfig` (which checked its mask and
        profile when it was made, so nothing is checked again) with the run's ``options`` (``adapter``,
        ``device``, ``checkpoint_dir``, ``fingerprint``, ``progress``, ...)."""
        return cls(config.pruner(), config.spec, **{**config.engine_kwargs(), **options})


class LayerWalk:
    """One walk over a model's decoder layers with one :class:`WalkSettings`; :meth:`run` prunes the
    model in place and returns the report (per-layer and per-linear stats).

    Steps: :meth:`allocate` (every layer's sparsity, exact per-linear counts), :meth:`start` (resume
    from the checkpoint, or the structured methods' pre-pass and the capture of the first layer's
    inputs), then per layer :meth:`prune_or_forward`, :meth:`advance` (the next layer's streams) and
    :meth:`checkpoint`, and :meth:`finish` (the method's finalize and the report).

    Timing: every layer record carries ``solver_seconds`` (the method's own work: its statistics
    passes, its solves and the pass of the pruned layer that feeds the next one, read after waiting
    for the device) and ``engine_seconds`` (the rest of the layer's wall time: moving the layer and its
    inputs, copies, reports, checkpoints); the report sums both.
    """

    def __init__(self, model: nn.Module, calib_ids: torch.Tensor, settings: WalkSettings) -> None:
        s = self.settings = settings
        self.model, self.calib_ids, self.pruner, self.spec = model, calib_ids, s.pruner, s.spec
        self.intra_layer = s.pruner.resolve_intra_layer(s.intra_layer)
        self.adapter = s.adapter or get_adapter(model)
        self.all_layers = self.adapter.layers()
        self.todo = self.layers_to_prune()
        check_layers(self.adapter, sorted(self.todo), self.pruner, self.spec)
        self.device = torch.device(s.device) if s.device is not None else next(model.parameters()).device
        self.ckpt = Path(s.checkpoint_dir) if s.checkpoint_dir is not None else None
        self.store = s.layer_store
        self.keep_dense = s.sequential and self.pruner.needs_dense and self.pruner.needs_stats
        self.layer_reports: list[dict[str, Any]] = []
        self.start_layer = 0
        self.capture_seconds = 0.0
        self.seconds_before = 0.0  # wall seconds the interrupted runs spent, when resuming
        self.prepare_seconds = 0.0  # a method's own pass over the whole model before the walk (FASP's allocation)

    def layers_to_prune(self) -> set[int]:
        n_layers = len(self.all_layers)
        layers = self.settings.layers
        todo = set(range(n_layers)) if layers is None else set(layers)
        if not todo:
            raise LeanmlError("no layers to prune: pass at least one layer index")
        if not todo <= set(range(n_layers)):
            raise LeanmlError(f"layer indices must be in [0, {n_layers}), got {sorted(todo)}")
        return todo

    @torch.no_grad()
    def run(self) -> dict[str, Any]:
        """Prune the model in place, layer by layer; return the report."""
        self.t_start = time.perf_counter()
        self.allocate()
        self.meta = self.checkpoint_settings()
        self.start()
        self.walk()
        return self.finish()

    def allocate(self) -> None:
        """Every layer's sparsity under the profile and, for unstructured masks, every linear's count."""
        s = self.settings
        n_layers = len(self.all_layers)
        self.layer_sparsity, self.profile_info = layer_sparsities(
            s.sparsity_profile, self.model, self.calib_ids, self.spec.sparsity, adapter=self.adapter,
            batch_size=s.batch_size, device=self.device, progress=s.progress, **(s.owl or {}),
        )
        self.per_linear = None
        if self.spec.pattern is None and not self.pruner.structured:
            # over all layers, so a run on a subset of layers (a rank of a layer-parallel run) gives every
            # linear the count it gets in a run over the whole model
            self.per_linear = linear_specs(self.adapter, range(n_layers), self.spec, self.layer_sparsity)
        self.requested = {i: (self.spec.sparsity if self.layer_sparsity is None else self.layer_sparsity[i])
                          for i in self.todo}

    def checkpoint_settings(self) -> dict[str, Any]:
        """What a checkpoint must match to be resumed."""
        s, spec = self.settings, self.spec
        return {
            "version": CHECKPOINT_VERSION,
            "method": self.pruner.name,
            "method_config": self.pruner.config(),
            "sparsity": spec.sparsity,
            "pattern": spec.describe() if spec.pattern is not None else None,
            "scope": spec.scope,
            "profile": self.layer_sparsity,
            "sequential": s.sequential,
            "intra_layer": self.intra_layer,
            "batch_size": s.batch_size,
            "layers": sorted(self.todo),
            **(s.fingerprint or {}),
            # after the caller's settings, so a caller's key of the same name (a corpus name) never hides them
            "calib_windows": windows_fingerprint(self.calib_ids),
            "weights": weights_fingerprint(self.model, self.store.index.dir if self.store is not None else None),
        }

    def start(self) -> None:
        """The streams entering the first layer to walk: from the checkpoint, or captured; then placed."""
        state = resume_state(self.ckpt, self.meta)
        streams = self.resume(state) if state is not None else self.capture()
        stream_bytes = sum(nbytes(x) for x in (streams.pruned, streams.dense) if x is not None)
        self.place = Place(self.device, stream_home(self.device, stream_bytes, self.settings.stream_device))
        self.streams = Streams(self.place.adopt(streams.pruned), self.place.adopt(streams.dense))

    def resume(self, state: dict[str, Any]) -> Streams:
        """Reports, layers, streams and the method's state of the interrupted run."""
        assert self.ckpt is not None
        self.start_layer = state["next_layer"]
        self.layer_reports = state["reports"]
        self.seconds_before = float(state.get("seconds", 0.0))
        self.kwargs = state["kwargs"]
        # streamed: the layers are written already
        restore_layers(self.ckpt, self.all_layers, self.start_layer if self.store is None else 0)
        if "pruner" in state:
            self.pruner.load_state_dict(state["pruner"])
        return Streams(state["pruned"], state["dense"])

    def capture(self) -> Streams:
        """A structured method's allocation pre-pass (dense model), then the first layer's inputs."""
        from leanml.models.layerwise import outer_on

        s = self.settings
        if self.store is None and self.pruner.structured:  # a streamed run does its own pre-pass
            t = time.perf_counter()
            self.pruner.prepare(  # type: ignore[attr-defined]
                self.model, self.adapter, self.calib_ids, batch_size=s.batch_size, device=self.device,
                spec=self.spec, progress=s.progress)
            sync_device(self.device)
            self.prepare_seconds = time.perf_counter() - t
        t = time.perf_counter()
        if self.store is not None:
            self.store.load_outer(self.model)
        with outer_on(self.model, self.adapter, self.device):
            inps, self.kwargs = capture_layer_inputs(self.model, self.adapter, self.calib_ids, s.batch_size)
        if self.store is not None:
            self.store.release_outer(self.model)
        self.capture_seconds = time.perf_counter() - t
        return Streams(inps, inps.clone() if self.keep_dense else None)

    def walk(self) -> None:
        """Every layer up to the last one to prune (the layers after it change nothing)."""
        s = self.settings
        writer = Checkpointer(self.ckpt, s.checkpoint_interval) if self.ckpt is not None else None
        # updated by hand after each layer: the bar prints the estimated time for the rest after the first one
        bar = EtaBar(total=max(self.todo) + 1 - self.start_layer, desc=f"prune {self.pruner.name}", unit="layer",
                     disable=not s.progress)
        try:
            for idx in range(self.start_layer, max(self.todo) + 1):
                self.layer_step(idx, bar, writer)
        except OOM as exc:
            raise LeanmlError(
                f"out of memory on {self.device} while pruning: lower batch_size (now {s.batch_size}) or keep the "
                "activation streams on the host (stream_device cpu)", fields=("batch_size", "stream_device")
            ) from exc
        finally:
            bar.close()
            if writer is not None:
                if sys.exc_info()[0] is None:
                    writer.close()
                else:  # already failing: finish what was queued, keep the first error
                    with contextlib.suppress(Exception):
                        writer.close()

    def layer_step(self, idx: int, bar: EtaBar, writer: Checkpointer | None) -> None:
        """Layer ``idx``: loaded (streamed), pruned or forwarded on the device, the streams advanced,
        checkpointed, released (streamed), timed."""
        t_layer = time.perf_counter()
        layer = self.all_layers[idx]
        if self.store is not None:
            self.store.load(idx, layer)
        kw = [to_device(k, self.device) for k in self.kwargs[idx]]
        with layer_on(layer, self.device):
            report, pruned_next, dense_next, dense_out = self.prune_or_forward(idx, layer, kw)
        if report is not None:
            bar.set_postfix(err=f"{report['rel_output_error']:.2e}")
        self.advance(idx, pruned_next, dense_next, dense_out)
        self.checkpoint(idx, layer, writer)
        if self.store is not None:  # after its checkpoint snapshot: written out, then freed
            self.store.release(idx, layer)
        bar.update(1)
        if report is not None:
            sync_device(self.device)
            report["seconds"] = time.perf_counter() - t_layer
            report["solver_seconds"] = report["stats_seconds"] + report["prune_seconds"] + report["forward_seconds"]
            report["engine_seconds"] = report["seconds"] - report["solver_seconds"]

    def prune_or_forward(
        self, idx: int, layer: nn.Module, kw: list[dict[str, Any]],
    ) -> tuple[dict[str, Any] | None, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """A layer to prune: :func:`prune_layer`'s result, its report recorded; another one (before
        the first to prune): forwarded unchanged, no report."""
        s, streams = self.settings, self.streams
        if idx in self.todo:
            lspec = self.per_linear[idx] if self.per_linear is not None else self.spec
            feed = LayerFeed(streams, kw, s.batch_size, self.place)
            report, pruned_next, dense_next, dense_out = prune_layer(
                layer, self.adapter, feed, self.pruner, lspec, self.intra_layer, s.dense_cache_bytes)
            report["layer"] = idx
            report["sparsity_requested"] = self.requested[idx]
            self.layer_reports.append(report)
            return report, pruned_next, dense_next, dense_out
        pruned_next = forward_stream(layer, streams.pruned, kw, s.batch_size, self.place)
        dense_next = (forward_stream(layer, streams.dense, kw, s.batch_size, self.place)
                      if streams.dense is not None else None)
        return None, pruned_next, dense_next, pruned_next

    def advance(self, idx: int, pruned_next: torch.Tensor, dense_next: torch.Tensor | None,
                dense_out: torch.Tensor | None) -> None:
        """The streams entering the next layer. Dense-input mode: every layer sees the dense model's
        activations (there the pruned stream holds them, so the dense layer's output on it is the next
        input)."""
        if self.settings.sequential:
            self.streams = Streams(pruned_next, dense_next)
        else:
            assert dense_out is not None
            self.streams = Streams(dense_out, None)
        if self.store is not None:
            self.streams = Streams(*self.store.spill(idx, self.streams.pruned, self.streams.dense))

    def checkpoint(self, idx: int, layer: nn.Module, writer: Checkpointer | None) -> None:
        """Layer ``idx`` written for resuming, and (when due) the walk's state after it."""
        if writer is None:
            return
        writer.layer(idx, layer)
        writer.state(lambda streams=self.streams: {
            "settings": self.meta, "fingerprint": settings_fingerprint(self.meta), "next_layer": idx + 1,
            "reports": list(self.layer_reports),
            "pruned": streams.pruned, "dense": streams.dense, "kwargs": self.kwargs,
            "pruner": self.pruner.state_dict(), "seconds": self.seconds_before + time.perf_counter() - self.t_start,
        }, last=idx == max(self.todo))

    def finish(self) -> dict[str, Any]:
        """The method's finalize (when asked) and the report."""
        s = self.settings
        final_info = self.pruner.finalize(self.model, self.adapter) if s.finalize else {}
        sync_device(self.device)
        # over every layer, the ones pruned before a resume included
        prune_seconds = self.seconds_before + time.perf_counter() - self.t_start
        solver_seconds = self.prepare_seconds + sum(lay.get("solver_seconds", 0.0) for lay in self.layer_reports)
        spec = self.spec
        return {
            "engine": {
                "sequential": s.sequential,
                "intra_layer": self.intra_layer,
                "batch_size": s.batch_size,
                "device": str(self.device),
                "resumed_from_layer": self.start_layer,
                "dense_stream": self.keep_dense,
                "capture_seconds": self.capture_seconds,
                "prepare_seconds": self.prepare_seconds,
                "stream_device": str(self.place.home),
                "checkpoint_interval": s.checkpoint_interval if self.ckpt is not None else None,
            },
            "method": self.pruner.name,
            "method_config": self.pruner.config(),
            "mask": {"sparsity": spec.target_sparsity, "pattern": spec.describe(), "scope": spec.scope,
                     "profile": self.profile_info},
            "layers": self.layer_reports,
            "finalize": final_info,
            "prune_seconds": prune_seconds,
            "solver_seconds": solver_seconds,
            "engine_seconds": prune_seconds - solver_seconds,
        }


def prune_model(model: nn.Module, calib_ids: torch.Tensor, pruner: Pruner, spec: MaskSpec,
                **options: Any) -> dict[str, Any]:
    """Prune ``model`` in place, layer by layer, with ``pruner`` at ``spec``; return the report
    (per-layer and per-linear stats).

    ``calib_ids``: ``(nsamples, seqlen)`` token ids. ``spec``: the mask; an open scope
    (``MaskSpec(0.5)``) is resolved by ``pruner.resolve_spec`` (the same choice as the CLI's).
    ``options``: the walk's settings, the fields of :class:`WalkSettings` (``sequential``,
    ``intra_layer``, ``layers``, ``batch_size``, ``sparsity_profile``, ``device``, ``checkpoint_dir``,
    ...). The calibration ids and the settings are checked here; a
    :class:`~leanml.prune.config.PruneConfig` checks itself when made, and :func:`leanml.prune` runs a
    :class:`LayerWalk` with :meth:`WalkSettings.from_config` instead.
    """
    check_calib_ids(calib_ids)
    return LayerWalk(model, calib_ids, WalkSettings.checked(pruner, spec, **options)).run()
