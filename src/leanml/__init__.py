"""leanml: cheaper, better industrial deep learning."""

import importlib.metadata
import re
import sys
from pathlib import Path

__version__ = "0.1.0"

# the oldest torch and transformers the test suite ran on (`make test-floor`; pyproject.toml admits no older)
TORCH_FLOOR = (2, 6)
TRANSFORMERS_FLOOR = (5, 0)  # transformers.conversion_mapping (streamed pruning), from_pretrained(dtype=...)


class TorchVersionError(ImportError):
    """The installed torch (or transformers) is older than :data:`TORCH_FLOOR` (:data:`TRANSFORMERS_FLOOR`)."""


def _check_floor(package: str, version: str | None, floor: tuple[int, int]) -> None:
    m = re.match(r"\s*(\d+)\.(\d+)", version or "")
    if m and (int(m.group(1)), int(m.group(2))) < floor:
        need = ".".join(map(str, floor))
        raise TorchVersionError(f"leanml needs {package} >= {need}, found {package} {version}; upgrade it "
                                f"(pip install '{package}>={need}') or use a leanml environment that has it")


def check_torch_version(version: str | None) -> None:
    """Raise :class:`TorchVersionError` (one line, naming the version needed) when ``version`` (a torch
    version string such as ``"2.6.0+cu124"``) is older than :data:`TORCH_FLOOR`; None or an unreadable
    string passes (torch's own import then decides)."""
    _check_floor("torch", version, TORCH_FLOOR)


def check_transformers_version(version: str | None) -> None:
    """As :func:`check_torch_version`, for transformers and :data:`TRANSFORMERS_FLOOR`."""
    _check_floor("transformers", version, TRANSFORMERS_FLOOR)


def _installed(package: str) -> str | None:
    """The installed ``package``'s version from its metadata (without importing it); None when absent."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _installed_torch() -> str | None:
    """The installed torch's version from its package metadata (without importing torch)."""
    return _installed("torch")


def _running_cli() -> bool:
    """Whether this import is the ``leanml`` command's own (``leanml ...`` or ``python -m leanml ...``)."""
    return bool(sys.argv) and (sys.argv[0] == "-m" or Path(sys.argv[0]).name == "leanml")


try:
    check_torch_version(_installed_torch())
    check_transformers_version(_installed("transformers"))
except TorchVersionError as _exc:
    if not _running_cli():
        raise
    # the command line: its one-line error and exit code 2, before any work
    sys.stderr.write(f"leanml: error: {_exc}\n")
    raise SystemExit(2) from None


def version_text() -> str:
    """What ``leanml --version`` prints: leanml's, torch's and transformers' versions and the device."""
    import torch
    import transformers

    if torch.cuda.is_available():
        device = f"cuda ({torch.cuda.get_device_name(0)}, {torch.cuda.device_count()} visible)"
    else:
        device = "cpu"
    return (f"leanml {__version__}\ntorch {torch.__version__}\ntransformers {transformers.__version__}\n"
            f"python {sys.version.split()[0]}\ndevice {device}")


# ``leanml.prune(model, calibration, config)``: the pruning package is callable (see leanml/prune/__init__.py);
# importing it here costs nothing (it imports torch only when called)
from leanml import prune  # noqa: E402


def __getattr__(name: str) -> object:
    """``leanml.PruneConfig``: the pruning options, imported on first use."""
    if name == "PruneConfig":
        from leanml.prune.config import PruneConfig

        return PruneConfig
    raise AttributeError(f"module 'leanml' has no attribute {name!r}")


__all__ = ["PruneConfig", "TORCH_FLOOR", "TRANSFORMERS_FLOOR", "TorchVersionError", "check_torch_version",
           "check_transformers_version", "prune", "version_text"]
