"""FISTAPruner behind the engine on tiny random LLaMA / OPT models: exactness, error vs SparseGPT, options."""

from __future__ import annotations

import argparse
import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

from leanml.config import ConfigError
from leanml.flags import add_options, cli_message, flags_of, from_args
from leanml.models.layout import get_adapter
from leanml.prune.engine import prune_model
from leanml.prune.masks import MaskSpec, satisfies_nm, sparsity_of
from leanml.prune.methods import pruner_class
from leanml.prune.methods.baselines import SparseGPTPruner
from leanml.prune.methods.fista import FistaOptions, FistaPruner


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(cfg).eval()


def calib(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(seed))


def _linears(model):
    for layer in get_adapter(model).layers():
        for name, mod in layer.named_modules():
            if isinstance(mod, torch.nn.Linear):
                yield name, mod


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


@pytest.mark.parametrize("pattern", [None, (2, 4)])
@pytest.mark.parametrize("warm", ["dense", "sparsegpt"])
def test_fista_layer_error_not_above_sparsegpt(llama, pattern, warm):
    ids = calib()
    sgpt = copy.deepcopy(llama)
    rep_s = prune_model(sgpt, ids, SparseGPTPruner(), MaskSpec(0.5, pattern, SparseGPTPruner.default_scope),
                        progress=False)
    fista = copy.deepcopy(llama)
    rep_f = prune_model(fista, ids, FistaPruner(warm_start=warm), MaskSpec(0.5, pattern), progress=False)
    for ls, lf in zip(rep_s["layers"], rep_f["layers"]):
        assert lf["rel_output_error"] <= ls["rel_output_error"]
    for name, lin in _linears(fista):
        W = lin.weight.data
        if pattern:
            assert satisfies_nm(W, *pattern), name
        else:
            # the open scope is FISTA's own (per layer): an exact count per matrix (a kept weight is
            # non-zero unless its refill would raise the error)
            assert int((W != 0).sum()) <= W.numel() // 2, name
            assert sparsity_of(W) == pytest.approx(0.5, abs=0.02), name
    for layer in rep_f["layers"]:
        for rec in layer["linears"].values():
            assert rec["fista_error"] <= rec["warm_start_error"] * (1 + 1e-6)


def test_fista_on_opt_per_layer_mask_and_lambda_scope():
    torch.manual_seed(0)
    cfg = OPTConfig(
        hidden_size=64,
        ffn_dim=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=256,
        max_position_embeddings=128,
        word_embed_proj_dim=64,
    )
    model = OPTForCausalLM(cfg).eval()
    pruner = FistaPruner(warm_start="wanda", lambda_scope="layer", rounds=2, iters=10, damp=0.01, refine=5)
    rep = prune_model(model, calib(), pruner, MaskSpec(0.6, None, "layer"), progress=False)
    assert rep["method_config"]["lambda_scope"] == "layer"
    zeros = total = 0
    for _, lin in _linears(model):
        W = lin.weight.data
        # one threshold per matrix; counts rounded cumulatively over the linears (at most one off each)
        assert int((W == 0).sum()) >= round(0.6 * W.numel()) - 1
        assert sparsity_of(W) == pytest.approx(0.6, abs=0.01)
        zeros, total = zeros + int((W == 0).sum()), total + W.numel()
    assert zeros >= round(0.6 * total)


def test_refine_option_lowers_error(llama):
    ids = calib()
    errs = []
    for refine in (0, 20):
        m = copy.deepcopy(llama)
        rep = prune_model(m, ids, FistaPruner(warm_start="dense", refine=refine), MaskSpec(0.5), progress=False)
        errs.append(rep["layers"][-1]["rel_output_error"])
    assert errs[1] < errs[0]


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_options(parser, FistaOptions, FistaOptions.prefix)
    return parser.parse_args(argv)


def _options(argv: list[str]) -> FistaOptions:
    return from_args(FistaOptions, _parse(argv), FistaOptions.prefix)


def test_cli_options_and_registry():
    assert pruner_class("fista") is FistaPruner
    p = FistaPruner(_options(["--fista-lambda", "0.01", "--fista-iters", "7", "--fista-rounds", "2",
                              "--fista-warm-start", "wanda", "--fista-no-precondition"]))
    o = p.options
    assert (o.lam, o.iters, o.rounds, o.warm_start, o.precondition) == (0.01, 7, 2, "wanda", False)
    assert FistaPruner.needs_dense


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--fista-lambda", "-1"], "--fista-lambda"),
        (["--fista-iters", "0"], "--fista-iters"),
        (["--fista-rounds", "0"], "--fista-rounds"),
        (["--fista-xi", "-0.3"], "--fista-xi"),
        (["--fista-damp", "-1"], "--fista-damp"),
        (["--fista-refine", "-2"], "--fista-refine"),
        (["--fista-correction", "1.2"], "--fista-correction"),
        (["--fista-correction", "nan"], "--fista-correction"),
        (["--fista-ridge", "-0.1"], "--fista-ridge"),
    ],
)
def test_bad_values_give_one_line_errors(argv, needle):
    """The library's refusal names the field; the command line shows the flag that set it."""
    with pytest.raises(ConfigError) as exc:
        _options(argv)
    text = cli_message(exc.value, flags_of(FistaOptions, FistaOptions.prefix))
    assert needle in text and "\n" not in text


def test_unknown_warm_start_is_rejected():
    with pytest.raises(ConfigError, match="warm_start") as exc:
        FistaPruner(warm_start="obs")
    assert "--fista-warm-start" in cli_message(exc.value, flags_of(FistaOptions, FistaOptions.prefix))
    with pytest.raises(SystemExit):  # argparse refuses it before the class sees it
        _parse(["--fista-warm-start", "obs"])
