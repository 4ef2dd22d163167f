"""Layer-parallel pruning with 2 torchrun processes (gloo, CPU) equals the single-process run, for
every method (FLAP's added biases included)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from leanml.prune.engine import prune_model
from leanml.prune.masks import MaskSpec
from leanml.prune.parallel import assign_layers

METHODS = ["magnitude", "wanda", "sparsegpt", "fista", "fasp", "wanda-sp", "magnitude-sp", "flap"]

SCRIPT = textwrap.dedent(
    """
    import faulthandler, json, sys, torch
    import torch.distributed as dist
    from transformers import LlamaForCausalLM
    from leanml.prune.masks import MaskSpec
    from leanml.prune.parallel import prune_distributed
    sys.path.insert(0, sys.argv[3])
    from test_parallel import METHODS, make_pruner, spec_for

    faulthandler.dump_traceback_later(240, exit=True)  # a hang fails the test with a traceback
    model_dir, out = sys.argv[1], sys.argv[2]
    ids = torch.load(model_dir + "/ids.pt")
    dist.init_process_group("gloo")  # one process group for all runs (prune_distributed reuses it)
    for method in METHODS:
        model = LlamaForCausalLM.from_pretrained(model_dir).eval()
        report = prune_distributed(model, ids, make_pruner(method), spec_for(method), sequential=True,
                                   progress=False)
        if report is not None:
            torch.save(model.state_dict(), f"{out}/{method}.pt")
            json.dump(report, open(f"{out}/{method}.json", "w"))
    dist.destroy_process_group()
    """
)


def make_pruner(method: str):
    from leanml.prune.methods import pruner_class
    from leanml.prune.methods.fista import FistaPruner

    return FistaPruner(rounds=2, iters=10) if method == "fista" else pruner_class(method)()


def spec_for(method: str) -> MaskSpec:
    return MaskSpec(0.3) if method in ("fasp", "wanda-sp", "magnitude-sp", "flap") else MaskSpec(0.5)


def test_assign_layers_covers_each_layer_once():
    parts = [assign_layers(7, 3, r) for r in range(3)]
    assert sorted(i for p in parts for i in p) == list(range(7))
    assert [len(p) for p in parts] == [3, 2, 2]


@pytest.mark.slow  # several processes
def test_two_process_torchrun_equals_single_process_for_every_method(tmp_path):
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(1))
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    torch.save(ids, model_dir / "ids.pt")
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    here = os.path.dirname(__file__)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(script), str(model_dir), str(tmp_path), here]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for method in METHODS:
            single = LlamaForCausalLM.from_pretrained(model_dir).eval()
            ref = prune_model(single, ids, make_pruner(method), spec_for(method), sequential=False, progress=False)
            state = torch.load(tmp_path / f"{method}.pt")
            report = json.loads((tmp_path / f"{method}.json").read_text())
            assert set(state) == set(single.state_dict()), method  # FLAP's added biases came back
            for key, value in single.state_dict().items():
                assert state[key].shape == value.shape, (method, key)
                assert torch.equal(state[key] == 0, value == 0), (method, key)
                assert torch.allclose(state[key], value, atol=1e-6, rtol=1e-5), (method, key)
            assert report["engine"]["sequential"] is False and report["engine"]["world_size"] == 2
            assert [layer["rank"] for layer in report["layers"]] == [0, 1, 0]
            assert report["finalize"] == ref["finalize"], method  # parameter counts, widths, bias flags
            for got, want in zip(report["layers"], ref["layers"]):
                assert (abs(got["rel_output_error"] - want["rel_output_error"])
                        <= 1e-5 * max(1.0, want["rel_output_error"]))
    finally:
        torch.set_num_threads(threads)
