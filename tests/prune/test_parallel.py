"""Layer-parallel pruning with 2 torchrun processes (gloo, CPU) equals the single-process run."""

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
from leanml.prune.methods.fista import FistaPruner
from leanml.prune.parallel import assign_layers

SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from transformers import LlamaForCausalLM
    from leanml.prune.masks import MaskSpec
    from leanml.prune.methods.fista import FistaPruner
    from leanml.prune.parallel import prune_distributed

    model_dir, out = sys.argv[1], sys.argv[2]
    model = LlamaForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.load(model_dir + "/ids.pt")
    pruner = FistaPruner(warm_start="sparsegpt", rounds=2, iters=10)
    report = prune_distributed(model, ids, pruner, MaskSpec(0.5), sequential=True, progress=False)
    if report is not None:
        torch.save(model.state_dict(), out + "/state.pt")
        json.dump(report, open(out + "/report.json", "w"))
    """
)


def test_assign_layers_covers_each_layer_once():
    parts = [assign_layers(7, 3, r) for r in range(3)]
    assert sorted(i for p in parts for i in p) == list(range(7))
    assert [len(p) for p in parts] == [3, 2, 2]


@pytest.mark.slow  # several processes
def test_two_process_torchrun_equals_single_process(tmp_path):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=128,
    )
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(1))
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    torch.save(ids, model_dir / "ids.pt")
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(script), str(model_dir), str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = LlamaForCausalLM.from_pretrained(model_dir).eval()
        pruner = FistaPruner(warm_start="sparsegpt", rounds=2, iters=10)
        ref = prune_model(single, ids, pruner, MaskSpec(0.5), sequential=False, progress=False)
    finally:
        torch.set_num_threads(threads)

    state = torch.load(tmp_path / "state.pt")
    report = json.loads((tmp_path / "report.json").read_text())
    for key, value in single.state_dict().items():
        assert torch.equal(state[key] == 0, value == 0), key
        assert torch.allclose(state[key], value, atol=1e-6, rtol=1e-5), key
    assert report["engine"]["sequential"] is False and report["engine"]["world_size"] == 2
    assert [layer["layer"] for layer in report["layers"]] == [0, 1, 2]
    assert [layer["rank"] for layer in report["layers"]] == [0, 1, 0]
    for got, want in zip(report["layers"], ref["layers"]):
        assert abs(got["rel_output_error"] - want["rel_output_error"]) <= 1e-5 * max(1.0, want["rel_output_error"])
