"""Structured pair pruning (FASP and baselines): numeric core against direct references, and physical
shrinking against zeroing on tiny LLaMA (grouped-query attention) and OPT models."""

from __future__ import annotations

import argparse

import pytest
import torch
from transformers import AutoModelForCausalLM

from builders import tiny_llama_untied, tiny_opt_biased
from leanml.config import ConfigError
from leanml.errors import LeanmlError
from leanml.flags import cli_message, flags_of
from leanml.models.layout import get_adapter
from leanml.models.surgery import count_parameters, live_units
from leanml.prune.base import GroupStats
from leanml.prune.cores import fasp as core
from leanml.prune.masks import MaskSpec
from leanml.prune.methods.fasp import (
    FaspOptions,
    FaspPruner,
    FlapPruner,
    MagnitudeStructuredPruner,
    StructuredPairPruner,
    WandaStructuredPruner,
)

torch.set_num_threads(1)


# ---------------------------------------------------------------------------------------------------
# numeric core


def _data(n: int = 12, out: int = 5, N: int = 300, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, N, generator=g, dtype=torch.float64) + 0.3  # features x tokens, non-zero mean
    Xp = X + 0.2 * torch.randn(n, N, generator=g, dtype=torch.float64)  # "pruned path" input
    W = torch.randn(out, n, generator=g, dtype=torch.float64)
    return X, Xp, W


def test_restoration_equals_lstsq_undamped():
    X, Xp, W = _data()
    S = torch.tensor([0, 2, 3, 7, 8, 11])
    H = Xp @ Xp.T / X.shape[1]
    G = X @ Xp.T / X.shape[1]
    W_new = core.restore_least_squares(W, H, S, G=G, damp=0.0)
    # argmin || W_S Xp_S - W X ||  ->  Xp_S^T W_S^T = X^T W^T
    ref = torch.linalg.lstsq(Xp[S].T, (W @ X).T).solution.T
    torch.testing.assert_close(W_new[:, S], ref, rtol=1e-8, atol=1e-8)
    rest = core.complement(S, W.shape[1])
    assert (W_new[:, rest] == 0).all()
    # without G the target is the pruned-path input itself
    ref_self = torch.linalg.lstsq(Xp[S].T, (W @ Xp).T).solution.T
    torch.testing.assert_close(core.restore_least_squares(W, H, S, damp=0.0)[:, S], ref_self)


def test_restoration_equals_ridge_lstsq_with_damping():
    X, Xp, W = _data(seed=1)
    N = X.shape[1]
    S = torch.tensor([1, 4, 5, 6, 9, 10, 11])
    H = Xp @ Xp.T / N
    G = X @ Xp.T / N
    damp = 0.05
    W_new = core.restore_least_squares(W, H, S, G=G, damp=damp)
    diag = torch.diagonal(H[S][:, S])
    delta = damp * diag + 1e-8 * diag.mean()
    # ridge towards the original weights as an augmented least-squares problem:
    # [Xp_S^T; sqrt(N D)] w = [X^T W^T; sqrt(N D) W_S^T]
    A = torch.cat([Xp[S].T, torch.diag((N * delta).sqrt())])
    B = torch.cat([(W @ X).T, (N * delta).sqrt().unsqueeze(1) * W[:, S].T])
    ref = torch.linalg.lstsq(A, B).solution.T
    torch.testing.assert_close(W_new[:, S], ref, rtol=1e-8, atol=1e-8)


def test_restoration_recovers_when_pruned_columns_are_redundant():
    # columns 3 and 4 are exact linear combinations of kept ones: refit must be (nearly) lossless
    g = torch.Generator().manual_seed(2)
    X = torch.randn(6, 400, generator=g, dtype=torch.float64)
    X = torch.cat([X, (X[0] - 2 * X[1]).unsqueeze(0), (X[2] + X[5]).unsqueeze(0)])
    W = torch.randn(4, 8, generator=g, dtype=torch.float64)
    H = X @ X.T / 400
    S = torch.arange(6)
    stats = GroupStats(H=H, ntokens=400)
    W_new = core.restore_least_squares(W, stats.H, S, damp=1e-10)
    assert ((W_new @ X - W @ X).norm() / (W @ X).norm()) < 1e-6
    assert ((core.zero_columns(W, S) @ X - W @ X).norm() / (W @ X).norm()) > 0.1


