"""The command line generated from options dataclasses (see :mod:`leanml.config`): one flag per field,
parsed back into the dataclass, and the library's refusals rewritten with the flags the user typed.

:func:`add_options` / :func:`add_command` make the flags, :func:`from_args` builds the options from the
parsed arguments, :func:`to_argv` is its inverse (for a child process run from an options object), and
:func:`cli_message` turns an error naming fields (a :class:`~leanml.errors.LeanmlError` with ``fields``) into
one naming flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Callable, Iterator
from typing import Any, Literal

from leanml.config import MISSING, _hints, _mention, _meta, _unwrap_optional
from leanml.errors import LeanmlError


@dataclasses.dataclass(frozen=True)
class Flag:
    """One generated option: the flag and the dataclass and field it sets."""

    flag: str
    owner: type
    field: str


def flag_name(f: dataclasses.Field, prefix: str = "") -> str:
    m = _meta(f)
    return m["flag"] or f"--{prefix}{f.name.replace('_', '-')}"


def _nested(tp: Any, m: dict[str, Any]) -> bool:
    """Whether a field of type ``tp`` is an options dataclass expanded in place (not one parsed option)."""
    return dataclasses.is_dataclass(tp) and m["parse"] is None


def _walk(cls: type, prefix: str, base: Any) -> Iterator[tuple[dataclasses.Field, str, type, str, Any]]:
    """(field, flag, owner, nested prefix, default) of every command-line field; defaults are read from
    ``base`` (an instance of ``cls``) when given, a nested one's from its parent field's default."""
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        m = _meta(f)
        if not m["cli"]:
            continue
        tp, _ = _unwrap_optional(hints[f.name])
        default = getattr(base, f.name) if base is not None else _default_of(f)
        if _nested(tp, m):
            inner = default if dataclasses.is_dataclass(default) else None
            yield from _walk(tp, m["prefix"] if m["prefix"] is not None else prefix, inner)
            continue
        yield f, flag_name(f, prefix), cls, prefix, default


def iter_flags(cls: type, prefix: str = "") -> Iterator[tuple[dataclasses.Field, str, type, str]]:
    """(field, flag, owner, nested prefix) of every command-line field of ``cls``, nested ones expanded."""
    for f, flag, owner, nested_prefix, _ in _walk(cls, prefix, None):
        yield f, flag, owner, nested_prefix


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return MISSING


def add_options(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    prefix: str = "",
    *,
    skip: tuple[str, ...] = (),
    defaults: dict[str, Any] | None = None,
) -> list[Flag]:
    """Add one option per field of ``cls`` (nested options dataclasses expanded) and return them.

    ``skip`` leaves fields out (the caller sets them another way); ``defaults`` overrides the defaults
    shown and used by this command (for a subcommand whose sensible default differs). The generated
    flags are recorded on the parser (see :func:`parser_flags`).
    """
    hints_cache: dict[type, dict[str, Any]] = {}
    made: list[Flag] = []
    for f, flag, owner, _, default in _walk(cls, prefix, None):
        if f.name in skip:
            continue
        m = _meta(f)
        if owner not in hints_cache:
            hints_cache[owner] = _hints(owner)
        hints = hints_cache[owner]
        tp, optional = _unwrap_optional(hints[f.name])
        if defaults and f.name in defaults:
            default = defaults[f.name]
        kwargs: dict[str, Any] = {"dest": _dest(flag)}
        choices = m["choices"]
        if typing.get_origin(tp) is Literal:
            choices = choices or typing.get_args(tp)
            tp = type(typing.get_args(tp)[0])
        if tp is bool and m["parse"] is None and m["negative"]:
            kwargs.update(action=_Negatable, negative=m["negative"])
        elif tp is bool and m["parse"] is None:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = _option_type(m["parse"]) if m["parse"] else (tp if tp in (int, float, str) else str)
            if choices is not None:
                kwargs["choices"] = choices
            if m["metavar"]:
                kwargs["metavar"] = m["metavar"]
            if m["nargs"]:
                kwargs["nargs"] = m["nargs"]
            if m.get("const") is not None:
                kwargs["const"] = m["const"]
            if m.get("repeat"):
                kwargs["action"] = "append"
        text = m["help"]
        if m["show_default"] and default is not MISSING:
            shown = default if not isinstance(default, (list, tuple)) else ",".join(map(str, default))
            text = f"{text} (default {shown})".strip() if default is not None or not optional else text
        kwargs["help"] = text.replace("%", "%%")
        if not flag.startswith("-"):  # positional: argparse takes its dest from the name, no "required"
            del kwargs["dest"]
            if default is not MISSING:
                kwargs.update(nargs="?", default=default)
        elif default is MISSING:
            kwargs["required"] = True
        else:
            kwargs["default"] = None if m.get("repeat") else default  # appended values start a fresh list
        parser.add_argument(flag, **kwargs)
        made.append(Flag(flag, owner, f.name))
    # argument groups share their parser's defaults: the record travels into the parsed namespace, where
    # the command line's error handler finds it (see cli_message)
    parser._defaults.setdefault("_leanml_flags", []).extend(made)  # type: ignore[union-attr]
    return made


class _Negatable(argparse.Action):
    """A bool option with an explicitly named negative flag (``--fista-no-precondition``) instead of
    argparse's ``--no-<flag>``."""

    def __init__(self, option_strings: list[str], dest: str, negative: str, **kwargs: Any) -> None:
        super().__init__([*option_strings, negative], dest, nargs=0, **kwargs)
        self.negative = negative

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, option_string != self.negative)

    def format_usage(self) -> str:
        return " | ".join(self.option_strings)


