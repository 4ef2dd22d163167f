"""The streamed run's skeleton: a causal LM built from its config under ``torch.device("meta")`` has the same
parameters (names, shapes, dtypes) as the model built whole, every one on meta, tied weights tied, and its buffers
(rotary tables, Gemma's embedding scale) real and equal to the whole model's; a buffer the model's initialiser
does not set is refused in one line."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from leanml.errors import LeanmlError
from leanml.models.shards import build_skeleton, build_skeleton_from_config, materialize_buffers
from leanml.models.tiny import FAMILIES, tiny_family


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_skeleton_matches_the_model_built_whole(family: str, dtype: torch.dtype) -> None:
    config = tiny_family(family).config
    whole = AutoModelForCausalLM.from_config(config, dtype=dtype)
    skeleton = build_skeleton_from_config(config, dtype)
    shapes = {n: (tuple(p.shape), p.dtype) for n, p in whole.named_parameters()}
    assert {n: (tuple(p.shape), p.dtype) for n, p in skeleton.named_parameters()} == shapes
    assert {p.device.type for p in skeleton.parameters()} == {"meta"}
    whole_buffers, buffers = dict(whole.named_buffers()), dict(skeleton.named_buffers())
    assert buffers.keys() == whole_buffers.keys()
    for name, buf in buffers.items():
        assert buf.device.type == "cpu" and buf.dtype == whole_buffers[name].dtype, name
        assert torch.equal(buf, whole_buffers[name]), name
    tied = whole.get_output_embeddings().weight is whole.get_input_embeddings().weight
    assert (skeleton.get_output_embeddings().weight is skeleton.get_input_embeddings().weight) == tied
    assert not skeleton.training


def test_rotary_tables_are_real_and_the_model_runs_once_weights_arrive(tmp_path) -> None:
    model = tiny_family("llama")
    model.save_pretrained(tmp_path)
    skeleton = build_skeleton(tmp_path, torch.float32)
    inv_freq = skeleton.model.rotary_emb.inv_freq
    assert inv_freq.device.type == "cpu" and torch.isfinite(inv_freq).all() and inv_freq[0] == 1.0
    skeleton.load_state_dict(model.state_dict(), assign=True)
    skeleton.tie_weights()
    ids = torch.arange(12).reshape(1, 12)
    with torch.no_grad():
        torch.testing.assert_close(skeleton(ids).logits, model(ids).logits)


def test_a_buffer_the_initialiser_leaves_unset_is_refused() -> None:
    config = tiny_family("llama").config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    # no _init_weights branch sets it
    model.model.norm.register_buffer("table", torch.empty(4, device="meta"), persistent=False)
    with pytest.raises(LeanmlError, match=r"buffer model\.norm\.table unset.*drop stream\)") as err:
        materialize_buffers(model)
    assert "\n" not in str(err.value)
