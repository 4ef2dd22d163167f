"""Streaming readers for raw logs: TSV and JSON lines (optionally gzip) and Parquet, in chunks.

A reader yields ``dict[str, np.ndarray]`` chunks typed by a :class:`Schema`. A row that cannot be
read (wrong field count, a value that does not parse, invalid JSON or UTF-8, a missing field, a null)
is never dropped silently and never crashes the job: it is written to a :class:`Quarantine` JSON-lines
file with its source, line number, reason and raw text, and counted by reason.
"""

from __future__ import annotations

import gzip
import itertools
import json
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from leanml.utils import LeanmlError

TYPES = ("int", "float", "str")
Chunk = dict[str, np.ndarray]


@dataclass(frozen=True)
class Schema:
    """Ordered fields of a log: ``[("ts", "int"), ("user_id", "int"), ...]``. TSV fields come in this order."""

    fields: tuple[tuple[str, str], ...]

    def __post_init__(self) -> None:
        for name, typ in self.fields:
            if typ not in TYPES:
                raise LeanmlError(f"schema field {name!r} has type {typ!r}; use one of {', '.join(TYPES)}")

    @classmethod
    def parse(cls, spec: Sequence[Any] | dict[str, str] | str) -> Schema:
        """From ``"ts:int,user_id:int"``, ``{"ts": "int"}`` or ``[["ts", "int"], ...]``."""
        if isinstance(spec, str):
            pairs = [p.split(":") for p in spec.split(",") if p.strip()]
        elif isinstance(spec, dict):
            pairs = list(spec.items())
        else:
            pairs = [tuple(p) if not isinstance(p, dict) else next(iter(p.items())) for p in spec]
        try:
            return cls(tuple((str(n).strip(), str(t).strip()) for n, t in pairs))
        except ValueError as exc:
            raise LeanmlError(f"bad schema {spec!r}: write it as name:type,name:type") from exc

    @property
    def names(self) -> list[str]:
        return [n for n, _ in self.fields]


@dataclass
class Quarantine:
    """Collects malformed rows: counts by reason, and (when ``path`` is set) a JSON-lines file."""

    path: Path | None = None
    counts: Counter = field(default_factory=Counter)
    max_raw_chars: int = 2000
    _fh: IO[str] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, source: str, line: int, reason: str, raw: str | bytes, detail: str = "") -> None:
        if isinstance(raw, bytes):
            raw = raw.decode("utf-8", errors="backslashreplace")
        with self._lock:
            self.counts[reason] += 1
            if self.path is not None:
                if self._fh is None:
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                    self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
                rec = {"source": source, "line": line, "reason": reason, "detail": detail,
                       "raw": raw.rstrip("\r\n")[: self.max_raw_chars]}
                self._fh.write(json.dumps(rec, ensure_ascii=False) + "\n")

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None


def _open_binary(path: Path) -> IO[bytes]:
    if not path.exists():
        raise LeanmlError(f"log file {path} does not exist; check the path (or generate logs first)")
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")  # noqa: SIM115


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


# ------------------------------------------------------------------------------------------ conversion
def _parse_one(v: Any, typ: str) -> Any:
    """One value as ``int``/``float`` or ``None`` when it does not parse (bools never count as numbers)."""
    if isinstance(v, bool):
        return None
    try:
        if typ == "int":
            if isinstance(v, int):
                return v if -(2**63) <= v < 2**63 else None
            return int(v) if isinstance(v, str) and -(2**63) <= int(v) < 2**63 else None
        x = float(v) if isinstance(v, int | float | str) else None
        return x if x is not None and np.isfinite(x) else None
    except (ValueError, OverflowError):
        return None


def _convert(values: list[Any], typ: str) -> tuple[np.ndarray, np.ndarray | None]:
    """Typed array and a boolean ``bad`` mask (None when every value converted)."""
    n = len(values)
    if typ == "str":
        arr = np.empty(n, dtype=object)
        arr[:] = values
        bad = np.fromiter((type(v) is not str for v in values), dtype=bool, count=n)
        return arr, (bad if bad.any() else None)
    dtype = np.int64 if typ == "int" else np.float64
    kinds = set(map(type, values))
    fast = kinds <= {str} or kinds <= ({int} if typ == "int" else {int, float})
    if fast:
        try:
            arr = np.array(values, dtype=dtype) if n else np.empty(0, dtype=dtype)
            if typ == "int" or np.isfinite(arr).all():
                return arr, None
        except (ValueError, TypeError, OverflowError):
            pass
    parsed = [_parse_one(v, typ) for v in values]
    bad = np.fromiter((p is None for p in parsed), dtype=bool, count=n)
    arr = np.array([0 if p is None else p for p in parsed], dtype=dtype) if n else np.empty(0, dtype=dtype)
    return arr, (bad if bad.any() else None)


