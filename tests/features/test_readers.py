"""Raw log readers: typed chunks, sharding, and malformed rows in quarantine with counts."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from leanml.errors import LeanmlError
from leanml.features.read.data import LOG_SCHEMA, LogSpec, generate_logs
from leanml.features.read.logschema import Quarantine, Schema
from leanml.features.read.readers import LogReader

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
    generate_logs(tmp_path / "g", LogSpec(3000, seed=1), progress=False)
    log = tmp_path / "g" / "impressions_000.tsv"
    full = np.concatenate([c["ts"] for c in LogReader([log], LOG_SCHEMA, chunk_rows=256)])
    parts = [np.concatenate([c["ts"] for c in LogReader([log], LOG_SCHEMA, chunk_rows=256, shard=(i, 3))])
             for i in range(3)]
    assert sorted(np.concatenate(parts).tolist()) == sorted(full.tolist()) and len(full) == 3000
    assert all(len(p) > 0 for p in parts)


def test_generator_malformed_lines_all_quarantined(tmp_path):
    generate_logs(tmp_path, LogSpec(4000, seed=3, gz=True, malformed_rate=0.01), progress=False)
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


# ------------------------------------------------------------------------ arrow engine vs Python engine
_INTS = ["1", "-5", "0x10", "+5", " 5", "1_0", "٣", "", "9223372036854775807", "9223372036854775808", "007", "x"]
_FLOATS = ["1.5", "nan", "inf", "-1e5", ".5", "1e400", "abc", "", " 2", "Infinity"]
_STRS = ["a", "", "zürich", "a|b", " ", "0x1"]


def _random_tsv(rng: np.random.Generator, n: int) -> list[str]:
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.04:
            out.append(["", "  ", "\r"][int(rng.integers(0, 3))])
        elif r < 0.09:
            out.append("\t".join(["1"] * int(rng.choice([2, 3, 6]))))
        else:
            out.append("\t".join([
                str(rng.choice(_INTS)) if rng.random() < 0.2 else str(rng.integers(-100, 100)),
                str(rng.choice(_INTS)) if rng.random() < 0.2 else str(rng.integers(0, 100)),
                str(rng.choice(_FLOATS)) if rng.random() < 0.2 else f"{rng.random():.3f}", str(rng.choice(_STRS))]))
    return out


def _read_all(path, engine, chunk, schema=SCHEMA, tmp=None):
    qpath = path.with_suffix(f".{engine}{chunk}.q")
    q = Quarantine(qpath)
    chunks = list(LogReader([path], schema, chunk_rows=chunk, quarantine=q, engine=engine))
    q.close()
    rows = []
    for c in chunks:
        cols = [c[n].to_pylist() if isinstance(c[n], pa.Array) else c[n].tolist() for n in schema.names]
        rows += list(zip(*cols))
    recs = [json.loads(x) for x in qpath.read_text().splitlines()] if qpath.exists() else []
    return rows, sorted(recs, key=lambda r: (r["line"], r["reason"]))


@pytest.mark.parametrize("variant", ["lf", "crlf", "bad_utf8", "lone_cr", "no_final_newline"])
def test_arrow_engine_matches_python_engine_tsv(tmp_path, variant):
    rng = np.random.default_rng(hash(variant) % 2**32)
    raw = "\n".join(_random_tsv(rng, 400)).encode() + (b"" if variant == "no_final_newline" else b"\n")
    if variant == "crlf":
        raw = raw.replace(b"\n", b"\r\n", 60)
    if variant == "bad_utf8":
        raw += b"7\t8\t1.0\t\xff\xfe\n"
    if variant == "lone_cr":
        raw = raw.replace(b"\t", b"\r", 2)
    path = tmp_path / "log.tsv"
    path.write_bytes(raw)
    for chunk in (1, 37, 1000):
        a, b = _read_all(path, "arrow", chunk), _read_all(path, "python", chunk)
        assert a[0] == b[0]  # same rows, same values
        assert a[1] == b[1]  # same quarantine records: line, reason, detail, raw
    assert len(a[0]) > 200 and len(a[1]) > 50


def test_arrow_engine_matches_python_engine_jsonl(tmp_path):
    rng = np.random.default_rng(7)
    lines = []
    for _ in range(400):
        o = {"ts": int(rng.integers(0, 9)), "user": int(rng.integers(0, 9)), "price": float(rng.random()), "tags": "t"}
        k = rng.random()
        if k < 0.03:
            lines.append(["", "not json", "[1, 2]"][int(rng.integers(0, 3))])
            continue
        if k < 0.06:
            o["user"] = "7"
        elif k < 0.09:
            o["price"] = None
        elif k < 0.12:
            del o["tags"]
        elif k < 0.15:
            o["ts"] = True
        elif k < 0.18:
            o["tags"] = 5
        elif k < 0.21:
            o["ts"] = 1.0
        text = json.dumps(o)
        if 0.21 <= k < 0.24:
            text = text.replace(json.dumps(o["price"]), "NaN")
        lines.append(text)
    path = tmp_path / "log.jsonl"
    path.write_text("\n".join(lines) + "\n")
    for chunk in (5, 64, 1000):
        a, b = _read_all(path, "arrow", chunk), _read_all(path, "python", chunk)
        assert a == b
    clean = tmp_path / "clean.jsonl"  # a clean chunk takes the arrow path, not the fallback
    clean.write_text("".join(json.dumps({"ts": i, "user": i, "price": 0.5, "tags": "x"}) + "\n" for i in range(50)))
    chunk = next(iter(LogReader([clean], SCHEMA, chunk_rows=50)))
    assert isinstance(chunk["tags"], pa.Array) and chunk["ts"].tolist() == list(range(50))


def test_line_chunks_are_whole_lines(tmp_path):
    import io

    from leanml.features.read.linelogs import iter_line_chunks

    lines = [f"line {i}" * (i % 5) for i in range(1000)]
    data = "\n".join(lines).encode()  # no final newline
    for chunk_rows, block in ((1, 7), (33, 100), (1000, 1 << 20), (5000, 13)):
        got, first_lines = [], []
        for first, buf, ends in iter_line_chunks(io.BytesIO(data), chunk_rows, block_bytes=block):
            first_lines.append(first)
            assert buf.endswith(b"\n") and len(ends) <= chunk_rows and buf.count(b"\n") == len(ends)
            assert all(buf[e] == 10 for e in ends.tolist())
            got += buf.decode().split("\n")[:-1]
        assert got == lines
        assert first_lines == list(range(1, 1001, chunk_rows))


def test_parquet_arrow_matches_python(tmp_path):
    t = pa.table({"ts": pa.array([1, 2, None, 4, 5, 6], pa.int32()), "user": pa.array([1, 2, 3, 4, None, 6]),
                  "price": pa.array([0.5, float("nan"), 1.0, 2.0, 3.0, 4.0]),
                  "tags": pa.array(["a", "b", "c", "d", "e", None])})
    pq.write_table(t, tmp_path / "log.parquet")
    a, b = _read_all(tmp_path / "log.parquet", "arrow", 4), _read_all(tmp_path / "log.parquet", "python", 4)
    assert a == b and [r[0] for r in a[0]] == [1, 4]
    assert [(r["line"], r["reason"]) for r in a[1]] == [(1, "bad_float:price"), (2, "missing:ts"), (4, "missing:user"),
                                                        (5, "missing:tags")]
