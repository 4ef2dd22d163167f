"""Streaming readers for raw logs: TSV and JSON lines (optionally gzip) and Parquet, in chunks.

A reader yields chunks (``dict`` of column name -> column) typed by a :class:`Schema`: ``int`` and
``float`` fields as numpy arrays, ``str`` fields as arrow string arrays (numpy ``object`` arrays in the
pure-Python reference engine). A row that cannot be read (wrong field count, a value that does not
parse, invalid JSON or UTF-8, a missing field, a null) is never dropped silently and never crashes the
job: it is written to a :class:`Quarantine` JSON-lines file with its source, line number, reason and
raw text, and counted by reason.

Two engines give the same rows, the same reasons and the same line numbers:

* ``arrow`` (default): files are cut into chunks of whole lines with a vectorised newline scan, and
  each chunk is parsed by ``pyarrow.csv`` (an invalid-row handler collects rows with the wrong field
  count) or ``pyarrow.json``, with typed conversion in C++ (the GIL is released). Values arrow cannot
  take are re-checked one by one with the Python rules; a chunk arrow cannot read as a whole (bad
  UTF-8, a lone carriage return, JSON that is not one object per line, blank JSON lines) goes through
  the Python engine.
* ``python``: the line-by-line reference implementation.
"""

from __future__ import annotations

import gzip
import json
import threading
import zlib
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import pyarrow.json as pjson

from leanml.utils import LeanmlError

TYPES = ("int", "float", "str")
ENGINES = ("arrow", "python")
Chunk = dict[str, Any]  # field -> np.ndarray (int, float) | pa.Array or object np.ndarray (str)


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


# ------------------------------------------------------------------------------------------- line chunks
def iter_line_chunks(fh: IO[bytes], chunk_rows: int, block_bytes: int = 1 << 22
                     ) -> Iterator[tuple[int, bytes, np.ndarray]]:
    """Cut a binary stream into chunks of ``chunk_rows`` whole lines: ``(first_line, buf, ends)``.

    ``first_line`` is 1-based, ``buf`` holds the lines (each ending in ``\n``; a missing final newline
    is added) and ``ends[k]`` is the offset of line k's newline in ``buf``. Newlines are found with one
    vectorised comparison per block read, not line by line.
    """
    pending = b""
    ends = np.empty(0, dtype=np.int64)  # newline offsets in ``pending``
    line_no = 1
    eof = False
    while not eof:
        data = fh.read(block_bytes)
        if data:
            nl = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == 10).astype(np.int64) + len(pending)
            pending += data
            ends = np.concatenate([ends, nl]) if len(ends) else nl
        else:
            eof = True
            if pending and (not len(ends) or ends[-1] != len(pending) - 1):
                pending += b"\n"
                ends = np.append(ends, len(pending) - 1)
        start, k = 0, 0
        while len(ends) - k >= chunk_rows or (eof and k < len(ends)):
            take = min(chunk_rows, len(ends) - k)
            stop = int(ends[k + take - 1]) + 1
            yield line_no, pending[start:stop], ends[k : k + take] - start
            line_no += take
            start, k = stop, k + take
        if k:
            pending, ends = pending[start:], ends[k:] - start


def _checked_read(chunks: Iterator[tuple[int, bytes, np.ndarray]], path: Path
                  ) -> Iterator[tuple[int, bytes, np.ndarray]]:
    """``chunks``, with a truncated or corrupt compressed stream turned into a one-line error."""
    line = 1
    try:
        for item in chunks:
            line = item[0] + len(item[2])
            yield item
    except (EOFError, OSError, zlib.error) as exc:
        raise LeanmlError(f"log {path} is truncated or corrupt after line {line - 1} ({exc}); "
                          "copy or compress it again") from None


def _split_lines(buf: bytes, ends: np.ndarray) -> list[bytes]:
    starts = np.concatenate([[0], ends[:-1] + 1]).tolist()
    return [buf[s : e + 1] for s, e in zip(starts, ends.tolist())]


