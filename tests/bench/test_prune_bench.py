"""The pruning benchmark's harness (bench/prune.py, bench/prune_harness.py): record keys and merging,
sparsity per module kind read from saved weights, the embedding / head flag, seed statistics,
the targets, the generated Markdown, and one end-to-end run on a tiny model where the peer fails.
No peer environment needed (one optional test uses it when ``.venv-peers`` exists)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchload import load_bench
from builders import tiny_llama, tiny_llama_untied

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import prune_harness as H  # noqa: E402


def load_bench_prune():
    """bench/prune.py as a module (the name ``prune`` is taken by tests/prune)."""
    return load_bench("prune")


def rec(method, pattern="50%", seed=0, corpus="shakespeare", ppl=10.0, profile="uniform", **kw):
    r = {"method": method, "pattern": pattern, "profile": profile, "seed": seed, "corpus": corpus, "ppl": ppl,
         "seconds": 100.0, "cpu_seconds": 200.0, "calib_sha256": f"sha{seed}", "flags": []}
    r.update(kw)
    return r


# ---------------------------------------------------------------- keys and merging


def test_merge_replaces_by_key_keeps_others_and_drops_older_protocol():
    old = [rec("sparsegpt", ppl=1.0), rec("sparsegpt", corpus="reviews", ppl=2.0), rec("wanda", ppl=3.0),
           {"method": "sparsegpt", "pattern": "unstructured", "ppl": 9.0}]  # older protocol: no corpus/profile/seed
    new = [rec("sparsegpt", ppl=5.0), rec("sparsegpt", seed=1, ppl=6.0)]
    merged = H.merge_records(new, old)
    assert [(r["method"], r["seed"], r["corpus"], r["ppl"]) for r in merged] == [
        ("sparsegpt", 0, "shakespeare", 5.0), ("sparsegpt", 0, "reviews", 2.0), ("wanda", 0, "shakespeare", 3.0),
        ("sparsegpt", 1, "shakespeare", 6.0)]
    assert len({H.record_key(r) for r in merged}) == len(merged)
    with pytest.raises(ValueError, match="lacks"):
        H.merge_records([{"method": "x", "pattern": "50%"}], [])


def test_merge_records_file_roundtrip(tmp_path):
    bp = load_bench_prune()
    path = tmp_path / "prune.json"
    path.write_text(json.dumps([rec("sparsegpt", ppl=1.0), {"method": "old", "pattern": "2:4"}]))
    merged = bp.merge_records([rec("sparsegpt", ppl=4.0), rec("dense", pattern="dense", seed=None)], path)
    assert {(r["method"], r["ppl"]) for r in merged} == {("sparsegpt", 4.0), ("dense", 10.0)}


def test_patterns_parse_and_plan_skips_profiles_with_nm():
    assert H.parse_pattern("70%") == (0.7, None)
    assert H.parse_pattern("4:8") == (0.5, (4, 8))
    assert H.parse_pattern("3:8") == (pytest.approx(0.625), (3, 8))
    for bad in ("50", "4:2", "0:4", "150%", "half"):
        with pytest.raises(ValueError):
            H.parse_pattern(bad)
    rows = load_bench_prune().plan(["dense", "sparsegpt", "llmc-sparsegpt"], ["50%", "2:4"], ["uniform", "owl"], [0, 1])
    assert rows[0] == ("dense", "dense", "uniform", None)
    assert sum(r[0] == "dense" for r in rows) == 1
    assert ("sparsegpt", "50%", "owl", 1) in rows and ("sparsegpt", "2:4", "owl", 0) not in rows
    assert len(rows) == 1 + 2 * (2 * 2 + 2)  # dense + per seed: 50% x 2 profiles x 2 methods + 2:4 x 2 methods


# ---------------------------------------------------------------- sparsity per module kind


def test_module_kind_names():
    assert H.module_kind("model.layers.3.self_attn.q_proj.weight") == "q_proj"
    assert H.module_kind("model.layers.0.mlp.down_proj.weight") == "down_proj"
    assert H.module_kind("model.embed_tokens.weight") == "embeddings"
    assert H.module_kind("lm_head.weight") == "lm_head"
    assert H.module_kind("model.layers.0.mlp.down_proj.bias") is None


def _zero_fraction(t: torch.Tensor, frac: float, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(t.numel(), generator=g)[: int(round(frac * t.numel()))]
    t.view(-1)[idx] = 0.0


def test_sparsity_by_kind_from_saved_tied_model(tmp_path):
    model = tiny_llama()
    with torch.no_grad():
        _zero_fraction(model.model.layers[0].self_attn.q_proj.weight, 0.5)
        _zero_fraction(model.model.layers[1].mlp.down_proj.weight, 0.75)
    model.save_pretrained(tmp_path / "m")
    got = H.sparsity_by_kind(tmp_path / "m")
    kinds = got["by_kind"]
    assert got["tied_head"] is True
    assert kinds["q_proj"] == pytest.approx(0.25)  # half of one of two equal matrices
    assert kinds["down_proj"] == pytest.approx(0.375)
    assert kinds["k_proj"] == 0.0 and kinds["embeddings"] == 0.0 and kinds["lm_head"] == 0.0
    assert "input_layernorm" not in kinds  # 1-D norm scales are not counted
    # independent reference: every 2-D weight of the decoder layers, from the model in memory
    lin = [p for n, p in model.named_parameters() if ".layers." in n and p.dim() == 2]
    ref = sum(int((p == 0).sum()) for p in lin) / sum(p.numel() for p in lin)
    assert got["decoder_linears"] == pytest.approx(ref)
    assert H.untouched_flags(kinds, kinds) == []


def test_pruned_embeddings_and_head_are_flagged(tmp_path):
    dense = tiny_llama()
    dense.save_pretrained(tmp_path / "dense")
    pruned = tiny_llama()
    with torch.no_grad():  # what an unanchored ignore=["lm_head"] does to a tied model: the shared table loses half
        _zero_fraction(pruned.lm_head.weight, 0.5)
    pruned.save_pretrained(tmp_path / "pruned")
    dense_kinds = H.sparsity_by_kind(tmp_path / "dense")["by_kind"]
    got = H.sparsity_by_kind(tmp_path / "pruned")["by_kind"]
    assert got["embeddings"] == pytest.approx(0.5) and got["lm_head"] == pytest.approx(0.5)
    flags = H.untouched_flags(got, dense_kinds)
    assert len(flags) == 2 and flags[0].startswith("embeddings pruned (50.0 %")

    untied = tiny_llama_untied()
    with torch.no_grad():
        _zero_fraction(untied.lm_head.weight, 0.3)
    untied.save_pretrained(tmp_path / "untied")
    u = H.sparsity_by_kind(tmp_path / "untied")
    assert u["tied_head"] is False and u["by_kind"]["lm_head"] == pytest.approx(0.3, abs=1e-4)
    assert u["by_kind"]["embeddings"] == 0.0
    assert [f.split()[0] for f in H.untouched_flags(u["by_kind"], dense_kinds)] == ["lm_head"]
    # a dense model that already has a few zeros in its embeddings is not flagged for them
    assert H.untouched_flags({"embeddings": 0.015}, {"embeddings": 0.010}) == []


# ---------------------------------------------------------------- statistics and targets


def _records():
    rs = []
    for corpus, scale in (("shakespeare", 1.0), ("reviews", 2.0)):
        for seed, (ours, peer, fista) in enumerate([(60.0, 61.0, 52.0), (62.0, 63.0, 54.0), (61.0, 62.0, 53.0)]):
            rs += [rec("sparsegpt", seed=seed, corpus=corpus, ppl=ours * scale, seconds=50.0, cpu_seconds=90.0),
                   rec("llmc-sparsegpt", seed=seed, corpus=corpus, ppl=peer * scale, seconds=60.0, cpu_seconds=100.0),
                   rec("fista", seed=seed, corpus=corpus, ppl=fista * scale * (1.0 if corpus == "shakespeare" else 1.1),
                       seconds=120.0, cpu_seconds=200.0)]
        rs.append(rec("dense", pattern="dense", seed=None, corpus=corpus, ppl=40.0 * scale))
    return rs


def test_seed_stats_and_best_sparsegpt():
    rs = _records()
    s = H.stats(rs, method="sparsegpt", pattern="50%", profile="uniform", corpus="shakespeare")
    assert (s.mean, s.std, s.n) == (pytest.approx(61.0), pytest.approx(1.0), 3)
    name, best = H.best_sparsegpt(rs, "50%", "shakespeare")
    assert name == "sparsegpt" and best.mean == pytest.approx(61.0)
    # a flagged or failed record is not compared
    rs.append(rec("llmc-sparsegpt", seed=5, ppl=1.0, flags=["embeddings pruned"]))
    rs.append(rec("llmc-sparsegpt", seed=6, ppl=None, error="boom"))
    assert H.best_sparsegpt(rs, "50%", "shakespeare")[0] == "sparsegpt"
    assert H.stats(rs, method="llmc-sparsegpt", pattern="50%", corpus="shakespeare").n == 3


def test_targets_met_missed_pending():
    rs = _records()
    by = {(t["target"], t["corpus"]): t for t in H.targets(rs)}
    fista_h = by[("FISTA 50% <= 0.88 x better SparseGPT", "shakespeare")]
    assert fista_h["value"] == pytest.approx(53.0 / 61.0) and fista_h["status"] == "met"
    fista_r = by[("FISTA 50% <= 0.95 x better SparseGPT", "reviews")]
    assert fista_r["value"] == pytest.approx(53.0 * 1.1 / 61.0) and fista_r["status"] == "missed"
    assert by[("FISTA 2:4 <= 0.90 x better SparseGPT", "shakespeare")]["status"] == "pending"
    assert by[("70% owl: best of ours <= 0.75 x llmc-sparsegpt uniform", "reviews")]["status"] == "pending"
    t = by[("fista prune CPU-s <= 2 x sparsegpt (50%)", "-")]
    assert t["value"] == pytest.approx(200.0 / 90.0) and t["status"] == "missed"
    t = by[("sparsegpt prune wall s <= 1 x llmc-sparsegpt (50%)", "-")]
    assert t["value"] == pytest.approx(50.0 / 60.0) and t["status"] == "met"
    t = by[("our SparseGPT within ±3 % of llmc-sparsegpt (same windows)", "shakespeare")]
    want = sum(a / b - 1 for a, b in ((60, 61), (62, 63), (61, 62))) / 3
    assert t["value"] == pytest.approx(want) and t["status"] == "met"
    # owl rows of ours against the peer's uniform 70 %
    rs += [rec("llmc-sparsegpt", pattern="70%", corpus=c, ppl=400.0) for c in ("shakespeare", "reviews")]
    rs += [rec("wanda", pattern="70%", profile="owl", corpus=c, ppl=250.0) for c in ("shakespeare", "reviews")]
    rs += [rec("sparsegpt", pattern="70%", profile="owl", corpus=c, ppl=290.0) for c in ("shakespeare", "reviews")]
    key = ("70% owl: best of ours <= 0.75 x llmc-sparsegpt uniform", "shakespeare")
    t = {(t["target"], t["corpus"]): t for t in H.targets(rs)}[key]
    assert t["value"] == pytest.approx(250.0 / 400.0) and t["status"] == "met" and t["detail"].startswith("wanda owl")


def test_timing_targets_compare_common_seeds_only():
    rs = [rec("sparsegpt", seed=0, seconds=50.0, cpu_seconds=80.0),
          rec("llmc-sparsegpt", seed=0, seconds=100.0, cpu_seconds=100.0),
          rec("llmc-sparsegpt", seed=1, seconds=300.0, cpu_seconds=900.0)]  # no seed 1 of ours: not compared
    by = {t["target"]: t for t in H.targets(rs)}
    t = by["sparsegpt prune CPU-s <= 1 x llmc-sparsegpt (50%)"]
    assert t["value"] == pytest.approx(0.8) and t["status"] == "met" and "(seeds 0)" in t["detail"]
    rs = [rec("sparsegpt", seed=2), rec("llmc-sparsegpt", seed=0)]
    t = {t["target"]: t for t in H.targets(rs)}["sparsegpt prune wall s <= 1 x llmc-sparsegpt (50%)"]
    assert t["status"] == "pending" and t["detail"] == "needs sparsegpt and llmc-sparsegpt on a common calibration seed"
    fista = {t["target"]: t for t in H.targets(rs)}["fista prune wall s <= 2 x sparsegpt (50%)"]
    assert fista["detail"] == "needs fista"


def test_our_rows_run_with_the_cli_defaults():
    """Our rows take `leanml prune --method X`'s settings; FISTA rows need no option to run at its defaults."""
    import argparse

    from leanml.errors import LeanmlError
    from leanml.prune.cli import prune_job, register
    from leanml.prune.methods.baselines import SparseGPTPruner, WandaPruner
    from leanml.prune.methods.fista import FistaPruner

    sub = argparse.ArgumentParser().add_subparsers()
    register(sub)

    def cli(*argv: str):
        return prune_job(sub.choices["prune"].parse_args(["--out", "o", *argv])).config

    bp = load_bench_prune()
    config = bp.our_config("fista", "50%", "uniform", None)
    assert config == cli("--method", "fista")  # the same config as the command line's, field by field
    assert config.pruner().config() == FistaPruner().config() and config.scope is None and config.sparsity == 0.5
    assert config.spec.scope == "layer" and config.intra_layer_on is True
    assert config.engine_kwargs() == {"sequential": True, "intra_layer": None, "batch_size": 4,
                                      "sparsity_profile": "uniform", "owl": {"m": 5.0, "lam": 0.08},
                                      "stream_device": "auto", "checkpoint_interval": 0.0}
    assert bp.our_config("fista:dense", "2:4", "uniform", 8).pruner().config()["warm_start"] == "dense"
    config = bp.our_config("sparsegpt", "4:8", "uniform", 8)
    assert config == cli("--method", "sparsegpt", "--pattern", "4:8", "--batch-size", "8")
    assert isinstance(config.pruner(), SparseGPTPruner) and config.spec.pattern == (4, 8) and config.batch_size == 8
    config = bp.our_config("wanda", "70%", "owl", None)
    assert isinstance(config.pruner(), WandaPruner) and config.intra_layer_on is False
    assert config.sparsity_profile == "owl"
    with pytest.raises(LeanmlError, match="no warm start"):
        bp.our_config("wanda:dense", "50%", "uniform", None)
    with pytest.raises(SystemExit):  # unknown methods are refused before any row runs
        bp.main(["--methods", "dense,nosuch", "--results", "/nonexistent/prune.json"])


