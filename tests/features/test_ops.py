"""FeatureBox operators and hashing against plain-Python references."""

from __future__ import annotations

import bisect
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leanml.errors import LeanmlError
from leanml.features.ops import (
    Bucketize,
    ContentIdLookup,
    Cross,
    DictJoin,
    Filter,
    Hash,
    LogTransform,
    Normalize,
    OpContext,
    Ragged,
    Split,
    TruncatePad,
    op_from_spec,
    write_content_id_table,
)
from leanml.features.ops import hashing as H

FAST = settings(max_examples=40, deadline=None)
ints64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
texts = st.text(max_size=12)


def run(op, *cols, torch_path=False):
    ctx = OpContext()
    if torch_path:
        conv = [Ragged(torch.from_numpy(c.values), torch.from_numpy(c.offsets)) if isinstance(c, Ragged)
                else torch.from_numpy(c) for c in cols]
        outs = op.forward_torch(conv, ctx)
        return [Ragged(o.values.numpy(), o.offsets.numpy()) if isinstance(o, Ragged) else o.numpy() for o in outs]
    return op.forward(list(cols), ctx)


def obj(values):
    a = np.empty(len(values), dtype=object)
    a[:] = values
    return a


# ------------------------------------------------------------------------------------------- hashing
@FAST
@given(st.lists(ints64, min_size=1, max_size=30), st.integers(0, 2**32), st.sampled_from([None, 1, 7, 1000003]))
def test_hash_ints_matches_reference_numpy_and_torch(values, seed, buckets):
    x = np.array(values, dtype=np.int64)
    ref = [H.ref_bucket(H.ref_hash_value(v, seed), buckets) for v in values]
    got = H.to_sign(H.hash_values(x, seed), buckets)
    assert got.tolist() == ref
    assert (got >= 0).all()
    tor = H.to_sign_torch(H.hash_ints_torch(torch.from_numpy(x), seed), buckets)
    assert tor.tolist() == ref


@FAST
@given(st.lists(texts, min_size=1, max_size=30), st.integers(0, 2**32))
def test_hash_strings_matches_reference(values, seed):
    got = H.to_sign(H.hash_values(obj(values), seed))
    assert got.tolist() == [H.ref_bucket(H.ref_hash_value(v, seed), None) for v in values]


def test_fnv_reference_known_vectors():
    # published FNV-1a 64 test vectors
    assert H.ref_fnv1a(b"") == 0xCBF29CE484222325
    assert H.ref_fnv1a(b"a") == 0xAF63DC4C8601EC8C
    assert H.ref_fnv1a(b"foobar") == 0x85944171F73967E8


@FAST
@given(st.lists(st.tuples(ints64, texts, st.integers(-5, 5)), min_size=1, max_size=20), st.integers(0, 999))
def test_cross_matches_reference(rows, seed):
    a = np.array([r[0] for r in rows], dtype=np.int64)
    b = obj([r[1] for r in rows])
    c = np.array([r[2] for r in rows], dtype=np.int64)
    op = Cross(inputs=["a", "b", "c"], output="x", buckets=99991, seed=seed)
    (got,) = run(op, a, b, c)
    assert got.tolist() == [H.ref_bucket(H.ref_cross(list(r), seed), 99991) for r in rows]
    op2 = Cross(inputs=["a", "c"], output="x", seed=seed)
    (t,) = run(op2, a, c, torch_path=True)
    assert t.tolist() == [H.ref_bucket(H.ref_cross([r[0], r[2]], seed), None) for r in rows]


def test_cross_order_and_seed_matter():
    a, b = np.arange(50, dtype=np.int64), np.arange(50, dtype=np.int64)[::-1].copy()
    x1 = run(Cross(inputs=["a", "b"], output="x"), a, b)[0]
    x2 = run(Cross(inputs=["b", "a"], output="x"), b, a)[0]
    x3 = run(Cross(inputs=["a", "b"], output="y"), a, b)[0]
    assert (x1 != x2).mean() > 0.9 and (x1 != x3).mean() > 0.9


