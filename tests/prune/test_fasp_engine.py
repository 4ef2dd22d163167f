"""Structured pair pruning through the layer-wise engine on tiny random LLaMA (GQA) and OPT models."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from builders import tiny_llama_untied as tiny_llama
from builders import tiny_opt_biased as tiny_opt
from leanml.models.layout import get_adapter
from leanml.models.surgery import count_parameters, live_units
from leanml.prune.engine import prune_model
from leanml.prune.masks import MaskSpec
from leanml.prune.methods.fasp import (
    FaspPruner,
    FlapPruner,
    MagnitudeStructuredPruner,
    WandaStructuredPruner,
)
from leanml.utils import LeanmlError

torch.set_num_threads(1)


def _ids(n: int, seqlen: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n, seqlen), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "make, cls",
    [(tiny_llama, FaspPruner), (tiny_opt, FaspPruner), (tiny_llama, FlapPruner)],
    ids=["fasp-llama-gqa", "fasp-opt", "flap-llama-gqa"],
)
def test_engine_prunes_pairs_and_finalize_shrinks_exactly(make, cls, tmp_path):
    model = make()
    params0 = count_parameters(model)
    calib, test = _ids(8, 32, 0), _ids(2, 32, 1)
    pruner = cls()
    adapter = get_adapter(model)
    report = prune_model(model, calib, pruner, MaskSpec(sparsity=0.5), progress=False, finalize=False)
    # attn_in / mlp_in untouched, pairs at exactly 50% of units
    for layer_report, layer in zip(report["layers"], adapter.layers()):
        lin = layer_report["linears"]
        assert (layer.self_attn.q_proj.weight != 0).all() and (layer.self_attn.k_proj.weight != 0).all()
        pair = [v for v in lin.values() if v.get("role") == "consumer"]
        assert len(pair) == 2 and all(v["structured_sparsity"] == 0.5 for v in pair)
    for layer in adapter.layers():
        for group in adapter.pairs(layer):
            if group.units is not None:
                assert live_units(group).numel() == group.units.columns.shape[0] // 2
    with torch.no_grad():
        ref = model(test).logits
    info = pruner.finalize(model, adapter)
    with torch.no_grad():
        torch.testing.assert_close(model(test).logits, ref, rtol=1e-5, atol=1e-5)
    assert info["params_before"] == params0 > info["params_after"] == count_parameters(model)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert count_parameters(loaded) == info["params_after"]
    with torch.no_grad():
        torch.testing.assert_close(loaded(test).logits, ref, rtol=1e-5, atol=1e-5)


def test_fasp_beats_wanda_sp_and_magnitude_sp_on_held_out_loss():
    """Least-squares restoration must lower the held-out loss against the dense model's predictions."""
    calib, test = _ids(16, 32, 0), _ids(4, 32, 1)
    dense = tiny_llama()
    with torch.no_grad():
        target = dense(test).logits.softmax(-1)
    losses = {}
    for cls in (FaspPruner, WandaStructuredPruner, MagnitudeStructuredPruner, FlapPruner):
        model = tiny_llama()
        prune_model(model, calib, cls(), MaskSpec(sparsity=0.3), progress=False)
        with torch.no_grad():
            logp = model(test).logits.log_softmax(-1)
        losses[cls.name] = float(-(target * logp).sum(-1).mean())
    assert losses["fasp"] < losses["wanda-sp"]
    assert losses["fasp"] < losses["magnitude-sp"]
    assert losses["fasp"] < losses["flap"]


def test_engine_rejects_patterns_for_structured_methods():
    with pytest.raises(LeanmlError, match="pattern"):
        prune_model(tiny_llama(), _ids(2, 16, 0), FaspPruner(), MaskSpec(pattern=(2, 4)), progress=False)


def test_sparsity_leaving_no_unit_fails_before_any_calibration_pass(monkeypatch):
    import leanml.prune.engine as engine

    def no_capture(*args, **kwargs):
        raise AssertionError("calibration inputs were captured before the settings were checked")

    monkeypatch.setattr(engine, "capture_layer_inputs", no_capture)
    with pytest.raises(LeanmlError, match="remove all"):
        prune_model(tiny_llama(), _ids(2, 16, 0), WandaStructuredPruner(), MaskSpec(sparsity=0.999), progress=False)
    # the attention pair alone (4 query heads x 16 dims / 2 kv heads = 32 units) also fails up front
    with pytest.raises(LeanmlError, match="remove all"):
        prune_model(tiny_llama(), _ids(2, 16, 0), FaspPruner(pairs="attention"), MaskSpec(sparsity=0.99),
                    progress=False)


class _CrashingFlap(FlapPruner):
    """FLAP that dies in the second layer, after the first layer's consumers gained biases."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def prune_group(self, group, stats, spec):
        self.calls += 1
        if self.calls == 3:  # called for the two pairs of each layer: the 3rd call is layer 1's attention
            raise KeyboardInterrupt
        return super().prune_group(group, stats, spec)


def test_flap_resume_restores_added_biases_and_equals_an_uninterrupted_run(tmp_path):
    calib = _ids(4, 32, 0)
    ref = tiny_llama()
    ref_pruner = FlapPruner()
    prune_model(ref, calib, ref_pruner, MaskSpec(sparsity=0.5), progress=False)
    assert ref.model.layers[0].mlp.down_proj.bias is not None
    with pytest.raises(KeyboardInterrupt):
        prune_model(tiny_llama(), calib, _CrashingFlap(), MaskSpec(sparsity=0.5), checkpoint_dir=tmp_path,
                    progress=False)
    resumed = tiny_llama()
    pruner = FlapPruner()
    report = prune_model(resumed, calib, pruner, MaskSpec(sparsity=0.5), checkpoint_dir=tmp_path, progress=False)
    assert report["engine"]["resumed_from_layer"] == 1
    assert report["finalize"]["params_before"] == count_parameters(tiny_llama())
    ref_state, res_state = ref.state_dict(), resumed.state_dict()
    assert ref_state.keys() == res_state.keys()
    for key in ref_state:
        torch.testing.assert_close(res_state[key], ref_state[key])


def test_groups_a_structured_method_leaves_alone_cost_no_statistics(monkeypatch):
    import leanml.prune.engine as engine

    seen = []
    real = engine._group_stats_intra

    def counting(layer, dense_layer, group, *args, **kwargs):
        seen.append(group.name)
        return real(layer, dense_layer, group, *args, **kwargs)

    monkeypatch.setattr(engine, "_group_stats_intra", counting)
    model = tiny_llama()
    report = prune_model(model, _ids(2, 16, 0), FaspPruner(pairs="mlp"), MaskSpec(sparsity=0.5), progress=False)
    assert seen == ["mlp_out", "mlp_out"]  # one group per layer, two layers
    linears = report["layers"][0]["linears"]
    assert "rel_error" not in linears["self_attn.o_proj"]  # no statistics, so no error is claimed
    assert "rel_error" in linears["mlp.down_proj"]
    assert (model.model.layers[0].self_attn.o_proj.weight != 0).all()
