"""Tiny random-weight causal LMs of every supported family, built from their transformers configs (no
files needed): what the tests, ``bench/arch.py`` and a user trying the engine on a new family start from.

    from leanml.models.tiny import tiny_family
    model = tiny_family("qwen3")  # 2 layers, hidden 64, random weights
"""

from __future__ import annotations

import torch


def tiny_llama(seed: int = 0, vocab: int = 256, layers: int = 2) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=256, tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg).eval()


def tiny_opt(seed: int = 0, vocab: int = 256, layers: int = 2) -> torch.nn.Module:
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(seed)
    cfg = OPTConfig(
        hidden_size=64, ffn_dim=128, num_hidden_layers=layers, num_attention_heads=4, vocab_size=vocab,
        max_position_embeddings=256, word_embed_proj_dim=64,
    )
    return OPTForCausalLM(cfg).eval()


def tiny_llama_untied() -> torch.nn.Module:
    """A 2-layer LLaMA with untied embeddings (max 128 positions)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
    return LlamaForCausalLM(cfg).eval()


def tiny_opt_biased() -> torch.nn.Module:
    """A 2-layer OPT whose biases are random and non-zero, so bias handling is exercised."""
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    cfg = OPTConfig(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=256,
                    max_position_embeddings=128, word_embed_proj_dim=64)
    model = OPTForCausalLM(cfg).eval()
    with torch.no_grad():  # random non-zero biases so bias handling is exercised
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    return model


def _random_biases(model: torch.nn.Module, std: float = 0.1) -> torch.nn.Module:
    """Random non-zero biases, so bias handling (rows that go with their units) is exercised."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, std)
    return model


def tiny_family(model_type: str, seed: int = 0, vocab: int = 256, layers: int = 2) -> torch.nn.Module:
    """A tiny random-weight causal LM of one architecture family, built from its transformers config.

    Every family keeps what makes it different: grouped-query attention (llama, mistral, qwen2, qwen3,
    phi3), biased q/k/v (qwen2), q/k norms (qwen3, gemma3_text), ``head_dim`` != hidden/heads and one
    key/value head (gemma2, gemma3_text), fused qkv / gate_up projections (phi3), biases everywhere
    (opt), per-head fused query_key_value and parallel attention + MLP (gpt_neox).
    """
    import transformers as tf

    common = dict(vocab_size=vocab, num_hidden_layers=layers, max_position_embeddings=256)
    gqa = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    configs = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(gqa, tie_word_embeddings=True)),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM, dict(gqa, sliding_window=None)),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, dict(gqa)),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(gqa, head_dim=16)),
        "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM,
                   dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=1,
                        head_dim=32, sliding_window=16)),
        "gemma3_text": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM,
                        dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=1,
                             head_dim=32, sliding_window=16)),
        "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM, dict(gqa, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
        "opt": (tf.OPTConfig, tf.OPTForCausalLM,
                dict(hidden_size=64, ffn_dim=128, num_attention_heads=4, word_embed_proj_dim=64)),
        "gpt_neox": (tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM,
                     dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, use_parallel_residual=True)),
    }
    config_cls, model_cls, kwargs = configs[model_type]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**common, **kwargs)).eval()
    if model_type in ("qwen2", "opt", "gpt_neox"):
        _random_biases(model)
    return model


#: the families with an explicit structured layout, each buildable by :func:`tiny_family`
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "opt", "gpt_neox")
