"""Parquet logs: record batches of ``chunk_rows`` rows, typed by a :class:`Schema` with either engine.

Row ``first + i`` of a file (0-based) is reported as its line; a null is quarantined as ``missing:<field>``.
The ``arrow`` engine casts whole columns; a column of a type it cannot take as is (a string where a
number is expected, unsigned 64-bit integers) sends the chunk to the ``python`` rules, value by value.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from leanml.errors import LeanmlError
from leanml.features.read.logschema import (
    ARROW_TYPES,
    Chunk,
    Origin,
    Quarantine,
    Schema,
    finish_chunk,
    objects_to_arrow,
    typed_columns,
)


def parquet_chunks(path: Path, schema: Schema, quarantine: Quarantine, chunk_rows: int,
                   engine: str = "arrow") -> Iterator[tuple[int, Any]]:
    """``(rows, parse)`` per record batch of a Parquet file: ``parse()`` gives its typed columns."""
    import pyarrow.parquet as pq

    if not path.exists():
        raise LeanmlError(f"log file {path} does not exist; check the path")
    pf = pq.ParquetFile(path)
    missing = [n for n in schema.names if n not in pf.schema_arrow.names]
    if missing:
        raise LeanmlError(f"{path} lacks columns {missing}; it has {pf.schema_arrow.names}")
    row = 0
    for batch in pf.iter_batches(batch_size=chunk_rows, columns=schema.names):
        first = row
        row += batch.num_rows
        yield batch.num_rows, lambda b=batch, f=first: parquet_chunk(b, schema, quarantine, path, f, engine)


def parquet_chunk(batch: Any, schema: Schema, quarantine: Quarantine, path: Path, first: int,
                  engine: str = "arrow") -> Chunk:
    """One record batch -> typed columns; bad rows to ``quarantine``."""
    if engine == "arrow":
        out = _parquet_arrow(batch, schema, quarantine, path, first)
        if out is not None:
            return out
        return objects_to_arrow(_parquet_python(batch, schema, quarantine, path, first), schema)
    return _parquet_python(batch, schema, quarantine, path, first)


def _parquet_arrow(batch: Any, schema: Schema, quarantine: Quarantine, path: Path, first: int) -> Chunk | None:
    cols: dict[str, Any] = {}
    missing: list[tuple[str, str, np.ndarray]] = []
    reasons: list[tuple[str, str, np.ndarray]] = []
    for name, typ in schema.fields:
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
            values = np.asarray(col.cast(ARROW_TYPES[typ]))
            cols[name] = values
            if typ == "float":
                bad = ~np.isfinite(values)
                if bad.any():
                    reasons.append((name, f"bad_float:{name}", bad))
    line_of_row = np.arange(batch.num_rows, dtype=np.int64)

    def raw(k: int) -> str:
        return json.dumps({c: batch.column(c)[k].as_py() for c in schema.names}, default=str)

    return finish_chunk(cols, missing + reasons, Origin(quarantine, str(path), first), line_of_row, raw)


def _parquet_python(batch: Any, schema: Schema, quarantine: Quarantine, path: Path, first: int) -> Chunk:
    cols = {n: batch.column(n).to_pylist() for n in schema.names}
    n = batch.num_rows
    keep_idx = []
    for i in range(n):
        nulls = [c for c in schema.names if cols[c][i] is None]
        if nulls:
            raw = json.dumps({c: cols[c][i] for c in schema.names}, default=str)
            quarantine.add(str(path), first + i, f"missing:{nulls[0]}", raw, f"field {nulls[0]!r} absent or null")
        else:
            keep_idx.append(i)
    columns = [[cols[c][i] for i in keep_idx] for c in schema.names]
    raws = [json.dumps({c: cols[c][i] for c in schema.names}, default=str) for i in keep_idx]
    return typed_columns(columns, schema, quarantine, str(path), first, keep_idx, raws)