def parse_tsv_lines(lines: Sequence[bytes], schema: Schema, quarantine: Quarantine, source: str,
                    first_line: int, sep: str = "\t") -> Chunk:
    """Parse raw TSV lines (bytes, one row each) into typed columns; bad rows go to ``quarantine``."""
    try:
        text = b"".join(lines).decode("utf-8")
        rows_text = text.split("\n")
        if rows_text and rows_text[-1] == "":
            rows_text.pop()
        if len(rows_text) != len(lines):
            raise ValueError("line split mismatch")
        idx = list(range(len(lines)))
    except (UnicodeDecodeError, ValueError):
        rows_text, idx = [], []
        for i, raw in enumerate(lines):
            try:
                rows_text.append(raw.decode("utf-8").rstrip("\n"))
                idx.append(i)
            except UnicodeDecodeError as exc:
                quarantine.add(source, first_line + i, "bad_utf8", raw, str(exc))
    ncols = len(schema.fields)
    rows = [r.rstrip("\r").split(sep) for r in rows_text]
    good = [k for k, r in enumerate(rows) if len(r) == ncols]
    if len(good) != len(rows):
        good_set = set(good)
        for k, r in enumerate(rows):
            if k not in good_set:
                reason = "empty_line" if rows_text[k].strip() == "" else "field_count"
                quarantine.add(source, first_line + idx[k], reason, rows_text[k],
                               f"expected {ncols} fields separated by {sep!r}, got {len(r)}")
        rows = [rows[k] for k in good]
        idx = [idx[k] for k in good]
        rows_text = [rows_text[k] for k in good]
    columns = list(zip(*rows)) if rows else [() for _ in range(ncols)]
    return _typed(columns, schema, quarantine, source, first_line, idx, rows_text)


def _typed(columns: list[Sequence[Any]], schema: Schema, quarantine: Quarantine, source: str,
           first_line: int, idx: list[int], raw_rows: list[str]) -> Chunk:
    out: Chunk = {}
    bad_any = np.zeros(len(idx), dtype=bool)
    reasons: dict[int, str] = {}
    for (name, typ), col in zip(schema.fields, columns):
        arr, bad = _convert(list(col), typ)
        if bad is not None:
            for k in np.flatnonzero(bad & ~bad_any):
                reasons[int(k)] = f"bad_{typ}:{name}"
            bad_any |= bad
        out[name] = arr
    if bad_any.any():
        for k, reason in sorted(reasons.items()):
            name = reason.split(":", 1)[1]
            quarantine.add(source, first_line + idx[k], reason, raw_rows[k],
                           f"field {name!r} value {columns[schema.names.index(name)][k]!r} is not {reason[4:].split(':')[0]}")
        keep = ~bad_any
        out = {k: v[keep] for k, v in out.items()}
    return out


_MISSING = object()


def parse_json_lines(lines: Sequence[bytes], schema: Schema, quarantine: Quarantine, source: str,
                     first_line: int) -> Chunk:
    """Parse JSON-lines rows (objects keyed by field name); bad rows go to ``quarantine``."""
    names = schema.names
    cols: list[list[Any]] = [[] for _ in names]
    idx: list[int] = []
    raws: list[str] = []
    for i, raw in enumerate(lines):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            quarantine.add(source, first_line + i, "bad_utf8", raw, str(exc))
            continue
        if not text.strip():
            quarantine.add(source, first_line + i, "empty_line", text, "blank line")
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            quarantine.add(source, first_line + i, "bad_json", text, str(exc))
            continue
        if not isinstance(obj, dict):
            quarantine.add(source, first_line + i, "bad_json", text, "a row must be a JSON object")
            continue
        vals = [obj.get(n, _MISSING) for n in names]
        missing = [n for n, v in zip(names, vals) if v is _MISSING or v is None]
        if missing:
            quarantine.add(source, first_line + i, f"missing:{missing[0]}", text, f"field {missing[0]!r} absent or null")
            continue
        for c, v in zip(cols, vals):
            c.append(v)
        idx.append(i)
        raws.append(text)
    return _typed(cols, schema, quarantine, source, first_line, idx, raws)


