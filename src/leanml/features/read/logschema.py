"""What a log row is: the :class:`Schema` of a log, the :class:`Quarantine` of rows that cannot be read,
and the rules that turn raw values into typed columns (shared by every log format and both engines).

A chunk (``dict`` of column name -> column) holds ``int`` and ``float`` fields as numpy arrays and ``str``
fields as arrow string arrays (numpy ``object`` arrays in the pure-Python reference engine). A row that
cannot be read is never dropped silently and never crashes the job: it is written to a
:class:`Quarantine` JSON-lines file with its source, line number, reason and raw text, and counted by reason.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from leanml.errors import LeanmlError

TYPES = ("int", "float", "str")
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


def parse_one(v: Any, typ: str) -> Any:
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


def convert_values(values: list[Any], typ: str) -> tuple[np.ndarray, np.ndarray | None]:
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
    parsed = [parse_one(v, typ) for v in values]
    bad = np.fromiter((p is None for p in parsed), dtype=bool, count=n)
    arr = np.array([0 if p is None else p for p in parsed], dtype=dtype) if n else np.empty(0, dtype=dtype)
    return arr, (bad if bad.any() else None)


def typed_columns(columns: list[Sequence[Any]], schema: Schema, quarantine: Quarantine, source: str,
           first_line: int, idx: list[int], raw_rows: list[str]) -> Chunk:
    out: Chunk = {}
    bad_any = np.zeros(len(idx), dtype=bool)
    reasons: dict[int, str] = {}
    for (name, typ), col in zip(schema.fields, columns):
        arr, bad = convert_values(list(col), typ)
        if bad is not None:
            for k in np.flatnonzero(bad & ~bad_any):
                reasons[int(k)] = f"bad_{typ}:{name}"
            bad_any |= bad
        out[name] = arr
    if bad_any.any():
        for k, reason in sorted(reasons.items()):
            name = reason.split(":", 1)[1]
            value = columns[schema.names.index(name)][k]
            quarantine.add(source, first_line + idx[k], reason, raw_rows[k],
                           f"field {name!r} value {value!r} is not {reason[4:].split(':')[0]}")
        keep = ~bad_any
        out = {k: v[keep] for k, v in out.items()}
    return out


ARROW_TYPES = {"int": pa.int64(), "float": pa.float64(), "str": pa.string()}
INT_RE = r"^-?[0-9]{1,18}$"  # what arrow parses exactly as Python's int() does (no hex, no overflow)


def arrow_convert(col: pa.Array, typ: str, strict_int: bool) -> tuple[Any, np.ndarray | None]:
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
        ok = np.asarray(pc.match_substring_regex(col, INT_RE), dtype=bool)
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
        p = parse_one(v, typ)
        if p is not None:
            values[i] = p
            bad[i] = False
    return values, (bad if bad.any() else None)


@dataclass(frozen=True)
class Origin:
    """Where a chunk's rows come from and where its bad rows go: the ``quarantine``, the ``source`` file
    and the line number of the chunk's first line (``first_line``)."""

    quarantine: Quarantine
    source: str
    first_line: int


def finish_chunk(cols: dict[str, Any], bad_reasons: list[tuple[str, str, np.ndarray]], origin: Origin,
                 line_of_row: np.ndarray, raw: Any, extra_bad: np.ndarray | None = None,
                 raw_cols: dict[str, Any] | None = None) -> Chunk:
    """Quarantine rows flagged bad (first reason in ``bad_reasons`` wins: give them in schema order) and
    drop them from every column.

    ``raw(k)`` is row k's text; ``raw_cols[name](k)`` its field as written (for the quarantine detail);
    ``line_of_row[k]`` its line within the chunk (see :class:`Origin`)."""
    quarantine, source, first_line = origin.quarantine, origin.source, origin.first_line
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


def objects_to_arrow(chunk: Chunk, schema: Schema) -> Chunk:
    return {n: (pa.array(chunk[n].tolist(), type=pa.string()) if t == "str" else chunk[n]) for n, t in schema.fields}
