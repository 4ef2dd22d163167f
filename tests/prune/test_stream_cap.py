"""A memory cap that holds: ``prune --stream --max-memory`` on a model whose embeddings dwarf its
layers (vocabulary 150,000 x hidden 256, tied: 154 MB of its 160 MB) is refused below the smallest cap
it names, computed from the model's sizes and what the process holds, and at that cap the run's real
peak resident memory (fresh process, ``VmHWM``) stays under it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cli.conftest import SAMPLE_TEXT, assert_user_error, run_cli, save_tiny_tokenizer


@pytest.fixture(scope="module")
def big_vocab(tmp_path_factory) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("vocab") / "model"
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=150_000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(path)
    save_tiny_tokenizer(path)
    (path.parent / "text.txt").write_text(SAMPLE_TEXT, encoding="utf-8")
    return path


def test_a_large_vocabulary_cap_is_refused_below_the_floor_and_holds_at_it(big_vocab, tmp_path) -> None:
    def args(cap: str, out: Path) -> list[str]:
        return ["prune", "--model", str(big_vocab), "--method", "wanda", "--calib", str(big_vocab.parent / "text.txt"),
                "--seqlen", "64", "--nsamples", "8", "--threads", "1", "--no-eval", "--max-memory", cap,
                "--out", str(out)]

    # a fresh process each, so its peak is this run's own
    refused = run_cli(args("300MB", tmp_path / "a"), fresh=True, timeout=300)
    line = assert_user_error(refused, "smallest cap that works is", "embeddings", before_work=False)
    cap = re.search(r"smallest cap that works is (\d+MiB)", line).group(1)
    assert not (tmp_path / "a").exists()
    done = run_cli(args(cap, tmp_path / "b"), fresh=True, timeout=300)
    assert done.code == 0, str(done)
    stream = json.loads((tmp_path / "b" / "report.json").read_text())["stream"]
    assert stream["max_memory_bytes"] == int(cap[:-3]) * 2**20
    assert stream["peak_rss_bytes"] <= stream["max_memory_bytes"] and stream["cap_held"], stream
    print(f"cap {cap}: peak RSS {stream['peak_rss_bytes'] / 2**20:.1f} MiB, floor {stream['floor']}")
