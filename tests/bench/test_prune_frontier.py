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
