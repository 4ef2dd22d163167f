"""leanml: cheaper, better industrial deep learning."""

import importlib.metadata
import re

__version__ = "0.1.0"

# the oldest torch the test suite ran on (pyproject.toml admits no older one; docs/memory.md lists the tested)
TORCH_FLOOR = (2, 6)


class TorchVersionError(ImportError):
    """The installed torch is older than :data:`TORCH_FLOOR`."""


def check_torch_version(version: str | None) -> None:
    """Raise :class:`TorchVersionError` (one line, naming the version needed) when ``version`` (a torch
    version string such as ``"2.6.0+cu124"``) is older than :data:`TORCH_FLOOR`; None or an unreadable
    string passes (torch's own import then decides)."""
    m = re.match(r"\s*(\d+)\.(\d+)", version or "")
    if m and (int(m.group(1)), int(m.group(2))) < TORCH_FLOOR:
        need = ".".join(map(str, TORCH_FLOOR))
        raise TorchVersionError(f"leanml needs torch >= {need}, found torch {version}; upgrade it "
                                f"(pip install 'torch>={need}') or use a leanml environment that has it")


def _installed_torch() -> str | None:
    """The installed torch's version from its package metadata (without importing torch)."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


check_torch_version(_installed_torch())

# ``leanml.prune(model, calibration, config)``: the pruning package is callable (see leanml/prune/__init__.py);
# importing it here costs nothing (it imports torch only when called)
from leanml import prune  # noqa: E402


def __getattr__(name: str) -> object:
    """``leanml.PruneConfig``: the pruning options, imported on first use."""
    if name == "PruneConfig":
        from leanml.prune.config import PruneConfig

        return PruneConfig
    raise AttributeError(f"module 'leanml' has no attribute {name!r}")


__all__ = ["PruneConfig", "TORCH_FLOOR", "TorchVersionError", "check_torch_version", "prune"]
