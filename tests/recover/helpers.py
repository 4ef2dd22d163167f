"""Tiny pruned models, a tiny tokenizer and a small text for the recovery tests (no files but their own)."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from torch import nn

from builders import tiny_llama

WORDS = ("the king queen lord lady speaks sings walks runs to from a an of in castle garden night day "
         "and but so then sword crown letter ghost").split()


def text(n_sentences: int = 1500, seed: int = 0) -> str:
    """A small seeded text with regular structure (so a tiny model's loss can fall)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n_sentences):
        subj = rng.choice(["the king", "the queen", "a lord", "a lady", "the ghost"])
        verb = rng.choice(["speaks", "sings", "walks", "runs"])
        place = rng.choice(["the castle", "the garden", "a night", "the day"])
        out.append(f"{subj} {verb} to {place} .")
    return "\n".join(out)


def tiny_tokenizer(vocab: int = 300, corpus: str | None = None):
    """A byte-level BPE tokenizer trained on ``corpus`` (default :func:`text`), as a Hugging Face fast
    tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([corpus if corpus is not None else text()], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def prune_magnitude(model: nn.Module, sparsity: float = 0.5, pattern: tuple[int, int] | None = None) -> nn.Module:
    """Zero the smallest weights of every linear but the head (per row, or n of every m inputs)."""
    head = model.get_output_embeddings()
    with torch.no_grad():
        for mod in model.modules():
            if not isinstance(mod, nn.Linear) or mod is head:
                continue
            w = mod.weight
            if pattern is None:
                k = int(round(sparsity * w.shape[1]))
                idx = w.abs().topk(k, dim=1, largest=False).indices
                w.scatter_(1, idx, 0.0)
            else:
                n, m = pattern
                g = w.view(w.shape[0], -1, m)
                idx = g.abs().topk(m - n, dim=-1, largest=False).indices
                g.scatter_(-1, idx, 0.0)
    return model


def sparse_llama(seed: int = 0, pattern: tuple[int, int] | None = None, vocab: int = 256) -> nn.Module:
    return prune_magnitude(tiny_llama(seed=seed, vocab=vocab), 0.5, pattern)


def save_dir(model: nn.Module, tokenizer, path: Path) -> Path:
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
