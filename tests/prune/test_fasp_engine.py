"""Structured pair pruning through the layer-wise engine on tiny random models: LLaMA (GQA) and OPT,
whole key/value groups removed in every family whose stock attention can lose heads, refusals, and
the score allocation."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from builders import tiny_family
from builders import tiny_llama_untied as tiny_llama
from builders import tiny_opt_biased as tiny_opt
from leanml.errors import LeanmlError
from leanml.models import surgery
from leanml.models.layout import get_adapter
from leanml.models.surgery import count_parameters, live_units
from leanml.prune.cores import fasp as core
from leanml.prune.engine import prune_model
from leanml.prune.masks import MaskSpec
from leanml.prune.methods.fasp import (
    FaspPruner,
    FlapPruner,
    MagnitudeStructuredPruner,
    WandaStructuredPruner,
)

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
    pairs = "mlp" if model.config.model_type == "opt" else "attention,mlp"  # OPT cannot lose heads
    pruner = cls(alloc="uniform", pairs=pairs)
    adapter = get_adapter(model)
    report = prune_model(model, calib, pruner, MaskSpec(sparsity=0.5), progress=False, finalize=False)
    # the selected pairs at exactly 50% of their units (LLaMA: 1 of 2 key/value groups)
    for layer_report in report["layers"]:
        pair = [v for v in layer_report["linears"].values() if v.get("role") == "consumer"]
        assert len(pair) == len(pairs.split(",")) and all(v["structured_sparsity"] == 0.5 for v in pair)
    for layer in adapter.layers():
        for group in adapter.pairs(layer):
            if group.name in pruner.group_names:
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
        prune_model(model, calib, cls(groups=1), MaskSpec(sparsity=0.3), progress=False)
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
    import leanml.prune.engine.walk as walk

    def no_capture(*args, **kwargs):
        raise AssertionError("calibration inputs were captured before the settings were checked")

    import leanml.models.layerwise as layerwise

    monkeypatch.setattr(walk, "capture_layer_inputs", no_capture)
    monkeypatch.setattr(layerwise, "capture_layer_inputs", no_capture)  # the allocation's pre-pass
    with pytest.raises(LeanmlError, match="remove all"):
        prune_model(tiny_llama(), _ids(2, 16, 0), WandaStructuredPruner(alloc="uniform"), MaskSpec(sparsity=0.999),
                    progress=False)
    # the attention pair alone (2 key/value groups): removing one of two rounds up at 0.75
    with pytest.raises(LeanmlError, match="remove all"):
        prune_model(tiny_llama(), _ids(2, 16, 0), FaspPruner(pairs="attention", alloc="uniform"),
                    MaskSpec(sparsity=0.75), progress=False)
    # score allocation: a budget that would take every group of a layer, or every MLP unit
    with pytest.raises(LeanmlError, match="every one of the 2 key/value groups of a layer"):
        prune_model(tiny_llama(), _ids(2, 16, 0), FaspPruner(pairs="attention"), MaskSpec(sparsity=0.3),
                    progress=False)
    with pytest.raises(LeanmlError, match="every MLP unit of a layer"):
        prune_model(tiny_llama(), _ids(2, 16, 0), FaspPruner(), MaskSpec(sparsity=0.9), progress=False)
    with pytest.raises(LeanmlError, match="groups 2 must leave"):
        prune_model(tiny_llama(), _ids(2, 16, 0), FaspPruner(groups=2), MaskSpec(sparsity=0.3), progress=False)
    # models whose heads cannot be removed: refused unless only the MLP is pruned
    for family, why in (("opt", "OPTAttention sizes its heads"), ("gpt_neox", "GPTNeoXAttention sizes its heads"),
                        ("gemma3_text", "one key/value group")):
        with pytest.raises(LeanmlError, match=f"attention heads cannot be removed|{why}") as err:
            prune_model(tiny_family(family), _ids(2, 16, 0), FaspPruner(), MaskSpec(0.3), progress=False)
        assert why in str(err.value) and "pairs mlp" in str(err.value) and "\n" not in str(err.value)


class _CrashingFlap(FlapPruner):
    """FLAP that dies in the second layer, after the first layer's consumers gained biases."""

    def __init__(self) -> None:
        super().__init__(alloc="uniform")
        self.calls = 0

    def prune_group(self, group, stats, spec):
        self.calls += 1
        if self.calls == 3:  # called for the two pairs of each layer: the 3rd call is layer 1's attention
            raise KeyboardInterrupt
        return super().prune_group(group, stats, spec)