def _line_text(buf: bytes, ends: np.ndarray, k: int) -> str:
    start = int(ends[k - 1]) + 1 if k else 0
    return buf[start : int(ends[k])].decode("utf-8", errors="backslashreplace")


def _blank_lines(buf: bytes, ends: np.ndarray) -> np.ndarray:
    """Lines with nothing before their newline but an optional carriage return."""
    starts = np.concatenate([[0], ends[:-1] + 1])
    lengths = ends - starts
    raw = np.frombuffer(buf, dtype=np.uint8)
    cr = np.zeros(len(ends), dtype=bool)
    one = lengths == 1
    if one.any():
        cr[one] = raw[starts[one]] == 13
    return (lengths == 0) | cr


def _utf8_ok(buf: bytes) -> bool:
    if buf.isascii():
        return True
    try:
        buf.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


_ARROW_TYPES = {"int": pa.int64(), "float": pa.float64(), "str": pa.string()}
_INT_RE = r"^-?[0-9]{1,18}$"  # what arrow parses exactly as Python's int() does (no hex, no overflow)


def _arrow_convert(col: pa.Array, typ: str, strict_int: bool) -> tuple[Any, np.ndarray | None]:
    """A string column converted to ``typ`` with Python's rules: values and a bad mask (None: none bad)."""
    if typ == "str":
        return col, None
    n = len(col)
    if typ == "int":
        if not strict_int:
            try:
                return np.asarray(pc.cast(col, pa.int64())), None
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                pass
        ok = np.asarray(pc.match_substring_regex(col, _INT_RE), dtype=bool)
        values = np.zeros(n, dtype=np.int64)
        if ok.any():
            values[ok] = np.asarray(pc.cast(col.filter(pa.array(ok)), pa.int64()))
    else:
        try:
            values = np.asarray(pc.cast(col, pa.float64()))
            bad = ~np.isfinite(values)
            return values, (bad if bad.any() else None)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            ok = np.zeros(n, dtype=bool)
            values = np.zeros(n, dtype=np.float64)
    bad = ~ok
    rest = np.flatnonzero(bad)
    for i, v in zip(rest.tolist(), col.take(pa.array(rest)).to_pylist()):
        p = _parse_one(v, typ)
        if p is not None:
            values[i] = p
            bad[i] = False
    return values, (bad if bad.any() else None)


def _finish(cols: dict[str, Any], bad_reasons: list[tuple[str, str, np.ndarray]], schema: Schema,
            quarantine: Quarantine, source: str, first_line: int, line_of_row: np.ndarray,
            raw: Any, extra_bad: np.ndarray | None = None, raw_cols: dict[str, Any] | None = None) -> Chunk:
    """``raw(k)`` is row k's text; ``raw_cols[name](k)`` its field as written (for the quarantine detail)."""
    """Quarantine rows flagged bad (first reason in schema order wins) and drop them from every column."""
    n = len(line_of_row)
    bad_any = np.zeros(n, dtype=bool) if extra_bad is None else extra_bad.copy()
    records: list[tuple[int, str, str]] = []
    for name, reason, bad in bad_reasons:
        new = bad & ~bad_any
        for k in np.flatnonzero(new).tolist():
            records.append((k, reason, name))
        bad_any |= bad
    for k, reason, name in sorted(records):
        if reason.startswith("missing:"):
            detail = f"field {name!r} absent or null"
        else:
            if raw_cols is not None and name in raw_cols:
                value = raw_cols[name](k)
            else:
                v = cols[name][k]
                value = v.as_py() if isinstance(v, pa.Scalar) else v.item() if hasattr(v, "item") else v
            detail = f"field {name!r} value {value!r} is not {reason[4:].split(':')[0]}"
        quarantine.add(source, first_line + int(line_of_row[k]), reason, raw(k), detail)
    if bad_any.any():
        keep = ~bad_any
        mask = pa.array(keep, type=pa.bool_())
        cols = {c: (v.filter(mask) if isinstance(v, pa.Array) else v[keep]) for c, v in cols.items()}
    return cols


