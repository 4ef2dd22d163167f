"""The sparse-bitmask save format: the layout against a directory written by compressed-tensors 0.13
(``data/ct013-bitmask``, made once with that package), exact reloads, sizes, sharding, the loud failure
of stock ``from_pretrained`` on the sparse directory, and the dense copy it does load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from builders import tiny_family
from leanml.errors import LeanmlError
from leanml.models import decoder_linear_names, load_model, save_model
from leanml.models.compressed import (
    WEIGHTS_NAME,
    bitmask_pack,
    bitmask_unpack,
    decompress_dir,
    is_compressed_dir,
    load_compressed,
    main,
    read_state_dict,
)

DATA = Path(__file__).parent / "data"
CT013 = DATA / "ct013-bitmask"


def test_layout_matches_compressed_tensors_013():
    ref = load_file(DATA / "ct013-bitmask-reference.safetensors")
    stored = load_file(CT013 / "model.safetensors")
    targets = json.loads((CT013 / "config.json").read_text())["quantization_config"]["sparsity_config"]["targets"]
    for t in targets:
        parts = bitmask_pack(ref[f"{t}.weight"])
        for name, tensor in parts.items():
            assert torch.equal(tensor, stored[f"{t}.{name}"]), (t, name)
    assert torch.equal(bitmask_unpack(stored[f"{t}.compressed"], stored[f"{t}.bitmask"], stored[f"{t}.shape"]),
                       ref[f"{t}.weight"])


def test_reads_a_compressed_tensors_013_directory():
    ref = load_file(DATA / "ct013-bitmask-reference.safetensors")
    assert is_compressed_dir(CT013)
    state = read_state_dict(CT013)
    assert set(state) == set(ref) and all(torch.equal(state[k], ref[k]) for k in ref)
    model = load_compressed(CT013)
    assert torch.equal(model.lm_head.weight, ref["model.embed_tokens.weight"])  # tied
    assert all(torch.equal(model.state_dict()[k], v) for k, v in ref.items())


def test_pack_roundtrip_odd_widths_and_dtypes():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        w = (torch.randn(7, 13, generator=g) * (torch.rand(7, 13, generator=g) < 0.3)).to(dtype)
        parts = bitmask_pack(w)
        assert parts["bitmask"].shape == (7, 2) and parts["compressed"].numel() == int((w != 0).sum())
        assert torch.equal(bitmask_unpack(parts["compressed"], parts["bitmask"], parts["shape"]), w)
    with pytest.raises(LeanmlError, match="corrupt sparse-bitmask"):
        bitmask_unpack(parts["compressed"][:-1], parts["bitmask"], parts["shape"])


def _pruned(sparsity: float, dtype: torch.dtype = torch.float32, family: str = "llama"):
    model = tiny_family(family).to(dtype)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name in decoder_linear_names(model):
            w = dict(model.named_modules())[name].weight
            w[torch.rand(w.shape, generator=g) < sparsity] = 0
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_save_reload_exact_and_smaller(tmp_path, dtype):
    model = _pruned(0.5, dtype)
    names = decoder_linear_names(model)
    sizes = save_model(model, None, tmp_path / "c", "compressed", names, 0.5)
    weights = [dict(model.named_modules())[n].weight for n in names]
    # values, one bit per weight (rows padded to whole bytes), one int64 offset per row
    expected = sum(int((w != 0).sum()) * w.element_size() + w.shape[0] * (-(-w.shape[1] // 8) + 8) for w in weights)
    assert sizes == {"dense_bytes": sum(w.numel() * w.element_size() for w in weights), "compressed_bytes": expected}
    assert sizes["compressed_bytes"] < 0.65 * sizes["dense_bytes"]  # 64-wide rows: offsets weigh in
    assert (tmp_path / "c" / WEIGHTS_NAME).is_file() and not (tmp_path / "c" / "model.safetensors").exists()
    assert is_compressed_dir(tmp_path / "c")
    assert "quantization_config" not in json.loads((tmp_path / "c" / "config.json").read_text())
    loaded = load_compressed(tmp_path / "c", dtype=dtype)
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


def test_stock_from_pretrained_fails_on_sparse_and_loads_the_dense_copy_exactly(tmp_path):
    from transformers import AutoModelForCausalLM

    model = _pruned(0.5, family="qwen2")  # untied head, biases
    save_model(model, None, tmp_path / "c", "compressed", decoder_linear_names(model), 0.5)
    with pytest.raises(OSError):  # no weight file it can read: a loud failure, never random weights
        AutoModelForCausalLM.from_pretrained(tmp_path / "c")
    decompress_dir(tmp_path / "c", tmp_path / "d")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "d").eval()
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(plain(input_ids=ids).logits, model(input_ids=ids).logits)
    with pytest.raises(LeanmlError, match="not a sparse-bitmask model directory"):
        decompress_dir(tmp_path / "d", tmp_path / "e")


def test_sharded_save_reloads(tmp_path):
    from leanml.models.compressed import save_compressed

    model = _pruned(0.7)
    save_compressed(model, tmp_path / "s", decoder_linear_names(model), 0.7, max_shard_size="20KB")
    shards = sorted(p.name for p in (tmp_path / "s").glob("sparse-bitmask-*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "s" / f"{WEIGHTS_NAME}.index.json").is_file()
    loaded = load_compressed(tmp_path / "s")
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())


def test_load_model_and_command_line(tmp_path, capsys):
    from recover.helpers import tiny_tokenizer

    model = _pruned(0.5)
    save_model(model, tiny_tokenizer(vocab=256), tmp_path / "c", "compressed", decoder_linear_names(model), 0.5)
    loaded, tok = load_model(str(tmp_path / "c"))
    assert torch.equal(loaded.model.layers[1].mlp.up_proj.weight, model.model.layers[1].mlp.up_proj.weight)
    assert main([str(tmp_path / "c"), str(tmp_path / "d")]) == 0
    assert (tmp_path / "d" / "model.safetensors").is_file() and (tmp_path / "d" / "tokenizer.json").is_file()
    assert main([str(tmp_path / "c")]) == 2
    assert main([str(tmp_path / "nope"), str(tmp_path / "x")]) == 2
    assert "not a sparse-bitmask model directory" in capsys.readouterr().err