def test_hash_stable_across_processes():
    code = ("import numpy as np; from leanml.features.ops import hashing as H;"
            "x=np.array([0,1,-1,2**62,123456789],dtype=np.int64);"
            "s=np.array(['','user 1','zürich','a|b'],dtype=object);"
            "print(H.to_sign(H.hash_values(x,5),1000003).tolist(), H.to_sign(H.hash_values(s,9)).tolist(),"
            " H.to_sign(H.cross_values([x[:4],s],3)).tolist())")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={"PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin"}, check=True)
    x = np.array([0, 1, -1, 2**62, 123456789], dtype=np.int64)
    s = obj(["", "user 1", "zürich", "a|b"])
    here = (f"{H.to_sign(H.hash_values(x, 5), 1000003).tolist()} {H.to_sign(H.hash_values(s, 9)).tolist()} "
            f"{H.to_sign(H.cross_values([x[:4], s], 3)).tolist()}")
    assert r.stdout.strip() == here


# ----------------------------------------------------------------------------------------------- ops
@FAST
@given(st.lists(st.lists(st.integers(-10**12, 10**12), max_size=6), min_size=1, max_size=20))
def test_split_int_and_hash_ragged(rows):
    col = obj(["|".join(map(str, r)) for r in rows])
    (rag,) = run(Split(input="h", output="l", dtype="int"), col)
    assert rag.rows() == rows
    (hashed,) = run(Hash(input="l", output="hl", buckets=1000, seed=3), rag)
    assert hashed.rows() == [[H.ref_bucket(H.ref_hash_value(v, 3), 1000) for v in r] for r in rows]
    (th,) = run(Hash(input="l", output="hl", buckets=1000, seed=3), rag, torch_path=True)
    assert th.rows() == hashed.rows()


@FAST
@given(st.lists(st.lists(st.text(alphabet="ab c1é", min_size=1, max_size=4), max_size=5), min_size=1, max_size=20))
def test_split_str(rows):
    col = obj(["|".join(r) for r in rows])
    (rag,) = run(Split(input="s", output="l"), col)
    assert rag.rows() == rows


def test_split_int_drops_and_counts_bad_items():
    ctx = OpContext()
    (rag,) = Split(input="h", output="l", dtype="int").forward([obj(["1|x|3", "", "4 |5", "2.5|7"])], ctx)
    assert rag.rows() == [[1, 3], [], [4, 5], [7]]
    assert ctx.counters["l:bad_items"] == 2


@FAST
@given(st.lists(st.floats(-100, 100), min_size=1, max_size=40),
       st.lists(st.floats(-50, 50), min_size=1, max_size=6, unique=True))
def test_bucketize(values, bounds):
    bounds = sorted(bounds)
    x = np.array(values)
    op = Bucketize(input="x", output="b", boundaries=bounds)
    ref = [bisect.bisect_right(bounds, v) for v in values]
    assert run(op, x)[0].tolist() == ref
    assert run(op, x, torch_path=True)[0].tolist() == ref
    assert op.cardinality("b") == len(bounds) + 1


@FAST
@given(st.lists(st.floats(-1e4, 1e4), min_size=1, max_size=40), st.floats(-10, 10), st.floats(0.1, 100),
       st.sampled_from([None, 2.0]))
