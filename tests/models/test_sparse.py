"""2:4 semi-structured sparse kernels: the 2:4 check, the CPU fallback, the GPU refusals, and the
conversion path with a stand-in converter (torch's sparse CSR tensors, which run on the CPU)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from builders import tiny_family
from leanml.errors import LeanmlError
from leanml.models import load_model, save_model
from leanml.models.sparse import (
    check_24,
    check_sparse_kernels,
    decoder_linears,
    kernel_support,
    min_shape,
    nm_violations,
    shape_reason,
    to_sparse_kernels,
)
from leanml.prune.engine import prune_model
from leanml.prune.masks import MaskSpec
from leanml.prune.methods import pruner_class

CALIB = torch.randint(0, 256, (4, 24), generator=torch.Generator().manual_seed(0))


def mask_24(model: nn.Module) -> nn.Module:
    """Keep the 2 largest of every 4 consecutive inputs of each decoder linear (written independently of
    leanml's mask code)."""
    with torch.no_grad():
        for mod in decoder_linears(model).values():
            w = mod.weight
            for r in range(w.shape[0]):
                for c in range(0, w.shape[1], 4):
                    group = w[r, c:c + 4]
                    order = sorted(range(4), key=lambda i: float(group[i].abs()))
                    for i in order[:2]:
                        w[r, c + i] = 0.0
    return model


def test_nm_violations_against_a_loop():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(6, 16, generator=g) * (torch.rand(6, 16, generator=g) < 0.55)
    ref = sum(int((w[r, c:c + 4] != 0).sum() > 2) for r in range(6) for c in range(0, 16, 4))
    assert nm_violations(w) == ref and ref > 0
    assert nm_violations(torch.zeros(3, 6)) == 1  # 6 inputs: not whole groups of 4


def test_check_24_accepts_pruned_and_masked_models_and_refuses_unstructured():
    pruned = tiny_family("llama")
    prune_model(pruned, CALIB, pruner_class("magnitude")(), MaskSpec(pattern=(2, 4)), progress=False)
    assert len(check_24(pruned)) == 14
    assert len(check_24(mask_24(tiny_family("llama")))) == 14
    unstructured = tiny_family("llama")
    prune_model(unstructured, CALIB, pruner_class("magnitude")(), MaskSpec(0.5), progress=False)
    with pytest.raises(LeanmlError, match=r"needs a 2:4-sparse model, but 14 of 14 decoder linears are not 2:4"):
        check_24(unstructured)
    with pytest.raises(LeanmlError, match="prune with pattern 2:4"):
        to_sparse_kernels(tiny_family("llama"))


def test_cpu_falls_back_to_dense_with_one_warning_line():
    model = mask_24(tiny_family("llama"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = to_sparse_kernels(model, progress=False)
    notes = [str(w.message) for w in caught if "sparse kernels" in str(w.message)]
    assert len(notes) == 1 and "\n" not in notes[0] and "runs dense" in notes[0]
    assert report["converted"] == 0 and report["dense"] == 14 and model.leanml_sparse_kernels is report
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_gpu_without_support_and_float32_are_one_line_errors(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    status, why = kernel_support(torch.device("cuda"), torch.bfloat16)
    assert status == "error" and "Tesla T4 (sm75)" in why and "\n" not in why
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert kernel_support(torch.device("cuda"), torch.bfloat16) == ("ok", None)
    status, why = kernel_support(torch.device("cuda"), torch.float32)
    assert status == "error" and "dtype bfloat16" in why
    assert kernel_support(torch.device("cpu"), torch.bfloat16)[0] == "fallback"


def test_shape_limits():
    assert min_shape("cutlass", torch.bfloat16) == (32, 64)
    assert min_shape("cusparselt", torch.float16) == (16, 16)
    assert shape_reason((128, 64), torch.bfloat16, "cutlass") is None
    assert "not a multiple of 32 x 64" in shape_reason((16, 64), torch.bfloat16, "cutlass")
    assert shape_reason((16, 64), torch.bfloat16, "cusparselt") is None


def test_stand_in_conversion_runs_the_masked_model_and_leaves_odd_shapes_dense():
    """CSR weights stand in for semi-structured ones: eligible linears are converted, the k/v projections
    (16 rows: below CUTLASS's 32) stay dense and are counted, and the logits match the masked model."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=1, vocab_size=256, max_position_embeddings=64)
    model = mask_24(tf.LlamaForCausalLM(cfg).eval())
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        report = to_sparse_kernels(model, backend="cutlass", converter=lambda w: w.to_sparse_csr(), progress=False)
        out = model(input_ids=ids).logits
    assert report["converted"] == 10 and report["dense"] == 4
    assert sorted(report["dense_linears"]) == [f"model.layers.{i}.self_attn.{p}_proj" for i in (0, 1) for p in "kv"]
    assert model.model.layers[0].mlp.up_proj.weight.layout == torch.sparse_csr
    assert model.model.layers[0].self_attn.k_proj.weight.layout == torch.strided
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_loader_option(tmp_path):
    from recover.helpers import tiny_tokenizer

    tok = tiny_tokenizer(vocab=256)
    save_model(mask_24(tiny_family("llama")), tok, tmp_path / "m24")
    with pytest.warns(UserWarning, match="the 2:4 model runs dense"):
        model, _ = load_model(str(tmp_path / "m24"), sparse_kernels=True)
    assert model.leanml_sparse_kernels["dense"] == 14
    save_model(tiny_family("llama"), tok, tmp_path / "dense")
    with pytest.raises(LeanmlError, match="not 2:4"):
        load_model(str(tmp_path / "dense"), sparse_kernels=True)


def test_backend_probe_takes_the_first_that_computes_the_right_product(monkeypatch):
    import leanml.models.sparse as sp

    def converter(backend):
        if backend == "cusparselt":
            def fail(w):
                raise RuntimeError("cuSPARSELt not supported\nsecond line")
            return fail
        return lambda w: w.to_sparse_csr()

    monkeypatch.setattr(sp, "_converter", converter)
    monkeypatch.setattr(sp, "backend_name", lambda backend=None: backend or "cusparselt")
    assert sp.working_backend(torch.device("cpu"), torch.float32) == (
        "cutlass", ["cusparselt: cuSPARSELt not supported"])
    assert sp.probe_backend("cutlass", torch.device("cpu"), torch.float32) is None
    monkeypatch.setattr(sp, "_converter", lambda backend: lambda w: (2 * w).to_sparse_csr())  # a wrong product
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "FakeGPU")
    with pytest.raises(LeanmlError, match=r"no semi-structured sparse kernel works on FakeGPU .*product off by"):
        sp.working_backend(torch.device("cpu"), torch.float32)


def test_check_sparse_kernels_compares_with_the_dense_model():
    model = mask_24(tiny_family("llama"))
    before = model.model.layers[0].mlp.up_proj.weight.clone()
    good = check_sparse_kernels(model, device="cpu", dtype=torch.float32, backend="cutlass",
                                converter=lambda w: w.to_sparse_csr())
    assert good["ok"] and good["converted"] == 14 and good["max_abs_diff_vs_dense"] < 1e-4
    bad = check_sparse_kernels(model, device="cpu", dtype=torch.float32, backend="cutlass",
                               converter=lambda w: (w * 1.01).to_sparse_csr())  # a kernel 1 % off
    assert not bad["ok"] and bad["max_abs_err_sparse"] > 10 * good["max_abs_err_sparse"]
    assert torch.equal(model.model.layers[0].mlp.up_proj.weight, before)  # the model itself is untouched
