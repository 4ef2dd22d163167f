"""Resume checkpoints of the layer walk: the settings fingerprint, atomic writes, a background writer.

A checkpoint folder holds ``layer_NNN.pt`` (each finished layer's state) and ``state.pt`` (the next
layer, the reports so far, the activation streams entering it, the pruner's state, the settings and
their fingerprint). :class:`Checkpointer` writes them off the walk's critical path; :func:`resume_state`
reads ``state.pt`` back and refuses one made with other settings, naming them: the settings hold a
hash of the calibration windows (:func:`windows_fingerprint`), of the weights (:func:`weights_fingerprint`)
and every option that changes the result. :func:`check_checkpoint` inspects a folder before any work
(empty or corrupt checkpoints are named and cleared with ``--overwrite``).
"""

from __future__ import annotations

import hashlib
import shutil
import struct
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from leanml.config import ConfigError
from leanml.errors import LeanmlError
from leanml.models.surgery import load_layer_state
from leanml.outputs import atomic_file, fingerprint

#: bumped when the checkpoint layout changes, so an old checkpoint is refused instead of misread
CHECKPOINT_VERSION = 3

#: the options a checkpoint's refusal names (the command line shows them as flags)
RESUME_FIELDS = ("resume", "overwrite")


class CheckpointError(LeanmlError):
    """A checkpoint that cannot be resumed (empty, corrupt); a failing run keeps it for the user to see.
    Its message names the options ``resume`` and ``overwrite`` (the command line shows their flags)."""

    def __init__(self, message: str = "", *, owner: type | None = None,
                 fields: str | tuple[str, ...] = RESUME_FIELDS) -> None:
        super().__init__(message, owner=owner, fields=fields)


class CheckpointMismatch(ConfigError):
    """A resume under settings other than the checkpoint's (its ``fields`` are the differing ones)."""


#: values of each tensor hashed into :func:`weights_fingerprint` (a strided sample: cheap at any size)
WEIGHT_SAMPLE = 256


def windows_fingerprint(ids: torch.Tensor) -> dict[str, Any]:
    """The calibration windows as checkpoint settings: their count, length and a hash of every token."""
    data = ids.detach().to("cpu", torch.int64).contiguous()
    return {"nsamples": int(data.shape[0]), "seqlen": int(data.shape[-1]),
            "calibration_tokens": hashlib.sha256(data.numpy().tobytes()).hexdigest()[:16]}


