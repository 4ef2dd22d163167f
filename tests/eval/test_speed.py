"""Speed measurement: decode loop against ``generate``, timing arithmetic against known sleeps,
peak memory against a known allocation, directory sizes against ``os.stat``."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from leanml.errors import LeanmlError
from leanml.eval.speed import dir_size_bytes, greedy_decode, measure_speed, measure_speeds


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=97, max_position_embeddings=128)
    return LlamaForCausalLM(cfg).eval()


def test_greedy_decode_matches_generate():
    model = tiny_llama()
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(3))
    seconds, tokens = greedy_decode(model, ids, 6)
    ref = model.generate(ids, max_new_tokens=7, min_new_tokens=7, do_sample=False, pad_token_id=0)
    assert seconds > 0
    assert torch.equal(tokens, ref[:, 7:])


class Sleeper(nn.Module):
    """A stand-in LM whose every forward sleeps a fixed time, to check the tokens/s arithmetic."""

    def __init__(self, seconds: float, alloc_mb: int = 0):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))
        self.seconds, self.alloc_mb = seconds, alloc_mb
        self.config = SimpleNamespace(vocab_size=11, max_position_embeddings=4096)
        self.calls: list[tuple[int, bool]] = []

    def forward(self, input_ids, use_cache=False, past_key_values=None, logits_to_keep=0):
        self.calls.append((input_ids.shape[1], past_key_values is not None))
        if self.alloc_mb:
            buf = torch.ones(self.alloc_mb << 18)  # alloc_mb MiB of float32, touched
            buf.sum()
        time.sleep(self.seconds)
        logits = torch.zeros(input_ids.shape[0], 1, 11)
        return SimpleNamespace(logits=logits, past_key_values=object() if use_cache else None)


def test_tokens_per_second_from_known_sleeps():
    m = Sleeper(0.02)
    r = measure_speed(m, prompt_len=40, gen_len=5, repeats=3, batch_size=2, warmup=0, progress=False)
    # prefill: 2 x 40 tokens in one 20 ms forward; decode: 5 steps of 20 ms for 2 x 5 tokens
    assert r["prefill_tok_s"] == pytest.approx(80 / 0.02, rel=0.3)
    assert r["decode_tok_s"] == pytest.approx(10 / 0.1, rel=0.3)
    assert len(r["prefill_runs_s"]) == 3 and len(r["decode_runs_s"]) == 3
    # each repeat: prefill without cache, decode prompt into the cache, then 5 cached one-token steps
    assert m.calls[:7] == [(40, False), (32, False)] + [(1, True)] * 5


def test_interleaved_runs_alternate_models():
    a, b = Sleeper(0.001), Sleeper(0.001)
    order: list[str] = []
    a.register_forward_pre_hook(lambda *_: order.append("a"))
    b.register_forward_pre_hook(lambda *_: order.append("b"))
    res = measure_speeds({"a": a, "b": b}, prompt_len=8, gen_len=0, repeats=3, warmup=0, progress=False)
    assert order == ["a", "b"] * 3
    assert res["a"]["decode_tok_s"] is None and res["b"]["prefill_tok_s"] > 0


def test_peak_memory_sees_an_allocation():
    small = measure_speed(Sleeper(0.0), prompt_len=4, gen_len=1, repeats=1, warmup=0, progress=False)
    big = measure_speed(Sleeper(0.0, alloc_mb=256), prompt_len=4, gen_len=1, repeats=1, warmup=0, progress=False)
    assert big["peak_memory_bytes"] >= 256 << 20
    if small["peak_memory_kind"] == "process peak RSS":  # the counter could be reset: it sees the difference
        assert big["peak_memory_bytes"] - small["peak_memory_bytes"] > 200 << 20


def test_real_tiny_model_and_bad_lengths():
    model = tiny_llama()
    r = measure_speed(model, device="cpu", prompt_len=16, gen_len=4, repeats=2, progress=False)
    assert r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 and r["dtype"] == "float32"
    with pytest.raises(LeanmlError, match="past the model's 128 positions"):
        measure_speed(model, prompt_len=500, repeats=1, progress=False)
    with pytest.raises(LeanmlError, match="repeats must be at least 1"):
        measure_speed(model, repeats=0, progress=False)


def test_dir_size_counts_weight_files_only(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "pytorch_model.bin").write_bytes(b"x" * 234)
    (tmp_path / "config.json").write_text("{}" * 50)
    (tmp_path / "tokenizer.json").write_text("{}" * 500)
    assert dir_size_bytes(tmp_path) == 1234
    assert dir_size_bytes(tmp_path / "model.safetensors") == 1000
    with pytest.raises(LeanmlError, match="does not exist"):
        dir_size_bytes(tmp_path / "nope")


def test_speed_command_writes_a_report(tmp_path, capsys):
    import json

    from leanml.cli import main
    from leanml.models import save_model
    from recover.helpers import tiny_tokenizer

    tok = tiny_tokenizer(vocab=97)
    save_model(tiny_llama(), tok, tmp_path / "a")
    save_model(tiny_llama(seed=1), tok, tmp_path / "b")
    out = tmp_path / "speed.json"
    assert main(["speed", "--model", str(tmp_path / "a"), str(tmp_path / "b"), "--device", "cpu",
                 "--prompt-len", "16", "--gen-len", "3", "--repeats", "2", "--threads", "1",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["model"] for r in report["models"]] == [str(tmp_path / "a"), str(tmp_path / "b")]
    for r in report["models"]:
        assert r["disk_bytes"] == dir_size_bytes(r["model"]) > 0 and r["params"] > 0
        assert r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 and len(r["decode_runs_s"]) == 2
    assert "prefill tok/s" in capsys.readouterr().out
    assert main(["speed", "--model", str(tmp_path / "a"), "--repeats", "0", "--json", str(out)]) == 2
    assert "--repeats must be at least 1" in capsys.readouterr().err


def test_speed_command_sparse_kernels_convert_only_the_24_models(tmp_path, capsys):
    import json

    from leanml.cli import main
    from leanml.models import save_model
    from leanml.models.sparse import decoder_linears
    from recover.helpers import tiny_tokenizer

    tok = tiny_tokenizer(vocab=97)
    sparse = tiny_llama(seed=1)
    with torch.no_grad():  # keep the 2 largest of every 4 inputs
        for lin in decoder_linears(sparse).values():
            g = lin.weight.view(lin.weight.shape[0], -1, 4)
            g.scatter_(-1, g.abs().topk(2, dim=-1, largest=False).indices, 0.0)
    save_model(tiny_llama(), tok, tmp_path / "dense")
    save_model(sparse, tok, tmp_path / "s24")
    out = tmp_path / "speed.json"
    args = ["--device", "cpu", "--prompt-len", "8", "--gen-len", "2", "--repeats", "1", "--json", str(out)]
    with pytest.warns(UserWarning, match="the 2:4 model runs dense"):  # on the CPU
        models = [str(tmp_path / "dense"), str(tmp_path / "s24")]
        assert main(["speed", "--model", *models, "--sparse-kernels", *args]) == 0
    dense_rec, sparse_rec = json.loads(out.read_text())["models"]
    assert dense_rec["sparse_kernels"] is None and sparse_rec["sparse_kernels"]["dense"] == 14
    assert "dense: not 2:4 sparse, runs dense" in capsys.readouterr().out
    assert main(["speed", "--model", str(tmp_path / "dense"), "--sparse-kernels", *args]) == 2
    assert "none of --model is 2:4 sparse" in capsys.readouterr().err