def _option_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` as an argparse ``type``: its :class:`LeanmlError` is a bad option (one line)."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except LeanmlError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def add_command(
    sub: argparse._SubParsersAction,
    name: str,
    job: type,
    run: Callable[[Any], int],
    *,
    help: str,
    description: str,
    epilog: str = "",
    skip: tuple[str, ...] = (),
) -> argparse.ArgumentParser:
    """A subcommand whose flags are the fields of the dataclass ``job``; it calls ``run(job(...))``."""
    p = sub.add_parser(name, help=help, description=description, epilog=epilog,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(p, job, skip=skip)
    p.set_defaults(func=lambda args: run(from_args(job, args)))
    return p


def parser_flags(parser: argparse.ArgumentParser) -> list[Flag]:
    """The options :func:`add_options` generated on ``parser`` (and its argument groups)."""
    return list(parser._defaults.get("_leanml_flags", []))


def _values(cls: type, args: argparse.Namespace, prefix: str, overrides: dict[str, Any]) -> dict[str, Any]:
    hints = _hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        m = _meta(f)
        if f.name in overrides:
            values[f.name] = overrides[f.name]
            continue
        if not m["cli"]:
            continue
        tp, _ = _unwrap_optional(hints[f.name])
        if _nested(tp, m):
            base = _default_of(f)
            values[f.name] = _build(tp, args, m["prefix"] if m["prefix"] is not None else prefix, {},
                                    base if dataclasses.is_dataclass(base) else None)
            continue
        dest = _dest(flag_name(f, prefix))
        if hasattr(args, dest):
            value = getattr(args, dest)
            if m.get("repeat"):
                if value is None:  # not given: the field's default
                    continue
                value = tuple(value)
            values[f.name] = value
    return values


def _build(cls: type, args: argparse.Namespace, prefix: str, overrides: dict[str, Any], base: Any = None) -> Any:
    values = _values(cls, args, prefix, overrides)
    return dataclasses.replace(base, **values) if base is not None else cls(**values)


def from_args(cls: type, args: argparse.Namespace, prefix: str = "", **overrides: Any) -> Any:
    """Build ``cls`` from the options :func:`add_options` generated (fields skipped there keep their
    defaults unless given in ``overrides``)."""
    return _build(cls, args, prefix, overrides)


def _cli_text(value: Any) -> str:
    """A value as its option's parser reads it back."""
    if hasattr(value, "cli_text"):
        return value.cli_text()
    if isinstance(value, (tuple, list)):
        return ",".join(_cli_text(v) for v in value)
    return repr(value) if isinstance(value, float) else str(value)


def to_argv(obj: Any, prefix: str = "", skip: tuple[str, ...] = (), always: tuple[str, ...] = ()) -> list[str]:
    """The command-line arguments that :func:`from_args` turns back into ``obj`` (the inverse of the
    generated parser): fields at their defaults are left out unless named in ``always`` (for a command
    line that reads well on its own), positionals come first. For programs that run a command in a child
    process (benchmarks) from a config object, so the two cannot drift. Raises ``ValueError`` for a
    value the command line cannot express (``None`` over a non-None default)."""
    cls = type(obj)
    argv: list[str] = []
    positional: list[str] = []
    for (f, flag, owner, _, default), (*_, value) in zip(_walk(cls, prefix, None), _walk(cls, prefix, obj)):
        if f.name in skip or (value == default and (f.name not in always or value is None)):
            continue
        m = _meta(f)
        if not flag.startswith("-"):
            positional.append(_cli_text(value))
        elif isinstance(value, bool) and m["parse"] is None:
            argv.append(flag if value else (m["negative"] or f"--no-{flag[2:]}"))
        elif value is None:
            raise ValueError(f"{owner.__name__}.{f.name}=None has no command-line form (its default is {default!r})")
        elif m.get("repeat"):
            for v in value:
                argv += [flag, _cli_text(v)]
        else:
            argv += [flag, _cli_text(value)]
    return positional + argv


def flag_of(cls: type, name: str, prefix: str = "", *, negative: bool = False) -> str:
    """The flag that sets field ``name`` of ``cls`` (or of an options object nested in it), for a message
    printed outside an error (a warning, a report note) that names the option; ``negative``: the flag that
    turns a boolean field off (``--no-eval``, or the one its declaration names)."""
    found = [(f, flag) for f, flag, _, _ in iter_flags(cls, prefix) if f.name == name]
    if len(found) != 1:
        raise ValueError(f"{cls.__name__} has {len(found)} command-line fields named {name!r}, not one")
    f, flag = found[0]
    if not negative:
        return flag
    return _meta(f)["negative"] or f"--no-{flag[2:]}"


def flags_of(cls: type, prefix: str = "") -> dict[tuple[type, str], str]:
    """``{(owner class, field name): flag}`` for every command-line field of ``cls``."""
    return {(owner, f.name): flag for f, flag, owner, _ in iter_flags(cls, prefix)}


def cli_message(exc: LeanmlError, flags: list[Flag] | dict[tuple[type, str], str]) -> str:
    """The message of ``exc`` with the fields it names written as the flags that set them."""
    table = flags if isinstance(flags, dict) else {(fl.owner, fl.field): fl.flag for fl in flags}
    text = str(exc)
    for name in exc.fields:
        flag = table.get((exc.owner, name)) if exc.owner is not None else None
        if flag is None:  # the field's class is a parent or child of the one the parser knows
            flag = next((v for (o, n), v in table.items() if n == name and exc.owner is not None
                         and (issubclass(exc.owner, o) or issubclass(o, exc.owner))), None)
        if flag is None:  # a field of a nested options object: the one flag of that name, if unique
            named = {v for (_, n), v in table.items() if n == name}
            flag = named.pop() if len(named) == 1 else None
        if flag:
            text = _mention(name).sub(flag, text)
    return text
