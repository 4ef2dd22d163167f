"""Adacc with compiled blocks: the compiler's budgeted recomputation as one more per-layer option."""

import pytest
import torch

from leanml.memory import Adacc
from leanml.memory.compiled import compiled_option_name, parse_compiled_option

from .test_runtime import IDS, tiny_llama


def test_option_names_round_trip() -> None:
    assert parse_compiled_option(compiled_option_name(0.5)) == (0.5, None)
    assert parse_compiled_option(compiled_option_name(0.25, "int8-token")) == (0.25, "int8-token")
    assert parse_compiled_option("retain") is None


@pytest.mark.slow  # compiles a block with inductor (tens of seconds on 2 shared cores)
def test_adacc_on_compiled_blocks() -> None:
    torch.set_num_threads(1)
    model = tiny_llama()
    model.config.use_cache = False

    def grads() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        model(input_ids=IDS, labels=IDS).loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    ref = grads()
    # only compiled options are affordable in time here: compression off, so the plan must pick them
    adacc = Adacc(model, budget=0.6, compressors=(), compile_blocks=(0.0,))
    plan = adacc.prepare(input_ids=IDS, labels=IDS)
    prof = adacc.profile
    assert prof.compile_error is None and set(prof.compiled) == {0, 1}
    stats = prof.compiled[0][0]
    # the compiler at budget 0 recomputes the block: it saves less than the eager block does
    assert stats.budget == 0.0 and 0 < stats.bytes < sum(g.bytes for g in prof.layer_groups(0))
    assert plan.measured_peak <= plan.budget_bytes
    assert any(m.startswith("compiled@") for m in plan.layer_modes) or any(plan.layer_checkpoint)
    got = grads()
    adacc.step()
    assert adacc.step_peaks[-1] <= plan.budget_bytes
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    adacc.remove()
    assert "forward" not in model.model.layers[0].__dict__  # the compiled forward is gone
