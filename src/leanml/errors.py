"""The error a user's input causes: one line saying what was wrong and what to do about it."""

from __future__ import annotations


class LeanmlError(Exception):
    """An error caused by the user's input. The CLI prints its message on one line and exits with code 2.

    The message must say what was wrong and what to do about it.
    """