def test_restoration_keeps_dense_weights_where_data_is_missing():
    # feature 3 is never active in the calibration data: its weights must stay, not be erased
    X, _, W = _data(n=6, out=3, seed=4)
    X[3] = 0
    H = X @ X.T / X.shape[1]
    S = torch.tensor([0, 1, 3, 4])
    W_new = core.restore_least_squares(W, H, S, damp=0.01)
    torch.testing.assert_close(W_new[:, 3], W[:, 3])


def test_scores_against_direct_formulas():
    X, _, W = _data(n=8, out=4)
    N = X.shape[1]
    H = X @ X.T / N
    mean = X.mean(1)
    columns = torch.tensor([[0, 4], [1, 5], [2, 6], [3, 7]])
    fasp = core.fasp_scores(W, torch.diagonal(H), columns)
    mag = core.magnitude_scores(W, columns)
    flap = core.flap_scores(W, torch.diagonal(H), mean, columns)
    for u, cols in enumerate(columns.tolist()):
        # ||X_j||_2 over tokens, up to the constant sqrt(N)
        ref = sum(float(W[:, j].abs().sum() * X[j].norm()) / N**0.5 for j in cols)
        assert float(fasp[u]) == pytest.approx(ref, rel=1e-10)
        assert float(mag[u]) == pytest.approx(sum(float(W[:, j].norm()) for j in cols), rel=1e-6)
        ref_flap = sum(float(X[j].var(unbiased=False) * W[:, j].pow(2).sum()) for j in cols)
        assert float(flap[u]) == pytest.approx(ref_flap, rel=1e-8)


def test_bias_compensation_preserves_mean_output():
    X, _, W = _data()
    P = torch.tensor([1, 2, 9])
    keep = core.complement(P, W.shape[1])
    delta = core.bias_compensation(W, X.mean(1), P)
    before = (W @ X).mean(1)
    after = (core.zero_columns(W, keep) @ X).mean(1) + delta
    torch.testing.assert_close(after, before)


def test_num_kept_rounding_and_errors():
    assert core.num_kept(1536, 0.2) == 1536 - 307  # 307.2 -> 307 pruned
    assert core.num_kept(192, 0.3) == 192 - 58  # 57.6 -> 58 pruned
    assert core.num_kept(10, 0.25) == 8  # 2.5 rounds half to even -> 2 pruned
    assert core.num_kept(1536, 0.2, multiple=8) == 1232
    assert core.num_kept(7, 0.0) == 7
    for bad in (1.0, 1.5, -0.1):
        with pytest.raises(LeanmlError, match="sparsity"):
            core.num_kept(10, bad)
    with pytest.raises(LeanmlError, match="remove all"):
        core.num_kept(3, 0.9)


def test_select_units_against_brute_force():
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        scores = torch.randint(0, 5, (9,), generator=g).float()  # many ties
        keep = int(torch.randint(1, 10, (1,), generator=g))
        got = core.select_units(scores, keep).tolist()
        ref = sorted(sorted(range(9), key=lambda i: (-float(scores[i]), i))[:keep])
        assert got == ref


def test_allocate_against_brute_force():
    """The (groups, units) per layer that meets the budget with the least score lost, by enumeration of
    every pair of counts."""
    g = torch.Generator().manual_seed(5)
    for trial in range(30):
        L, G, n = 3, int(torch.randint(2, 5, (1,), generator=g)), 20
        att = torch.rand(L, G, generator=g, dtype=torch.float64) * float(torch.rand(1, generator=g) * 3)
        mlp = torch.rand(L, n, generator=g, dtype=torch.float64) * 0.1
        cg, cu = int(torch.randint(5, 40, (1,), generator=g)), 3
        budget = int(torch.randint(1, L * (G - 1) * cg + L * (n - 1) * cu, (1,), generator=g))
        multiple = 1 if trial % 3 else 4
        try:
            got = core.allocate(att, mlp, cg, cu, budget, multiple)
        except LeanmlError:
            got = None
        best = None
        for k in range(G):
            if L * k * cg > budget:
                continue
            for m in range(n):  # m < n: a layer keeps a unit
                if (n - m) % multiple or L * (k * cg + m * cu) < budget:
                    continue
                lost = float(att.sort(1).values[:, :k].sum() + mlp.sort(1).values[:, :m].sum())
                if best is None or lost < best[0] - 1e-12:
                    best = (lost, k, m)
                break  # the fewest units completing the budget for this k
        if best is None:
            assert got is None
            continue
        assert got is not None and (got["groups_removed"], got["units_removed"]) == best[1:], trial
        assert got["score_lost"] == pytest.approx(best[0])
        assert got["params_removed"] == L * (best[1] * cg + best[2] * cu) >= budget


