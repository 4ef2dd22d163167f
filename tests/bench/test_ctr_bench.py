"""The CTR benchmark's chunk log (bench/ctr.py): a grid chunk whose records a later chunk all replaced
leaves the log, any other stays; the tower ablation pairs by seed; the targets' standard errors combine
the training seeds and the test set (a bootstrap over whole ads, used only from the same seeds)."""

from __future__ import annotations

import numpy as np
import pytest

from benchload import load_bench


def test_grid_covers_only_chunks_whose_seeds_and_models_were_all_rerun():
    covers = load_bench("ctr")._grid_covers
    old = "grid:fashion seeds 0,1,2 models deepfm,dcnv2"
    assert covers(old, "grid:fashion", {0, 1, 2}, {"lr", "dnn", "deepfm", "dcnv2"})
    assert covers(old, "grid:fashion", {0, 1, 2}, {"deepfm", "dcnv2"})
    assert not covers(old, "grid:fashion", {0, 1}, {"lr", "dnn", "deepfm", "dcnv2"})  # seed 2 kept
    assert not covers(old, "grid:fashion", {0, 1, 2}, {"deepfm"})  # dcnv2 rows kept
    assert not covers(old, "grid:movielens", {0, 1, 2}, {"deepfm", "dcnv2"})  # another dataset
    assert not covers("select:fashion", "grid:fashion", {0, 1, 2}, {"deepfm", "dcnv2"})  # not a grid chunk


def test_tower_ablation_pairs_by_seed_and_restricts_id_raw_to_those_seeds():
    render = load_bench("ctr").render_tower_ablation
    recs = [{"dataset": "fashion", "model": "deepfm", "features": f, "seed": s, "auc_new": v}
            for f, vals in (("id+raw+visual", (0.70, 0.72, 0.90)), ("id+raw", (0.69, 0.71, 0.10)))
            for s, v in enumerate(vals)]
    abl = [{"dataset": "fashion", "model": "deepfm", "seed": s, "content_tower": False, "auc_new": v}
           for s, v in ((0, 0.68), (1, 0.71))]  # seed 2 has no ablation run: left out everywhere
    row = [line for line in render({"records": recs, "tower_ablation": abl}) if line.startswith("| fashion")]
    assert row == ["| fashion | deepfm | one tower | 0.7100 ± 0.0141 | 0.6950 ± 0.0212 | 0.0150 ± 0.0071 "
                   "| 0.7000 ± 0.0141 |"]
    assert render({"records": recs}) == []


def test_targets_use_the_ad_bootstrap_only_from_the_same_seeds():
    targets = load_bench("ctr").targets
    base = {"id": 0.60, "raw": 0.70, "visual": 0.69, "id+raw": 0.70, "id+visual": 0.69, "id+raw+visual": 0.701}
    recs = [{"dataset": "movielens", "model": "deepfm", "features": f, "seed": s, "auc_new": v + 0.001 * s,
             "bytes_per_ad": 512.0 if "raw" in f else 4.0} for f, v in base.items() for s in (0, 1)]
    ad = {"unit": "ad", "n_boot": 1000}
    row_se = {"movielens": {"deepfm|id+raw+visual|id+raw": {"se": 0.004, "se_rows": 0.002, "seeds": [0, 1], **ad},
                            # an older row bootstrap (no unit): not used
                            "deepfm|id+visual|id+raw": {"se": 0.001, "seeds": [0, 1], "n_boot": 1000},
                            "deepfm|id+visual|visual": {"se": 0.001, "seeds": [0, 1, 2], **ad}}}
    rows = {r["target"]: r for r in targets({"records": recs, "row_se": row_se})}
    # the two seeds' differences are equal (seed std 0), so the test rows alone set the standard error
    plus = rows["id+raw+visual ≥ id+raw + 0.003"]  # +0.001 against +0.003: 0.5 SE away, unresolved
    assert not plus["met"] and plus["row_se"] == 0.004 and plus["se"] == pytest.approx(0.004) and not plus["clear"]
    assert plus["se_rows"] == 0.002  # the row bootstrap rides along for the report, never in the verdict
    lower = rows["id+visual ≥ id+raw − 0.005 at ≥ 10× fewer bytes"]  # -0.01 against -0.005: 5 SE away
    assert not lower["met"] and lower["clear"] and lower["row_se"] is None and lower["se_rows"] is None
    ids = rows["adding the ad ID: id+visual ≥ visual − 0.002"]
    assert ids["row_se"] is None and ids["se"] == pytest.approx(0.0)  # other seeds: the bootstrap is not used


def test_targets_combine_seed_and_row_errors():
    targets = load_bench("ctr").targets
    diffs = {0: 0.000, 1: 0.004, 2: 0.002, 3: 0.006}  # id+raw+visual - id+raw per seed: mean 0.003, std 0.00258
    feature_sets = ("id", "raw", "visual", "id+raw", "id+visual", "id+raw+visual")
    recs = [{"dataset": "fashion", "model": "dcnv2", "features": f, "seed": s,
             "auc_new": 0.7 + (d if f == "id+raw+visual" else 0), "bytes_per_ad": 1.0}
            for s, d in diffs.items() for f in feature_sets]
    row_se = {"fashion": {"dcnv2|id+raw+visual|id+raw": {"se": 0.001, "seeds": [0, 1, 2, 3], "unit": "ad",
                                                         "n_boot": 1000}}}
    r = next(x for x in targets({"records": recs, "row_se": row_se}) if x["target"] == "id+raw+visual ≥ id+raw + 0.003")
    std = float(np.std(list(diffs.values()), ddof=1))
    assert r["seed_se"] == pytest.approx(std / 2) and r["se"] == pytest.approx(np.hypot(std / 2, 0.001))


def test_cli_line_reproduces_the_chosen_design_through_the_real_parser():
    """The command the report prints for the chosen design parses with `leanml ctr train` and carries the
    raw vector's normalization (norm_groups) into the content-ID options."""
    import shlex

    from leanml.cli import build_parser
    from leanml.ctr.jobs import TrainJob
    from leanml.flags import from_args

    ctr = load_bench("ctr")
    chosen = {"content": {"codebook": "pq", "m": 16, "k": 64, "joint": False, "norm_groups": 8},
              "visual_fields": "none", "codeword_vector": True,
              "id": {"deepfm": {"id+visual": {"id_mode": "dropout", "id_dropout": 0.5}}}}
    line = ctr.cli_line("fashion", chosen)
    assert "--norm-groups 8" in line and "--posthoc" in line and "--id-dropout 0.5" in line
    args = build_parser().parse_args(shlex.split(line)[1:])
    c = from_args(TrainJob, args).content
    assert (c.norm_groups, c.m, c.k, c.joint, c.codebook) == (8, 16, 64, False, "pq")


def test_a_fit_loaded_from_the_cache_is_not_reported_as_timed():
    C = load_bench("ctr")
    assert C.fit_seconds({"seconds": 14.2}) == "14"
    assert C.fit_seconds({"seconds": None, "cached_fit_seconds": 14.2}) == "14 (cached)"
    assert C.fit_seconds({"seconds": None}) == "–"  # unknown is not 0
