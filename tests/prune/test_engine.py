"""The layer-wise engine on tiny random LLaMA (GQA) and OPT models."""

from __future__ import annotations

import pytest
import torch

from builders import tiny_llama, tiny_opt
from leanml.errors import LeanmlError
from leanml.models.layerwise import capture_layer_inputs
from leanml.models.layout import get_adapter
from leanml.prune.base import GroupStats, Pruner, output_error
from leanml.prune.engine import prune_model
from leanml.prune.masks import MaskSpec, satisfies_nm
from leanml.prune.methods import pruner_class
from leanml.prune.methods.baselines import SparseGPTPruner

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
    with pytest.raises(LeanmlError, match="other settings: sparsity 0.5 -> 0.6"):
        prune_model(tiny_llama(seed=4, layers=3), IDS, SparseGPTPruner(), MaskSpec(0.6),
                    checkpoint_dir=tmp_path, progress=False)


def test_streams_are_snapshotted_at_the_interval_and_a_resume_redoes_the_rest_exactly(tmp_path):
    ref = tiny_llama(seed=4, layers=3)
    prune_model(ref, IDS, SparseGPTPruner(), MaskSpec(0.5), progress=False)
    model = tiny_llama(seed=4, layers=3)
    with pytest.raises(KeyboardInterrupt):  # dies inside layer 2; with a long interval only layer 0's
        prune_model(model, IDS, _Crash(10), MaskSpec(0.5), checkpoint_dir=tmp_path, progress=False,  # streams
                    checkpoint_interval=3600)                                                        # are kept
    assert (tmp_path / "layer_000.pt").exists() and (tmp_path / "layer_001.pt").exists()
    state = torch.load(tmp_path / "state.pt", weights_only=False)
    assert state["next_layer"] == 1 and state["seconds"] > 0
    resumed = tiny_llama(seed=4, layers=3)
    report = prune_model(resumed, IDS, SparseGPTPruner(), MaskSpec(0.5), checkpoint_dir=tmp_path, progress=False,
                         checkpoint_interval=3600)
    assert report["engine"]["resumed_from_layer"] == 1
    assert report["prune_seconds"] > state["seconds"]  # the interrupted run's time counts too
    for a, b in zip(ref.state_dict().values(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


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


def test_dense_input_cache_gives_the_partial_pass_statistics():
    """With intra-layer correction and a dense target, one dense pass with the groups' inputs (or, for
    the MLP down projection, its dense outputs: ``C = y x*^T`` instead of ``G``) kept gives the statistics
    of one partial dense pass per group. Compared on the first layer, which both runs see identically
    (later layers inherit rounding-level differences that FISTA's hard threshold can amplify)."""
    from leanml.prune.methods.fista import FistaPruner

    seen: dict[int, list] = {}

    class Recording(FistaPruner):
        def prune_group(self, group, stats, spec):
            W = {n: lin.weight.data.clone() for n, lin in group.linears.items()}
            seen.setdefault(self.budget, []).append(
                (stats.C is not None, stats.H,
                 {n: (stats.cross(n, w), stats.dense_energy(n, w)) for n, w in W.items()}))
            return super().prune_group(group, stats, spec)

    for budget in (2**31, 0):
        pruner = Recording(rounds=1, iters=3)
        pruner.budget = budget
        prune_model(tiny_llama(seed=6), IDS, pruner, MaskSpec(0.5), progress=False, batch_size=5,
                    layers=[0], dense_cache_bytes=budget)
    cached, partial = seen[2**31], seen[0]
    assert [c[0] for c in cached] == [False, False, False, True]  # only the down projection goes by output
    assert not any(c[0] for c in partial)
    for (_, Ha, a), (_, Hb, b) in zip(cached, partial):
        torch.testing.assert_close(Ha, Hb, rtol=1e-6, atol=1e-7)
        for n in a:
            torch.testing.assert_close(a[n][0], b[n][0], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(a[n][1], b[n][1], rtol=1e-5, atol=1e-6)


def test_output_error_from_cross_product_equals_the_one_from_G():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(200, 16, generator=g, dtype=torch.float64)
    Xs = torch.randn(200, 16, generator=g, dtype=torch.float64)
    W = torch.randn(5, 16, generator=g, dtype=torch.float64)
    Wn = W * (torch.rand(5, 16, generator=g) > 0.5)
    H, G = Xs.T @ Xs / 200, X.T @ Xs / 200
    energy = {"w": ((X @ W.T) ** 2).mean(0)}
    direct = float(((Xs @ Wn.T - X @ W.T) ** 2).sum(1).mean())
    with_g = output_error(W, Wn, GroupStats(H=H, G=G, out_sq=energy), "w")
    with_c = output_error(W, Wn, GroupStats(H=H, C={"w": (X @ W.T).T @ Xs / 200}, out_sq=energy), "w")
    assert with_g == pytest.approx(direct, rel=1e-9)
    assert with_c == pytest.approx(direct, rel=1e-9)


@pytest.mark.parametrize("family,method", [("llama", "fista"), ("opt", "fista"), ("gpt_neox", "fista"),
                                           ("llama", "flap"), ("phi3", "fasp")])
def test_reusing_finished_parts_changes_nothing(monkeypatch, family, method):
    """The intra-layer passes reuse the outputs of a layer's finished parts (attention once its output
    projection is pruned): weights, reports and the next layer's inputs equal full recomputation, and
    the reuse really happens (fewer attention computations)."""
    from builders import tiny_family
    from leanml.prune.engine import layer

    calls = {}

    def run(reuse: bool):
        monkeypatch.setattr(layer, "REUSE_FINISHED_PARTS", reuse)
        model = tiny_family(family, seed=3)
        first_linear = next(iter(get_adapter(model).linears(get_adapter(model).layers()[0]).values()))
        count = [0]  # the attention's input projection runs only when the attention is computed
        first_linear.register_forward_hook(lambda *a: count.__setitem__(0, count[0] + 1))
        pruner = pruner_class(method)(**({"rounds": 1, "iters": 3} if method == "fista" else {}))
        spec = MaskSpec(0.5) if method == "fista" else MaskSpec(0.25)
        rep = prune_model(model, IDS, pruner, spec, progress=False, batch_size=5, intra_layer=True)
        calls[reuse] = count[0]
        return model, rep

    a, ra = run(True)
    b, rb = run(False)
    for (na, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), na
    assert [r["rel_output_error"] for r in ra["layers"]] == [r["rel_output_error"] for r in rb["layers"]]
    assert calls[True] < calls[False]


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_parts_short_cut_by_their_finishing_linear(monkeypatch, family):
    """Once the MLP's output projection is pruned, the final forward computes the MLP as that linear on
    the input its statistics pass kept, so the MLP's input projections run once per batch fewer (and
    the attention's, in the pass after its output projection is pruned); the
    result is bit-identical to full recomputation. A part whose output is not that linear's alone (a
    broken check) is computed in full, with identical results too."""
    from builders import tiny_family
    from leanml.prune.engine import layer
    from leanml.prune.engine.finished import FinishedParts

    def run(reuse: bool, break_check: bool = False):
        monkeypatch.setattr(layer, "REUSE_FINISHED_PARTS", reuse)
        if break_check:  # the kept input is off by one ulp: the exact check must refuse the short cut
            orig = FinishedParts.keep_input
            monkeypatch.setattr(FinishedParts, "keep_input",
                                lambda self, p, n, b, x: orig(self, p, n, b, torch.nextafter(x, x + 1)))
        model = tiny_family(family, seed=5)
        adapter = get_adapter(model)
        lins = adapter.linears(adapter.layers()[-1])
        mlp_in = [n for n in lins if n.startswith("mlp.")][0]
        attn_in = next(iter(lins))  # the attention's input projection
        count = {mlp_in: 0, attn_in: 0}
        for n in count:
            lins[n].register_forward_hook(lambda *a, n=n: count.__setitem__(n, count[n] + 1))
        pruner = pruner_class("fista")(rounds=1, iters=3)
        rep = prune_model(model, IDS, pruner, MaskSpec(0.5), progress=False, batch_size=5, intra_layer=True)
        monkeypatch.undo()
        return model, rep, count[mlp_in], count[attn_in]

    a, ra, ca, qa = run(True)
    b, rb, cb, qb = run(False)
    c, rc, cc, qc = run(True, break_check=True)
    for (na, x), y, z in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(x, y), na
        assert torch.equal(z, y), na
    errs = [r["rel_output_error"] for r in rb["layers"]]
    assert [r["rel_output_error"] for r in ra["layers"]] == errs
    assert [r["rel_output_error"] for r in rc["layers"]] == errs
    batches = -(-IDS.shape[0] // 5)
    assert ca == cb - batches + 1  # the final forward ran the MLP in full on its first batch only
    assert cc == cb
    # the attention: the pass after its output projection is pruned ran it in full on the first batch
    # only (then recorded it); with the check failing, on every batch
    assert qa == qc - batches + 1
    assert qb > qc
