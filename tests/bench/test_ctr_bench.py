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