def test_baseline_check_needs_identical_calibration():
    rs = [rec("sparsegpt", ppl=60.0), rec("llmc-sparsegpt", ppl=70.0, calib_sha256="other")]
    t = [t for t in H.targets(rs) if t["target"].startswith("our SparseGPT within")][0]
    assert t["status"] == "pending"


def test_markdown_headers_come_from_records():
    rs = _records()
    for r in rs:
        r.update(eval_windows=103 if r["corpus"] == "shakespeare" else 47, seqlen=512, eval_text=f"{r['corpus']} text",
                 nsamples=64, calib_text="the plays", model="m", command="python bench/prune.py --x",
                 machine={"cpu": "CPU-Z", "cores": 2, "cores_available": 2, "torch_threads": 2, "torch": "t"},
                 load={"before": [1.5, 1, 1], "after": [2.5, 1, 1]}, sparsity_measured=0.5, cpu_lock_held=True,
                 sparsity_by_kind={"q_proj": 0.5, "embeddings": 0.0})
    rs.append({**rs[0], "method": "llmc-wanda", "flags": ["embeddings pruned (50.0 %)"], "ppl": 70.0})
    md = H.render_markdown(rs)
    assert "Machine: CPU-Z, 2 cores (2 available), 2 torch threads" in md
    assert "Evaluation Hamlet: shakespeare text, 103 windows x 512 tokens." in md
    assert "Evaluation reviews: reviews text, 47 windows x 512 tokens." in md
    assert "64 x 512 tokens from the plays; seeds 0, 1, 2" in md
    assert "| 50% | sparsegpt | uniform | 0, 1, 2 | 0.500 | 61.00 ± 1.00 (n=3) | 1.000 |" in md
    assert "embeddings pruned (50.0 %)" in md and "**met**" in md and "**missed**" in md
    assert "`python bench/prune.py --x`" in md and "load average" in md.lower()
    rs[0]["eval_windows"] = 20
    assert "MIXED" in H.render_markdown(rs)


