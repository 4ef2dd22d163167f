"""The recovery benchmark's records and targets (bench/recover.py), computed from chunk results: the gap
formula against a hand computation, the reference of each setting, and the one-setting target."""

from __future__ import annotations

from benchload import load_bench

MIB = 2**20


def load_bench_recover():
    return load_bench("recover")


def ev(hamlet: float, reviews: float, sparsity: float = 0.5) -> dict:
    return {"sparsity": sparsity, "params": 1000, "ppl": {"hamlet": hamlet, "reviews": reviews}}


def train(teacher: str, peak_mib: float = 300, budget_mib: float = 300, kd: float | None = None) -> dict:
    settings = {"steps": 150, "memory": "adacc", "lr": 1e-4, "kd_weight": 0.5}
    return {"settings": settings, "budget_fraction": 0.5, "peak_bytes": peak_mib * MIB,
            "budget_bytes": budget_mib * MIB,
            "unoptimized_peak_bytes": 2 * budget_mib * MIB, "within_budget": peak_mib <= budget_mib,
            "train_seconds": 100.0, "teacher_seconds": 0.0 if teacher == "none" else 20.0, "median_step_s": 1.0,
            "train_cpu_seconds": 190.0, "load_before": [1.0], "command": "leanml recover ...", "kd_weight": kd}


def data(distill_fasp_reviews: float) -> dict:
    """Dense 40 / 40; SparseGPT 50 % pruned 60 / 80; FASP 30 % pruned 50 / 90."""
    chunks = {"eval:dense": ev(40, 40, 0.0), "eval:sgpt50": ev(60, 80), "eval:fasp30": ev(50, 90, 0.05)}
    for teacher, kd in (("none", None), ("distill", 1.0)):
        chunks[f"train:dense:{teacher}"] = train(teacher, kd=kd)
        chunks[f"eval:rec-dense-{teacher}"] = ev(30, 45, 0.0) if teacher == "none" else ev(40, 40, 0.0)
        for model in ("sgpt50", "fasp30"):
            chunks[f"train:{model}:{teacher}"] = train(teacher, kd=kd)
    chunks["eval:rec-sgpt50-none"] = ev(40, 75)
    chunks["eval:rec-fasp30-none"] = ev(35, 92, 0.05)
    chunks["eval:rec-sgpt50-distill"] = ev(48, 60)
    chunks["eval:rec-fasp30-distill"] = ev(45, distill_fasp_reviews, 0.05)
    return {"chunks": chunks, "settings": {"threads": 2, "steps": 150, "lr": 1e-4, "kd_weight": 0.5}}


def test_gap_closed_uses_the_reference_trained_the_same_way() -> None:
    b = load_bench_recover()
    recs = b.build_records(data(70))
    by = {(r["model"], r["teacher"], r["corpus"]): r for r in recs}
    # no teacher: reference = dense fine-tuned without teacher (30 / 45)
    r = by[("sgpt50", "none", "hamlet")]
    assert r["gap_closed"] == 1 - (40 - 30) / (60 - 40)
    r = by[("fasp30", "none", "reviews")]
    assert abs(r["gap_closed"] - (1 - (92 - 45) / (90 - 40))) < 1e-12
    # distillation: its own reference (40 / 40), and the kd weight carried into the record
    r = by[("fasp30", "distill", "reviews")]
    assert abs(r["gap_closed"] - (1 - (70 - 40) / (90 - 40))) < 1e-12 and r["kd_weight"] == 1.0
    assert not any(r["teacher"] == "dense" for r in recs)  # that setting has no chunks here: no record invented


def test_one_setting_target_needs_every_method_and_corpus() -> None:
    b = load_bench_recover()
    for fasp_reviews, met in ((69.9, True), (70.1, False)):  # 40 % closed needs reviews <= 40 + 0.6 * 50 = 70
        d = data(fasp_reviews)
        tgts = b.targets(b.build_records(d), d)
        one = next(t for t in tgts if t["target"].startswith("one recovery setting"))
        assert one["met"] is met, (fasp_reviews, one)
        if met:
            assert "kd weight 1" in one["detail"]
    # the per-setting line of a setting never run says which chunks are missing
    dense = next(t for t in tgts if "kd weight 0.5" in t["target"] and t["target"].startswith("sgpt50"))
    assert dense["met"] is None and "train:sgpt50:dense" in dense["detail"]