def test_allocate_rules_and_errors():
    att = torch.tensor([[0.1, 0.15, 0.3]] * 2, dtype=torch.float64)
    mlp = torch.full((2, 10), 0.05, dtype=torch.float64)
    # cheap attention: two groups per layer (0.25, 40 params) beat one group and 4 units (0.3)
    assert core.allocate(att, mlp, 20, 5, 80)["groups_removed"] == 2
    assert core.allocate(att * 10, mlp, 20, 5, 80)["groups_removed"] == 0
    forced = core.allocate(att * 10, mlp, 20, 5, 80, groups=1)
    assert (forced["groups_removed"], forced["units_removed"]) == (1, 4)
    # attention alone: the group count closest to the budget; never every group of a layer
    assert core.allocate(att, None, 20, 0, 75)["groups_removed"] == 2
    with pytest.raises(LeanmlError, match="every one of the 3 key/value groups"):
        core.allocate(att, None, 20, 0, 110)
    with pytest.raises(LeanmlError, match="too small to remove one key/value group"):
        core.allocate(att, None, 20, 0, 10)
    with pytest.raises(LeanmlError, match="groups 3 must leave"):
        core.allocate(att, mlp, 20, 5, 80, groups=3)
    with pytest.raises(LeanmlError, match="every MLP unit of a layer"):
        core.allocate(att, mlp, 20, 5, 2 * (2 * 20 + 10 * 5))


def test_layer_scores_are_normalized_per_layer():
    att = torch.tensor([[1.0, 3.0], [10.0, 30.0]])
    mlp = torch.tensor([[2.0, 2.0, 2.0], [0.0, 0.0, 60.0]])
    a, m = core.normalize_layer_scores(att, mlp)
    torch.testing.assert_close(a.sum(1) + m.sum(1), torch.ones(2, dtype=torch.float64))
    torch.testing.assert_close(a[0], torch.tensor([0.1, 0.3], dtype=torch.float64))
    torch.testing.assert_close(m[1], torch.tensor([0.0, 0.0, 0.6], dtype=torch.float64))
    assert core.normalize_layer_scores(None, mlp)[0] is None


# ---------------------------------------------------------------------------------------------------
# tiny models


def _ids(n: int = 4, seqlen: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n, seqlen), generator=torch.Generator().manual_seed(seed))


def prune_by_hand(model, pruner: StructuredPairPruner, sparsity: float, ids: torch.Tensor) -> None:
    """Minimal sequential driver: per layer and group, second moments (and means) of the consumer input
    on the current model, then ``prune_group``. G = H (no separate dense pass)."""
    adapter = get_adapter(model)
    spec = MaskSpec(sparsity=sparsity)
    for layer in adapter.layers():
        for group in adapter.pairs(layer):
            consumer = next(iter(group.linears.values()))
            xs = []
            handle = consumer.register_forward_pre_hook(lambda m, a, xs=xs: xs.append(a[0].reshape(-1, a[0].shape[-1])))
            with torch.no_grad():
                model(ids)
            handle.remove()
            X = torch.cat(xs).double()
            stats = GroupStats(H=X.T @ X / len(X), G=X.T @ X / len(X), Hd=X.T @ X / len(X), ntokens=len(X))
            stats.mean = X.mean(0)
            pruner.prune_group(group, stats, spec)


METHODS = [FaspPruner, WandaStructuredPruner, MagnitudeStructuredPruner, FlapPruner]


