"""Architecture knowledge: layers and linear groups found automatically, declared structured pairs
checked against what the modules really compute, and the models leanml refuses."""

from __future__ import annotations

import pytest
import torch

from builders import FAMILIES, tiny_family
from leanml.errors import LeanmlError
from leanml.models.layerwise import capture_layer_inputs, forward_layer
from leanml.models.layout import DecoderAdapter, discover_groups, find_layers, get_adapter

IDS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))

EXPECTED_GROUPS = {
    "llama": [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"],
              ["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]],
    "phi3": [["self_attn.qkv_proj"], ["self_attn.o_proj"], ["mlp.gate_up_proj"], ["mlp.down_proj"]],
    "opt": [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.out_proj"], ["fc1"], ["fc2"]],
    # parallel attention and MLP read two different layer norms of the same residual
    "gpt_neox": [["attention.query_key_value"], ["attention.dense"], ["mlp.dense_h_to_4h"], ["mlp.dense_4h_to_h"]],
}
for _f in ("mistral", "qwen2", "qwen3", "gemma2", "gemma3_text"):
    EXPECTED_GROUPS[_f] = EXPECTED_GROUPS["llama"]


def _first_layer_run(model):
    adapter = get_adapter(model)
    hidden, kwargs = capture_layer_inputs(model, adapter, IDS, batch_size=2)
    layer = adapter.layers()[0]
    return adapter, layer, (lambda: forward_layer(layer, hidden, kwargs[0][0]))


@pytest.mark.parametrize("family", FAMILIES)
def test_groups_are_found_in_forward_order(family):
    model = tiny_family(family)
    adapter, layer, run = _first_layer_run(model)
    assert len(adapter.layers()) == 2 and adapter.layers() is find_layers(model)
    groups = discover_groups(layer, run, family)
    assert [list(g.linears) for g in groups] == EXPECTED_GROUPS[family]


@pytest.mark.parametrize("family", FAMILIES)
def test_declared_units_are_what_the_modules_compute(family):
    """Zeroing a unit's producer rows (weights and biases) must zero that unit's consumer input columns
    and change no other column: this checks the declared rows of fused projections (phi3's qkv_proj and gate_up_proj,
    gpt_neox's per-head query_key_value) and the key/value groups (query, key and value rows of a key/value
    head and its query heads -> their output-projection columns) against the real forward."""
    model = tiny_family(family)
    adapter, layer, run = _first_layer_run(model)

    def consumer_input(name):
        box = []
        h = layer.get_submodule(name).register_forward_pre_hook(lambda m, a: box.append(a[0]))
        with torch.no_grad():
            run()
        h.remove()
        return box[0].reshape(-1, box[0].shape[-1])

    for pair in adapter.pairs(layer):
        units = pair.units
        x0 = consumer_input(pair.leader)
        for u in sorted({0, units.n_units // 2, units.n_units - 1}):  # attention: one unit per key/value group
            saved = {n: (p.weight.data.clone(), None if p.bias is None else p.bias.data.clone())
                     for n, p in pair.producers.items()}
            with torch.no_grad():
                for n, p in pair.producers.items():
                    p.weight[units.rows[n][u]] = 0
                    if p.bias is not None:
                        p.bias[units.rows[n][u]] = 0
            x = consumer_input(pair.leader)
            cols = set(units.columns[u].tolist())
            changed = set((x != x0).any(dim=0).nonzero().flatten().tolist())
            assert (x[:, units.columns[u]] == 0).all() and changed and changed <= cols, (family, pair.name, u)
            with torch.no_grad():
                for n, p in pair.producers.items():
                    p.weight.copy_(saved[n][0])
                    if p.bias is not None:
                        p.bias.copy_(saved[n][1])


def test_a_decoder_without_a_declared_layout_still_prunes_unstructured():
    from transformers import BloomConfig, BloomForCausalLM

    model = BloomForCausalLM(BloomConfig(n_layer=2, hidden_size=32, n_head=2, vocab_size=64)).eval()
    adapter = get_adapter(model)
    assert type(adapter) is DecoderAdapter and not adapter.has_pairs
    hidden, kwargs = capture_layer_inputs(model, adapter, IDS % 64, batch_size=2)
    layer = adapter.layers()[0]
    groups = discover_groups(layer, lambda: forward_layer(layer, hidden, kwargs[0][0]), "bloom")
    assert [list(g.linears) for g in groups] == [["self_attention.query_key_value"], ["self_attention.dense"],
                                                 ["mlp.dense_h_to_4h"], ["mlp.dense_4h_to_h"]]


def test_mixture_of_experts_and_encoder_decoder_models_are_refused():
    from transformers import MixtralConfig, MixtralForCausalLM, T5Config, T5ForConditionalGeneration

    moe = MixtralForCausalLM(MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
                                           num_local_experts=4))
    with pytest.raises(LeanmlError, match=r"mixtral is a mixture-of-experts model \(num_\w*experts=4\)"):
        get_adapter(moe)
    t5 = T5ForConditionalGeneration(T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, vocab_size=64))
    with pytest.raises(LeanmlError, match="encoder-decoder"):
        get_adapter(t5)


def test_a_linear_called_only_on_some_tokens_is_refused():
    """Discovery names linears a forward did not call (routing), instead of pruning them blind."""
    model = tiny_family("llama")
    adapter, layer, _ = _first_layer_run(model)
    layer.mlp.extra = torch.nn.Linear(64, 64)  # registered, never called
    hidden, kwargs = capture_layer_inputs(model, adapter, IDS, batch_size=2)
    with pytest.raises(LeanmlError, match="linears mlp.extra were not called"):
        discover_groups(layer, lambda: forward_layer(layer, hidden, kwargs[0][0]), "llama")
