"""Packages whose public names are imported on first use, so that importing one of their submodules (the
command line's ``cli`` modules) does not import torch.

A package's ``__init__`` names where each public name lives and installs the module hooks of PEP 562::

    __getattr__, __dir__, __all__ = lazy_exports(__name__, {"leanml.memory.budget": ("Budget",), ...})
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def lazy_exports(
    package: str, where: Mapping[str, Sequence[str]],
) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """``(__getattr__, __dir__, __all__)`` for ``package``: ``where`` maps a module to the names the package re-exports
    from it. A name is imported from its module when first asked for, then kept on the package; any other
    attribute is tried as a submodule (``leanml.memory.adacc``), as a package that imported it eagerly would
    have had it."""
    home = {name: module for module, names in where.items() for name in names}

    def __getattr__(name: str) -> Any:
        if name in home:
            value = getattr(importlib.import_module(home[name]), name)
        elif not name.startswith("__"):
            try:
                value = importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as exc:
                if exc.name != f"{package}.{name}":
                    raise
                raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(home))

    return __getattr__, __dir__, sorted(home)
