"""The torch device a job runs on: the default one and the one ``device`` names, checked against this machine.

torch is imported by the functions, not by this module, so option checks can name this module without
importing torch (the command line starts without it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from leanml.errors import LeanmlError

if TYPE_CHECKING:
    import torch


def default_device() -> torch.device:
    """``cuda`` when a GPU is present, else ``cpu``."""
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def parse_device(arg: str | None, flag: str = "--device") -> torch.device:
    """``--device``: ``None`` (cuda when present, else cpu), ``cpu``, ``cuda``/``cuda:N`` or ``mps``, checked
    against this machine; raises :class:`LeanmlError` with one line naming the fix."""
    import torch

    if arg is None:
        return default_device()
    try:
        device = torch.device(arg)
    except (RuntimeError, ValueError):
        raise LeanmlError(f"unknown {flag} {arg!r}; use cpu or cuda (or cuda:N)") from None
    if device.type == "cpu":
        return device
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise LeanmlError(f"{flag} {arg}: no CUDA device is available here; use {flag} cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise LeanmlError(f"{flag} {arg}: this machine has {torch.cuda.device_count()} CUDA device(s); "
                              f"use cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
        return device
    if device.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise LeanmlError(f"{flag} mps: no Apple MPS device is available here; use {flag} cpu")
        return device
    raise LeanmlError(f"{flag} {arg}: leanml runs on cpu or cuda, not {device.type}; use {flag} cpu or cuda")
