"""Options declared once: dataclass fields that are also the command line.

A job's options live in one dataclass. Each field is declared with :func:`option` (default, help text,
and optionally the flag and a parser); the class checks itself once, in ``__post_init__``, and raises
:class:`ConfigError` naming the *fields* it refuses. The command line is generated from the fields by
:func:`leanml.flags.add_options` and read back by :func:`leanml.flags.from_args`, so a flag and its field
cannot drift; when the library refuses a value, :func:`leanml.flags.cli_message` rewrites the field names in
the message into the flags the user typed.

Example::

    @dataclass(frozen=True)
    class Options:
        iters: int = option(20, "FISTA iterations per round")
        ridge: float = option(0.1, "ridge of the refit", flag="--fista-ridge")

        def __post_init__(self) -> None:
            require(self, self.iters >= 1, "iters", f"must be >= 1, got {self.iters}")

    add_options(parser, Options, prefix="fista-")   # --fista-iters, --fista-ridge
    opts = from_args(Options, args, prefix="fista-")
"""

from __future__ import annotations

import collections.abc
import dataclasses
import math
import numbers
import os
import pathlib
import re
import types
import typing
from collections.abc import Callable
from typing import Any, Literal

from leanml.errors import LeanmlError

MISSING = dataclasses.MISSING
_META = "leanml"  # key of the field metadata this module reads
#: the metadata of a field declared without :func:`option` (and the keys every option has)
_DEFAULT_META: dict[str, Any] = dict(help="", flag=None, parse=None, choices=None, metavar=None, cli=True, prefix=None,
                                     show_default=True, nargs=None, repeat=False, negative=None, const=None,
                                     gt=None, ge=None, lt=None, le=None, finite=True)


class ConfigError(LeanmlError):
    """A refused option value. ``fields`` are the field names the message mentions (as whole words);
    on the command line they are shown as the flags that set them."""

    def __init__(self, message: str, owner: type | None = None, fields: tuple[str, ...] = ()) -> None:
        super().__init__(message, owner=owner, fields=fields)


def _mention(name: str) -> re.Pattern[str]:
    """``name`` as a word of a message, not part of a path, a file name or a quoted value (``/tmp/report/x``,
    ``a.out``, ``model.bin``, ``'out'``); a sentence's full stop after it is still a mention."""
    return re.compile(rf"(?<![\w\-/'\".]){re.escape(name)}(?![\w\-/'\"]|\.\w)")


def require(obj: Any, ok: bool, fields: str | tuple[str, ...], message: str) -> None:
    """Raise :class:`ConfigError` unless ``ok``.

    ``fields`` is the field (or fields) of ``obj`` that the message is about; a one-field message that
    does not name its field starts with it: ``require(self, n >= 1, "iters", "must be >= 1")`` reads
    "iters must be >= 1" in Python and "--fista-iters must be >= 1" on the command line.
    """
    if ok:
        return
    names = (fields,) if isinstance(fields, str) else tuple(fields)
    if len(names) == 1 and not _mention(names[0]).search(message):
        message = f"{names[0]} {message}"
    raise ConfigError(message, type(obj), names)


class _DefaultFloat(float):
    """A float default that remembers it was not given (see :func:`default` and :func:`given`)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return float.__repr__(self)


class _DefaultInt(int):
    """An int default that remembers it was not given (see :func:`default` and :func:`given`)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return int.__repr__(self)


class _DefaultStr(str):
    """A str default that remembers it was not given (see :func:`default` and :func:`given`); ``str()`` of it
    is itself, so argparse, which converts a string default with the option's type, keeps the mark."""

    __slots__ = ()

    def __str__(self) -> str:
        return self


def default(value: float | str) -> Any:
    """A numeric or string option default that :func:`given` tells apart from the same value given by the
    user (on the command line or in Python): for an option that another option would silently override, so
    the pair can be refused only when both are given. It compares, prints and serialises as the plain value."""
    if isinstance(value, str):
        return _DefaultStr(value)
    return _DefaultInt(value) if isinstance(value, int) and not isinstance(value, bool) else _DefaultFloat(value)