def _arrow_tsv(buf: bytes, ends: np.ndarray, schema: Schema, quarantine: Quarantine, source: str,
               first_line: int, sep: str) -> Chunk | None:
    """Parse one chunk of TSV with ``pyarrow.csv``; None when the chunk needs the Python engine."""
    if not _utf8_ok(buf) or (b"\r" in buf and buf.count(b"\r") != buf.count(b"\r\n")) or len(sep) != 1:
        return None
    names, ncols = schema.names, len(schema.fields)
    strict_int = b"0x" in buf or b"0X" in buf  # arrow reads hex integers, Python's int() does not
    invalid: list[Any] = []

    def handler(row: Any) -> str:
        invalid.append(row)
        return "skip"

    parse = pcsv.ParseOptions(delimiter=sep, quote_char=False, escape_char=False, double_quote=False,
                              newlines_in_values=False, ignore_empty_lines=False, invalid_row_handler=handler)
    read = pcsv.ReadOptions(column_names=names, use_threads=False, block_size=len(buf) + 1)
    table = None
    for typed in ((not strict_int), False):
        types = {n: (_ARROW_TYPES[t] if typed else pa.string()) for n, t in schema.fields}
        conv = pcsv.ConvertOptions(column_types=types, null_values=[], true_values=[], false_values=[],
                                   strings_can_be_null=False, quoted_strings_can_be_null=False)
        invalid.clear()
        try:
            table = pcsv.read_csv(pa.py_buffer(buf), read, parse, conv)
            break
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            if not typed:
                return None
    if table is None:
        return None
    skipped = np.array([r.number - 1 if r.number is not None else -1 for r in invalid], dtype=np.int64)
    if (skipped < 0).any():
        return None
    line_of_row = np.delete(np.arange(len(ends), dtype=np.int64), skipped)
    if len(line_of_row) != table.num_rows:
        return None
    for r, k in zip(invalid, skipped.tolist()):
        text = r.text or ""
        reason = "empty_line" if text.strip() == "" else "field_count"
        quarantine.add(source, first_line + k, reason, text,
                       f"expected {ncols} fields separated by {sep!r}, got {r.actual_columns}")
    blank = _blank_lines(buf, ends)[line_of_row] if ncols > 1 else None
    cols: dict[str, Any] = {}
    reasons: list[tuple[str, str, np.ndarray]] = []
    def field_text(j: int) -> Any:
        return lambda k: _line_text(buf, ends, int(line_of_row[k])).rstrip("\r").split(sep)[j]

    raw_cols = {name: field_text(j) for j, name in enumerate(names)}
    for name, typ in schema.fields:
        col = table.column(name).combine_chunks()
        if pa.types.is_string(col.type) and typ != "str":
            values, bad = _arrow_convert(col, typ, strict_int)
        else:
            values = col if typ == "str" else np.asarray(col)
            bad = (~np.isfinite(values)) if typ == "float" else None
            bad = bad if bad is not None and bad.any() else None
        cols[name] = values
        if bad is not None:
            reasons.append((name, f"bad_{typ}:{name}", bad))
    if blank is not None and blank.any():
        for k in np.flatnonzero(blank).tolist():
            quarantine.add(source, first_line + int(line_of_row[k]), "empty_line", "",
                           f"expected {ncols} fields separated by {sep!r}, got 1")
    return _finish(cols, reasons, schema, quarantine, source, first_line, line_of_row,
                   lambda k: _line_text(buf, ends, int(line_of_row[k])), extra_bad=blank, raw_cols=raw_cols)


