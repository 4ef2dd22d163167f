"""Adacc under torch.distributed DDP: two CPU processes with gloo give the unoptimized gradients."""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import LlamaConfig, LlamaForCausalLM

from leanml.memory import Adacc


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, use_cache=False)
    return LlamaForCausalLM(cfg).train()


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(10 + rank))
    results = {}
    for mode in ("none", "adacc"):
        model = _model()
        adacc = None
        if mode == "adacc":
            adacc = Adacc(model, budget=0.5, compressors=("int8-channel",))
            adacc.prepare(input_ids=ids, labels=ids)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        ddp(input_ids=ids, labels=ids).loss.backward()
        results[mode] = torch.cat([p.grad.flatten() for p in model.parameters()])
        if adacc is not None:
            results["plan"] = adacc.plan.to_json()["options"]
            results["peak"] = adacc.plan.measured_peak
            results["budget"] = adacc.plan.budget_bytes
            adacc.remove()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_ddp_two_processes_gloo() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(os.path.join(tmp, "init"), tmp), nprocs=2, join=True)
        r0, r1 = (torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in (0, 1))
    # DDP averaged the gradients: both ranks hold the same ones
    assert torch.allclose(r0["adacc"], r1["adacc"], atol=1e-6)
    assert r0["plan"] == r1["plan"]  # rank 0's plan was broadcast
    cos = torch.nn.functional.cosine_similarity(r0["adacc"], r0["none"], dim=0).item()
    assert cos > 0.99
    assert r0["peak"] <= r0["budget"] and r1["peak"] <= r1["budget"]