def test_flap_resume_restores_added_biases_and_equals_an_uninterrupted_run(tmp_path):
    calib = _ids(4, 32, 0)
    ref = tiny_llama()
    ref_pruner = FlapPruner(alloc="uniform")
    prune_model(ref, calib, ref_pruner, MaskSpec(sparsity=0.5), progress=False)
    assert ref.model.layers[0].mlp.down_proj.bias is not None
    with pytest.raises(KeyboardInterrupt):
        prune_model(tiny_llama(), calib, _CrashingFlap(), MaskSpec(sparsity=0.5), checkpoint_dir=tmp_path,
                    progress=False)
    resumed = tiny_llama()
    pruner = FlapPruner(alloc="uniform")
    report = prune_model(resumed, calib, pruner, MaskSpec(sparsity=0.5), checkpoint_dir=tmp_path, progress=False)
    assert report["engine"]["resumed_from_layer"] == 1
    assert report["finalize"]["params_before"] == count_parameters(tiny_llama())
    ref_state, res_state = ref.state_dict(), resumed.state_dict()
    assert ref_state.keys() == res_state.keys()
    for key in ref_state:
        torch.testing.assert_close(res_state[key], ref_state[key])


def test_groups_a_structured_method_leaves_alone_cost_no_statistics(monkeypatch):
    import leanml.prune.engine.layer as layer_mod

    seen = []
    real = layer_mod.group_stats_intra

    def counting(layer, dense_layer, group, *args, **kwargs):
        seen.append(group.name)
        return real(layer, dense_layer, group, *args, **kwargs)

    monkeypatch.setattr(layer_mod, "group_stats_intra", counting)
    model = tiny_llama()
    report = prune_model(model, _ids(2, 16, 0), FaspPruner(pairs="mlp", alloc="uniform"), MaskSpec(sparsity=0.5),
                         progress=False)
    assert seen == ["mlp_out", "mlp_out"]  # one group per layer, two layers
    linears = report["layers"][0]["linears"]
    assert "rel_error" not in linears["self_attn.o_proj"]  # no statistics, so no error is claimed
    assert "rel_error" in linears["mlp.down_proj"]
    assert (model.model.layers[0].self_attn.o_proj.weight != 0).all()


