"""What every benchmark shares: replacing a generated block between markers in a Markdown page.

A page holds ``<!-- bench:NAME:start -->`` and ``<!-- bench:NAME:end -->``; :func:`replace_block` puts the
given text between them (atomically) and leaves the rest of the page as it was. Pages without the markers
are left alone.
"""

from __future__ import annotations

import os
from pathlib import Path


def markers(name: str) -> tuple[str, str]:
    """The start and end markers of block ``name``."""
    return f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"


def replace_block(path: Path, name: str, inner: str) -> bool:
    """Put ``inner`` between the ``name`` markers of ``path`` (exactly: no newline is added); returns
    whether the page had both markers and was rewritten."""
    if not path.exists():
        return False
    text = path.read_text()
    start, end = markers(name)
    if start not in text or end not in text:
        return False
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(f"{head}{start}{inner}{end}{tail}")
    os.replace(tmp, path)
    return True