# ---------------------------------------------------------------- end to end (tiny model, real tokenizer)


@pytest.mark.slow
def test_harness_runs_rows_and_records_a_failing_peer(tiny_model_dir, tmp_path):
    bp = load_bench_prune()
    text = tmp_path / "small.txt"
    text.write_text(" ".join(f"word{i % 97} and then some more text number {i}." for i in range(3000)))
    results = tmp_path / "res" / "prune.json"
    common = ["--model", str(tiny_model_dir), "--nsamples", "2", "--seqlen", "32", "--corpora", str(text),
              "--results", str(results), "--work-dir", str(tmp_path / "work"), "--threads", "1"]
    bp.main([*common, "--methods", "dense,magnitude,fista,llmc-wanda", "--patterns", "60%",
             "--peers-python", str(tmp_path / "no-such-venv" / "python")])
    recs = json.loads(results.read_text())
    by = {r["method"]: r for r in recs}
    assert set(by) == {"dense", "magnitude", "fista", "llmc-wanda"}
    fista = by["fista"]
    assert fista["sparsity_measured"] == pytest.approx(0.6, abs=0.01) and fista["ppl"] > 1
    assert fista["method_config"]["warm_start"] == "sparsegpt" and fista["mask_scope"] == "layer"
    assert fista["engine"]["intra_layer"] is True and fista["engine"]["batch_size"] == 4
    assert fista["settings"] == "leanml prune --method fista defaults"
    assert "peer python" in by["llmc-wanda"]["error"] and by["llmc-wanda"]["ppl"] is None
    mag = by["magnitude"]
    assert mag["sparsity_measured"] == pytest.approx(0.6, abs=0.01) and mag["sparsity_by_kind"]["embeddings"] == 0.0
    assert mag["flags"] == [] and mag["seed"] == 0 and mag["profile"] == "uniform" and mag["nsamples"] == 2
    n_windows = mag["eval_windows"]
    assert n_windows == by["dense"]["eval_windows"] > 1 and mag["ppl"] > 1
    assert len(mag["calib_sha256"]) == 64 and mag["cpu_seconds"] >= 0 and "load" in mag
    md = results.with_suffix(".md").read_text()
    assert f"{n_windows} windows x 32 tokens" in md and "error: LeanmlError: peer python" in md
    assert results.with_suffix(".png").exists()
    # by field name
    assert "| fista | uniform | leanml prune --method fista defaults; preset=None, lam=0.001, iters=10" in md
    # a second chunk merges: the dense record is kept, a new seed and an owl row are added
    bp.main([*common, "--methods", "magnitude", "--patterns", "60%", "--seeds", "1", "--profiles", "uniform,owl"])
    recs = json.loads(results.read_text())
    assert sorted((r["method"], r["seed"], r["profile"]) for r in recs) == [
        ("dense", None, "uniform"), ("fista", 0, "uniform"), ("llmc-wanda", 0, "uniform"), ("magnitude", 0, "uniform"),
        ("magnitude", 1, "owl"), ("magnitude", 1, "uniform")]
    owl = next(r for r in recs if r["profile"] == "owl")
    assert owl["sparsity_measured"] == pytest.approx(0.6, abs=0.01) and len(owl["profile_info"]["layer_sparsity"]) == 2
    assert owl["engine"]["owl"] == {"m": 5.0, "lam": 0.08}


