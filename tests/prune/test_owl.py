"""OWL layer sparsities: the pure allocation against a hand computation, the dense pre-pass against
direct hooks, and exact totals through the engine."""

from __future__ import annotations

import pytest
import torch

from builders import tiny_family
from leanml.errors import LeanmlError
from leanml.models.layout import get_adapter
from leanml.prune.engine import linear_specs, prune_model
from leanml.prune.engine.allocation import outlier_ratio, owl_allocation, owl_layer_sparsities
from leanml.prune.masks import MaskSpec
from leanml.prune.methods import pruner_class

CALIB = torch.randint(0, 256, (4, 24), generator=torch.Generator().manual_seed(0))


def test_allocation_matches_a_hand_computation():
    # a = 2 * 0.08 * (D - 0.1) / 0.4 = [0, 0.08, 0.04, 0.16]; centred on its mean 0.07
    assert owl_allocation([0.1, 0.3, 0.2, 0.5], 0.6, 0.08) == pytest.approx([0.67, 0.59, 0.63, 0.51])
    # parameter-weighted centre: (0*100 + 0.08*100 + 0.04*200 + 0.16*100) / 500 = 0.064
    s = owl_allocation([0.1, 0.3, 0.2, 0.5], 0.6, 0.08, sizes=[100, 100, 200, 100])
    assert s == pytest.approx([0.664, 0.584, 0.624, 0.504])
    assert sum(a * b for a, b in zip(s, [100, 100, 200, 100])) == pytest.approx(0.6 * 500)
    assert owl_allocation([0.2, 0.2, 0.2], 0.7) == pytest.approx([0.7, 0.7, 0.7])  # no spread: uniform
    with pytest.raises(LeanmlError, match="lower lam"):
        owl_allocation([0.0, 1.0], 0.95, 0.08)


def test_outlier_ratio_counts_scores_above_m_times_the_mean():
    scores = [torch.ones(3, 3), torch.tensor([31.0])]  # mean (9 + 31) / 10 = 4; only 31 > 5 * 4
    assert outlier_ratio(scores, 5.0) == pytest.approx(0.1)
    assert outlier_ratio(scores, 8.0) == 0.0  # 31 < 8 * 4


def test_pre_pass_ratios_equal_direct_hooks_on_the_dense_model():
    model = tiny_family("llama")
    sq: dict[str, torch.Tensor] = {}
    hooks = [lin.register_forward_pre_hook(
                 lambda m, a, n=name: sq.__setitem__(n, sq.get(n, 0) + a[0].pow(2).sum((0, 1))))
             for name, lin in model.named_modules() if isinstance(lin, torch.nn.Linear) and "layers" in name]
    with torch.no_grad():
        for start in range(0, 4, 2):
            model(CALIB[start : start + 2])
    for h in hooks:
        h.remove()
    expect = []
    for i, layer in enumerate(model.model.layers):
        scores = [lin.weight.abs() * sq[f"model.layers.{i}.{n}"].sqrt() for n, lin in layer.named_modules()
                  if isinstance(lin, torch.nn.Linear)]
        expect.append(outlier_ratio(scores, 2.0))
    sparsities, info = owl_layer_sparsities(model, CALIB, 0.6, adapter=get_adapter(model), batch_size=2,
                                            progress=False, m=2.0)
    assert info["outlier_ratios"] == pytest.approx(expect, rel=1e-5)
    assert sparsities == pytest.approx(owl_allocation(expect, 0.6, 0.08))


@pytest.mark.parametrize("method", ["magnitude", "wanda", "sparsegpt"])
def test_owl_through_the_engine_is_exact_and_reported(method):
    model = tiny_family("llama", layers=3)
    report = prune_model(model, CALIB, pruner_class(method)(), MaskSpec(0.7), sparsity_profile="owl",
                         owl={"m": 2.0}, progress=False, batch_size=2)
    prof = report["mask"]["profile"]
    assert prof["name"] == "owl" and len(set(prof["layer_sparsity"])) == 3  # the layers differ
    adapter = get_adapter(model)
    zeros = total = 0
    for rec, layer in zip(report["layers"], adapter.layers()):
        lz = sum(int((lin.weight == 0).sum()) for lin in adapter.linears(layer).values())
        ln = sum(lin.weight.numel() for lin in adapter.linears(layer).values())
        assert rec["sparsity_requested"] == prof["layer_sparsity"][rec["layer"]]
        assert rec["sparsity_measured"] == lz / ln
        assert abs(lz - rec["sparsity_requested"] * ln) <= len(adapter.linears(layer))  # within rounding
        zeros, total = zeros + lz, total + ln
    assert zeros == round(0.7 * total)  # the total over all pruned linears is exact


def test_per_linear_counts_round_cumulatively_to_an_exact_total():
    model = tiny_family("qwen3")
    adapter = get_adapter(model)
    specs = linear_specs(adapter, range(2), MaskSpec(0.37), [0.31, 0.43])
    counts = {(i, n): round(s.sparsity * adapter.linears(adapter.layers()[i])[n].weight.numel())
              for i, per in specs.items() for n, s in per.items()}
    sizes = [sum(lin.weight.numel() for lin in adapter.linears(layer).values()) for layer in adapter.layers()]
    assert sum(counts.values()) == round(0.31 * sizes[0] + 0.43 * sizes[1])


def test_owl_refuses_patterns_and_structured_methods():
    with pytest.raises(LeanmlError, match="does not apply to the 2:4 pattern"):
        prune_model(tiny_family("llama"), CALIB, pruner_class("wanda")(), MaskSpec(pattern=(2, 4)),
                    sparsity_profile="owl", progress=False)
    with pytest.raises(LeanmlError, match="does not apply to structured fasp"):
        prune_model(tiny_family("llama"), CALIB, pruner_class("fasp")(), MaskSpec(0.3),
                    sparsity_profile="owl", progress=False)