def given(value: Any) -> bool:
    """Whether a field's value was given, not its :func:`default` (True for any other default)."""
    return not isinstance(value, (_DefaultFloat, _DefaultInt, _DefaultStr))


@dataclasses.dataclass(frozen=True)
class Bounds:
    """The declared range of a numeric option: ``gt``/``ge`` (lower bound, open/closed), ``lt``/``le``
    (upper bound), and whether every float in the value must be finite (``finite``)."""

    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    finite: bool = True

    def __post_init__(self) -> None:
        assert self.gt is None or self.ge is None, "give one lower bound: gt or ge"
        assert self.lt is None or self.le is None, "give one upper bound: lt or le"


@dataclasses.dataclass(frozen=True)
class Form:
    """How an option reads on the command line besides its flag and parser: the values it allows
    (``choices``), the placeholder in the help (``metavar``), the prefix of a nested options dataclass's
    flags (``prefix``), whether the help shows the default, ``nargs`` and the bare flag's value
    (``const``), a repeatable flag (``repeat``) and a boolean's negative flag (``negative``)."""

    choices: tuple[Any, ...] | None = None
    metavar: str | None = None
    prefix: str | None = None
    show_default: bool = True
    nargs: str | None = None
    repeat: bool = False
    negative: str | None = None
    const: Any = None


_NO_BOUNDS, _PLAIN_FORM = Bounds(), Form()


def option(
    default: Any = MISSING,
    help: str = "",
    *,
    flag: str | None = None,
    parse: Callable[[str], Any] | None = None,
    default_factory: Callable[[], Any] | None = None,
    cli: bool = True,
    bounds: Bounds | None = None,
    form: Form | None = None,
) -> Any:
    """A dataclass field that is also a command-line option.

    ``flag`` overrides the generated ``--<prefix><name-with-dashes>``; ``parse`` turns the command-line
    string into the field's value (default: the annotated type); ``cli=False`` keeps the field off the
    command line (a value only Python callers give). ``form`` (a :class:`Form`): ``choices`` limits the
    values (a ``Literal`` annotation gives them too); a ``bool`` field gets ``--x``/``--no-x`` unless
    ``negative`` names its negative flag; a field whose type is itself an options dataclass is expanded
    in place, its flags prefixed by ``prefix``; ``repeat``: the flag may be given several times and the
    field (a tuple) holds every value in order; ``nargs="?"`` with ``const``: the value of the bare flag.
    A ``flag`` without leading dashes is a positional argument. A nested options dataclass takes its
    defaults from its ``default_factory``'s instance; with ``parse`` it is one option instead, whose
    value ``parse`` builds. A :class:`LeanmlError` raised by ``parse`` is a bad option.

    Declared checks, run by the config system when an instance is made (before the class's own
    ``__post_init__``): the value has the annotated type (an ``int`` field refuses 2.5 and "2", a
    ``float`` field "0.5", a ``bool`` field 1; ``Literal`` checks its choices; ``Optional`` allows None),
    every float in it is finite unless ``bounds.finite`` is False, and a number lies in the range of
    ``bounds`` (a :class:`Bounds`: ``gt``/``ge`` lower bound, open/closed, ``lt``/``le`` upper bound).
    """
    b, f = bounds or _NO_BOUNDS, form or _PLAIN_FORM
    meta = {_META: dict(help=help, flag=flag, parse=parse, choices=f.choices, metavar=f.metavar, cli=cli,
                        prefix=f.prefix, show_default=f.show_default, nargs=f.nargs, repeat=f.repeat,
                        negative=f.negative, const=f.const, gt=b.gt, ge=b.ge, lt=b.lt, le=b.le,
                        finite=b.finite)}
    assert meta[_META].keys() == _DEFAULT_META.keys()
    if default_factory is not None:
        made = dataclasses.field(default_factory=default_factory, metadata=meta)
    else:
        made = dataclasses.field(default=default, metadata=meta)
    made.__class__ = _OptionField  # the same field, that also installs the checks on its class
    return made


