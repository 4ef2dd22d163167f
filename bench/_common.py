"""What every benchmark shares: merging a run's records into the ones on disk, and replacing a generated
block between markers in a Markdown page.

Records are dicts; a benchmark names the fields that identify a run (its key), and a new record replaces
the old one of the same key (:func:`merge_records`).

A page holds ``<!-- bench:NAME:start -->`` and ``<!-- bench:NAME:end -->``; :func:`replace_block` puts the
given text between them (atomically) and leaves the rest of the page as it was. Pages without the markers
are left alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

Record = dict[str, Any]


def key_of(fields: Sequence[str]) -> Callable[[Record], tuple]:
    """A record key made of ``fields`` (a missing field counts as ``None``)."""
    return lambda r: tuple(r.get(f) for f in fields)


def merge_records(old: Iterable[Record], new: Iterable[Record], key: Callable[[Record], Hashable],
                  keep_place: bool = False) -> list[Record]:
    """``old`` with each record of ``new`` replacing the one of the same ``key`` (a later duplicate in
    ``new`` wins). Old records keep their order; a replacing record goes to the end, or with
    ``keep_place`` where the record it replaces stood; new keys are appended in the order given."""
    merged: dict[Hashable, Record] = {key(r): r for r in old}
    for r in new:
        if not keep_place:
            merged.pop(key(r), None)
        merged[key(r)] = r
    return list(merged.values())


def load_json(path: Path, default: Any) -> Any:
    """The JSON document at ``path``, or ``default`` when there is none yet."""
    return json.loads(path.read_text()) if path.exists() else default


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


#: the lock every heavy job on a shared machine takes (``flock /tmp/leanml-cpu.lock CMD`` on the command line)
CPU_LOCK = "/tmp/leanml-cpu.lock"


@contextlib.contextmanager
def cpu_lock(path: str = CPU_LOCK) -> Iterator[None]:
    """Hold the shared CPU lock for one measurement (other heavy jobs run between measurements, never during one)."""
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def write_outputs(records: list[Record], results: Path, render: Callable[[list[Record]], str],
                  plot: Callable[[list[Record], Path], None]) -> None:
    """A benchmark's ``NAME.json``, ``NAME.md`` (``render``) and ``NAME.png`` (``plot``), each written atomically."""
    from leanml.outputs import atomic_file, write_json

    write_json(results, records)
    with atomic_file(results.with_suffix(".md")) as tmp:
        tmp.write_text(render(records))
    with atomic_file(results.with_suffix(".png"), suffix=".png") as tmp:
        plot(records, tmp)
