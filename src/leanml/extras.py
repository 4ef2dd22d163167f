"""Optional dependencies ("extras"): which packages each one brings, and the one-line error when one is missing.

The core install (``pip install leanml``) prunes, evaluates and trains with memory planning; each other system
comes with an extra declared in ``pyproject.toml``. A command whose extra is not installed stops before any work
with one line naming the fix, e.g. ``pip install 'leanml[features]'``: either where the package is imported
(:func:`require_extra`) or, for an import deeper down, where the command line catches it (:func:`missing_extra`).
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from leanml.errors import LeanmlError

#: extra -> the import names it provides (the order says which extra names a module that several bring)
EXTRAS: dict[str, tuple[str, ...]] = {
    "features": ("pyarrow", "pandas", "yaml"),
    "ctr": ("PIL", "pyarrow", "pandas"),
    "ray": ("ray",),
    "hub": ("datasets",),
    "eval": ("lm_eval",),
    "gguf": ("gguf",),
    "bench": ("matplotlib",),
    "dev": ("pytest", "hypothesis", "sklearn"),
}

class MissingExtraError(LeanmlError, ModuleNotFoundError):
    """A package of an optional extra is not installed; the message names the ``pip install`` that adds it."""


def extra_of(module: str, command: str | None = None) -> str | None:
    """The extra that provides top-level import name ``module``: the one named like ``command`` when that one
    provides it (``pandas`` for ``leanml ctr`` is the ``ctr`` extra's), else the first that does; None when
    no extra does (a core dependency or a package leanml does not declare)."""
    top = module.split(".")[0]
    if command in EXTRAS and top in EXTRAS[command]:
        return command
    return next((extra for extra, modules in EXTRAS.items() if top in modules), None)


def missing_message(extra: str, module: str, command: str | None = None) -> str:
    """The one line that says ``module`` is missing and how to install ``extra``."""
    what = f"leanml {command}" if command else "this command"
    return (f"{what} needs the '{extra}' extra ({module.split('.')[0]} is not installed); "
            f"install it with: pip install 'leanml[{extra}]'")


#: commands that need their whole extra to start (FeatureBox reads and plans with pyarrow): without it they
#: are listed, and refuse to run, with the line naming the extra
COMMAND_EXTRAS = {"features": "features"}


def not_installed(extra: str) -> str | None:
    """The first import name of ``extra`` that is not installed (found without importing it), or None."""
    return next((m for m in EXTRAS.get(extra, ()) if importlib.util.find_spec(m) is None), None)


def require_extra(extra: str, *modules: str, command: str | None = None) -> ModuleType:
    """Import ``modules`` (import names, e.g. ``"pyarrow"``) and return the first; raise
    :class:`MissingExtraError` naming ``pip install 'leanml[extra]'`` when one is not installed."""
    if extra not in EXTRAS:
        raise ValueError(f"unknown extra {extra!r}; one of {', '.join(EXTRAS)}")
    if not modules:
        raise ValueError("require_extra needs at least one module name")
    loaded = []
    for name in modules:
        try:
            loaded.append(importlib.import_module(name))
        except ModuleNotFoundError as exc:
            if exc.name is None or not name.startswith(exc.name.split(".")[0]):
                raise  # the package is there but one of its own dependencies is not: not ours to rename
            raise MissingExtraError(missing_message(extra, name, command), name=name) from exc
    return loaded[0]


def missing_extra(exc: ModuleNotFoundError, command: str | None = None) -> MissingExtraError | None:
    """The :class:`MissingExtraError` for ``exc`` (a failed import) when the missing module belongs to an
    extra, else None; ``command`` is the subcommand that was running, so its own extra is named first."""
    if isinstance(exc, MissingExtraError):
        return exc
    extra = extra_of(exc.name or "", command)
    if extra is None:
        return None
    return MissingExtraError(missing_message(extra, exc.name or "", command), name=exc.name)
