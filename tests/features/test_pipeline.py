"""Pipelined vs two-stage on MovieLens-100k logs: identical feature tensors, identical training, CLI reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from leanml.cli import main as cli_main
from leanml.errors import LeanmlError
from leanml.features.options import PipelineOptions, ProducerOptions, TrainOptions
from leanml.features.read.data import movielens_logs
from leanml.features.run.batch import FeatureBatch
from leanml.features.run.extract import ExtractConfig, Extractor
from leanml.features.run.graph import FeatureGraph
from leanml.features.run.producers import Prefetcher
from leanml.features.train.pipeline import run_pipelined
from leanml.features.train.twostage import extract_to_parquet, read_parquet_batches, run_two_stage

ROWS = 3000


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    full = movielens_logs(tmp_path_factory.mktemp("ml"))
    d = tmp_path_factory.mktemp("ml_small")
    lines = (full / "impressions_train.tsv").read_text().splitlines(keepends=True)[:ROWS]
    lines.insert(100, "881250949\t196\n")  # malformed: too few fields
    lines.insert(2000, "881250949\tabc\t242\t0\t\n")  # malformed: user id is not an int
    (d / "log.tsv").write_text("".join(lines))
    (d / "test.tsv").write_text("".join((full / "impressions_test.tsv").read_text().splitlines(keepends=True)[:1000]))
    for t in ("users.jsonl", "items.jsonl"):
        (d / t).write_text((full / t).read_text())
    return d


def test_pipelined_and_two_stage_produce_identical_tensors(logs, tmp_path):
    cfg = ExtractConfig.build("movielens", [logs / "log.tsv"], PipelineOptions(batch_rows=512))
    before = sorted(p.name for p in logs.iterdir())
    thread = list(Prefetcher(cfg, ProducerOptions(prefetch=2, producer="thread")))
    process = list(Prefetcher(cfg, ProducerOptions(prefetch=3, producer="process")))
    assert sorted(p.name for p in logs.iterdir()) == before  # pipelined: no intermediate files
    extract_to_parquet(cfg, tmp_path / "feats")
    staged = list(read_parquet_batches(tmp_path / "feats"))
    assert len(thread) == len(process) == len(staged) == -(-(ROWS + 2) // 512)
    for a, b, c in zip(thread, process, staged):
        assert a.equal(b) and a.equal(c)
    total = FeatureBatch.concat(thread)
    assert len(total) == ROWS
    assert total.sparse.shape[1] == 8 and total.dense.shape[1] == 2 and [s.shape[1] for s in total.seqs] == [20, 6, 8]
    report = json.loads((tmp_path / "feats" / "report.json").read_text())
    assert report["extract"]["quarantined"] == {"field_count": 1, "bad_int:user_id": 1}


def test_pipelined_training_matches_two_stage(logs, tmp_path):
    torch.set_num_threads(1)
    cfg = ExtractConfig.build("movielens", [logs / "log.tsv"], PipelineOptions(batch_rows=512))
    train = TrainOptions(lr=3e-3, seed=1, dim=4, hidden=(16,))
    m1, r1 = run_pipelined(cfg, train, ProducerOptions(prefetch=2), device="cpu")
    m2, r2 = run_two_stage(cfg, tmp_path / "f", train, device="cpu")
    assert r1["rows"] == r2["rows"] == ROWS
    assert r1["train"][0]["losses"] == r2["train"][0]["losses"]
    for p, q in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p, q)
    ext = r1["extract"]
    assert ext["rows_read"] == ROWS and ext["quarantined"] == {"field_count": 1, "bad_int:user_id": 1}
    assert ext["arena"]["bytes_reused"] > 0 and ext["arena"]["resets"] == ext["batches"]
    assert r1["handoff"]["ring"] > 0 and sum(r1["handoff"].values()) == ext["batches"]
    assert set(ext["exec"]["op_seconds"]) >= {"join_user", "hist_list", "demo_x_item", "<collate>"}


def test_cli_extract_and_train_reports(logs, tmp_path):
    feats, rep1, rep2 = tmp_path / "feats", tmp_path / "r1.json", tmp_path / "r2.json"
    common = ["--graph", "movielens", "--log", str(logs / "log.tsv"), "--batch-rows", "1024"]
    assert cli_main(["features", "extract", *common, "--out", str(feats)]) == 0
    assert cli_main(["features", "extract", *common, "--out", str(feats)]) == 2  # exists, no --overwrite
    assert cli_main(["features", "train", "--features", str(feats), "--report", str(rep1),
                     "--dim", "4", "--hidden", "8"]) == 0
    assert cli_main(["features", "train", *common, "--report", str(rep2), "--dim", "4", "--hidden", "8",
                     "--test-log", str(logs / "test.tsv")]) == 0
    r1, r2 = json.loads(rep1.read_text()), json.loads(rep2.read_text())
    assert r1["rows"] == r2["rows"] == ROWS
    assert r2["mode"] == "pipelined" and r2["extract"]["quarantined"] == {"field_count": 1, "bad_int:user_id": 1}
    assert r2["extract"]["rows_read"] == ROWS and r2["extract"]["arena"]["allocations"] > 0
    assert 0.0 <= r2["test"]["auc"] <= 1.0 and r2["test"]["rows"] == 1000
    q = [json.loads(x) for x in Path(r2["extract"]["quarantine_file"]).read_text().splitlines()]
    assert {x["line"] for x in q} == {101, 2001}  # 1-based line numbers of the two inserted lines
    assert r2["lookup_plans"] is True
    rep3 = tmp_path / "r3.json"
    assert cli_main(["features", "train", *common, "--report", str(rep3), "--dim", "4", "--hidden", "8",
                     "--no-plans"]) == 0
    r3 = json.loads(rep3.read_text())
    assert r3["lookup_plans"] is False and r3["train"][0]["losses"] == r2["train"][0]["losses"]


def test_train_job_parses_the_graph_once_and_tests_with_the_jobs_options(logs, tmp_path, monkeypatch):
    """One parse of the graph per run (the config carries the object), and the test log is extracted with
    every pipeline option of the job (threads, arena, entity were once dropped there)."""
    from leanml.features import jobs
    from leanml.features.options import Inputs, TrainJob
    from leanml.features.train import pipeline

    parsed: list[str] = []
    real_parse = FeatureGraph.from_dict.__func__
    monkeypatch.setattr(FeatureGraph, "from_dict", classmethod(lambda cls, d: parsed.append(d["name"]) or
                                                               real_parse(cls, d)))
    tested = []
    real_evaluate = pipeline.evaluate
    monkeypatch.setattr(pipeline, "evaluate", lambda model, ex, *a, **k: tested.append(ex.cfg) or
                        real_evaluate(model, ex, *a, **k))
    opts = PipelineOptions(batch_rows=512, threads=2, arena=False, entity=False)
    job = TrainJob(inputs=Inputs(log=(str(logs / "log.tsv"),)), options=opts,
                   producer=ProducerOptions(producer="thread"), train=TrainOptions(dim=4, hidden=(8,)),
                   test_log=(str(logs / "test.tsv"),), report=str(tmp_path / "r.json"))
    report, _ = jobs.train_job(job, progress=False)
    assert parsed == ["movielens"]
    assert [cfg.options for cfg in tested] == [opts] and report["test"]["rows"] == 1000
    assert json.loads((tmp_path / "r.json").read_text())["config"]["options"]["entity"] is False


def test_training_stops_at_the_first_non_finite_loss(logs):
    """A batch whose loss is NaN stops FeatureBox training before its optimizer step, naming the step and
    the learning rate; the steps before it were taken, the bad one was not."""
    from leanml.features.train.model import CTROptimizer, model_for_graph
    from leanml.features.train.pipeline import train_on
    from leanml.finite import NonFiniteError

    cfg = ExtractConfig.build("movielens", [logs / "log.tsv"], PipelineOptions(batch_rows=512))
    batches = list(Extractor(cfg))[:3]
    batches[2].label[5] = float("nan")
    torch.manual_seed(0)
    model = model_for_graph(cfg.graph, dim=4, hidden=(8,))
    opt = CTROptimizer(model, lr=2e-3)
    train_on(model, batches[:2], opt)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(NonFiniteError, match=r"loss is nan at step 1 of FeatureBox training: .*learning rate .*0\.002"):
        train_on(model, batches[2:], opt)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_errors_reach_the_consumer(logs):
    cfg = ExtractConfig.build("movielens", [logs / "log.tsv"], PipelineOptions(batch_rows=512),
                              tables={"users": "nope.jsonl"})
    with pytest.raises(LeanmlError, match="table 'users' not found"):
        list(Prefetcher(cfg))
    with pytest.raises(LeanmlError, match="prefetch 0: use a number >= 1"):
        Prefetcher(cfg, ProducerOptions(prefetch=0))
    test_cfg = ExtractConfig.build("movielens", [logs / "test.tsv"], PipelineOptions(batch_rows=300))
    assert len(list(Extractor(test_cfg))) == 4


def test_visual_graph_with_content_id_table(logs, tmp_path):
    import numpy as np

    from leanml.features.ops import write_content_id_table
    from leanml.features.train.model import model_for_graph

    d = tmp_path / "data"
    d.mkdir()
    for f in ("test.tsv", "users.jsonl", "items.jsonl"):
        (d / f).write_text((logs / f).read_text())
    rng = np.random.default_rng(0)
    items = np.arange(1, 1683, 2, dtype=np.int64)  # odd items only: even ones are "new ads" without IDs
    codes = rng.integers(0, 256, (len(items), 4))
    write_content_id_table(d / "visual_ids.parquet", items, codes, k=256)
    cfg = ExtractConfig.build("movielens_visual", [d / "test.tsv"], PipelineOptions(batch_rows=400))
    batch = FeatureBatch.concat(list(Extractor(cfg)))
    vis = batch.seqs[3]
    item_ids = [int(x.split("\t")[2]) for x in (d / "test.tsv").read_text().splitlines()]
    ref = {int(i): c.tolist() for i, c in zip(items, codes)}
    assert vis.tolist() == [ref.get(i, [256] * 4) for i in item_ids]
    model = model_for_graph(cfg.graph, dim=4, hidden=(8,))
    assert model(batch).shape == (len(item_ids),)


class _SlowSource:
    """A stand-in extractor whose batches each take 80 ms of waiting (no CPU), for timing the overlap."""

    def __init__(self, cfg) -> None:
        self.n = 10

    def __iter__(self):
        import time

        for i in range(self.n):
            time.sleep(0.08)
            yield FeatureBatch(torch.full((4,), float(i)), torch.zeros(4, 1, dtype=torch.long), torch.zeros(4, 1), [])


def test_prefetcher_overlaps_extraction_with_training(logs):
    import time

    cfg = ExtractConfig.build("movielens", [logs / "test.tsv"])
    t0 = time.perf_counter()
    seen = []
    for b in Prefetcher(cfg, ProducerOptions(prefetch=2), source=_SlowSource):
        time.sleep(0.08)  # "training" on batch i while batch i+1 is being produced
        seen.append(int(b.label[0]))
    wall = time.perf_counter() - t0
    assert seen == list(range(10))
    assert wall < 0.8 * (10 * 0.08 * 2)  # serial would take 1.6 s; overlapped about 0.9 s


def test_worker_processes_keep_chunk_order_and_merge_quarantine(logs, tmp_path):
    q = tmp_path / "q.jsonl"
    cfg = ExtractConfig.build("movielens", [logs / "log.tsv"], PipelineOptions(batch_rows=256), quarantine=str(q))
    ref = list(Extractor(ExtractConfig.build("movielens", [logs / "log.tsv"], PipelineOptions(batch_rows=256))))
    pf = Prefetcher(cfg, ProducerOptions(prefetch=2, producer="process", workers=3))
    got = list(pf)
    assert len(got) == len(ref) and all(a.equal(b) for a, b in zip(got, ref))  # same batches, same order
    assert pf.report.rows_read == ROWS and pf.report.quarantined == {"field_count": 1, "bad_int:user_id": 1}
    assert pf.report.cpu_s > 0 and pf.report.batches == len(ref)
    lines = [json.loads(x)["line"] for x in q.read_text().splitlines()]
    assert lines == [101, 2001] and not list(tmp_path.glob("q.worker*"))


class _Dies:
    """A producer whose worker process dies (as if killed) after its first batch."""

    def __init__(self, cfg) -> None:
        pass

    def __iter__(self):
        import os

        yield FeatureBatch(torch.zeros(2), torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 1), [])
        os._exit(3)


class _Fails:
    def __init__(self, cfg) -> None:
        pass

    def __iter__(self):
        yield FeatureBatch(torch.zeros(2), torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 1), [])
        raise ValueError("column 'x' broke in the producer")


@pytest.mark.slow  # worker processes
def test_a_dying_or_failing_worker_raises_in_the_trainer(logs):
    cfg = ExtractConfig.build("movielens", [logs / "test.tsv"])
    with pytest.raises(RuntimeError, match="exited unexpectedly"):
        list(Prefetcher(cfg, ProducerOptions(producer="process"), source=_Dies))
    with pytest.raises(ValueError, match="column 'x' broke in the producer"):
        list(Prefetcher(cfg, ProducerOptions(producer="process"), source=_Fails))
    with pytest.raises(RuntimeError, match="column 'x' broke in the producer"):
        list(Prefetcher(cfg, ProducerOptions(producer="thread"), source=_Fails))


def _one_at_a_time(batches, ref: list[FeatureBatch]) -> int:
    """Compare each batch with the reference while holding no other; returns how many came."""
    n = 0
    for b in batches:
        assert b.equal(ref[n])
        n += 1
        del b
    return n


@pytest.mark.slow  # worker processes
def test_worker_batches_come_through_the_shared_memory_ring(logs):
    cfg = ExtractConfig.build("movielens", [logs / "log.tsv"], PipelineOptions(batch_rows=256))
    ref = list(Extractor(cfg))
    # taken one at a time (as training does): every batch through the ring, none overwritten before use
    pf = Prefetcher(cfg, ProducerOptions(prefetch=2, producer="process"))
    assert _one_at_a_time(pf, ref) == len(ref) and pf.handoff == {"ring": len(ref)}
    # all kept: once the depth + 3 slots are held the worker falls back to ordinary sharing, and the
    # batches kept from the ring are not overwritten by later ones
    pf = Prefetcher(cfg, ProducerOptions(prefetch=2, producer="process"))
    got = list(pf)
    assert len(got) == len(ref) and all(a.equal(r) for a, r in zip(got, ref))
    assert pf.handoff == {"ring": 5, "copied": len(ref) - 5}
    off = Prefetcher(cfg, ProducerOptions(prefetch=2, producer="process"), ring=False)
    assert all(a.equal(r) for a, r in zip(off, ref)) and off.handoff == {"copied": len(ref)}


@pytest.mark.slow  # worker processes
def test_epochs_left_early_do_not_leak_ring_slots(logs):
    cfg = ExtractConfig.build("movielens", [logs / "log.tsv"], PipelineOptions(batch_rows=256))
    ref = list(Extractor(cfg))
    pf = Prefetcher(cfg, ProducerOptions(prefetch=2, producer="process"), persistent=True)
    try:
        for _ in range(4):  # each abandoned epoch leaves the prefetched batches' slots sent but never used
            for b in pf:
                assert b.equal(ref[0])
                break
            del b
        assert _one_at_a_time(pf, ref) == len(ref) and pf.handoff == {"ring": len(ref)}
    finally:
        pf.close()


@pytest.mark.slow  # worker processes
def test_producers_build_the_lookup_plans_for_the_model(logs):
    from dataclasses import replace

    from leanml.features.train.lookup import build_plan
    from leanml.features.train.model import model_for_graph

    base = ExtractConfig.build("movielens", [logs / "log.tsv"], PipelineOptions(batch_rows=256))
    sizes = model_for_graph(base.graph).emb.sizes
    cfg = replace(base, lookup_sizes=sizes)
    ref = list(Extractor(base))
    for mode in ("process", "thread"):
        pf = Prefetcher(cfg, ProducerOptions(prefetch=2, producer=mode))
        n = 0
        for got, want in zip(pf, ref, strict=True):
            plan = build_plan(want.ids(), want.layout(), sizes)
            assert got.equal(want) and got.plan is not None and got.plan.sizes == tuple(sizes)
            assert all(torch.equal(x, y) for x, y in zip(got.plan.tensors(), plan.tensors(), strict=True))
            n += 1
        assert n == len(ref)
        if mode == "process":
            assert pf.handoff == {"ring": len(ref)}
