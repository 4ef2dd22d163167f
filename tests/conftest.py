"""Shared fixtures: tiny random models built from configs, and a tiny model directory with the real
SmolLM2 tokenizer so command-line runs finish in seconds."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(min(2, os.cpu_count() or 1))


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


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The bundled SmolLM2-135M converted to safetensors (converted once into the cache)."""
    from leanml.models import bundled_dir

    return bundled_dir("smollm2-135m")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_dir) -> Path:
    """A 2-layer random LLaMA with SmolLM2's real tokenizer, saved as a Hugging Face directory."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = tiny_llama(vocab=len(tok))
    path = tmp_path_factory.mktemp("tiny") / "tiny-llama"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture
def one_thread():
    """Run a test with one torch thread, restoring the previous count afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
