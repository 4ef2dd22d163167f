"""One class per architecture family: the structured-pair layout of its decoder layers.

Unstructured and N:M pruning need none of this (the linears and their groups are found by
:func:`leanml.models.layout.discover_groups` on any decoder). Structured methods (FASP, FLAP,
Wanda-sp, magnitude-sp) need to know which output rows of which producer feed which input columns of
which consumer, whether the stock attention can lose heads, which config key holds the MLP width, and
which config flags give a linear a bias. Adding a family is one class here: name its ``model_types``,
its query/key/value/output projections, its MLP producers/consumer, and override
:meth:`~leanml.models.layout.DecoderAdapter.group_rows` for a fused qkv projection.

Whole key/value groups (a key/value head with its query heads) can be removed where the stock attention
reads ``head_dim`` from the config and sizes its projections as heads x ``head_dim`` (LLaMA, Mistral,
Qwen2/3, Gemma 2/3, Phi-3). OPT and GPT-NeoX derive the head size from ``hidden_size /
num_attention_heads``, so a model with fewer heads cannot be described by their configs: ``fixed_heads``
says so and structured methods refuse their attention.
"""

from __future__ import annotations

from leanml.models.layout import DecoderAdapter, get_adapter, register, structured_model_types

__all__ = ["get_adapter", "structured_model_types"]

_LLAMA_ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
_LLAMA_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_OPT_ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj")


@register
class LlamaAdapter(DecoderAdapter):
    """LLaMA 2/3, SmolLM2: grouped-query attention, gated MLP; ``attention_bias`` / ``mlp_bias`` flags."""

    model_types = ("llama",)
    q_proj, k_proj, v_proj, o_proj = _LLAMA_ATTN
    mlp_in, mlp_out = _LLAMA_MLP[:2], _LLAMA_MLP[2]
    bias_flags = {"attention_bias": _LLAMA_ATTN, "mlp_bias": _LLAMA_MLP}


@register
class MistralAdapter(LlamaAdapter):
    """Mistral: the LLaMA layout without bias flags."""

    model_types = ("mistral",)
    bias_flags = {}


@register
class Qwen2Adapter(LlamaAdapter):
    """Qwen2 / Qwen2.5: biased q/k/v (their rows go with the units), bias-free output and MLP."""

    model_types = ("qwen2",)
    bias_flags = {}


@register
class Qwen3Adapter(LlamaAdapter):
    """Qwen3: per-head q/k norms (values untouched), ``attention_bias`` flag, bias-free MLP."""

    model_types = ("qwen3",)
    bias_flags = {"attention_bias": _LLAMA_ATTN}


@register
class Gemma2Adapter(Qwen3Adapter):
    """Gemma 2: ``head_dim`` independent of hidden/heads, extra norms around attention and MLP."""

    model_types = ("gemma2",)


@register
class Gemma3TextAdapter(Qwen3Adapter):
    """Gemma 3 (text): as Gemma 2 plus q/k norms; often one key/value head."""

    model_types = ("gemma3_text",)


@register
class Phi3Adapter(DecoderAdapter):
    """Phi-3 / Phi-4: fused ``qkv_proj`` (rows: all queries, all keys, all values) and fused
    ``gate_up_proj`` (rows: gate, then up); no bias flags."""

    model_types = ("phi3",)
    v_proj = "self_attn.qkv_proj"
    o_proj = "self_attn.o_proj"
    mlp_in = ("mlp.gate_up_proj",)
    mlp_out = "mlp.down_proj"
    mlp_segments = 2

    def group_rows(self, g: int) -> dict[str, list[int]]:
        hd, rep, nq, nkv = self.head_dim, self.group_size, self.num_heads, self.num_kv_heads
        q = list(range(g * rep * hd, (g + 1) * rep * hd))
        k = list(range(nq * hd + g * hd, nq * hd + (g + 1) * hd))
        v = [r + nkv * hd for r in k]
        assert self.v_proj is not None
        return {self.v_proj: q + k + v}


@register
class OPTAdapter(DecoderAdapter):
    """OPT: multi-head attention and a two-linear MLP, biases everywhere unless ``enable_bias`` is off."""

    model_types = ("opt",)
    q_proj, k_proj, v_proj, o_proj = _OPT_ATTN
    mlp_in, mlp_out = ("fc1",), "fc2"
    intermediate_size_key = "ffn_dim"
    fixed_heads = "OPTAttention sizes its heads as hidden_size / num_attention_heads"
    bias_flags = {"enable_bias": (*_OPT_ATTN, "fc1", "fc2")}


@register
class GPTNeoXAdapter(DecoderAdapter):
    """GPT-NeoX / Pythia: fused ``query_key_value`` laid out per head (``[q_h, k_h, v_h]`` for each head
    ``h``), attention and MLP in parallel on the same residual input, biased MLP."""

    model_types = ("gpt_neox",)
    v_proj = "attention.query_key_value"
    o_proj = "attention.dense"
    mlp_in = ("mlp.dense_h_to_4h",)
    mlp_out = "mlp.dense_4h_to_h"
    bias_flags = {"attention_bias": ("attention.query_key_value", "attention.dense")}
    fixed_heads = "GPTNeoXAttention sizes its heads as hidden_size / num_attention_heads"

    def group_rows(self, g: int) -> dict[str, list[int]]:
        assert self.v_proj is not None
        return {self.v_proj: list(range(g * 3 * self.head_dim, (g + 1) * 3 * self.head_dim))}