def _unit_params(group) -> int:
    """Parameters of one unit of a pair, counted from the modules (rows with biases, columns)."""
    n = sum(group.units.rows[name].shape[1] * (p.in_features + (p.bias is not None))
            for name, p in group.producers.items())
    return n + group.units.columns.shape[1] * next(iter(group.linears.values())).out_features


@pytest.mark.parametrize("make", [tiny_llama_untied, tiny_opt_biased], ids=["llama-gqa", "opt"])
@pytest.mark.parametrize("cls", METHODS, ids=lambda c: c.name)
def test_shrunk_model_equals_zeroed_model_and_loads_with_transformers(make, cls, tmp_path):
    model = make()
    adapter = get_adapter(model)
    ids = _ids()
    params0 = count_parameters(model)
    is_opt = model.config.model_type == "opt"  # OPT's attention cannot lose heads: its MLP alone
    pruner = cls(alloc="uniform", pairs="mlp" if is_opt else "attention,mlp")
    prune_by_hand(model, pruner, 0.5, ids)
    # the zeroed dense-shaped model: half of the MLP units and (LLaMA) one of two key/value groups
    width = model.config.intermediate_size if hasattr(model.config, "mlp_bias") else model.config.ffn_dim
    removed = 0
    for layer in adapter.layers():
        groups = {g.name: g for g in adapter.pairs(layer)}
        assert live_units(groups["mlp_out"]).numel() == width // 2
        removed += width // 2 * _unit_params(groups["mlp_out"])
        if not is_opt:
            assert live_units(groups["attn_out"]).numel() == 1
            removed += _unit_params(groups["attn_out"])
    test_ids = _ids(2, 24, seed=1)
    with torch.no_grad():
        ref = model(test_ids).logits
    report = pruner.finalize(model, adapter)
    with torch.no_grad():
        got = model(test_ids).logits
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert report["intermediate_size"] == width // 2
    assert report["params_before"] == params0
    if not is_opt:
        assert report["num_key_value_heads"] == model.config.num_key_value_heads == 1
        assert report["num_attention_heads"] == model.config.num_attention_heads == 2
        assert report["attention_groups_removed"] == 1 and model.config.head_dim == 16
    expected = params0 + _added_biases(model, cls) - removed
    assert report["params_after"] == expected == count_parameters(model)

    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert count_parameters(loaded) == expected
    with torch.no_grad():
        torch.testing.assert_close(loaded(test_ids).logits, ref, rtol=1e-5, atol=1e-5)


def _added_biases(model, cls) -> int:
    """FLAP on LLaMA adds biases to every attention and MLP linear (zeros except the compensated ones),
    counted after the shrink: 2 of 4 query heads and 1 of 2 key/value heads (16 dims), 64 MLP units."""
    if cls is not FlapPruner or not hasattr(model.config, "mlp_bias"):
        return 0
    cfg = model.config
    per_layer = 2 * 16 + 2 * 16 + cfg.hidden_size + 2 * 64 + cfg.hidden_size
    return cfg.num_hidden_layers * per_layer


def test_fasp_restoration_beats_no_restoration_on_layer_output():
    ids = _ids()
    errs = {}
    for cls in (FaspPruner, WandaStructuredPruner):
        model = tiny_llama_untied()
        dense = tiny_llama_untied()
        prune_by_hand(model, cls(alloc="uniform"), 0.4, ids)
        with torch.no_grad():
            errs[cls.name] = float((model(ids).logits - dense(ids).logits).pow(2).mean())
    assert errs["fasp"] < errs["wanda-sp"]


def test_a_pruned_group_zeroes_its_query_key_value_rows_and_output_columns():
    model = tiny_llama_untied()
    prune_by_hand(model, WandaStructuredPruner(pairs="attention", alloc="uniform"), 0.5, _ids())
    attn = model.model.layers[0].self_attn
    hd, rep = 16, 2  # 4 query heads, 2 key/value heads
    dead_kv = (attn.v_proj.weight == 0).all(dim=1).nonzero().flatten().tolist()
    assert len(dead_kv) == hd and dead_kv[0] % hd == 0 and dead_kv == list(range(dead_kv[0], dead_kv[0] + hd))
    g = dead_kv[0] // hd
    assert (attn.k_proj.weight == 0).all(dim=1).nonzero().flatten().tolist() == dead_kv
    q_rows = list(range(g * rep * hd, (g + 1) * rep * hd))
    assert (attn.q_proj.weight == 0).all(dim=1).nonzero().flatten().tolist() == q_rows
    assert (attn.o_proj.weight == 0).all(dim=0).nonzero().flatten().tolist() == q_rows
    # MLP untouched when only attention is selected
    assert (model.model.layers[0].mlp.down_proj.weight != 0).all()