def test_peak_over_budget_is_missed() -> None:
    b = load_bench_recover()
    d = data(70)
    d["chunks"]["train:fasp30:distill"] = train("distill", peak_mib=301, budget_mib=300, kd=1.0)
    tgts = b.targets(b.build_records(d), d)
    peak = next(t for t in tgts if t["target"].startswith("peak activation"))
    assert peak["met"] is False and "fasp30:distill" in peak["detail"]


def test_teacher_samples_setting_counts_its_sampling_time() -> None:
    b = load_bench_recover()
    d = data(70)
    for model in ("dense", "sgpt50", "fasp30"):
        d["chunks"][f"train:{model}:mix"] = {**train("mix", kd=1.0),
                                             "teacher_samples": {"seconds": 30.0, "windows": 150}}
    d["chunks"]["eval:rec-dense-mix"] = ev(41, 41, 0.0)
    d["chunks"]["eval:rec-sgpt50-mix"] = ev(47, 55)
    d["chunks"]["eval:rec-fasp30-mix"] = ev(44, 60, 0.05)
    recs = [r for r in b.build_records(d) if r["teacher"] == "mix"]
    assert len(recs) == 4 and all(r["seconds"] == 130.0 and r["sampling_seconds"] == 30.0 for r in recs)
    r = next(r for r in recs if (r["model"], r["corpus"]) == ("fasp30", "reviews"))
    assert abs(r["gap_closed"] - (1 - (60 - 41) / (90 - 40))) < 1e-12
    assert b.teacher_label("mix", {}) == "dense teacher, kd weight 1, 50% of the windows sampled from it"
    assert b.teacher_label("distill", {}) == "dense teacher, kd weight 1"
    args = b.all_chunks()
    assert args.index("train:fasp30:mix") > args.index("eval:rec-sgpt24-distill")


