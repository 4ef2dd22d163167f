"""TSV and JSON-lines logs (optionally gzip): whole-line chunks, parsed by either engine.

* ``arrow`` (default): files are cut into chunks of whole lines with a vectorised newline scan, and
  each chunk is parsed by ``pyarrow.csv`` (an invalid-row handler collects rows with the wrong field
  count) or ``pyarrow.json``, with typed conversion in C++ (the GIL is released). Values arrow cannot
  take are re-checked one by one with the Python rules; a chunk arrow cannot read as a whole (bad
  UTF-8, a lone carriage return, JSON that is not one object per line, blank JSON lines) goes through
  the Python engine.
* ``python``: the line-by-line reference implementation.

Both give the same rows, the same quarantine reasons and the same line numbers.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.json as pjson

from leanml.errors import LeanmlError
from leanml.features.read.logschema import (
    ARROW_TYPES,
    Chunk,
    Origin,
    Quarantine,
    Schema,
    arrow_convert,
    finish_chunk,
    objects_to_arrow,
    typed_columns,
)


def open_binary(path: Path) -> IO[bytes]:
    if not path.exists():
        raise LeanmlError(f"log file {path} does not exist; check the path (or generate logs first)")
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")  # noqa: SIM115


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
    return typed_columns(columns, schema, quarantine, source, first_line, idx, rows_text)


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
            quarantine.add(source, first_line + i, f"missing:{missing[0]}", text,
                           f"field {missing[0]!r} absent or null")
            continue
        for c, v in zip(cols, vals):
            c.append(v)
        idx.append(i)
        raws.append(text)
    return typed_columns(cols, schema, quarantine, source, first_line, idx, raws)



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


def checked_read(chunks: Iterator[tuple[int, bytes, np.ndarray]], path: Path
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
        types = {n: (ARROW_TYPES[t] if typed else pa.string()) for n, t in schema.fields}
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
            values, bad = arrow_convert(col, typ, strict_int)
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
    return finish_chunk(cols, reasons, Origin(quarantine, source, first_line), line_of_row,
                        lambda k: _line_text(buf, ends, int(line_of_row[k])), extra_bad=blank, raw_cols=raw_cols)


def _arrow_jsonl(buf: bytes, ends: np.ndarray, schema: Schema, quarantine: Quarantine, source: str,
                 first_line: int) -> Chunk | None:
    """Parse one chunk of JSON lines with ``pyarrow.json``; None when the chunk needs the Python engine."""
    if not _utf8_ok(buf) or _blank_lines_any(buf, ends):
        return None
    arrow_schema = pa.schema([(n, ARROW_TYPES[t]) for n, t in schema.fields])
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
    return finish_chunk(cols, missing + reasons, Origin(quarantine, source, first_line), line_of_row,
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


def parse_tsv_chunk(buf: bytes, ends: np.ndarray, schema: Schema, quarantine: Quarantine, source: str,
                    first_line: int, sep: str = "\t", engine: str = "arrow") -> Chunk:
    """One chunk of TSV lines (see :func:`iter_line_chunks`) -> typed columns; bad rows to ``quarantine``."""
    if engine == "arrow":
        out = _arrow_tsv(buf, ends, schema, quarantine, source, first_line, sep)
        if out is not None:
            return out
        return objects_to_arrow(parse_tsv_lines(_split_lines(buf, ends), schema, quarantine, source,
                                                 first_line, sep), schema)
    return parse_tsv_lines(_split_lines(buf, ends), schema, quarantine, source, first_line, sep)


def parse_jsonl_chunk(buf: bytes, ends: np.ndarray, schema: Schema, quarantine: Quarantine, source: str,
                      first_line: int, engine: str = "arrow") -> Chunk:
    """One chunk of JSON lines -> typed columns; bad rows to ``quarantine``."""
    if engine == "arrow":
        out = _arrow_jsonl(buf, ends, schema, quarantine, source, first_line)
        if out is not None:
            return out
        return objects_to_arrow(parse_json_lines(_split_lines(buf, ends), schema, quarantine, source,
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


def line_chunks(path: Path, fmt: str, schema: Schema, quarantine: Quarantine, chunk_rows: int, sep: str = "\t",
                engine: str = "arrow") -> Iterator[tuple[int, Any]]:
    """``(lines, parse)`` per chunk of a TSV or JSON-lines file: ``parse()`` gives its typed columns (only
    the chunks a reader keeps are parsed)."""
    with open_binary(path) as fh:
        for first, buf, ends in checked_read(iter_line_chunks(fh, chunk_rows), path):
            if fmt == "tsv":
                yield len(ends), lambda b=buf, e=ends, f=first: parse_tsv_chunk(
                    b, e, schema, quarantine, str(path), f, sep, engine)
            else:
                yield len(ends), lambda b=buf, e=ends, f=first: parse_jsonl_chunk(
                    b, e, schema, quarantine, str(path), f, engine)
