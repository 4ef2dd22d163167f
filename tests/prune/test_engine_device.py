"""The engine's placement of activation streams, its timing split and its background checkpoints."""

from __future__ import annotations

import pytest
import torch

from builders import tiny_llama
from leanml.errors import LeanmlError
from leanml.prune.engine import prune_model
from leanml.prune.engine.placement import Place, stream_home
from leanml.prune.engine.walk import OOM
from leanml.prune.masks import MaskSpec
from leanml.prune.methods.baselines import SparseGPTPruner, WandaPruner

IDS = torch.randint(0, 256, (12, 32), generator=torch.Generator().manual_seed(0))
CUDA = torch.device("cuda")


def test_streams_stay_on_a_gpu_while_its_free_memory_holds_them(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (8 * 2**30, 80 * 2**30))
    assert stream_home(CUDA, 2 * 2**30) == CUDA  # input and output, twice over, in half the free memory
    assert stream_home(CUDA, 2 * 2**30 + 1) == torch.device("cpu")
    assert stream_home(CUDA, 2**40, "device") == CUDA  # asked for: no check
    assert stream_home(CUDA, 1, "cpu") == torch.device("cpu")
    assert stream_home(torch.device("cpu"), 1, "device") == torch.device("cpu")
    with pytest.raises(LeanmlError, match="stream_device must be auto, device or cpu"):
        stream_home(CUDA, 1, "gpu")


def test_feeding_and_collecting_batches_on_one_device_makes_no_copies():
    place = Place(torch.device("cpu"), torch.device("cpu"))
    x = torch.randn(7, 3, 4)
    seen = list(place.feed(x, 3))
    assert [(b, s, e) for b, s, e, _ in seen] == [(0, 0, 3), (1, 3, 6), (2, 6, 7)]
    assert all(xb.data_ptr() == x[s].data_ptr() for _, s, _, xb in seen)  # views, not copies
    sink = place.sink(7)
    for _, s, e, xb in seen:
        sink.put(s, e, xb * 2)
    torch.testing.assert_close(sink.result(), x * 2)


def test_the_report_splits_wall_time_into_solver_and_engine():
    report = prune_model(tiny_llama(seed=1, layers=3), IDS, SparseGPTPruner(), MaskSpec(0.5), progress=False)
    for lay in report["layers"]:
        assert lay["solver_seconds"] == pytest.approx(
            lay["stats_seconds"] + lay["prune_seconds"] + lay["forward_seconds"])
        assert lay["seconds"] >= lay["solver_seconds"] > 0 and lay["engine_seconds"] >= 0
    assert report["solver_seconds"] == pytest.approx(sum(lay["solver_seconds"] for lay in report["layers"]))
    assert report["engine_seconds"] == pytest.approx(report["prune_seconds"] - report["solver_seconds"])
    assert report["engine"]["stream_device"] == "cpu"


class _OutOfMemory(WandaPruner):
    def prune_group(self, group, stats, spec):
        raise OOM("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_running_out_of_device_memory_names_a_smaller_batch_or_host_streams():
    with pytest.raises(LeanmlError, match=r"lower batch_size \(now 4\).*stream_device cpu"):
        prune_model(tiny_llama(), IDS, _OutOfMemory(), MaskSpec(0.5), batch_size=4, progress=False)