def test_a_pruned_model_pruned_again_keeps_each_recovery_with_its_own_start(tmp_path) -> None:
    """sgpt50 pruned twice (another weights hash): the second evaluation moves the first to eval:sgpt50@1,
    recoveries that recorded no start hash stay compared with it, a new one with the new model."""
    b = load_bench_recover()
    d = data(70)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model.safetensors").write_bytes(b"weights one")
    sha = b.model_sha256(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").write_bytes(b"weights two")
    assert b.model_sha256(tmp_path / "m") != sha and len(sha) == 64
    b.store_chunk(d["chunks"], "eval:sgpt50", {**ev(70, 100), "model_sha256": sha})
    assert d["chunks"]["eval:sgpt50@1"]["ppl"]["hamlet"] == 60 and d["chunks"]["eval:sgpt50"]["ppl"]["hamlet"] == 70
    b.store_chunk(d["chunks"], "eval:sgpt50", {**ev(70, 100), "model_sha256": sha})  # the same model: replaced
    assert "eval:sgpt50@2" not in d["chunks"]
    d["chunks"]["train:dense:mix"] = train("mix", kd=1.0)
    d["chunks"]["eval:rec-dense-mix"] = ev(40, 40, 0.0)
    d["chunks"]["train:sgpt50:mix"] = {**train("mix", kd=1.0), "start_model_sha256": sha}
    d["chunks"]["eval:rec-sgpt50-mix"] = ev(55, 85)
    recs = {(r["teacher"], r["corpus"]): r for r in b.build_records(d) if r["model"] == "sgpt50"}
    assert recs[("distill", "hamlet")]["ppl_pruned"] == 60 and recs[("mix", "hamlet")]["ppl_pruned"] == 70
    assert abs(recs[("mix", "reviews")]["gap_closed"] - (1 - (85 - 40) / (100 - 40))) < 1e-12
    lines = " ".join(b._pruned_models_lines(d["chunks"]))
    assert "sgpt50 was pruned 2 times" in lines and "recoveries mix" in lines and "recoveries none, distill" in lines
    d["chunks"]["train:sgpt50:mix"]["start_model_sha256"] = "another"
    assert not [r for r in b.build_records(d) if (r["model"], r["teacher"]) == ("sgpt50", "mix")]


def test_a_variant_setting_trains_with_its_own_options_and_counts_for_the_one_setting_target() -> None:
    """``mixlong`` is ``mix`` with more steps at another learning rate: same teacher and samples, its own
    steps and lr in the chunk settings and the records, its own dense reference; it alone can meet the
    one-setting target."""
    b = load_bench_recover()
    base = {"steps": 150, "memory": "adacc", "lr": 1e-4, "kd_weight": 0.5, "teacher_samples": 0.5}
    s = b.run_settings("mixlong", base)
    assert s["lr"] == b.VARIANTS["mixlong"][1]["lr"] != base["lr"] and base["lr"] == 1e-4  # the base is not changed
    assert s["steps"] == b.VARIANTS["mixlong"][1]["steps"] != base["steps"]
    assert b.run_settings("mix", base) == base
    assert b.kd_weight("mixlong", base) == b.kd_weight("mix", base) == 1.0
    assert b.teacher_share("mixlong", base) == b.teacher_share("mix", base) == 0.5
    assert b.teacher_label("mixlong", base).startswith(b.teacher_label("mix", base) + ", steps 300, lr ")
    d = data(75)  # distill misses fasp30's reviews (30 %)
    for model in ("dense", "sgpt50", "fasp30"):
        d["chunks"][f"train:{model}:mixlong"] = {**train("mixlong", kd=1.0), "settings": s}
    d["chunks"]["eval:rec-dense-mixlong"] = ev(42, 41, 0.0)
    d["chunks"]["eval:rec-sgpt50-mixlong"] = ev(50, 60)
    d["chunks"]["eval:rec-fasp30-mixlong"] = ev(46, 70, 0.05)  # 1 - (70 - 41) / 50 = 42 %
    recs = [r for r in b.build_records(d) if r["teacher"] == "mixlong"]
    assert len(recs) == 4 and all(r["lr"] == s["lr"] and r["steps"] == s["steps"] for r in recs)
    r = next(r for r in recs if (r["model"], r["corpus"]) == ("fasp30", "reviews"))
    assert abs(r["gap_closed"] - (1 - (70 - 41) / (90 - 40))) < 1e-12 and r["ppl_dense_ft"] == 41
    one = next(t for t in b.targets(b.build_records(d), d) if t["target"].startswith("one recovery setting"))
    assert one["met"] is True and one["detail"].count("met by") == 1 and ", steps 300, lr " in one["detail"]
    assert "train:fasp30:mixlong" in b.all_chunks()


def test_a_variant_that_changes_the_teacher_share_says_and_records_its_own_share() -> None:
    """``mixlong75`` samples three quarters of its windows from the teacher: its label says 75 % (not the
    base setting's 50 %, and not the raw option a second time), its chunk runs with that share, and its
    records carry it."""
    b = load_bench_recover()
    base = {"steps": 150, "memory": "adacc", "lr": 1e-4, "kd_weight": 0.5, "teacher_samples": 0.5}
    s = b.run_settings("mixlong75", base)
    assert b.teacher_share("mixlong75", s) == 0.75 and b.teacher_share("mix", base) == 0.5
    label = b.teacher_label("mixlong75", base)
    assert "75% of the windows sampled" in label and "50%" not in label and "teacher_samples" not in label
    assert label.endswith(", steps 300, lr 0.0002")
    assert b.variant_changes("mixlong75").endswith("teacher_samples 0.75")
    d = data(75)
    d["chunks"]["train:fasp30:mixlong75"] = {**train("mixlong75", kd=1.0), "settings": s}
    d["chunks"]["train:dense:mixlong75"] = {**train("mixlong75", kd=1.0), "settings": s}
    d["chunks"]["eval:rec-dense-mixlong75"] = ev(41, 41, 0.0)
    d["chunks"]["eval:rec-fasp30-mixlong75"] = ev(46, 70, 0.05)
    recs = [r for r in b.build_records(d) if r["teacher"] == "mixlong75"]
    assert len(recs) == 2 and all(r["teacher_samples"] == 0.75 and r["steps"] == 300 for r in recs)
    assert [r["teacher_samples"] for r in b.build_records(d) if r["teacher"] == "none"] == [0.0] * 4
    assert ["train:dense:mixlong75", "eval:rec-dense-mixlong75"] == [
        c for c in b.all_chunks() if c.endswith("dense:mixlong75") or c.endswith("dense-mixlong75")]