@pytest.mark.slow
def test_calibration_partly_sampled_is_one_file_for_every_row(tiny_model_dir, tmp_path):
    bp = load_bench_prune()
    text = tmp_path / "small.txt"
    text.write_text(" ".join(f"word{i % 97} and then some more text number {i}." for i in range(3000)))
    results = tmp_path / "mix.json"
    common = ["--model", str(tiny_model_dir), "--nsamples", "4", "--seqlen", "32", "--corpora", str(text),
              "--results", str(results), "--work-dir", str(tmp_path / "work"), "--threads", "1",
              "--calib-samples", "0.5", "--patterns", "50%"]
    bp.main([*common, "--methods", "magnitude,sparsegpt"])
    bp.main([*common, "--methods", "wanda"])  # a later chunk reads the sampled file, never samples again
    recs = json.loads(results.read_text())
    assert {r["method"] for r in recs} == {"magnitude", "sparsegpt", "wanda"}
    assert len({r["calib_sha256"] for r in recs}) == 1 and len({r["calib_sampling_seconds"] for r in recs}) == 1
    assert all(r["calib_samples"] == 0.5 and r["calib_sampling_seconds"] > 0 for r in recs)
    assert recs[0]["calib_text"].startswith("2 of 4 windows sampled from the dense model itself")
    assert len(list((tmp_path / "work").glob("calib-*-samples0.5-*.sampled.pt"))) == 1
    assert "Sampling the calibration windows from the dense model" in results.with_suffix(".md").read_text()
    before = results.read_text()
    with pytest.raises(SystemExit):  # corpus-only rows would replace the sampled ones of the same key
        bp.main([*[a for a in common if a not in ("--calib-samples", "0.5")], "--methods", "magnitude"])
    assert results.read_text() == before