def test_normalize_and_log(values, mean, std, clip):
    x = np.array(values)
    op = Normalize(input="x", output="z", mean=mean, std=std, clip=clip)
    ref = [(v - mean) / std for v in values]
    ref = [max(-clip, min(clip, r)) for r in ref] if clip else ref
    np.testing.assert_allclose(run(op, x)[0], ref, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(run(op, x, torch_path=True)[0], ref, rtol=1e-5, atol=1e-4)
    lg = LogTransform(input="x", output="l")
    ref_log = [math.log1p(max(v, 0.0)) for v in values]
    np.testing.assert_allclose(run(lg, x)[0], ref_log, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(run(lg, x, torch_path=True)[0], ref_log, rtol=1e-6, atol=1e-7)


@FAST
@given(st.lists(st.lists(st.integers(0, 10**6), max_size=9), min_size=1, max_size=20), st.integers(1, 6),
       st.sampled_from(["first", "last"]))
def test_truncate_pad(rows, max_len, keep):
    rag = Ragged.from_rows(rows)
    op = TruncatePad(input="l", output="p", max_len=max_len, keep=keep, pad=-1)
    ref = []
    for r in rows:
        kept = r[:max_len] if keep == "first" else r[-max_len:] if r else []
        ref.append(kept + [-1] * (max_len - len(kept)))
    assert run(op, rag)[0].tolist() == ref
    assert run(op, rag, torch_path=True)[0].tolist() == ref


def test_dict_join_and_filter(tmp_path):
    (tmp_path / "users.jsonl").write_text(
        '{"uid": 1, "age": 30, "city": "Oslo"}\n{"uid": 5, "age": 41, "city": "Rome"}\n'
        '{"uid": 9, "age": 22, "city": null}\n')
    op = DictJoin(input="u", table="users.jsonl", key="uid", columns={"age": "age", "city": "city"},
                  defaults={"age": -1, "city": "?"}, found="hit")
    keys = np.array([5, 2, 1, 9, 5], dtype=np.int64)
    ctx = OpContext(data_dir=tmp_path)
    age, city, hit = op.forward([keys], ctx)
    table = {1: (30, "Oslo"), 5: (41, "Rome"), 9: (22, "")}
    assert age.tolist() == [table.get(k, (-1, "?"))[0] for k in keys.tolist()]
    assert city.tolist() == [table.get(k, (-1, "?"))[1] for k in keys.tolist()]
    assert hit.tolist() == [int(k in table) for k in keys.tolist()]
    assert ctx.counters[f"{op.name}:misses"] == 1
    (mask,) = Filter(input="age", output="k", cmp=">=", value=30).forward([age], ctx)
    assert mask.tolist() == [a >= 30 for a in age.tolist()]
    (mask2,) = Filter(input="city", output="k2", cmp="in", value=["Oslo", "?"]).forward([city], ctx)
    assert mask2.tolist() == [c in ("Oslo", "?") for c in city.tolist()]
    with pytest.raises(LeanmlError, match="not found"):
        DictJoin(input="u", table="nope.jsonl", key="uid", columns={"age": "a"}).forward([keys], ctx)


def test_content_id_lookup(tmp_path):
    rng = np.random.default_rng(0)
    ads = np.array([10, 20, 30, 40], dtype=np.int64)
    codes = rng.integers(0, 256, (4, 3))
    write_content_id_table(tmp_path / "vis.parquet", ads, codes, k=256)
    op = ContentIdLookup(input="ad", output="vis", table="vis.parquet")
    q = np.array([30, 99, 10, 40, 30], dtype=np.int64)
    (out,) = op.forward([q], OpContext(data_dir=tmp_path))
    ref = {int(a): list(map(int, c)) for a, c in zip(ads, codes)}
    assert out.tolist() == [ref.get(int(a), [256] * 3) for a in q]
    assert op.cardinality("vis") == 257
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"ad_id": pa.array([1], pa.int64()), "visual_ids": pa.array([[1, 2]])}),
                   tmp_path / "bad.parquet")
    with pytest.raises(LeanmlError, match="metadata key 'M'"):
        ContentIdLookup(input="ad", output="v", table="bad.parquet").forward([q], OpContext(data_dir=tmp_path))


def test_op_spec_roundtrip_and_errors():
    for op in [Hash(input="a", output="b", buckets=5), Cross(inputs=["a", "b"], output="c", buckets=9),
               TruncatePad(input="l", output="p", max_len=3, keep="last", placement="gpu"),
               Filter(input="x", output="k", cmp="in", value=[1, 2])]:
        again = op_from_spec(op.spec())
        assert again.spec() == op.spec() and again.inputs == op.inputs and again.outputs == op.outputs
    with pytest.raises(LeanmlError, match="unknown op"):
        op_from_spec({"op": "frobnicate"})
    with pytest.raises(LeanmlError, match="unknown keys"):
        op_from_spec({"op": "hash", "input": "a", "output": "b", "bucket": 3})
    with pytest.raises(LeanmlError, match="no GPU implementation"):
        DictJoin(input="u", table="t", key="k", columns={"a": "b"}, placement="gpu")
    with pytest.raises(LeanmlError, match="at least two"):
        Cross(inputs=["a"], output="c")


# ---------------------------------------------------------------------------------- arrow string columns
@FAST
@given(st.lists(texts, min_size=1, max_size=30), st.integers(0, 2**32))
def test_hash_arrow_strings_matches_reference(values, seed):
    import pyarrow as pa

    got = H.to_sign(H.hash_values(pa.array(values), seed))
    assert got.tolist() == [H.ref_bucket(H.ref_hash_value(v, seed), None) for v in values]
    sliced = pa.array(["pad", *values])[1:]  # a sliced array (non-zero offset) hashes the same
    assert H.to_sign(H.hash_values(sliced, seed)).tolist() == got.tolist()