# ---------------------------------------------------------------------------------------------- readers
@dataclass
class LogReader:
    """Iterates typed chunks of ``chunk_rows`` lines over one or more log files.

    ``shard=(index, count)`` keeps every ``count``-th chunk starting at ``index`` (files are read in
    order), so ``count`` workers together read every row exactly once.
    """

    paths: Sequence[str | Path]
    schema: Schema
    chunk_rows: int = 4096
    quarantine: Quarantine = field(default_factory=Quarantine)
    fmt: str | None = None
    shard: tuple[int, int] = (0, 1)
    sep: str = "\t"
    rows_read: int = 0
    lines_read: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.paths, str | Path):
            self.paths = [self.paths]
        if not self.paths:
            raise LeanmlError("no log files given; pass at least one --log PATH")
        if self.chunk_rows < 1:
            raise LeanmlError(f"chunk size must be >= 1 (got {self.chunk_rows})")
        idx, count = self.shard
        if not 0 <= idx < count:
            raise LeanmlError(f"shard index {idx} out of range for {count} shards")

    def __iter__(self) -> Iterator[Chunk]:
        chunk_no = 0
        for p in self.paths:
            path = Path(p)
            fmt = self.fmt or detect_format(path)
            if fmt == "parquet":
                it = self._parquet(path)
            else:
                it = self._lines(path, fmt)
            for chunk_lines, make in it:
                mine = chunk_no % self.shard[1] == self.shard[0]
                chunk_no += 1
                if not mine:
                    continue
                chunk = make()
                self.lines_read += chunk_lines
                n = len(next(iter(chunk.values()))) if chunk else 0
                self.rows_read += n
                yield chunk

    def _lines(self, path: Path, fmt: str) -> Iterator[tuple[int, Any]]:
        with _open_binary(path) as fh:
            line_no = 1
            while True:
                lines = list(itertools.islice(fh, self.chunk_rows))
                if not lines:
                    break
                first = line_no
                line_no += len(lines)
                if not lines[-1].endswith(b"\n"):
                    lines[-1] += b"\n"
                if fmt == "tsv":
                    yield len(lines), lambda ls=lines, f=first: parse_tsv_lines(
                        ls, self.schema, self.quarantine, str(path), f, self.sep)
                else:
                    yield len(lines), lambda ls=lines, f=first: parse_json_lines(
                        ls, self.schema, self.quarantine, str(path), f)

    def _parquet(self, path: Path) -> Iterator[tuple[int, Any]]:
        import pyarrow.parquet as pq

        if not path.exists():
            raise LeanmlError(f"log file {path} does not exist; check the path")
        pf = pq.ParquetFile(path)
        missing = [n for n in self.schema.names if n not in pf.schema_arrow.names]
        if missing:
            raise LeanmlError(f"{path} lacks columns {missing}; it has {pf.schema_arrow.names}")
        row = 0
        for batch in pf.iter_batches(batch_size=self.chunk_rows, columns=self.schema.names):
            first = row
            row += batch.num_rows
            yield batch.num_rows, lambda b=batch, f=first: self._parquet_chunk(b, path, f)

    def _parquet_chunk(self, batch: Any, path: Path, first: int) -> Chunk:
        cols = {n: batch.column(n).to_pylist() for n in self.schema.names}
        n = batch.num_rows
        keep_idx, raws = [], []
        for i in range(n):
            nulls = [c for c in self.schema.names if cols[c][i] is None]
            if nulls:
                raw = json.dumps({c: cols[c][i] for c in self.schema.names}, default=str)
                self.quarantine.add(str(path), first + i, f"missing:{nulls[0]}", raw, f"null in {nulls[0]!r}")
            else:
                keep_idx.append(i)
        if len(keep_idx) == n:
            columns = [cols[c] for c in self.schema.names]
            raws = [""] * n
        else:
            columns = [[cols[c][i] for i in keep_idx] for c in self.schema.names]
            raws = [json.dumps({c: cols[c][i] for c in self.schema.names}, default=str) for i in keep_idx]
        return _typed(columns, self.schema, self.quarantine, str(path), first, keep_idx, raws)