def weights_fingerprint(model: nn.Module, files: str | Path | None = None) -> str:
    """A cheap hash of the weights a walk starts from: with ``files`` (a safetensors directory, read
    tensor by tensor) each file's name, size and header; else every parameter's name, shape, dtype and
    a strided sample of :data:`WEIGHT_SAMPLE` values (meta tensors: names and shapes only)."""
    h = hashlib.sha256()
    if files is not None:
        for path in sorted(Path(files).glob("*.safetensors")):
            size = path.stat().st_size
            with open(path, "rb") as f:
                head = f.read(8)
                n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
                h.update(f"{path.name}:{size}:".encode() + f.read(min(n, size)))
        return h.hexdigest()[:16]
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
        if p.device.type != "meta" and p.numel():
            flat = p.detach().reshape(-1)
            step = max(1, flat.numel() // WEIGHT_SAMPLE)
            h.update(flat[::step][:WEIGHT_SAMPLE].to("cpu", torch.float64).numpy().tobytes())
    return h.hexdigest()[:16]


def differing_settings(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The settings whose values differ between two checkpoint settings dicts, each as
    ``name saved -> now`` (a nested dict's keys by their own name: ``damp``, ``nsamples``)."""
    out: list[str] = []
    for key in sorted(set(saved) | set(now), key=str):
        a, b = saved.get(key, "(unset)"), now.get(key, "(unset)")
        if isinstance(a, dict) and isinstance(b, dict):
            out += [d for d in differing_settings(a, b) if d not in out]
        elif fingerprint(a) != fingerprint(b) and f"{key} {_short(a)} -> {_short(b)}" not in out:
            out.append(f"{key} {_short(a)} -> {_short(b)}")
    return out


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _field_names(diffs: list[str]) -> tuple[str, ...]:
    """The option names a diff mentions, which the CLI shows as the flags that set them."""
    return tuple(dict.fromkeys(d.split(" ", 1)[0] for d in diffs))


def checkpoint_problem(ckpt: Path, partial: tuple[str, ...] = ()) -> str | None:
    """Why the checkpoint folder ``ckpt`` cannot be resumed (``None``: it can): not a folder, empty (no
    ``state.pt`` nor any of the ``partial`` files a job resumes from: a run stopped before it saved
    anything), or ``state.pt`` unreadable (a truncated or corrupt file). Reads ``state.pt``
    memory-mapped, so a large one costs little."""
    if not ckpt.is_dir():
        return f"{ckpt} is not a folder"
    state = ckpt / "state.pt"
    if not state.is_file():
        if any((ckpt / name).is_file() for name in partial):
            return None
        return "it is empty (no state.pt: the run stopped before it saved anything)"
    try:
        torch.load(state, weights_only=False, mmap=True, map_location="cpu")
    except Exception as exc:  # any unpickling or zip error: the file is not what a checkpoint writes
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:120]
        return f"its state.pt is corrupt or truncated ({first})"
    return None


def check_checkpoint(ckpt: Path, resume: bool, overwrite: bool, partial: tuple[str, ...] = ()) -> None:
    """Before any work, what a run does with the checkpoint ``ckpt`` left beside its output: nothing
    there, or ``resume`` of a readable one, goes on; ``overwrite`` clears it (readable or not); else a
    one-line refusal that says whether it is resumable, empty or corrupt, and what to do. ``partial``:
    see :func:`checkpoint_problem`."""
    if not ckpt.exists() and not ckpt.is_symlink():
        return
    if overwrite and not resume:
        if ckpt.is_dir() and not ckpt.is_symlink():
            shutil.rmtree(ckpt)
        else:
            ckpt.unlink()
        return
    problem = checkpoint_problem(ckpt, partial)
    if problem is None:
        if not resume:
            raise CheckpointError(f"an interrupted run left a checkpoint in {ckpt}; add resume to continue it, "
                                  f"or overwrite (or delete {ckpt}) to start over")
        return
    raise CheckpointError(f"the checkpoint in {ckpt} cannot be resumed: {problem}; pass overwrite instead of "
                          f"resume to clear it (or delete {ckpt})")


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save`` to a temporary file renamed to ``path``."""
    with atomic_file(path) as tmp:
        torch.save(obj, tmp)


def layer_path(ckpt: Path, idx: int) -> Path:
    """Where the checkpoint ``ckpt`` keeps decoder layer ``idx``'s state."""
    return ckpt / f"layer_{idx:03d}.pt"


def check_settings(ckpt: Path, saved: dict[str, Any] | None, now: dict[str, Any]) -> None:
    """Refuse to resume the checkpoint ``ckpt`` made with the settings ``saved`` under the settings
    ``now``, naming each that differs (:class:`ConfigError`: on the command line, as flags)."""
    if saved is not None and fingerprint(saved) == fingerprint(now):
        return
    diffs = differing_settings(saved, now) if saved is not None else ["version (a checkpoint of an older leanml)"]
    raise CheckpointMismatch(f"the checkpoint in {ckpt} was made with other settings: {'; '.join(diffs[:6])}"
                             f"{'; ...' if len(diffs) > 6 else ''}; rerun with resume and the interrupted run's "
                             f"settings, or pass overwrite instead of resume to start over (or delete {ckpt})",
                             None, (*_field_names(diffs), *RESUME_FIELDS))


def resume_state(ckpt: Path | None, meta: dict[str, Any]) -> dict[str, Any] | None:
    """The walk's state saved in ``ckpt`` (``None`` without a checkpoint to resume from); a checkpoint
    made with settings other than ``meta`` is refused, naming them, and a corrupt one is named."""
    state_path = ckpt / "state.pt" if ckpt else None
    if state_path is None or not state_path.exists():
        return None
    try:
        state = torch.load(state_path, weights_only=False)
    except Exception as exc:  # a truncated or foreign file
        raise CheckpointError(f"the checkpoint in {ckpt} cannot be resumed: its state.pt is corrupt or truncated; "
                              f"pass overwrite instead of resume to clear it (or delete {ckpt})") from exc
    if not isinstance(state, dict):
        raise CheckpointError(f"the checkpoint in {ckpt} cannot be resumed: its state.pt is not a leanml "
                              f"checkpoint; pass overwrite instead of resume to clear it (or delete {ckpt})")
    check_settings(ckpt, state.get("settings"), meta)
    return state


def restore_layers(ckpt: Path, layers: nn.ModuleList, count: int) -> None:
    """Load the first ``count`` decoder layers' states from ``ckpt`` into ``layers``."""
    for i in range(count):
        try:
            sd = torch.load(layer_path(ckpt, i), weights_only=True)
        except Exception as exc:  # missing, truncated or foreign
            raise CheckpointError(f"the checkpoint in {ckpt} cannot be resumed: {layer_path(ckpt, i).name} is "
                                  "missing or corrupt; pass overwrite instead of resume to clear it") from exc
        load_layer_state(layers[i], sd)


class Checkpointer:
    """Writes resume checkpoints on a background thread, off the layer walk's critical path.

    Each finished layer's weights are snapshotted to the host at once and written behind the walk; the
    activation streams (the big part) are snapshotted after the first layer, then every ``interval``
    seconds (0: after every layer), and always after the last layer. Files are written in order, each
    atomically, so a kill leaves a consistent checkpoint: ``state.pt`` names the next layer only after
    the layers before it are on disk. :meth:`close` waits for every pending write and raises the first
    error one raised."""

    def __init__(self, ckpt: Path, interval: float) -> None:
        from concurrent.futures import ThreadPoolExecutor

        ckpt.mkdir(parents=True, exist_ok=True)
        self.ckpt = ckpt
        self.interval = interval
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="leanml-ckpt")
        self.pending: list[Any] = []
        self.last_state = float("-inf")  # the first finished layer is always snapshotted

    def layer(self, idx: int, layer: nn.Module) -> None:
        sd = {k: v.detach().to("cpu", copy=True) for k, v in layer.state_dict().items()}
        self.pending.append(self.pool.submit(atomic_save, sd, layer_path(self.ckpt, idx)))

    def state(self, make: Any, last: bool) -> None:
        """Snapshot the state ``make()`` returns when due (``last``: always)."""
        now = time.perf_counter()
        if not last and now - self.last_state < self.interval:
            return
        self.last_state = now
        self._wait()  # at most one stream snapshot in flight: bounded memory
        state = make()

        def write() -> None:
            atomic_save({k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in state.items()},
                         self.ckpt / "state.pt")

        self.pending.append(self.pool.submit(write))

    def _wait(self) -> None:
        done, self.pending = self.pending, []
        for f in done:
            f.result()

    def close(self) -> None:
        try:
            self._wait()
        finally:
            self.pool.shutdown(wait=True)