class _OptionField(dataclasses.Field):
    """A field made by :func:`option`: when its class is created, it makes the class's ``__post_init__``
    run :func:`check_fields` first (once per class; the dataclass decorator then calls that hook from
    ``__init__``, and so from :func:`replace` too)."""

    __slots__ = ()

    def __set_name__(self, owner: type, name: str) -> None:
        super().__set_name__(owner, name)
        current = owner.__dict__.get("__post_init__")
        if getattr(current, "__leanml_owner__", None) is not owner:
            owner.__post_init__ = _checked_post_init(owner, current)  # type: ignore[attr-defined]


def _checked_post_init(owner: type, original: Callable[..., None] | None) -> Callable[..., None]:
    def __post_init__(self: Any, *args: Any) -> None:
        outer = getattr(type(self), "__post_init__", None)
        # the outermost hook checks every field once; an inner one only when the outermost is not a hook
        if outer is __post_init__ or not hasattr(outer, "__leanml_owner__"):
            check_fields(self)
        if original is not None:
            original(self, *args)
            return
        for base in owner.__mro__[1:]:  # what the class inherited before the hook was added
            if "__post_init__" in base.__dict__:
                base.__dict__["__post_init__"](self, *args)
                return

    __post_init__.__leanml_owner__ = owner  # type: ignore[attr-defined]
    __post_init__.__wrapped__ = original  # type: ignore[attr-defined]
    __post_init__.__qualname__ = f"{owner.__qualname__}.__post_init__"
    return __post_init__


_FIELD_TYPES: dict[type, list[tuple[dataclasses.Field, Any]]] = {}


def _field_types(cls: type) -> list[tuple[dataclasses.Field, Any]]:
    """(field, annotated type) of every field of the dataclass ``cls`` (``Any`` where a type cannot be
    resolved at run time, e.g. a name imported only for type checkers)."""
    if cls not in _FIELD_TYPES:
        try:
            hints = typing.get_type_hints(cls)
        except Exception:  # noqa: BLE001 - resolve field by field below
            hints = {}
        pairs = []
        for f in dataclasses.fields(cls):
            tp = hints.get(f.name, Any)
            if f.name not in hints and not isinstance(f.type, str):
                tp = f.type
            pairs.append((f, tp))
        _FIELD_TYPES[cls] = pairs
    return _FIELD_TYPES[cls]


def _conforms(value: Any, tp: Any) -> bool:
    """Whether ``value`` has the annotated type ``tp`` (containers: their items too; what cannot be
    checked at run time passes)."""
    if tp is Any or isinstance(tp, (typing.TypeVar, str)):
        return True
    if tp is None or tp is type(None):
        return value is None
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, a) for a in args)
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if origin is typing.Annotated:
        return _conforms(value, args[0])
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if origin in (tuple, list, set, frozenset):
        if not isinstance(value, (tuple, list) if origin in (tuple, list) else (set, frozenset)):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_conforms(v, args[0]) for v in value)
        if origin is tuple and args:
            return len(value) == len(args) and all(_conforms(v, a) for v, a in zip(value, args))
        return not args or all(_conforms(v, args[0]) for v in value)
    if origin is not None:
        tp = origin
    if tp is collections.abc.Callable:
        return callable(value)
    if isinstance(tp, type) and issubclass(tp, pathlib.PurePath):  # the command line gives a str
        return isinstance(value, (str, os.PathLike))
    try:
        return isinstance(value, tp)
    except TypeError:  # a typing construct isinstance cannot check
        return True


