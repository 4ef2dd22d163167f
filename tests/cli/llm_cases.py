"""Inputs shared by the bad-input cases of the LLM commands (prune, eval, recover, train): each
``setup_*`` prepares a damaged input in a case folder ``d`` from the shared inputs (``llm_inputs``)."""

from __future__ import annotations

import shutil
from pathlib import Path

from cli.conftest import truncated_copy
from cli.parallel import readonly_dir


def resolve(name: str, d: Path, shared: Path) -> str:
    """``name`` in the case folder, else in the shared inputs, else as given (a missing path, a hub id)."""
    for base in (d, shared):
        if (base / name).exists():
            return str(base / name)
    return name


def setup_truncated(d: Path, shared: Path) -> None:
    """``d/cut``: the tiny model with its ``model.safetensors`` cut to 60 %."""
    truncated_copy(shared / "model", d / "cut")


def setup_cut_config(d: Path, shared: Path) -> None:
    """``d/cutcfg``: the tiny model with its ``config.json`` cut in the middle of a line."""
    shutil.copytree(shared / "model", d / "cutcfg")
    text = (d / "cutcfg" / "config.json").read_text()
    (d / "cutcfg" / "config.json").write_text(text[: len(text) // 2])


def setup_readonly(d: Path, shared: Path) -> None:
    """A folder nothing can be written into; its path is kept in ``d/ro-path`` (see :func:`readonly`)."""
    (d / "ro-path").write_text(str(readonly_dir(d / "ro")))


def readonly(d: Path) -> Path:
    """The read-only folder :func:`setup_readonly` made for case folder ``d``."""
    return Path((d / "ro-path").read_text())


def with_option(make_args, option: str, value) -> object:
    """``make_args`` with ``option``'s value replaced by ``value(d, shared)`` (e.g. an --out computed later)."""
    def args(d: Path, shared: Path) -> list[str]:
        out = list(make_args(d, shared))
        out[out.index(option) + 1] = str(value(d, shared))
        return out
    return args
