"""bench/prune_frontier.py's setting labels: method options and engine fields in one label."""

from __future__ import annotations

import pytest

from benchload import load_bench


def test_label_fields_go_to_the_method_options_or_the_engine_config():
    F = load_bench("prune_frontier")
    config = F.config_for("fista@fast{ridge=0.2,intra_layer=false}", "2:4")
    assert config.method == "fista" and config.pattern == "2:4"
    assert config.options.preset == "fast" and config.options.ridge == 0.2
    assert config.intra_layer is False
    assert F.config_for("fista", "50%").intra_layer is None


def test_a_field_neither_options_nor_engine_have_is_refused():
    F = load_bench("prune_frontier")
    with pytest.raises(ValueError, match="no field 'bogus'"):
        F.config_for("fista{bogus=1}", "50%")


def _rec(method, seed, ppl, cpu=10.0, corpus="shakespeare"):
    return {"method": method, "pattern": "50%", "seed": seed, "nsamples": 16, "corpus": corpus, "ppl": ppl,
            "cpu_seconds": cpu, "sparsity_measured": 0.5, "flags": []}


def test_ratios_are_taken_against_sparsegpt_over_the_same_seeds():
    F = load_bench("prune_frontier")
    recs = [_rec("sparsegpt", 0, 60.0, 70.0), _rec("sparsegpt", 1, 64.0, 74.0), _rec("fista", 0, 54.0, 105.0),
            _rec("fista", 2, 50.0)]
    key = ("50%", "shakespeare", 16)
    assert F.same_seed_reference(recs, key, [0], "ppl") == 60.0  # not the mean of seeds 0 and 1
    assert F.same_seed_reference(recs, key, [0, 1], "cpu_seconds") == 72.0
    assert F.same_seed_reference(recs, key, [0, 2], "ppl") is None  # SparseGPT lacks seed 2
    assert F.same_seed_reference(recs, ("2:4", "shakespeare", 16), [0], "ppl") is None
