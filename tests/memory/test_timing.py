"""Device timing: every clock read waits for the device (a stand-in device here, on CPU), in the
profiler that prices the planner's options, in Adacc and in the training loop; out-of-memory errors."""

import pytest
import torch

from leanml.errors import LeanmlError
from leanml.memory import Adacc, Budget
from leanml.memory.profiler import ProfileOptions, profile_step
from leanml.memory.structure import SELF, find_blocks
from leanml.memory.timing import DeviceTimer, device_synchronizer
from leanml.train import StrategyRunner, TrainConfig

from .test_runtime import IDS, tiny_llama

torch.set_num_threads(1)


class FakeDevice:
    """A device whose queued work takes ``work_s`` virtual seconds and finishes only when synchronized:
    a clock read without a synchronization before it misses that work (as perf_counter around CUDA
    launches does). ``log`` records the order of synchronizations and clock reads."""

    def __init__(self, work_s: float = 1.0) -> None:
        self.work_s = work_s
        self.t = 0.0
        self.log: list[str] = []

    def sync(self) -> None:
        self.t += self.work_s
        self.log.append("sync")

    def clock(self) -> float:
        self.log.append("clock")
        return self.t

    def timer(self) -> DeviceTimer:
        return DeviceTimer("cpu", sync=self.sync, clock=self.clock)

    def every_read_synchronized(self) -> bool:
        return all(i > 0 and self.log[i - 1] == "sync" for i, e in enumerate(self.log) if e == "clock")


def test_device_timer() -> None:
    dev = FakeDevice(0.5)
    timer = dev.timer()
    seconds, out = timer.time(lambda: 7)
    assert (seconds, out) == (0.5, 7) and dev.log == ["sync", "clock", "sync", "clock"]
    with timer.measure() as t:
        pass
    assert t.seconds == 0.5 and timer.syncs == 4 and timer.synchronizes
    assert not DeviceTimer("cpu").synchronizes and device_synchronizer("cpu") is None
    assert callable(device_synchronizer("cuda"))  # built, not called: no CUDA needed
    assert DeviceTimer.for_module(torch.nn.Linear(2, 2)).device.type == "cpu"


def test_profiler_waits_for_the_device_before_reading_the_clock() -> None:
    """Every time the planner prices an option with comes from intervals closed by a synchronization:
    each group's forward, the pointwise ops a selective checkpoint recomputes, each compressor's pack and
    unpack. With the stand-in device each such interval holds at least one unit of device work."""
    model = tiny_llama()
    dev = FakeDevice(1.0)
    prof = profile_step(model, find_blocks(model), lambda: model(input_ids=IDS, labels=IDS).loss,
                        ProfileOptions(compressors=("bf16", "int8-token")), timer=dev.timer())
    assert dev.every_read_synchronized() and dev.log.count("clock") > 50
    children = [g for k, g in prof.groups.items() if k.layer is not None and k.child != SELF and g.bytes]
    assert children and all(g.fwd_s >= 1.0 for g in children)
    assert any(g.sel_recompute_s >= 1.0 for g in children)
    packed = [st for g in children for st in g.compress.values() if st.payload_bytes < g.bytes]
    assert packed and all(st.pack_s >= 1.0 and st.unpack_s >= 1.0 for st in packed)
    assert prof.profile_s >= 1.0


def test_adacc_and_training_loop_time_through_the_device_timer() -> None:
    model = tiny_llama()
    dev = FakeDevice(1.0)
    cfg = TrainConfig(strategy="adacc", budget=Budget.parse(0.7), steps=3, warmup=0, progress=False)
    runner = StrategyRunner(model, cfg, timer=dev.timer())
    runner.setup(IDS)
    assert runner.adacc is not None and runner.adacc.timer is runner.timer
    n_before = dev.log.count("sync")
    for _ in range(3):
        runner.step(IDS)
    assert dev.every_read_synchronized() and dev.log.count("sync") > n_before
    assert all(t >= 1.0 for t in runner.times)  # the step's device work is inside its time
    assert runner.adacc.replan_s >= 1.0 and runner.setup_s >= 1.0
    res = runner.result()
    assert res["compile_s"] == 0.0 and res["cuda_step_peaks"] is None and res["cuda_steps_over_budget"] is None
    assert res["grad_bytes"] == sum(p.numel() * 4 for p in model.parameters())
    runner.close()


def _oom(*args: object, **kwargs: object) -> None:
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
                                 "139.8 GiB of which 1.2 GiB is free.\nSee documentation for Memory Management")


@pytest.mark.parametrize("strategy", ["adacc", "checkpoint"])
def test_out_of_memory_in_a_step_is_one_line_naming_the_fix(monkeypatch: pytest.MonkeyPatch, strategy: str) -> None:
    cfg = TrainConfig(strategy=strategy, budget=Budget.parse(0.7), batch_size=2, steps=2, progress=False)
    runner = StrategyRunner(tiny_llama(), cfg)
    runner.setup(IDS)
    monkeypatch.setattr(runner, "_train_step", _oom)
    with pytest.raises(LeanmlError) as err:
        runner.step(IDS)
    msg = str(err.value)
    assert "\n" not in msg and "ran out of memory" in msg and "Tried to allocate 2.00 GiB" in msg
    assert "smaller batch (now 2)" in msg
    assert ("smaller memory budget (now 70%)" in msg) == (strategy == "adacc")
    runner.close()


def test_out_of_memory_while_planning(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_llama()
    adacc = Adacc(model, budget=0.5)
    monkeypatch.setattr("leanml.memory.adacc.profile_step", _oom)
    with pytest.raises(LeanmlError, match=r"ran out of memory while Adacc profiled and planned .*smaller batch") as err:
        adacc.prepare(input_ids=IDS, labels=IDS)
    assert "\n" not in str(err.value) and adacc._applied is None
    adacc.remove()