PEERS_PY = Path(__file__).resolve().parents[2] / ".venv-peers" / "bin" / "python"


@pytest.mark.slow
@pytest.mark.skipif(not PEERS_PY.exists(), reason="needs .venv-peers (make peers)")
def test_peer_runner_leaves_the_tied_head_alone_unless_misconfigured(tiny_model_dir, tmp_path):
    ids = torch.randint(0, 1000, (2, 32))
    torch.save(ids, tmp_path / "calib.pt")
    script = BENCH / "peers" / "llmc_prune.py"
    kinds = {}
    for name, extra in (("default", []), ("bare", ["--ignore", "lm_head"])):
        out = tmp_path / name
        subprocess.run([str(PEERS_PY), str(script), "--model", str(tiny_model_dir),
                        "--calib", str(tmp_path / "calib.pt"),
                        "--method", "wanda", "--mask", "2:4", "--threads", "1", "--out", str(out), *extra],
                       check=True, capture_output=True, timeout=300)
        report = json.loads((out / "run.json").read_text())
        assert report["nsamples"] == 2 and report["cpu_seconds"] > 0 and report["versions"]["llmcompressor"]
        kinds[name] = H.sparsity_by_kind(out)["by_kind"]
    dense = H.sparsity_by_kind(tiny_model_dir)["by_kind"]
    assert kinds["default"]["q_proj"] == pytest.approx(0.5) and H.untouched_flags(kinds["default"], dense) == []
    assert kinds["bare"]["embeddings"] == pytest.approx(0.5)  # the trap: the tied table is pruned
    assert len(H.untouched_flags(kinds["bare"], dense)) == 2
