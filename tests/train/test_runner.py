"""The training loop shared by ``leanml train`` and the benchmark: per-step budgets across input shapes,
the allocator's own peak as a cross-check of the meter, and the ``--compile-blocks`` budgets."""

import dataclasses

import pytest
import torch

from leanml.config import ConfigError
from leanml.errors import LeanmlError
from leanml.memory import Budget
from leanml.memory.meter import AllocatorPeak, param_tensors
from leanml.train import (
    StepOptions,
    StrategyRunner,
    TrainConfig,
    lm_unoptimized_peak,
    parse_compile_budgets,
    shared_weights_copy,
)
from memory.test_runtime import IDS, tiny_llama


def test_allocator_peak_replays_allocations_and_frees() -> None:
    before = torch.ones(1000)  # allocated before the region: the profiler does not report its free
    with AllocatorPeak("cpu") as alloc:
        a = torch.empty(1_000_000, dtype=torch.uint8)
        del a  # freed inside the region: credited
        del before
        b = torch.empty(250_000, dtype=torch.float32)
        c = torch.empty(750_000, dtype=torch.uint8)
    # the brute-force running sum: a (1 MB) is gone before b (1 MB) and c (0.75 MB) coexist
    assert alloc.peak == 1_000_000 + 750_000
    assert alloc.events >= 4
    del b, c
    with AllocatorPeak("cpu") as empty:
        pass
    assert empty.peak == 0


def test_allocator_step_cross_checks_the_meter() -> None:
    torch.set_num_threads(1)
    model = tiny_llama()
    base = lm_unoptimized_peak(model, IDS)
    grad_bytes = sum(t.nbytes for t in param_tensors(model))
    res = {}
    for strategy in ("none", "checkpoint", "adacc"):
        r = StrategyRunner(shared_weights_copy(model),
                           TrainConfig(strategy=strategy, budget=Budget.parse(0.6), steps=2, warmup=0, progress=False),
                           unoptimized_peak=base)
        r.setup(IDS)
        r.step(IDS)
        r.step(IDS)
        assert r.allocator_step(IDS) == r.allocator_peak
        r.close()
        res[strategy] = r.result()
    for k, r in res.items():
        # the extra step is not part of the timed record
        assert r["steps"] == 2 and len(r["step_peaks"]) == 2 and r["peak_measured_every_step"], k
        # every activation the meter saw was allocated inside the step (the input ids excepted); beyond it the
        # allocator only adds gradients and short-lived workspace, far less than every allocation of the step
        assert r["allocator_step_meter_peak_bytes"] - IDS.nbytes <= r["allocator_peak_bytes"], k
        assert r["allocator_peak_bytes"] <= r["allocator_step_meter_peak_bytes"] + 2 * grad_bytes, k
    assert res["none"]["allocator_peak_bytes"] > res["checkpoint"]["allocator_peak_bytes"]
    assert res["none"]["allocator_step_meter_peak_bytes"] == base
    assert res["adacc"]["steps_over_budget"] == 0 and res["adacc"]["peak_bytes"] <= 0.6 * base + 1


def test_runner_new_shape_replans_with_its_own_budget() -> None:
    """A fraction budget is re-converted for a batch of another shape: the step is checked against the
    budget of its own plan, and the re-planning time is counted in tokens/s."""
    torch.set_num_threads(1)
    model = tiny_llama()
    cfg = TrainConfig(strategy="adacc", budget=Budget.parse(0.6), steps=3, warmup=0, progress=False)
    r = StrategyRunner(model, cfg)
    r.setup(IDS)
    r.step(IDS)
    r.step(IDS[:, :16])
    r.step(IDS)  # back to the cached plan of the first shape
    r.close()
    res = r.result()
    long, short, again = res["step_budget_bytes"]
    assert short < 0.75 * long and again == long
    assert all(p <= b for p, b in zip(res["step_peaks"], res["step_budget_bytes"]))
    assert res["steps_over_budget"] == 0
    assert res["replan_s"] > 0
    assert "new input shape" in [h["reason"] for h in res["history"]]
    tokens = (IDS.numel() * 2 + IDS[:, :16].numel()) / 3
    assert res["tokens_s"] == pytest.approx(tokens * 3 / (res["step_s"] * 3 + res["replan_s"]))


def test_compile_block_budgets_parsed() -> None:
    assert TrainConfig().compile_blocks == ()
    assert parse_compile_budgets("1,0.5,0") == (1.0, 0.5, 0.0)
    for bad in ("", "1,2", "half", "0.5,,0", "-0.5"):
        with pytest.raises(LeanmlError, match="compiler budgets in"):
            parse_compile_budgets(bad)


def test_train_config_checks_once_and_keeps_what_was_asked() -> None:
    """Refusals name fields; nothing is rewritten behind the caller's back (a warm-up as long as the run
    stays as given; the timing just leaves no step out); the default budget is the one default."""
    cfg = TrainConfig(steps=2, warmup=5)
    assert cfg.warmup == 5 and cfg.timing_warmup == 0 and TrainConfig(steps=3).timing_warmup == 2
    assert cfg.budget is None and cfg.memory_budget == Budget("fraction", 0.5) and cfg.label == "adacc@50%"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.steps = 3  # type: ignore[misc]
    for bad, field in ((dict(steps=0), "steps"), (dict(batch_size=0), "batch_size"), (dict(lr=0.0), "lr"),
                       (dict(strategy="compile", budget=Budget.parse("2GB")), "budget"),
                       (dict(strategy="checkpoint", compile_blocks=(1.0,)), "compile_blocks"),
                       (dict(budget=0.5), "budget")):
        with pytest.raises(ConfigError) as err:
            TrainConfig(**bad)
        assert field in err.value.fields and str(err.value).startswith(field), (bad, str(err.value))


def test_result_with_a_meter_every_other_step_reads_the_measured_steps() -> None:
    torch.set_num_threads(1)
    r = StrategyRunner(tiny_llama(), TrainConfig(strategy="checkpoint", steps=4, warmup=2, progress=False),
                       options=StepOptions(measure_every=2))
    r.setup(IDS)
    for _ in range(4):
        r.step(IDS)
    res = r.result()
    r.close()
    assert r.measured_steps == [0, 2] and not res["peak_measured_every_step"]
    assert res["peak_bytes"] == r.peaks[1]  # the timed steps are 2 and 3; step 2 was measured
