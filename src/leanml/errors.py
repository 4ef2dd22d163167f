"""The error a user's input causes: one line saying what was wrong and what to do about it."""

from __future__ import annotations


class LeanmlError(Exception):
    """An error caused by the user's input. The CLI prints its message on one line and exits with code 2.

    The message must say what was wrong and what to do about it. ``fields``: the options (dataclass field
    names) the message names, as whole words; the command line shows each as the flag that sets it, so
    library prose never writes a flag: ``LeanmlError("... rerun with resume", fields=("resume",))`` reads
    "rerun with resume" from Python and "rerun with --resume" from ``leanml prune``. ``owner``: the
    options class the fields belong to, where one field name has several flags.
    """

    def __init__(self, message: str = "", *, owner: type | None = None, fields: str | tuple[str, ...] = (),
                 **kwargs: object) -> None:
        super().__init__(message, **kwargs)  # kwargs: a second base's (ModuleNotFoundError's name=)
        self.owner = owner
        self.fields = (fields,) if isinstance(fields, str) else tuple(fields)


def option_fields(option: str) -> tuple[str, ...]:
    """The ``fields`` of an error that names ``option``: a field name (shown as its flag on the command line)
    is a field; a flag already written out (``--out``, from :func:`leanml.flags.flag_of`) is none."""
    return () if option.startswith("-") else (option,)