def _describe(tp: Any) -> str:
    """The annotated type ``tp`` in words, for a refusal."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin is Literal:
        words = [str(a) for a in args]
        return ", ".join(words[:-1]) + " or " + words[-1] if len(words) > 1 else words[0]
    if origin is typing.Annotated:
        return _describe(args[0])
    names = {bool: "True or False", int: "an integer", float: "a number", str: "a string", type(None): "None"}
    if tp in names:
        return names[tp]
    if origin in (tuple, list):
        return f"a {origin.__name__}" + (f" of {_describe(args[0])}" if args and args[-1] is Ellipsis else "")
    name = getattr(origin or tp, "__name__", str(tp))
    return f"a {name}"


def _nonfinite(value: Any) -> Any:
    """The first float in ``value`` (a number or a tuple/list of them) that is NaN or infinite, else None."""
    if isinstance(value, (float, numbers.Real)) and not isinstance(value, (bool, numbers.Integral)):
        return None if math.isfinite(value) else value
    if isinstance(value, (tuple, list)):
        return next((v for v in value if _nonfinite(v) is not None), None)
    return None


def _range_text(m: dict[str, Any]) -> str:
    low = "" if m["gt"] is None and m["ge"] is None else ("(" if m["gt"] is not None else "[")
    high = "" if m["lt"] is None and m["le"] is None else (")" if m["lt"] is not None else "]")
    lo = m["gt"] if m["gt"] is not None else m["ge"]
    hi = m["lt"] if m["lt"] is not None else m["le"]
    if low and high:
        return f"in {low}{lo}, {hi}{high}"
    if low:
        return f"> {lo}" if low == "(" else f"at least {lo}"
    return f"< {hi}" if high == ")" else f"at most {hi}"


def _in_range(value: Any, m: dict[str, Any]) -> bool:
    return ((m["gt"] is None or value > m["gt"]) and (m["ge"] is None or value >= m["ge"])
            and (m["lt"] is None or value < m["lt"]) and (m["le"] is None or value <= m["le"]))


def check_fields(obj: Any) -> None:
    """The declared checks of every field of the dataclass instance ``obj`` (see :func:`option`): its
    type, finite floats, its range. Raises :class:`ConfigError` naming the first field refused. The
    config system runs it when an instance of a class with :func:`option` fields is made."""
    for f, tp in _field_types(type(obj)):
        value = getattr(obj, f.name)
        m = _meta(f)
        if not _conforms(value, tp):
            shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
            kind = "" if typing.get_origin(_unwrap_optional(tp)[0]) is Literal else f" ({type(value).__name__})"
            raise ConfigError(f"{f.name} must be {_describe(tp)}, got {shown}{kind}", type(obj), (f.name,))
        bad = _nonfinite(value) if m["finite"] else None
        if bad is not None:
            what = "hold finite numbers" if isinstance(value, (tuple, list)) else "be a finite number"
            raise ConfigError(f"{f.name} must {what}, got {bad}", type(obj), (f.name,))
        bounded = any(m[k] is not None for k in ("gt", "ge", "lt", "le"))
        if bounded and isinstance(value, numbers.Real) and not isinstance(value, bool) and not _in_range(value, m):
            raise ConfigError(f"{f.name} must be {_range_text(m)}, got {value}", type(obj), (f.name,))


def _meta(f: dataclasses.Field) -> dict[str, Any]:
    return f.metadata.get(_META) or _DEFAULT_META


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def check_argument(value: Any, name: str, kinds: type | tuple[type, ...], expected: str, hint: str = "") -> None:
    """The boundary check of a public function's argument: raise ``TypeError`` (one line naming the
    argument, what it takes and what it got) unless ``value`` is an instance of ``kinds`` (``type(None)``
    among them allows None). ``hint``: how to fix the usual mistake, appended after a semicolon."""
    if isinstance(value, kinds):
        return
    raise TypeError(f"{name} must be {expected}, got {type(value).__name__}" + (f"; {hint}" if hint else ""))


def check_token_ids(value: Any, name: str, shape: str = "(n, seqlen)", hint: str = "") -> None:
    """``value`` must be a 2-D integer ``torch.Tensor`` of token ids: ``TypeError`` for another kind (a list,
    an array), ``ValueError`` for another rank or a float tensor, each naming ``name``."""
    import torch

    check_argument(value, name, torch.Tensor, f"a torch.Tensor of token ids {shape}",
                   hint or "wrap lists with torch.tensor(ids, dtype=torch.long)")
    if value.dim() != 2:
        raise ValueError(f"{name} must be token ids {shape} (2-D), got shape {tuple(value.shape)}")
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer token ids, got dtype {str(value.dtype).replace('torch.', '')}")


def replace(obj: Any, **changes: Any) -> Any:
    """``dataclasses.replace``: a copy with some fields changed, checked again."""
    return dataclasses.replace(obj, **changes)


def as_dict(obj: Any) -> dict[str, Any]:
    """The fields as a plain dict (nested options included), for reports and fingerprints."""
    return dataclasses.asdict(obj)
