"""Layer-parallel pruning under ``torchrun``: decoder layers split over ranks, rank 0 assembles.

With *dense inputs* (``sequential=False``) every decoder layer's statistics depend only on the dense
model, so layers are independent. Each rank walks the model with the engine, prunes only its own
layers (round-robin: layer ``i`` goes to rank ``i % world_size``) and forwards the others unchanged;
rank 0 then gathers the pruned layers' weights and reports, loads them into its model and runs the
pruner's ``finalize``. The result equals a single-process ``prune_model(..., sequential=False)`` run.

Backend: NCCL when CUDA is available, else gloo (CPU).

Usage::

    torchrun --nproc_per_node=2 -m leanml prune --model smollm2-135m --method fista --out DIR
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from leanml.errors import LeanmlError
from leanml.models.layout import get_adapter
from leanml.models.surgery import load_layer_state
from leanml.prune.base import Pruner
from leanml.prune.engine import LayerWalk, WalkSettings
from leanml.prune.engine.walk import check_calib_ids
from leanml.prune.masks import MaskSpec


def world() -> tuple[int, int, int]:
    """``(rank, world_size, local_rank)`` from the torchrun environment (``(0, 1, 0)`` without it)."""
    return (
        int(os.environ.get("RANK", "0")),
        int(os.environ.get("WORLD_SIZE", "1")),
        int(os.environ.get("LOCAL_RANK", "0")),
    )


def assign_layers(n_layers: int, world_size: int, rank: int) -> list[int]:
    """The layers rank ``rank`` prunes: ``i % world_size == rank`` (balanced, each layer exactly once)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world of size {world_size}")
    return [i for i in range(n_layers) if i % world_size == rank]


def prune_distributed(
    model: nn.Module, calib_ids: torch.Tensor, pruner: Pruner, spec: MaskSpec, **options: Any,
) -> dict[str, Any] | None:
    """Prune ``model`` with the layers split over the torchrun ranks: :func:`distributed_walk` with the
    settings of ``pruner`` at ``spec`` and ``options`` (the fields of
    :class:`~leanml.prune.engine.WalkSettings`; ``sequential`` defaults to False, what the ranks run),
    checked here."""
    check_calib_ids(calib_ids)
    return distributed_walk(model, calib_ids, WalkSettings.checked(pruner, spec, **{"sequential": False, **options}))


def distributed_walk(model: nn.Module, calib_ids: torch.Tensor, settings: WalkSettings) -> dict[str, Any] | None:
    """Prune ``model`` with the layers split over the torchrun ranks.

    Returns the merged report on rank 0 (its ``model`` then holds every pruned layer) and ``None`` on
    the other ranks. ``settings.sequential`` is overridden with ``False`` (dense inputs: the condition
    for independent layers) and recorded; ``layers`` and ``finalize`` are the rank's own.
    ``checkpoint_dir`` gets one sub-directory per rank. Without a process group this function creates
    one and destroys it at the end; a program that prunes several times in one process should call
    ``dist.init_process_group`` once itself (re-creating gloo groups in one process can hang).
    """
    created = _open_group()
    t0 = time.perf_counter()
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        if settings.sequential and rank == 0:
            print("layer-parallel pruning uses dense inputs for every layer (sequential mode is off)", flush=True)
        mine = rank_settings(model, settings, rank, world_size)
        report = LayerWalk(model, calib_ids, mine).run()
        layers_all = mine.adapter.layers()
        payload = {
            "rank": rank,
            "layers": {i: {k: v.detach().cpu() for k, v in layers_all[i].state_dict().items()} for i in mine.layers},
            "reports": report["layers"],
            "seconds": report["prune_seconds"],
            "pruner": settings.pruner.state_dict(),
        }
        gathered: list[Any] | None = [None] * world_size if rank == 0 else None
        dist.gather_object(payload, gathered, dst=0)
        if rank != 0:
            _close(created, ok=True)
            return None
        assert gathered is not None
        merge_ranks(model, mine, report, gathered)
        report["engine"]["requested_sequential"] = bool(settings.sequential)
        report["prune_seconds"] = time.perf_counter() - t0
    except BaseException:
        _close(created, ok=False)
        raise
    _close(created, ok=True)
    return report


def _open_group() -> bool:
    """Join the torchrun process group, creating it when there is none (then True: this module closes it)."""
    if dist.is_initialized():
        return False
    _rank, world_size, local_rank = world()
    if world_size < 2:
        raise LeanmlError("prune_distributed needs torchrun with --nproc_per_node >= 2 (WORLD_SIZE >= 2)")
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return True


def rank_settings(model: nn.Module, settings: WalkSettings, rank: int, world_size: int) -> WalkSettings:
    """This rank's walk: dense inputs, its own layers, no finalize (rank 0 runs it on the merged model),
    its own checkpoint sub-directory, its own GPU, a progress bar on rank 0 only."""
    adapter = settings.adapter or get_adapter(model)
    device = settings.device
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        device = torch.device("cuda", torch.cuda.current_device())
    ckpt = settings.checkpoint_dir
    return replace(
        settings, adapter=adapter, sequential=False, layers=assign_layers(len(adapter.layers()), world_size, rank),
        finalize=False, device=device, progress=settings.progress and rank == 0,
        checkpoint_dir=None if ckpt is None else os.path.join(os.fspath(ckpt), f"rank{rank}"),
    )


def merge_ranks(model: nn.Module, settings: WalkSettings, report: dict[str, Any], gathered: list[Any]) -> None:
    """On rank 0: every rank's pruned layers loaded into ``model``, their reports and the pruners' states
    merged, the method's finalize run; ``report`` updated in place."""
    pruner, adapter = settings.pruner, settings.adapter
    assert adapter is not None
    layers_all = adapter.layers()
    layer_reports: list[dict[str, Any]] = []
    for part in gathered:
        for i, state in part["layers"].items():
            load_layer_state(layers_all[i], state)  # keeps biases added by bias compensation (FLAP)
        for rep in part["reports"]:
            rep["rank"] = part["rank"]
            layer_reports.append(rep)
    layer_reports.sort(key=lambda r: r["layer"])
    pruner.load_state_dict(pruner.merge_states([part["pruner"] for part in gathered]))
    report["finalize"] = pruner.finalize(model, adapter)
    report["engine"]["sequential"] = False
    report["engine"]["world_size"] = len(gathered)
    report["engine"]["backend"] = dist.get_backend()
    report["layers"] = layer_reports
    report["rank_seconds"] = [part["seconds"] for part in gathered]


def _close(created: bool, ok: bool) -> None:
    """Tear down the process group this module created (after a barrier when all went well)."""
    if created and dist.is_initialized():
        if ok:
            dist.barrier()
        dist.destroy_process_group()
