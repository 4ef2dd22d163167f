"""The CTR benchmark's chunk log (bench/ctr.py): a grid chunk whose records a later chunk all replaced
leaves the log, any other stays."""

from __future__ import annotations

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
