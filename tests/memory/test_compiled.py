"""Adacc with compiled blocks: the compiler's budgeted recomputation as one more per-layer option."""

import pytest
import torch

from leanml.memory import Adacc
from leanml.memory.compiled import compile_loss_function, compiled_option_name, parse_compiled_option
from leanml.memory.meter import ActivationMeter, param_tensors

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
    assert adacc.compiled_loss and adacc.report()["compiled_loss"]  # compile_blocks compiles the loss too
    assert any(m.startswith("compiled@") for m in plan.layer_modes) or any(plan.layer_checkpoint)
    got = grads()
    adacc.step()
    assert adacc.step_peaks[-1] <= plan.budget_bytes
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    adacc.remove()
    assert "forward" not in model.model.layers[0].__dict__  # the compiled forward is gone
    assert "_loss_function" not in model.__dict__  # so is the compiled loss
    assert adacc.compiled_loss  # what a record written after remove() reads: how the loss ran


@pytest.mark.slow  # compiles the loss with inductor
def test_compiled_loss_matches_the_eager_loss_in_value_gradients_and_saved_bytes() -> None:
    torch.set_num_threads(1)
    model = tiny_llama()
    model.config.use_cache = False

    def run() -> tuple[torch.Tensor, torch.Tensor, int]:
        model.zero_grad(set_to_none=True)
        meter = ActivationMeter(param_tensors(model))
        with meter:
            loss = model(input_ids=IDS, labels=IDS).loss
            loss.backward()
        return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()]), meter.peak

    # independent reference: the eager loss by hand (shifted labels, mean NLL over the vocabulary)
    with torch.no_grad():
        logits = model(input_ids=IDS).logits
    by_hand = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 128), IDS[:, 1:].reshape(-1))
    eager_loss, eager_grads, eager_peak = run()
    torch.testing.assert_close(eager_loss, by_hand)
    compiled = compile_loss_function(model)
    assert compiled is not None and model.__dict__["_loss_function"] is compiled
    loss, grads, peak = run()
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads, eager_grads, rtol=1e-4, atol=1e-6)
    # the compiled graph saves logits + one log-sum-exp per token instead of the log-probabilities
    assert abs(peak - eager_peak) <= 0.02 * eager_peak and compiled.active
    compiled.undo()
    assert "_loss_function" not in model.__dict__
    # a model without a settable loss_function is left alone, and Adacc says its loss runs eagerly
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert compile_loss_function(plain) is None
    adacc = Adacc(model, budget=0.9, compressors=(), compile_loss=False)
    assert not adacc.compiled_loss and "_loss_function" not in model.__dict__
    adacc.remove()


def test_a_loss_the_compiler_cannot_take_falls_back_to_eager_and_input_errors_still_raise() -> None:
    model = tiny_llama()
    model.config.use_cache = False
    with torch.no_grad():
        eager = model(input_ids=IDS, labels=IDS).loss
    compiled = compile_loss_function(model)
    assert compiled is not None

    def broken(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("C++ compile error\nno compiler found")

    compiled._compiled = broken  # what a machine without a working compiler does at the first call
    bad = IDS.clone()
    bad[0, 5] = 10_000  # a label outside the vocabulary: the eager loss raises too, so the error is the caller's
    with torch.no_grad(), pytest.raises(IndexError):
        model(input_ids=IDS, labels=bad)
    assert compiled.active  # not blamed on the compiler
    with torch.no_grad():
        got = model(input_ids=IDS, labels=IDS).loss
    torch.testing.assert_close(got, eager)
    assert not compiled.active and compiled.error == "RuntimeError: C++ compile error"
    adacc = Adacc(model, budget=0.9, compressors=())  # no compile_blocks: the loss is not compiled
    assert not adacc.compiled_loss
    adacc.remove()
    compiled.undo()
    assert "_loss_function" not in model.__dict__
