"""The layer walk's settings: checked once where they are made (a PruneConfig, or WalkSettings.checked for a
pruner and a mask), never again by the walk; the walk built from a config prunes as prune_model does."""

from __future__ import annotations

import pytest
import torch

import leanml
from builders import tiny_family
from leanml.config import ConfigError
from leanml.models.layout import get_adapter
from leanml.prune.config import PruneConfig
from leanml.prune.engine import LayerWalk, WalkSettings, prune_model, walk
from leanml.prune.engine.allocation import owl_layer_sparsities
from leanml.prune.masks import MaskSpec
from leanml.prune.methods import pruner_class

CALIB = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))


def _count_checks(monkeypatch) -> dict[str, int]:
    calls = {"spec": 0, "profile": 0}
    real_spec, real_profile = walk.check_spec, walk.check_profile

    def spec(*args, **kwargs):
        calls["spec"] += 1
        return real_spec(*args, **kwargs)

    def profile(*args, **kwargs):
        calls["profile"] += 1
        return real_profile(*args, **kwargs)

    monkeypatch.setattr(walk, "check_spec", spec)
    monkeypatch.setattr(walk, "check_profile", profile)
    return calls


def test_a_config_is_checked_when_made_and_not_again_by_the_walk(monkeypatch):
    config = PruneConfig(method="wanda", sparsity=0.5, batch_size=2, device="cpu")
    calls = _count_checks(monkeypatch)  # after the config checked itself
    leanml.prune(tiny_family("llama", layers=2), CALIB, config, progress=False)
    assert calls == {"spec": 0, "profile": 0}
    prune_model(tiny_family("llama", layers=2), CALIB, pruner_class("wanda")(), MaskSpec(0.5), progress=False)
    assert calls == {"spec": 1, "profile": 1}  # a pruner and a mask: checked once, where the settings are made


def test_checked_settings_resolve_the_open_scope_and_refuse_what_the_method_cannot_take():
    assert WalkSettings.checked(pruner_class("sparsegpt")(), MaskSpec(0.5)).spec.scope == "layer"
    assert WalkSettings.checked(pruner_class("wanda")(), MaskSpec(0.5)).spec.scope == "row"
    with pytest.raises(ConfigError, match="takes no N:M mask: drop pattern"):
        WalkSettings.checked(pruner_class("fasp")(), MaskSpec(pattern=(2, 4)))
    with pytest.raises(ConfigError, match="sparsity_profile owl .* drop sparsity_profile"):
        WalkSettings.checked(pruner_class("wanda")(), MaskSpec(pattern=(2, 4)), sparsity_profile="owl")
    with pytest.raises(TypeError, match="batchsize"):  # a misspelt walk option is not ignored
        WalkSettings.checked(pruner_class("wanda")(), MaskSpec(0.5), batchsize=2)


def test_the_walk_from_a_config_prunes_as_prune_model_does():
    config = PruneConfig(method="sparsegpt", sparsity=0.6, batch_size=2, mode="dense", device="cpu")
    a, b = tiny_family("llama", layers=2, seed=4), tiny_family("llama", layers=2, seed=4)
    ra = LayerWalk(a, CALIB, WalkSettings.from_config(config, progress=False)).run()
    rb = prune_model(b, CALIB, pruner_class("sparsegpt")(), MaskSpec(0.6), sequential=False, batch_size=2,
                     device="cpu", progress=False)
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name
    assert [r["rel_output_error"] for r in ra["layers"]] == [r["rel_output_error"] for r in rb["layers"]]
    assert ra["engine"]["sequential"] is False and ra["mask"]["scope"] == "layer"


def test_owl_options_other_than_m_and_lam_are_refused():
    model = tiny_family("llama", layers=2)
    with pytest.raises(TypeError, match="m and lam, not lambda"):
        owl_layer_sparsities(model, CALIB, 0.5, adapter=get_adapter(model), progress=False, **{"lambda": 0.1})
