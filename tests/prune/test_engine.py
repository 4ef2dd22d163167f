"""The layer-wise engine on tiny random LLaMA (GQA) and OPT models."""

from __future__ import annotations

import pytest
import torch

from builders import tiny_llama, tiny_opt
from leanml.models.layerwise import capture_layer_inputs
from leanml.models.layout import get_adapter
from leanml.prune.base import GroupStats, Pruner
from leanml.prune.engine import prune_model
from leanml.prune.masks import MaskSpec, satisfies_nm
from leanml.prune.methods import pruner_class
from leanml.prune.methods.baselines import SparseGPTPruner
from leanml.utils import LeanmlError

IDS = torch.randint(0, 256, (12, 32), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("make", [tiny_llama, tiny_opt])
@pytest.mark.parametrize("method", ["magnitude", "wanda", "sparsegpt"])
def test_every_linear_meets_the_target_and_embeddings_are_untouched(make, method):
    model = make()
    emb = model.get_input_embeddings().weight.clone()
    head = model.get_output_embeddings().weight.clone()
    report = prune_model(model, IDS, pruner_class(method)(), MaskSpec(0.5, scope="row"), progress=False)
    adapter = get_adapter(model)
    for layer in adapter.layers():
        for lin in adapter.linears(layer).values():
            assert ((lin.weight == 0).sum(1) == lin.in_features // 2).all()
    torch.testing.assert_close(model.get_input_embeddings().weight, emb)
    torch.testing.assert_close(model.get_output_embeddings().weight, head)
    assert len(report["layers"]) == 2
    assert all(0 < lay["rel_output_error"] < 1 for lay in report["layers"])


def test_two_four_pattern_through_the_engine():
    model = tiny_llama()
    prune_model(model, IDS, SparseGPTPruner(blocksize=16), MaskSpec(pattern=(2, 4)), progress=False)
    for layer in get_adapter(model).layers():
        assert satisfies_nm(layer.mlp.down_proj.weight, 2, 4)
        assert satisfies_nm(layer.self_attn.q_proj.weight, 2, 4)


def test_sparsegpt_error_below_wanda_and_magnitude_on_tiny_model():
    errs = {}
    for method in ["magnitude", "wanda", "sparsegpt"]:
        model = tiny_llama(seed=1)
        report = prune_model(model, IDS, pruner_class(method)(), MaskSpec(0.5), progress=False)
        errs[method] = report["layers"][-1]["rel_output_error"]
    assert errs["sparsegpt"] < errs["wanda"] < errs["magnitude"]


class _Recorder(Pruner):
    """Records the statistics the engine hands over, prunes nothing."""

    name = "recorder"
    needs_dense = True

    def __init__(self) -> None:
        self.seen: dict[str, GroupStats] = {}

    def prune_group(self, group, stats, spec):
        self.seen[group.name] = stats
        for lin in group.linears.values():  # a visible change so intra-layer correction matters
            lin.weight.data.mul_(0.5)
        return {}


def test_group_statistics_match_a_direct_computation():
    model = tiny_llama(seed=2, layers=1)
    dense = tiny_llama(seed=2, layers=1)
    rec = _Recorder()
    prune_model(model, IDS, rec, MaskSpec(0.5), progress=False, batch_size=5)
    # direct: dense input of o_proj, and its input after q/k/v were halved (intra-layer correction)
    captured = {}
    layer = dense.model.layers[0]
    h = layer.self_attn.o_proj.register_forward_pre_hook(lambda m, a: captured.setdefault("x", a[0]))
    dense(input_ids=IDS)
    h.remove()
    for name in ["q_proj", "k_proj", "v_proj"]:
        getattr(layer.self_attn, name).weight.data.mul_(0.5)
    h = layer.self_attn.o_proj.register_forward_pre_hook(lambda m, a: captured.setdefault("xs", a[0]))
    dense(input_ids=IDS)
    h.remove()
    x = captured["x"].reshape(-1, 64)
    xs = captured["xs"].reshape(-1, 64)
    st = rec.seen["self_attn.o_proj"]
    n = x.shape[0]
    torch.testing.assert_close(st.H, xs.T @ xs / n, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(st.G, x.T @ xs / n, atol=1e-5, rtol=1e-4)
    # the dense target's energy per row: diag(W Hd W^T), from the dense outputs the engine ran anyway
    W = layer.self_attn.o_proj.weight
    torch.testing.assert_close(st.dense_energy("self_attn.o_proj", W), ((W @ (x.T @ x / n)) * W).sum(1),
                               atol=1e-5, rtol=1e-4)
    assert st.ntokens == IDS.numel()


def test_without_intra_layer_correction_stats_come_from_the_unpruned_layer():
    model = tiny_llama(seed=2, layers=1)
    rec = _Recorder()
    prune_model(model, IDS, rec, MaskSpec(0.5), progress=False, intra_layer=False)
    st = rec.seen["self_attn.o_proj"]
    torch.testing.assert_close(st.H, st.G)  # pruned-path input == dense input in the first layer


def test_dense_mode_layers_are_independent_and_subsets_compose():
    full = tiny_llama(seed=3, layers=3)
    prune_model(full, IDS, SparseGPTPruner(), MaskSpec(0.5), sequential=False, progress=False)
    parts = tiny_llama(seed=3, layers=3)
    for subset in ([2], [0, 1]):
        fresh = tiny_llama(seed=3, layers=3)
        prune_model(fresh, IDS, SparseGPTPruner(), MaskSpec(0.5), sequential=False, layers=subset, progress=False)
        for i in subset:
            parts.model.layers[i].load_state_dict(fresh.model.layers[i].state_dict())
    for a, b in zip(full.state_dict().values(), parts.state_dict().values()):
        torch.testing.assert_close(a, b)


class _Crash(SparseGPTPruner):
    def __init__(self, at_layer_call: int) -> None:
        super().__init__()
        self.calls = 0
        self.at = at_layer_call

    def prune_group(self, group, stats, spec):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt
        return super().prune_group(group, stats, spec)


def test_resume_after_interruption_equals_uninterrupted(tmp_path):
    ref = tiny_llama(seed=4, layers=3)
    prune_model(ref, IDS, SparseGPTPruner(), MaskSpec(0.5), progress=False)
    model = tiny_llama(seed=4, layers=3)
    with pytest.raises(KeyboardInterrupt):  # dies inside layer 1 (groups 5..8 belong to it)
        prune_model(model, IDS, _Crash(6), MaskSpec(0.5), checkpoint_dir=tmp_path, progress=False)
    assert (tmp_path / "layer_000.pt").exists() and not (tmp_path / "layer_001.pt").exists()
    resumed = tiny_llama(seed=4, layers=3)
    report = prune_model(resumed, IDS, SparseGPTPruner(), MaskSpec(0.5), checkpoint_dir=tmp_path, progress=False)
    assert report["engine"]["resumed_from_layer"] == 1
    assert [lay["layer"] for lay in report["layers"]] == [0, 1, 2]
    for a, b in zip(ref.state_dict().values(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b)
    with pytest.raises(LeanmlError, match="different settings"):
        prune_model(tiny_llama(seed=4, layers=3), IDS, SparseGPTPruner(), MaskSpec(0.6),
                    checkpoint_dir=tmp_path, progress=False)


def test_capture_returns_the_embeddings():
    model = tiny_llama(seed=5)
    inps, kwargs = capture_layer_inputs(model, get_adapter(model), IDS, batch_size=5)
    assert inps.shape == (12, 32, 64) and len(kwargs) == 2 and all(len(k) == 3 for k in kwargs)
    torch.testing.assert_close(inps, model.model.embed_tokens(IDS))


def test_a_model_without_linears_says_what_it_found():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64))
    with pytest.raises(LeanmlError, match=r"gpt2: decoder layers hold weights outside nn.Linear \(attn.c_attn.weight"):
        get_adapter(model)


def test_dense_input_cache_gives_the_partial_pass_result():
    """With intra-layer correction and a dense target, one dense pass with the groups' inputs kept equals
    one partial dense pass per group."""
    from leanml.prune.methods.fista import FistaPruner

    a, b = tiny_llama(seed=6), tiny_llama(seed=6)
    ra = prune_model(a, IDS, FistaPruner(rounds=1, iters=3), MaskSpec(0.5), progress=False, batch_size=5)
    rb = prune_model(b, IDS, FistaPruner(rounds=1, iters=3), MaskSpec(0.5), progress=False, batch_size=5,
                     dense_cache_bytes=0)
    for x, y in zip(a.state_dict().values(), b.state_dict().values()):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    assert [r["rel_output_error"] for r in ra["layers"]] == pytest.approx([r["rel_output_error"] for r in rb["layers"]])