def _arrow_jsonl(buf: bytes, ends: np.ndarray, schema: Schema, quarantine: Quarantine, source: str,
                 first_line: int) -> Chunk | None:
    """Parse one chunk of JSON lines with ``pyarrow.json``; None when the chunk needs the Python engine."""
    if not _utf8_ok(buf) or _blank_lines_any(buf, ends):
        return None
    arrow_schema = pa.schema([(n, _ARROW_TYPES[t]) for n, t in schema.fields])
    try:
        table = pjson.read_json(pa.py_buffer(buf), pjson.ReadOptions(use_threads=False, block_size=len(buf) + 1),
                                pjson.ParseOptions(explicit_schema=arrow_schema, unexpected_field_behavior="ignore",
                                                   newlines_in_values=False))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None
    if table.num_rows != len(ends):
        return None
    cols: dict[str, Any] = {}
    reasons: list[tuple[str, str, np.ndarray]] = []
    missing: list[tuple[str, str, np.ndarray]] = []
    for name, typ in schema.fields:
        col = table.column(name).combine_chunks()
        nulls = np.asarray(col.is_null(), dtype=bool)
        if nulls.any():
            missing.append((name, f"missing:{name}", nulls))
            col = col.fill_null("" if typ == "str" else 0)
        values = col if typ == "str" else np.asarray(col)
        cols[name] = values
        if typ == "float":
            bad = ~np.isfinite(values)
            if bad.any():
                reasons.append((name, f"bad_float:{name}", bad))
    line_of_row = np.arange(len(ends), dtype=np.int64)
    return _finish(cols, missing + reasons, schema, quarantine, source, first_line, line_of_row,
                   lambda k: _line_text(buf, ends, k))


def _blank_lines_any(buf: bytes, ends: np.ndarray) -> bool:
    starts = np.concatenate([[0], ends[:-1] + 1])
    raw = np.frombuffer(buf, dtype=np.uint8)
    if (ends - starts == 0).any():
        return True
    ws = np.isin(raw, np.array([9, 10, 13, 32], dtype=np.uint8))
    if not ws.any():
        return False
    # a line is blank when all its bytes are whitespace: count non-whitespace bytes per line
    nonws = np.concatenate([[0], np.cumsum(~ws)])
    return bool(((nonws[ends + 1] - nonws[starts]) == 0).any())


def _objects_to_arrow(chunk: Chunk, schema: Schema) -> Chunk:
    return {n: (pa.array(chunk[n].tolist(), type=pa.string()) if t == "str" else chunk[n]) for n, t in schema.fields}


def parse_tsv_chunk(buf: bytes, ends: np.ndarray, schema: Schema, quarantine: Quarantine, source: str,
                    first_line: int, sep: str = "\t", engine: str = "arrow") -> Chunk:
    """One chunk of TSV lines (see :func:`iter_line_chunks`) -> typed columns; bad rows to ``quarantine``."""
    if engine == "arrow":
        out = _arrow_tsv(buf, ends, schema, quarantine, source, first_line, sep)
        if out is not None:
            return out
        return _objects_to_arrow(parse_tsv_lines(_split_lines(buf, ends), schema, quarantine, source,
                                                 first_line, sep), schema)
    return parse_tsv_lines(_split_lines(buf, ends), schema, quarantine, source, first_line, sep)


def parse_jsonl_chunk(buf: bytes, ends: np.ndarray, schema: Schema, quarantine: Quarantine, source: str,
                      first_line: int, engine: str = "arrow") -> Chunk:
    """One chunk of JSON lines -> typed columns; bad rows to ``quarantine``."""
    if engine == "arrow":
        out = _arrow_jsonl(buf, ends, schema, quarantine, source, first_line)
        if out is not None:
            return out
        return _objects_to_arrow(parse_json_lines(_split_lines(buf, ends), schema, quarantine, source,
                                                  first_line), schema)
    return parse_json_lines(_split_lines(buf, ends), schema, quarantine, source, first_line)


def parse_lines(lines: Sequence[bytes], schema: Schema, quarantine: Quarantine, source: str, first_line: int,
                fmt: str = "tsv", sep: str = "\t", engine: str = "arrow") -> Chunk:
    """Lines (bytes, each ending in a newline) -> typed columns, with either engine."""
    buf = b"".join(x if x.endswith(b"\n") else x + b"\n" for x in lines)
    ends = np.flatnonzero(np.frombuffer(buf, dtype=np.uint8) == 10).astype(np.int64)
    if fmt == "jsonl":
        return parse_jsonl_chunk(buf, ends, schema, quarantine, source, first_line, engine)
    return parse_tsv_chunk(buf, ends, schema, quarantine, source, first_line, sep, engine)