def test_bad_inputs_are_one_line_errors():
    model = tiny_llama_untied()
    adapter = get_adapter(model)
    group = adapter.pairs(adapter.layers()[0])[1]
    stats = GroupStats(H=torch.eye(128), ntokens=1)
    with pytest.raises(LeanmlError, match="N:M"):
        FaspPruner().prune_group(group, stats, MaskSpec(pattern=(2, 4)))
    with pytest.raises(LeanmlError, match="remove all"):
        WandaStructuredPruner(alloc="uniform").prune_group(group, stats, MaskSpec(sparsity=0.999))
    with pytest.raises(LeanmlError, match="needs its allocation pre-pass"):
        FaspPruner().prune_group(group, stats, MaskSpec(sparsity=0.2))
    with pytest.raises(LeanmlError, match="means"):
        FlapPruner(alloc="uniform").prune_group(group, stats, MaskSpec(sparsity=0.2))
    # the library names the option's field; the command line shows its flag
    for make, flag in [(lambda: FaspPruner(alloc="global"), "--fasp-alloc"),
                       (lambda: FaspPruner(pairs="mlp", groups=1), "--fasp-groups"),
                       (lambda: FaspPruner(pairs="heads"), "--fasp-pairs")]:
        with pytest.raises(ConfigError) as exc:
            make()
        assert flag in cli_message(exc.value, flags_of(FaspOptions, FaspOptions.prefix))
    from transformers import BloomConfig, BloomForCausalLM

    bloom = get_adapter(BloomForCausalLM(BloomConfig(n_layer=1, hidden_size=32, n_head=2, vocab_size=64)))
    with pytest.raises(LeanmlError, match="no structured-pair layout for 'bloom'; structured methods support: .*llama"):
        bloom.pairs(bloom.layers()[0])


def test_cli_options_are_added_once_and_parsed():
    from leanml.prune.cli import prune_job, register

    sub = argparse.ArgumentParser().add_subparsers()
    register(sub)  # every method's options on one parser: a flag added twice would raise here
    parser = sub.choices["prune"]

    def pruner(method: str, *argv: str):
        return prune_job(parser.parse_args(["--out", "o", "--method", method, *argv])).config.pruner()

    argv = ["--fasp-pairs", "mlp", "--fasp-damp", "0.1", "--fasp-target", "dense", "--fasp-alloc", "score",
            "--fasp-plan-samples", "3"]  # (--fasp-plan-samples with --fasp-alloc uniform is refused)
    p = pruner("fasp", *argv)
    assert p.options.pair_names == ("mlp",) and p.options.damp == 0.1 and p.needs_dense is True
    assert p.options.alloc == "score" and p.options.plan_samples == 3 and p.options.groups is None
    assert pruner("fasp", "--fasp-alloc", "uniform").options.alloc == "uniform"
    q = pruner("wanda-sp", "--fasp-groups", "1")
    assert q.options.alloc == "score" and q.options.groups == 1 and q.config()["groups"] == 1
    assert FaspPruner.needs_dense is False and FaspPruner().needs_dense is False  # class default untouched
    assert pruner("flap", *argv[:2]).options.pair_names == ("mlp",) == FlapPruner(pairs=("mlp",)).options.pair_names
    assert not pruner("flap", "--fasp-no-shrink").options.shrink and pruner("flap").options.shrink
    assert p.config()["target"] == "dense"


def test_pairs_recorded_in_one_form_whatever_was_given():
    assert FaspPruner(pairs="attention,mlp").config() == FaspPruner(pairs=("attention", "mlp")).config()
    assert FaspPruner(pairs="mlp").config()["pairs"] == ["mlp"]