def test_split_on_arrow_follows_python_int_rules():
    import pyarrow as pa

    rows = ["1|0x10|3", "", "4 |5", "+7|-8", "|", "9223372036854775808|2", "٣|1"]
    ctx = OpContext()
    (rag,) = Split(input="h", output="l", dtype="int").forward([pa.array(rows)], ctx)
    ref = []
    bad = 0
    for r in rows:
        items = r.split("|") if r else []
        kept = []
        for x in items:
            try:
                v = int(x)
                ok = -(2**63) <= v < 2**63
            except ValueError:
                ok = False
            kept += [v] if ok else []
            bad += not ok
        ref.append(kept)
    assert rag.rows() == ref and ctx.counters["l:bad_items"] == bad
    (words,) = Split(input="t", output="w", sep=" ").forward([pa.array(["a b", "", "c  d"])], OpContext())
    assert words.rows() == [["a", "b"], [], ["c", "", "d"]]


def test_filter_on_arrow_strings():
    import pyarrow as pa

    col = pa.array(["a", "b", "", "c"])
    for cmp, value in (("==", "b"), ("!=", "b"), ("<", "b"), ("in", ["a", "c"]), ("not_in", ["a"])):
        (m,) = Filter(input="s", output="k", cmp=cmp, value=value).forward([col], OpContext())
        (ref,) = Filter(input="s", output="k", cmp=cmp, value=value).forward([obj(col.to_pylist())], OpContext())
        assert m.tolist() == ref.tolist()


@pytest.mark.parametrize("keys", [[1, 5, 9, -3], [10**15, 7, -(2**40)]], ids=["dense", "sparse"])
def test_dict_join_key_index(tmp_path, keys):
    import pyarrow as pa

    (tmp_path / "t.jsonl").write_text("".join(f'{{"k": {k}, "v": {i}}}\n' for i, k in enumerate(keys)))
    op = DictJoin(input="x", table="t.jsonl", key="k", columns={"v": "v"}, defaults={"v": -1}, found="f")
    q = np.array([*keys, 2, 10**16, -(2**63)], dtype=np.int64)[::-1].copy()
    ctx = OpContext(data_dir=tmp_path)
    v, f = op.forward([q], ctx)
    ref = {k: i for i, k in enumerate(keys)}
    assert v.tolist() == [ref.get(int(k), -1) for k in q] and f.tolist() == [int(int(k) in ref) for k in q]
    assert (op.prepare(ctx)[0].lut is not None) == (max(keys) - min(keys) < 1 << 22)
    (v2, _) = op.forward([pa.array([str(k) for k in q])], ctx)  # string keys against int keys: all missing
    assert (v2 == -1).all()


def test_table_too_large_for_memory(tmp_path, monkeypatch):
    from leanml.features.ops import join

    (tmp_path / "big.jsonl").write_text('{"k": 1, "v": 2}\n' * 1000)
    monkeypatch.setattr(join, "memory_available", lambda: 10_000)
    op = DictJoin(input="x", table="big.jsonl", key="k", columns={"v": "v"})
    with pytest.raises(LeanmlError, match=r"big.jsonl needs about .* GiB in memory but only .* available"):
        op.forward([np.array([1])], OpContext(data_dir=tmp_path))
    assert join.table_memory_estimate(tmp_path / "big.jsonl") == 3 * 17 * 1000


def test_strings_that_differ_by_nul_bytes_hash_apart(monkeypatch):
    """pandas before 3 factorizes '' and '\\x00' (and 'a', 'a\\x00') as one value; the hash must not."""
    import pandas as pd

    vals = obj(["", "\x00", "a\x00", "a", "", "a"])
    want = [H.ref_bucket(H.ref_cross([v], 0), None) for v in vals]
    assert H.to_sign(H.cross_values([vals], 0)).tolist() == want
    real = pd.factorize

    def merging(values, use_na_sentinel=True):  # what pandas 2.x does with NUL bytes
        return real(np.array([str(v).rstrip("\x00") for v in values], dtype=object), use_na_sentinel=use_na_sentinel)

    monkeypatch.setattr(H.pd, "factorize", merging)
    assert H.to_sign(H.cross_values([vals], 0)).tolist() == want
    codes, uniques = H.factorize_exact(vals)
    assert codes.tolist() == [0, 1, 2, 3, 0, 3] and uniques.tolist() == ["", "\x00", "a\x00", "a"]
