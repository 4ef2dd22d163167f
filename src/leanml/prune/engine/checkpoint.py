"""Resume checkpoints of the layer walk: the settings fingerprint, atomic writes, a background writer.

A checkpoint folder holds ``layer_NNN.pt`` (each finished layer's state) and ``state.pt`` (the next
layer, the reports so far, the activation streams entering it, the pruner's state, the settings
fingerprint). :class:`Checkpointer` writes them off the walk's critical path; :func:`resume_state`
reads ``state.pt`` back and refuses one made with other settings.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from leanml.models.surgery import load_layer_state
from leanml.utils import LeanmlError, atomic_file, fingerprint

#: bumped when the checkpoint layout changes, so an old checkpoint is refused instead of misread
CHECKPOINT_VERSION = 2


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save`` to a temporary file renamed to ``path``."""
    with atomic_file(path) as tmp:
        torch.save(obj, tmp)


def layer_path(ckpt: Path, idx: int) -> Path:
    """Where the checkpoint ``ckpt`` keeps decoder layer ``idx``'s state."""
    return ckpt / f"layer_{idx:03d}.pt"


def resume_state(ckpt: Path | None, meta: dict[str, Any]) -> dict[str, Any] | None:
    """The walk's state saved in ``ckpt`` (``None`` without a checkpoint to resume from); a checkpoint
    made with settings other than ``meta`` is refused."""
    state_path = ckpt / "state.pt" if ckpt else None
    if state_path is None or not state_path.exists():
        return None
    state = torch.load(state_path, weights_only=False)
    if state.get("fingerprint") != fingerprint(meta):
        raise LeanmlError(
            f"checkpoint in {ckpt} was made with different settings; delete it or run without --resume"
        )
    return state


def restore_layers(ckpt: Path, layers: nn.ModuleList, count: int) -> None:
    """Load the first ``count`` decoder layers' states from ``ckpt`` into ``layers``."""
    for i in range(count):
        load_layer_state(layers[i], torch.load(layer_path(ckpt, i), weights_only=True))


class Checkpointer:
    """Writes resume checkpoints on a background thread, off the layer walk's critical path.

    Each finished layer's weights are snapshotted to the host at once and written behind the walk; the
    activation streams (the big part) are snapshotted after the first layer, then every ``interval``
    seconds (0: after every layer), and always after the last layer. Files are written in order, each atomically, so a kill leaves a
    consistent checkpoint: ``state.pt`` names the next layer only after the layers before it are on
    disk. :meth:`close` waits for every pending write and raises the first error one raised."""

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