class _CrashingFasp(FaspPruner):
    """FASP (score allocation) that dies at its ``crash_at``-th ``prune_group`` call."""

    def __init__(self, crash_at: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.calls, self.crash_at = 0, crash_at

    def prune_group(self, group, stats, spec):
        self.calls += 1
        if self.calls == self.crash_at:
            raise KeyboardInterrupt
        return super().prune_group(group, stats, spec)


def test_score_allocation_survives_a_resume(tmp_path, monkeypatch):
    """A resumed run takes the allocation from the checkpoint (no second pre-pass) and equals an
    uninterrupted run."""
    calib = _ids(4, 32, 0)
    ref = tiny_llama()
    ref_pruner = _CrashingFasp(crash_at=0, groups=1)
    prune_model(ref, calib, ref_pruner, MaskSpec(0.3), progress=False)
    per_layer = ref_pruner.calls // 2
    with pytest.raises(KeyboardInterrupt):
        prune_model(tiny_llama(), calib, _CrashingFasp(crash_at=per_layer + 1, groups=1), MaskSpec(0.3),
                    checkpoint_dir=tmp_path, progress=False)
    pruner = FaspPruner(groups=1)
    monkeypatch.setattr(pruner, "prepare", lambda *a, **k: pytest.fail("the allocation ran again on resume"))
    resumed = tiny_llama()
    report = prune_model(resumed, calib, pruner, MaskSpec(0.3), checkpoint_dir=tmp_path, progress=False)
    assert report["engine"]["resumed_from_layer"] == 1 and pruner.plan == ref_pruner.plan
    for (key, a), b in zip(ref.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(b, a, msg=key)


# ---------------------------------------------------------------------------------------------------
# whole key/value groups in every family whose stock attention can lose heads

GROUP_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3")


def _two_group_model(family: str, seed: int = 0):
    """A tiny model of ``family`` with at least two key/value groups (the builders give Gemma one)."""
    if family not in ("gemma2", "gemma3_text"):
        return tiny_family(family, seed=seed)
    import transformers as tf

    config_cls, model_cls = {"gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM),
                             "gemma3_text": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM)}[family]
    torch.manual_seed(seed)
    cfg = config_cls(vocab_size=256, num_hidden_layers=2, max_position_embeddings=256, hidden_size=64,
                     intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                     sliding_window=16)
    return model_cls(cfg).eval()


def _zero_group_by_hand(model, g: int) -> int:
    """Zero key/value group ``g`` in every layer straight from the config (independent of the adapters):
    the query rows of its heads, its key and value rows (fused: Phi-3's qkv_proj is all queries, all
    keys, all values), the output-projection columns of its heads. Returns the parameters removed."""
    cfg = model.config
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // nq
    rep = nq // nkv
    q = torch.arange(g * rep * hd, (g + 1) * rep * hd)
    kv = torch.arange(g * hd, (g + 1) * hd)
    removed = 0
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            if hasattr(attn, "qkv_proj"):
                rows = torch.cat([q, nq * hd + kv, (nq + nkv) * hd + kv])
                lins = [(attn.qkv_proj, rows)]
            else:
                lins = [(attn.q_proj, q), (attn.k_proj, kv), (attn.v_proj, kv)]
            for lin, rows in lins:
                lin.weight[rows] = 0
                removed += rows.numel() * lin.in_features
                if lin.bias is not None:
                    lin.bias[rows] = 0
                    removed += rows.numel()
            attn.o_proj.weight[:, q] = 0
            removed += q.numel() * attn.o_proj.out_features
    return removed


@pytest.mark.parametrize("family", GROUP_FAMILIES)
def test_removing_a_group_equals_zeroing_its_heads_then_slicing(family, tmp_path):
    model = _two_group_model(family)
    cfg = model.config
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // nq
    before = count_parameters(model)
    removed = _zero_group_by_hand(model, g=nkv - 1)
    test = _ids(2, 24, 1)
    with torch.no_grad():
        zeroed = model(test).logits
    info = surgery.shrink_attention(model, get_adapter(model))
    assert info["num_key_value_heads"] == nkv - 1 and info["live_groups"] == [nkv - 1] * 2
    assert (cfg.num_key_value_heads, cfg.num_attention_heads, cfg.head_dim) == (nkv - 1, nq - nq // nkv, hd)
    assert count_parameters(model) == before - removed
    with torch.no_grad():
        torch.testing.assert_close(model(test).logits, zeroed, rtol=1e-5, atol=1e-5)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()  # plain transformers
    assert count_parameters(loaded) == before - removed
    with torch.no_grad():
        torch.testing.assert_close(loaded(test).logits, zeroed, rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", GROUP_FAMILIES)
def test_fasp_removes_one_group_in_every_family_and_plain_transformers_reloads_it(family, tmp_path):
    """Through the engine at a 30 % parameter budget with one group forced (Qwen2 here has 2 key/value
    heads, as Qwen2.5-0.5B: one of two goes)."""
    model = _two_group_model(family)
    nkv, nq = model.config.num_key_value_heads, model.config.num_attention_heads
    before = count_parameters(model)
    report = prune_model(model, _ids(4, 32, 0), FaspPruner(groups=1), MaskSpec(0.3), progress=False, batch_size=2)
    fin = report["finalize"]
    assert fin["attention_groups_removed"] == 1 and fin["num_key_value_heads"] == nkv - 1
    assert model.config.num_attention_heads == nq - nq // nkv
    assert fin["params_after"] == count_parameters(model) <= 0.7 * before
    assert fin["allocation"]["params_removed_planned"] == before - fin["params_after"]
    test = _ids(2, 24, 1)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert count_parameters(loaded) == fin["params_after"]
    with torch.no_grad():
        torch.testing.assert_close(loaded(test).logits, model(test).logits, rtol=0, atol=1e-6)


def test_score_allocation_matches_allocate_on_the_dense_scores():
    """The engine's plan is :func:`allocate` on per-layer normalized scores recomputed here from the
    dense model's consumer inputs (hooks on the full model, not the layer-wise pre-pass)."""
    model = tiny_llama()
    calib = _ids(4, 32, 0)
    adapter = get_adapter(model)
    sq: dict[str, list[torch.Tensor]] = {"attn_out": [], "mlp_out": []}
    hooks = []
    for layer in adapter.layers():
        for g in adapter.pairs(layer):
            lin = g.linears[g.leader]
            hooks.append(lin.register_forward_pre_hook(
                lambda m, a, name=g.name: sq[name].append(a[0].reshape(-1, a[0].shape[-1]).double().pow(2).mean(0))))
    with torch.no_grad():
        model(calib)
    for h in hooks:
        h.remove()
    scores = {}
    for name in sq:
        per_layer = []
        for i, layer in enumerate(adapter.layers()):
            g = next(g for g in adapter.pairs(layer) if g.name == name)
            W = g.linears[g.leader].weight
            per_layer.append(torch.stack([(W[:, c].abs().sum(0).double() * sq[name][i][c].sqrt()).sum()
                                          for c in g.units.columns]))
        scores[name] = torch.stack(per_layer)
    att, mlp = core.normalize_layer_scores(scores["attn_out"], scores["mlp_out"])
    pruner = FaspPruner(plan_samples=4)
    report = prune_model(model, calib, pruner, MaskSpec(0.3), progress=False, batch_size=4, finalize=False)
    group_cost = 16 * 64 * 2 + 2 * 16 * 64 * 2  # 2 query heads + key + value rows, 2 x 16 output columns x 64
    unit_cost = 3 * 64
    ref = core.allocate(att, mlp, group_cost, unit_cost, round(0.3 * count_parameters(tiny_llama())))
    assert pruner.plan["removed"] == {"attn_out": ref["groups_removed"], "mlp_out": ref["units_removed"]}
    assert pruner.plan["unit_params"] == {"attn_out": group_cost, "mlp_out": unit_cost}
    assert pruner.plan["score_lost"] == pytest.approx(ref["score_lost"], rel=1e-6)
    assert len(report["layers"]) == 2
