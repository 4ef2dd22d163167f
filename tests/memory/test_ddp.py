"""Adacc under torch.distributed DDP: two CPU processes with gloo give the unoptimized gradients."""

import os
import tempfile
from datetime import timedelta

import pytest
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
    # a collective one rank never joins fails after the timeout instead of hanging the test run
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
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
        # free DDP's reducer while the process group is alive: if the reducer holds the last reference,
        # freeing it destroys the gloo group while holding the GIL its worker thread needs (a deadlock)
        del ddp
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _spawn(worker, tmp: str, deadline_s: float = 240.0) -> None:
    """Run ``worker`` on 2 ranks; fail (never hang) if they do not finish within the deadline."""
    ctx = mp.spawn(worker, args=(os.path.join(tmp, "init"), tmp), nprocs=2, join=False)
    import time

    end = time.monotonic() + deadline_s
    while not ctx.join(timeout=5):
        if time.monotonic() > end:
            for p in ctx.processes:
                p.kill()
            raise AssertionError(f"the 2 ranks did not finish within {deadline_s:.0f} s (a collective mismatch?)")


@pytest.mark.slow  # several processes
def test_ddp_two_processes_gloo() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        _spawn(_worker, tmp)
        r0, r1 = (torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in (0, 1))
    # DDP averaged the gradients: both ranks hold the same ones
    assert torch.allclose(r0["adacc"], r1["adacc"], atol=1e-6)
    assert r0["plan"] == r1["plan"]  # rank 0's plan was broadcast
    cos = torch.nn.functional.cosine_similarity(r0["adacc"], r0["none"], dim=0).item()
    assert cos > 0.99
    assert r0["peak"] <= r0["budget"] and r1["peak"] <= r1["budget"]


def _drift_worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(10 + rank))
    model = _model()
    adacc = Adacc(model, budget=0.5, compressors=("int8-channel",), check_every=1)
    adacc.prepare(input_ids=ids, labels=ids)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    if rank == 1:  # only this rank sees drift: both must still re-plan, together
        adacc.monitor.check = lambda errors, outliers: ["forced drift on rank 1"]
    else:
        adacc.monitor.check = lambda errors, outliers: []
    replans = []
    for _ in range(2):
        ddp(input_ids=ids, labels=ids).loss.backward()
        replans.append(adacc.step())
    torch.save({"replans": replans, "history": len(adacc.history), "plan": adacc.plan.to_json()["options"]},
               os.path.join(out_dir, f"rank{rank}.pt"))
    adacc.remove()
    del ddp  # see _worker
    dist.destroy_process_group()


@pytest.mark.slow  # several processes
def test_ddp_ranks_replan_together_when_only_one_sees_drift() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        _spawn(_drift_worker, tmp)
        r0, r1 = (torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in (0, 1))
    assert r1["replans"] == [["forced drift on rank 1"]] * 2
    assert r0["replans"] == [["drift on another rank"]] * 2
    assert r0["history"] == r1["history"] == 3  # the initial plan and two re-plans on both ranks
    assert r0["plan"] == r1["plan"]