# ---------------------------------------------------------------------------------------------- readers
@dataclass
class LogReader:
    """Iterates typed chunks of ``chunk_rows`` lines over one or more log files.

    ``shard=(index, count)`` keeps every ``count``-th chunk starting at ``index`` (files are read in
    order), so ``count`` workers together read every row exactly once. ``engine`` is ``arrow``
    (native, default) or ``python`` (the reference); both give the same rows and quarantine records.
    """

    paths: Sequence[str | Path]
    schema: Schema
    chunk_rows: int = 4096
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
            raise LeanmlError("no log files given; pass at least one --log PATH")
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
            it = self._parquet(path) if fmt == "parquet" else self._lines(path, fmt)
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

    def _lines(self, path: Path, fmt: str) -> Iterator[tuple[int, Any]]:
        with _open_binary(path) as fh:
            for first, buf, ends in _checked_read(iter_line_chunks(fh, self.chunk_rows), path):
                if fmt == "tsv":
                    yield len(ends), lambda b=buf, e=ends, f=first: parse_tsv_chunk(
                        b, e, self.schema, self.quarantine, str(path), f, self.sep, self.engine)
                else:
                    yield len(ends), lambda b=buf, e=ends, f=first: parse_jsonl_chunk(
                        b, e, self.schema, self.quarantine, str(path), f, self.engine)

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
        """Row ``first + i`` of a Parquet file (0-based) is reported as its line; nulls are ``missing:``."""
        if self.engine == "arrow":
            out = self._parquet_arrow(batch, path, first)
            if out is not None:
                return out
            return _objects_to_arrow(self._parquet_python(batch, path, first), self.schema)
        return self._parquet_python(batch, path, first)

    def _parquet_arrow(self, batch: Any, path: Path, first: int) -> Chunk | None:
        cols: dict[str, Any] = {}
        missing: list[tuple[str, str, np.ndarray]] = []
        reasons: list[tuple[str, str, np.ndarray]] = []
        for name, typ in self.schema.fields:
            col = batch.column(name)
            t = col.type
            if typ == "str" and not (pa.types.is_string(t) or pa.types.is_large_string(t)):
                return None
            if typ == "int" and not pa.types.is_integer(t):
                return None
            if typ == "float" and not (pa.types.is_floating(t) or pa.types.is_integer(t)):
                return None
            if pa.types.is_uint64(t):
                return None  # values above 2**63 need the per-value rules
            nulls = np.asarray(col.is_null(), dtype=bool)
            if nulls.any():
                missing.append((name, f"missing:{name}", nulls))
                col = col.fill_null("" if typ == "str" else 0)
            if typ == "str":
                cols[name] = col.cast(pa.string())
            else:
                values = np.asarray(col.cast(_ARROW_TYPES[typ]))
                cols[name] = values
                if typ == "float":
                    bad = ~np.isfinite(values)
                    if bad.any():
                        reasons.append((name, f"bad_float:{name}", bad))
        line_of_row = np.arange(batch.num_rows, dtype=np.int64)

        def raw(k: int) -> str:
            return json.dumps({c: batch.column(c)[k].as_py() for c in self.schema.names}, default=str)

        return _finish(cols, missing + reasons, self.schema, self.quarantine, str(path), first, line_of_row, raw)

    def _parquet_python(self, batch: Any, path: Path, first: int) -> Chunk:
        cols = {n: batch.column(n).to_pylist() for n in self.schema.names}
        n = batch.num_rows
        keep_idx = []
        for i in range(n):
            nulls = [c for c in self.schema.names if cols[c][i] is None]
            if nulls:
                raw = json.dumps({c: cols[c][i] for c in self.schema.names}, default=str)
                self.quarantine.add(str(path), first + i, f"missing:{nulls[0]}", raw,
                                    f"field {nulls[0]!r} absent or null")
            else:
                keep_idx.append(i)
        columns = [[cols[c][i] for i in keep_idx] for c in self.schema.names]
        raws = [json.dumps({c: cols[c][i] for c in self.schema.names}, default=str) for i in keep_idx]
        return _typed(columns, self.schema, self.quarantine, str(path), first, keep_idx, raws)
