"""Every method on a tiny random model of every family with a declared layout: exact sparsity (N:M
per group of M), a saved directory that plain ``from_pretrained`` loads to the same logits, and for
structured methods fewer parameters by exactly the removed MLP units and key/value groups."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from builders import FAMILIES, tiny_family
from leanml.errors import LeanmlError
from leanml.models import count_parameters
from leanml.models.layout import get_adapter
from leanml.prune.engine import prune_model
from leanml.prune.masks import MaskSpec, satisfies_nm
from leanml.prune.methods import pruner_class
from leanml.prune.methods.fista import FistaPruner

CALIB = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
TEST = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
UNSTRUCTURED = [("magnitude", None), ("wanda", None), ("sparsegpt", None), ("fista", None), ("wanda", (2, 4)),
                ("sparsegpt", (4, 8))]
STRUCTURED = ["fasp", "wanda-sp", "magnitude-sp", "flap"]


def _pruner(method: str):
    if method == "fista":  # few iterations: this test is about architectures, not FISTA's optimum
        return FistaPruner(rounds=1, iters=4, refine=2)
    return pruner_class(method)()


def _reload_logits(model, path):
    model.save_pretrained(path)
    loaded = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        return loaded, model(TEST).logits, loaded(TEST).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_unstructured_methods_prune_every_family_exactly(family, tmp_path, one_thread):
    for method, pattern in UNSTRUCTURED:
        model = tiny_family(family)
        prune_model(model, CALIB, _pruner(method), MaskSpec(0.5, pattern), progress=False, batch_size=2)
        adapter = get_adapter(model)
        zeros = total = 0
        for layer in adapter.layers():
            for name, lin in adapter.linears(layer).items():
                if pattern is not None:
                    assert satisfies_nm(lin.weight, *pattern), (method, name)
                zeros += int((lin.weight == 0).sum())
                total += lin.weight.numel()
        if method in ("fista", "sparsegpt"):  # kept weights may be zero: FISTA's refill would raise the
            assert zeros >= total // 2           # error; SparseGPT zeroes inputs that are never active
        else:
            assert zeros == total // 2, (method, pattern)
        loaded, ref, got = _reload_logits(model, tmp_path / f"{method}-{pattern}")
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


def _removed_params(adapter, layer, removed: int, groups: int = 0) -> int:
    """Parameters the shrink removes with ``removed`` MLP units and ``groups`` key/value groups of one
    layer."""
    consumer = layer.get_submodule(adapter.mlp_out)
    per_unit = consumer.out_features
    for name in adapter.mlp_in:
        prod = layer.get_submodule(name)
        per_unit += adapter.mlp_segments * (prod.in_features + (prod.bias is not None))
    hidden, q_rows = adapter.config.hidden_size, adapter.group_size * adapter.head_dim
    rows = q_rows + 2 * adapter.head_dim  # a group's query, key and value rows (Qwen2: with biases)
    biased = layer.get_submodule(adapter.v_proj).bias is not None
    per_group = rows * (hidden + biased) + q_rows * hidden  # and its output-projection columns
    return removed * per_unit + groups * per_group


@pytest.mark.parametrize("family", FAMILIES)
def test_structured_methods_shrink_every_family_and_reload(family, tmp_path, one_thread):
    for method in STRUCTURED:
        model = tiny_family(family)
        adapter = get_adapter(model)
        before = count_parameters(model)
        width = getattr(model.config, adapter.intermediate_size_key)
        pairs = adapter.pairs(adapter.layers()[0])
        heads = adapter.fixed_heads_reason() is None  # OPT, GPT-NeoX and one key/value head: MLP only
        kv = adapter.num_kv_heads
        pruner = pruner_class(method)(alloc="uniform", pairs="attention,mlp" if heads else "mlp")
        if method == "flap" and not all(p.consumer_bias_ok for p in pairs if p.name in pruner.group_names):
            with pytest.raises(LeanmlError, match="flap adds a bias to .* cannot hold"):
                prune_model(model, CALIB, pruner, MaskSpec(0.5), progress=False)
            continue
        removed_expected = sum(_removed_params(adapter, layer, width // 2, kv // 2 if heads else 0)
                               for layer in adapter.layers())
        report = prune_model(model, CALIB, pruner, MaskSpec(0.5), progress=False, batch_size=2)
        fin = report["finalize"]
        assert getattr(model.config, adapter.intermediate_size_key) == fin["intermediate_size"] == width // 2
        added = fin["params_after"] - (before - removed_expected)  # biases bias compensation added
        assert added == 0 or method == "flap"
        assert fin["params_before"] == before and fin["params_after"] == count_parameters(model) < before
        # half of the key/value groups are gone where the stock attention can lose heads
        assert fin["num_key_value_heads"] == (kv - kv // 2 if heads else kv)
        assert get_adapter(model).num_kv_heads == (kv - kv // 2 if heads else kv)
        loaded, ref, got = _reload_logits(model, tmp_path / method)
        assert count_parameters(loaded) == fin["params_after"]
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
