"""The one serving-table contract: writer, reader, bad tables, and FeatureBox's op reading it."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from leanml.ctr.content_ids.schema import SCHEMA_VERSION, global_ids, read_table, write_table
from leanml.errors import LeanmlError
from leanml.features.ops import ContentIdLookup, OpContext, op_from_spec


def _raw_table(path, ad_ids, lists, meta, list_type=None):
    list_type = list_type or pa.list_(pa.int64())
    table = pa.table({"ad_id": pa.array(ad_ids, pa.int64()), "visual_ids": pa.array(lists, list_type)})
    pq.write_table(table.replace_schema_metadata(meta), path)
    return path


def test_round_trip_and_lookup(tmp_path) -> None:
    rng = np.random.default_rng(0)
    ads = np.array([40, 10, 30, 20], dtype=np.int64)
    codes = rng.integers(0, 16, (4, 3))
    write_table(tmp_path / "t.parquet", ads, codes, 16, codebook="rq")
    t = read_table(tmp_path / "t.parquet", m=3, k=16)
    assert t.codebook == "rq" and np.array_equal(t.ad_ids, ads) and np.array_equal(t.codes, codes)
    got, missing = t.lookup(np.array([20, 99, 40]))
    assert missing.tolist() == [False, True, False]
    assert got.tolist() == [codes[3].tolist(), [16] * 3, codes[0].tolist()]
    with pytest.raises(LeanmlError, match="ad 99 has no content IDs"):
        t.lookup(np.array([20, 99]), on_missing="error")
    meta = pq.read_schema(tmp_path / "t.parquet").metadata
    assert meta[b"schema"].decode() == SCHEMA_VERSION
    assert global_ids(codes, 16).tolist() == (codes + np.array([0, 16, 32])).tolist()


def test_other_integer_list_types_are_read(tmp_path) -> None:
    p = _raw_table(tmp_path / "f.parquet", [1, 2], [[1, 2], [3, 0]], {"M": "2", "K": "4"}, pa.list_(pa.int32(), 2))
    t = read_table(p)
    assert t.codes.tolist() == [[1, 2], [3, 0]] and t.codebook == "pq"


@pytest.mark.parametrize(
    ("ad_ids", "lists", "meta", "kwargs", "message"),
    [
        ([1, 2], [[1, 2], [3, 0]], {"M": "2"}, {}, "metadata key 'K' missing"),
        ([1, 2], [[1, 2], [3, 0]], {"M": "2", "K": "4"}, {"m": 3}, "has M=2 codes per ad but 3 are expected"),
        ([1, 2], [[1, 2], [3, 0]], {"M": "2", "K": "4"}, {"k": 8}, "has K=4 codewords but K=8"),
        ([1, 2], [[1, 2], [3, 0, 1]], {"M": "2", "K": "4"}, {}, "ad 2 has 3 codes but metadata says M=2"),
        ([1, 2], [[1, 2], [3, 9]], {"M": "2", "K": "4"}, {}, r"ad 2 has code 9 at position 1, outside \[0, K=4\)"),
        ([1, 2], [[1, 2], [-1, 0]], {"M": "2", "K": "4"}, {}, "ad 2 has code -1"),
        ([1, 2], [[1, 5], [3, 4]], {"M": "2", "K": "4"}, {}, "global ids m\\*K\\+k of the first table format"),
        ([1, 1], [[1, 2], [3, 0]], {"M": "2", "K": "4"}, {}, "ad 1 has more than one row"),
        ([1, 2], [[1, 2], None], {"M": "2", "K": "4"}, {}, "ad 2 has no content IDs"),
        ([1, 2], [[1, 2], []], {"M": "2", "K": "4"}, {}, "ad 2 has no content IDs"),
    ],
)
def test_bad_tables_name_the_file_and_the_ad(tmp_path, ad_ids, lists, meta, kwargs, message) -> None:
    p = _raw_table(tmp_path / "bad.parquet", ad_ids, lists, meta)
    with pytest.raises(LeanmlError, match=message) as err:
        read_table(p, **kwargs)
    assert "bad.parquet" in str(err.value) and "\n" not in str(err.value)


def test_ads_without_ids_can_be_skipped_and_counted(tmp_path) -> None:
    p = _raw_table(tmp_path / "s.parquet", [1, 2, 3], [[1, 2], None, []], {"M": "2", "K": "4"})
    t = read_table(p, on_empty="skip")
    assert t.ad_ids.tolist() == [1] and t.skipped == [2, 3]


def test_writer_refuses_what_the_reader_would_refuse(tmp_path) -> None:
    with pytest.raises(LeanmlError, match="ad 7 has code 4"):
        write_table(tmp_path / "w.parquet", np.array([7]), np.array([[4, 0]]), 4)
    with pytest.raises(LeanmlError, match="ad 3 appears twice"):
        write_table(tmp_path / "w.parquet", np.array([3, 3]), np.array([[1, 0], [0, 1]]), 4)
    assert not (tmp_path / "w.parquet").exists()


def test_featurebox_op_reads_the_same_table(tmp_path) -> None:
    codes = np.array([[1, 2, 0], [3, 3, 3]])
    write_table(tmp_path / "v.parquet", np.array([5, 6]), codes, 4)
    ctx = OpContext(data_dir=tmp_path)
    q = np.array([6, 7, 5], dtype=np.int64)
    op = ContentIdLookup(input="ad", output="vis", table="v.parquet", k=4)
    (out,) = op.forward([q], ctx)
    assert out.tolist() == [[3, 3, 3], [4, 4, 4], [1, 2, 0]] and op.cardinality("vis") == 5
    assert ctx.counters["vis:misses"] == 1
    shifted = op_from_spec({"op": "content_ids", "input": "ad", "output": "v2", "table": "v.parquet", "offset": True})
    (out2,) = shifted.forward([q], ctx)
    assert out2.tolist() == [[3, 8, 13], [4, 9, 14], [1, 7, 10]] and shifted.cardinality("v2") == 15
    strict = ContentIdLookup(input="ad", output="v3", table="v.parquet", on_missing="error")
    with pytest.raises(LeanmlError, match="ad 7 has no content IDs in .*v.parquet"):
        strict.forward([q], ctx)
    with pytest.raises(LeanmlError, match="has M=3 codes per ad but 2 are expected"):
        ContentIdLookup(input="ad", output="v4", table="v.parquet", m=2).forward([q], ctx)
