"""Graphs, YAML, the layer-wise plan and executor, and the arena."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from leanml.cli import main as cli_main
from leanml.errors import LeanmlError
from leanml.features.ops import Cross, Filter, Hash, LogTransform, Normalize, Split, TruncatePad
from leanml.features.run.arena import ALIGN, Arena
from leanml.features.run.graph import FeatureGraph, graph, load_graph
from leanml.features.run.scheduler import LayerwiseExecutor, make_plan

SCHEMA = {"a": "int", "b": "int", "s": "str", "y": "int"}


def branching() -> FeatureGraph:
    """a -> ha ------------\\
       b -> hb -> x(ha,hb,b) -> (output)
       s -> split -> hash -> pad
       a -> log -> norm;  filter on b"""
    return graph("branch", SCHEMA, [
        Hash(input="a", output="ha", buckets=1000, placement="gpu"),
        Hash(input="b", output="hb", buckets=1000),
        Cross(inputs=["ha", "hb", "b"], output="x", buckets=5000),
        Split(input="s", output="sl", dtype="int"),
        Hash(input="sl", output="sh", buckets=100, placement="gpu"),
        TruncatePad(input="sh", output="sp", max_len=4, placement="gpu"),
        LogTransform(input="a", output="la", placement="gpu"),
        Normalize(input="la", output="na", mean=1.0, std=2.0),
        Filter(input="b", output="keep", cmp="!=", value=3),
    ], label="y", sparse=["ha", "hb", "x"], dense=["na"], sequence=["sp"])


def test_levels_of_branching_dag():
    levels = branching().levels()
    names = [sorted(op.name for op in lv) for lv in levels]
    assert names == [["ha", "hb", "keep", "la", "sl"], ["na", "sh", "x"], ["sp"]]


def _ref_levels(deps: dict[int, list[int]]) -> dict[int, int]:
    """Longest-path depth by repeated relaxation (independent of the recursive implementation)."""
    lvl = dict.fromkeys(deps, 0)
    for _ in range(len(deps)):
        for i, ds in deps.items():
            for d in ds:
                lvl[i] = max(lvl[i], lvl[d] + 1)
    return lvl


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.integers(0, 100), max_size=3), min_size=1, max_size=12))
def test_levels_random_dags(raw):
    deps = {i: sorted({d % i for d in ds}) if i else [] for i, ds in enumerate(raw)}
    ops = []
    for i, ds in deps.items():
        ins = [f"c{d}" for d in ds] or ["a"]
        ops.append(Cross(inputs=[*ins, "b"], output=f"c{i}", buckets=7) if ins else None)
    g = graph("rand", SCHEMA, ops, label="y", sparse=[f"c{i}" for i in deps])
    ref = _ref_levels(deps)
    for k, lv in enumerate(g.levels()):
        for op in lv:
            assert ref[int(op.outputs[0][1:])] == k
        produced = {c for op in lv for c in op.outputs}
        assert not any(c in produced for op in lv for c in op.inputs)  # no dependency inside a level


def test_graph_errors():
    with pytest.raises(LeanmlError, match="cycle"):
        graph("cyc", SCHEMA, [Cross(inputs=["p", "a"], output="q"), Cross(inputs=["q", "a"], output="p")],
              label="y", sparse=["p"])
    with pytest.raises(LeanmlError, match="neither the schema"):
        graph("bad", SCHEMA, [Hash(input="nope", output="h")], label="y", sparse=["h"])
    with pytest.raises(LeanmlError, match="written by both"):
        graph("dup", SCHEMA, [Hash(input="a", output="h"), Hash(input="b", output="h", name="h2")],
              label="y", sparse=["h"])
    with pytest.raises(LeanmlError, match="does not parse"):
        FeatureGraph.from_yaml("ops: [")
    with pytest.raises(LeanmlError, match="bundled graph"):
        load_graph("no_such_graph")


def test_yaml_roundtrip_and_bundled_graph():
    g = branching()
    again = FeatureGraph.from_yaml(g.to_yaml())
    assert again.to_dict() == g.to_dict()
    ml = load_graph("movielens")
    assert FeatureGraph.from_yaml(ml.to_yaml()).to_dict() == ml.to_dict()
    assert ml.cardinality("hist_seq") == 100003 and ml.cardinality("age_bucket") == 7


def test_plan_transfers_only_at_level_boundaries():
    g = branching()
    cpu = make_plan(g, cuda=False)
    assert cpu.transfers == [] and set(cpu.device.values()) == {"cpu"}
    gpu = make_plan(g, cuda=True)
    moved = {(t.level, t.column, t.src, t.dst) for t in gpu.transfers}
    assert (0, "a", "cpu", "cuda") in moved  # raw input to the GPU hash and log
    assert (1, "sl", "cpu", "cuda") in moved  # split output (CPU) into the GPU hash
    assert (1, "la", "cuda", "cpu") in moved  # GPU log output into the CPU normalize
    assert (1, "ha", "cuda", "cpu") in moved  # GPU hash into the CPU cross
    assert sum(t.column == "a" for t in gpu.transfers) == 1  # copied once, reused by both GPU ops
    n_levels = len(gpu.levels)
    assert {(t.column, t.dst) for t in gpu.transfers if t.level == n_levels} == {("sp", "cpu")}
    assert all(0 <= t.level <= n_levels for t in gpu.transfers)
    text = gpu.table()
    assert "level 2" in text and "transfer sp: cuda -> cpu" in text


def _chunk(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    s = np.empty(n, dtype=object)
    s[:] = ["|".join(map(str, rng.integers(0, 50, rng.integers(0, 7)))) for _ in range(n)]
    return {"a": rng.integers(0, 100, n), "b": rng.integers(0, 6, n), "s": s, "y": rng.integers(0, 2, n)}


def test_executor_threads_torch_and_filter_agree():
    g = branching()
    chunk = _chunk(300)
    base = LayerwiseExecutor(g, threads=1).run(chunk)
    keep = chunk["b"] != 3
    assert len(base) == keep.sum()
    assert base.label.tolist() == chunk["y"][keep].astype(float).tolist()
    assert LayerwiseExecutor(g, threads=3).run(chunk).equal(base)
    tor = LayerwiseExecutor(g, force_torch=True).run(chunk)  # torch kernels: ids exact, floats to rounding
    assert tor.sparse.equal(base.sparse) and tor.seqs[0].equal(base.seqs[0]) and tor.label.equal(base.label)
    np.testing.assert_allclose(tor.dense.numpy(), base.dense.numpy(), rtol=1e-6)
    assert LayerwiseExecutor(g, arena=False).run(chunk).equal(base)
    # the filtered ragged column stayed aligned with its rows
    rows = [r for r, k in zip(chunk["s"], keep) if k]
    lengths = [len(r.split("|")) if r else 0 for r in rows]
    assert ((base.seqs[0] >= 0).sum(1).tolist()) == [min(n, 4) for n in lengths]


def test_cli_plan(capsys):
    assert cli_main(["features", "plan", "movielens", "--assume-cuda"]) == 0
    out = capsys.readouterr().out
    assert "level 0" in out and "cuda" in out and "transfer" in out
    assert cli_main(["features", "plan", "missing.yaml"]) == 2


# ---------------------------------------------------------------------------------------------- arena
@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 3000), st.sampled_from(["i8", "f4", "u1", "i4"])),
                         max_size=15), min_size=1, max_size=5), st.integers(0, 20000))
def test_arena_never_overlaps_live_buffers(batches, capacity):
    arena = Arena(capacity, growth=1.5)
    for allocs in batches:
        live = []
        for k, (n, dt) in enumerate(allocs):
            arr = arena.alloc(n, dt)
            assert arr.shape == (n,) and arr.dtype == np.dtype(dt)
            if n and arena.capacity and np.shares_memory(arr, arena._buf):
                assert (arr.__array_interface__["data"][0] - arena._buf.__array_interface__["data"][0]) % ALIGN == 0
            arr.fill(k % 100 + 1)
            for other, _ in live:
                assert not np.shares_memory(arr, other)
            live.append((arr, k % 100 + 1))
        for arr, v in live:  # nobody overwrote anybody
            assert (arr == v).all()
        arena.reset()
    st_ = arena.stats
    assert st_.resets == len(batches)
    assert st_.bytes_allocated == sum(n * np.dtype(dt).itemsize for a in batches for n, dt in a)


def test_arena_growth_and_reuse():
    arena = Arena(1024, growth=2.0)
    for _ in range(3):
        for n in (300, 700, 900):
            arena.alloc(n, np.int64)
        arena.reset()
    s = arena.stats
    assert s.grows == 1 and s.spill_allocations > 0
    assert arena.capacity >= 8 * (300 + 700 + 900)
    # the third batch fits entirely into memory the second batch already used
    assert s.bytes_reused >= 8 * (300 + 700 + 900) - 3 * ALIGN
    assert s.peak_bytes >= 8 * (300 + 700 + 900)


# ------------------------------------------------------------------------------------ per-entity features
def test_entity_scopes_of_the_movielens_graph():
    from leanml.features.run.scheduler import entity_scopes

    scope = entity_scopes(load_graph("movielens"))
    user = {"gender_id", "occupation_id", "zip_id", "age_bucket", "age_log"}
    item = {"known_item", "year_z", "genre_list", "title_words", "genre_ids", "title_ids", "genre_seq", "title_seq"}
    assert scope == {**dict.fromkeys(user, "join_user"), **dict.fromkeys(item, "join_item")}
    text = make_plan(load_graph("movielens"), cuda=True).table()
    import re

    assert "once per entity of join_item" in text and re.search(r"known_item\s+filter\s+gathered from join_item", text)
    assert "13 per entity" in text


def test_per_entity_execution_matches_per_row(tmp_path):
    """Entity mode (arrow reader, ops once per user/item, gathered) == every op per row (Python reader)."""
    from leanml.features.options import PipelineOptions
    from leanml.features.read.data import LogSpec, generate_logs
    from leanml.features.run.batch import FeatureBatch
    from leanml.features.run.extract import ExtractConfig, Extractor

    generate_logs(tmp_path, LogSpec(3000, seed=2, unknown_item_rate=0.05, malformed_rate=0.01), progress=False)
    (tmp_path / "users.jsonl").write_text("\n".join((tmp_path / "users.jsonl").read_text().splitlines()[::2]) + "\n")
    cfg = ExtractConfig.build("movielens", [tmp_path / "impressions_000.tsv"], PipelineOptions(batch_rows=500))
    fast = Extractor(cfg)
    ref = Extractor(ExtractConfig.build("movielens", [tmp_path / "impressions_000.tsv"],
                                        PipelineOptions(batch_rows=500, reader="python", entity=False)))
    a, b = list(fast), list(ref)
    assert len(a) == len(b) and all(x.equal(y) for x, y in zip(a, b))
    assert 2000 < len(FeatureBatch.concat(a)) < 3000  # unknown items filtered, malformed lines quarantined
    sa, sb = fast.report(), ref.report()
    assert sa.quarantined == sb.quarantined
    assert sa.exec["counters"]["filtered_rows"] == sb.exec["counters"]["filtered_rows"]
    assert sa.exec["counters"]["join_user:misses"] == sb.exec["counters"]["join_user:misses"] > 0
    assert "<per-entity join_item>" in sa.exec["op_seconds"] and "title_words" not in sa.exec["op_seconds"]
    assert "title_words" in sb.exec["op_seconds"]
