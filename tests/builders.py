"""Tiny random-weight models built from configs (no files needed), shared by the tests."""

from __future__ import annotations

import torch


def tiny_llama(seed: int = 0, vocab: int = 256, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=256, tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg).eval()


def tiny_opt(seed: int = 0, vocab: int = 256, layers: int = 2):
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(seed)
    cfg = OPTConfig(
        hidden_size=64, ffn_dim=128, num_hidden_layers=layers, num_attention_heads=4, vocab_size=vocab,
        max_position_embeddings=256, word_embed_proj_dim=64,
    )
    return OPTForCausalLM(cfg).eval()


def tiny_llama_untied():
    """A 2-layer LLaMA with untied embeddings (max 128 positions)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
    return LlamaForCausalLM(cfg).eval()


def tiny_opt_biased():
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
