"""The torch device a job runs on: the default one and the one ``device`` names, checked against this machine.

torch is imported by the functions, not by this module, so option checks can name this module without
importing torch (the command line starts without it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from leanml.errors import LeanmlError, option_fields

if TYPE_CHECKING:
    import torch


def default_device() -> torch.device:
    """``cuda`` when a GPU is present, else ``cpu``."""
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def parse_device(arg: str | None, flag: str | None = None) -> torch.device:
    """``--device``: ``None`` (cuda when present, else cpu), ``cpu``, ``cuda``/``cuda:N`` or ``mps``, checked
    against this machine; raises :class:`LeanmlError` with one line naming the fix. ``flag``: the option
    the error names, a field name (default ``device``, shown as its flag on the command line) or a flag."""
    import torch

    if arg is None:
        return default_device()
    name = flag or "device"
    fields = option_fields(name)
    try:
        device = torch.device(arg)
    except (RuntimeError, ValueError):
        raise LeanmlError(f"unknown {name} {arg!r}; use cpu or cuda (or cuda:N)", fields=fields) from None
    if device.type == "cpu":
        return device
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise LeanmlError(f"{name} {arg}: no CUDA GPU is available here; use {name} cpu", fields=fields)
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise LeanmlError(f"{name} {arg}: this machine has {torch.cuda.device_count()} CUDA GPU(s); "
                              f"use cuda:0 .. cuda:{torch.cuda.device_count() - 1}", fields=fields)
        return device
    if device.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise LeanmlError(f"{name} mps: no Apple MPS GPU is available here; use {name} cpu", fields=fields)
        return device
    raise LeanmlError(f"{name} {arg}: leanml runs on cpu or cuda, not {device.type}; use {name} cpu or cuda",
                      fields=fields)
