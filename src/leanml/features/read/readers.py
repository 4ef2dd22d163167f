"""Streaming readers for raw logs: TSV and JSON lines (optionally gzip) and Parquet, in chunks.

:class:`LogReader` walks the files in order and yields typed chunks (see :mod:`leanml.features.read.logschema`
for the row rules and the quarantine); each format family has its own module:
:mod:`leanml.features.read.linelogs` (TSV and JSON lines, ``arrow`` or ``python`` engine) and
:mod:`leanml.features.read.parquetlogs`. Both engines give the same rows, the same quarantine reasons and the
same line numbers.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from leanml.config import ConfigError
from leanml.errors import LeanmlError
from leanml.features.options import BATCH_ROWS, ENGINES
from leanml.features.read.linelogs import line_chunks
from leanml.features.read.logschema import Chunk, Quarantine, Schema
from leanml.features.read.parquetlogs import parquet_chunks


def detect_format(path: str | Path) -> str:
    """``tsv``, ``jsonl`` or ``parquet`` from the file name (``.gz`` allowed for the first two)."""
    name = Path(path).name.lower().removesuffix(".gz")
    if name.endswith((".tsv", ".txt", ".log")):
        return "tsv"
    if name.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    raise LeanmlError(f"cannot tell the format of {path}: name it .tsv, .jsonl or .parquet (optionally .gz)")


@dataclass
class LogReader:
    """Iterates typed chunks of ``chunk_rows`` lines over one or more log files.

    ``shard=(index, count)`` keeps every ``count``-th chunk starting at ``index`` (files are read in
    order), so ``count`` workers together read every row exactly once. ``engine`` is ``arrow``
    (native, default) or ``python`` (the reference); both give the same rows and quarantine records.
    """

    paths: Sequence[str | Path]
    schema: Schema
    chunk_rows: int = BATCH_ROWS
    quarantine: Quarantine = field(default_factory=Quarantine)
    fmt: str | None = None
    shard: tuple[int, int] = (0, 1)
    sep: str = "\t"
    engine: str = "arrow"
    rows_read: int = 0
    lines_read: int = 0
    yield_empty: bool = False  # also yield chunks whose rows were all quarantined (keeps shard order visible)

    def __post_init__(self) -> None:
        if isinstance(self.paths, str | Path):
            self.paths = [self.paths]
        if not self.paths:
            raise ConfigError("no files to read; pass at least one log PATH", None, ("log",))
        if self.chunk_rows < 1:
            raise LeanmlError(f"chunk size must be >= 1 (got {self.chunk_rows})")
        idx, count = self.shard
        if not 0 <= idx < count:
            raise LeanmlError(f"shard index {idx} out of range for {count} shards")
        if self.engine not in ENGINES:
            raise LeanmlError(f"reader engine {self.engine!r} must be one of {', '.join(ENGINES)}")

    def __iter__(self) -> Iterator[Chunk]:
        chunk_no = 0
        for p in self.paths:
            path = Path(p)
            fmt = self.fmt or detect_format(path)
            it = (parquet_chunks(path, self.schema, self.quarantine, self.chunk_rows, self.engine) if fmt == "parquet"
                  else line_chunks(path, fmt, self.schema, self.quarantine, self.chunk_rows, self.sep, self.engine))
            for chunk_lines, make in it:
                mine = chunk_no % self.shard[1] == self.shard[0]
                chunk_no += 1
                if not mine:
                    continue
                chunk = make()
                self.lines_read += chunk_lines
                n = len(next(iter(chunk.values()))) if chunk else 0
                self.rows_read += n
                if n or self.yield_empty:
                    yield chunk
