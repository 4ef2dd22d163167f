"""Raw log readers: typed chunks, sharding, and malformed rows in quarantine with counts."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from leanml.features.data import LOG_SCHEMA, generate_logs
from leanml.features.readers import LogReader, Quarantine, Schema
from leanml.utils import LeanmlError

SCHEMA = Schema.parse("ts:int,user:int,price:float,tags:str")


def _ref_parse(line: str):
    """Plain-Python reference: the typed row or the quarantine reason."""
    if not line.strip():
        return "empty_line"
    f = line.split("\t")
    if len(f) != 4:
        return "field_count"
    for name, v in (("ts", f[0]), ("user", f[1])):
        try:
            int(v)
        except ValueError:
            return f"bad_int:{name}"
    try:
        p = float(f[2])
        if p != p or p in (float("inf"), float("-inf")):
            return "bad_float:price"
    except ValueError:
        return "bad_float:price"
    return (int(f[0]), int(f[1]), float(f[2]), f[3])


def test_tsv_quarantine_counts_and_rows(tmp_path):
    rng = np.random.default_rng(0)
    lines = []
    for i in range(500):
        line = f"{1000 + i}\t{rng.integers(0, 50)}\t{rng.random() * 10:.3f}\tt{i % 7}|x"
        r = rng.random()
        if r < 0.03:
            line = line.rsplit("\t", 1)[0]
        elif r < 0.06:
            line = line.replace("\t", "\tu", 1)
        elif r < 0.08:
            line = line.replace(line.split("\t")[2], "nan")
        elif r < 0.09:
            line = ""
        lines.append(line)
    raw = "\n".join(lines).encode() + b"\n" + b"7\t8\t1.0\t\xff\xfe\n"  # plus one line of bad UTF-8
    path = tmp_path / "log.tsv"
    path.write_bytes(raw)
    q = Quarantine(tmp_path / "q.jsonl")
    reader = LogReader([path], SCHEMA, chunk_rows=64, quarantine=q)
    chunks = list(reader)
    q.close()
    got = list(zip(*(np.concatenate([c[n] for c in chunks]).tolist() for n in SCHEMA.names)))
    refs = [_ref_parse(x) for x in lines]
    assert got == [r for r in refs if isinstance(r, tuple)]
    expected = {}
    for r in refs:
        if isinstance(r, str):
            expected[r] = expected.get(r, 0) + 1
    expected["bad_utf8"] = 1
    assert dict(q.counts) == expected
    recs = [json.loads(x) for x in (tmp_path / "q.jsonl").read_text().splitlines()]
    assert len(recs) == sum(expected.values())
    for rec in recs:
        if rec["reason"] != "bad_utf8":
            assert _ref_parse(lines[rec["line"] - 1]) == rec["reason"]  # the right line, the right reason
            assert rec["raw"] == lines[rec["line"] - 1]
    assert reader.rows_read + q.total == len(lines) + 1


def test_jsonl_gzip_quarantine(tmp_path):
    rows = [{"ts": 1, "user": 2, "price": 1.5, "tags": "a"}, "not json", [1, 2],
            {"ts": 3, "user": "x", "price": 2, "tags": "b"}, {"ts": 4, "price": 1.0, "tags": "c"},
            {"ts": 5, "user": 6, "price": 3, "tags": None}, {"ts": 6, "user": 7, "price": 0.5, "tags": "d"},
            {"ts": True, "user": 1, "price": 1, "tags": "e"}, {"ts": 7, "user": 8, "price": 1, "tags": 5}]
    path = tmp_path / "log.jsonl.gz"
    with gzip.open(path, "wt") as fh:
        for r in rows:
            fh.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    q = Quarantine()
    chunks = list(LogReader([path], SCHEMA, chunk_rows=4, quarantine=q))
    ts = np.concatenate([c["ts"] for c in chunks]).tolist()
    assert ts == [1, 6]
    assert dict(q.counts) == {"bad_json": 2, "bad_int:user": 1, "missing:user": 1, "missing:tags": 1,
                              "bad_int:ts": 1, "bad_str:tags": 1}


def test_parquet_nulls_and_shards(tmp_path):
    t = pa.table({"ts": pa.array([1, 2, None, 4, 5, 6], pa.int64()), "user": pa.array([1, 2, 3, 4, None, 6]),
                  "price": pa.array([0.5] * 6), "tags": pa.array(["a", "b", "c", "d", "e", "f"]),
                  "extra": pa.array(list(range(6)))})
    pq.write_table(t, tmp_path / "log.parquet")
    q = Quarantine()
    ts = np.concatenate([c["ts"] for c in LogReader([tmp_path / "log.parquet"], SCHEMA, chunk_rows=4,
                                                     quarantine=q)]).tolist()
    assert ts == [1, 2, 4, 6] and dict(q.counts) == {"missing:ts": 1, "missing:user": 1}
    # shards of a line log: disjoint and together complete
    generate_logs(tmp_path / "g", 3000, seed=1, progress=False)
    log = tmp_path / "g" / "impressions_000.tsv"
    full = np.concatenate([c["ts"] for c in LogReader([log], LOG_SCHEMA, chunk_rows=256)])
    parts = [np.concatenate([c["ts"] for c in LogReader([log], LOG_SCHEMA, chunk_rows=256, shard=(i, 3))])
             for i in range(3)]
    assert sorted(np.concatenate(parts).tolist()) == sorted(full.tolist()) and len(full) == 3000
    assert all(len(p) > 0 for p in parts)


def test_generator_malformed_lines_all_quarantined(tmp_path):
    generate_logs(tmp_path, 4000, seed=3, malformed_rate=0.01, gz=True, progress=False)
    log = tmp_path / "impressions_000.tsv.gz"
    lines = gzip.open(log, "rt").read().splitlines()
    bad = sum(not isinstance(_ref_log(x), tuple) for x in lines)
    q = Quarantine()
    reader = LogReader([log], LOG_SCHEMA, chunk_rows=500, quarantine=q)
    n = sum(len(c["ts"]) for c in reader)
    assert bad > 10 and q.total == bad and n == len(lines) - bad
    assert set(q.counts) <= {"field_count", "bad_int:user_id", "bad_int:click"}


def _ref_log(line: str):
    f = line.split("\t")
    if len(f) != 5:
        return "field_count"
    try:
        return tuple(int(x) for x in f[:4]) + (f[4],)
    except ValueError:
        return "bad"


def test_reader_errors(tmp_path):
    with pytest.raises(LeanmlError, match="does not exist"):
        list(LogReader([tmp_path / "missing.tsv"], SCHEMA))
    with pytest.raises(LeanmlError, match="format"):
        list(LogReader([tmp_path / "x.csvx"], SCHEMA))
    with pytest.raises(LeanmlError, match="type"):
        Schema.parse("a:integer")
