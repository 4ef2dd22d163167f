"""Running on the torch releases users have: selective-checkpoint contexts without ``op_output``, the
compiler's budget knob missing, the private storage-expiry check missing, and the import-time floor."""

import importlib
import types

import pytest
import torch

import leanml
from leanml.errors import LeanmlError
from leanml.memory import Adacc, compiled, meter, runtime
from leanml.memory.runtime import SAC_SAVE_OPS, AppliedPlan, apply_strategy, sac_policy
from leanml.memory.structure import find_blocks

from .test_runtime import IDS, grads, peak_of, tiny_llama, tiny_opt

torch.set_num_threads(1)
aten = torch.ops.aten


class OldContext:
    """A selective-checkpoint context as torch releases before ``op_output`` pass it."""

    def __init__(self, is_recompute: bool) -> None:
        self.is_recompute = is_recompute


def test_policy_reads_only_is_recompute() -> None:
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with meter.ActivationMeter() as m:
        for recompute in (False, True):
            ctx = OldContext(recompute)
            assert sac_policy(ctx, aten.mm.default, a, b) == torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE
            assert sac_policy(ctx, aten.add.Tensor, a, b) == torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE
    assert m.peak == 0  # nothing to note without the output
    assert aten.mm.default in SAC_SAVE_OPS


def _old_torch_contexts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the runtime behave as on a torch whose policies get a context with ``is_recompute`` only."""
    real = torch.utils.checkpoint.create_selective_checkpoint_contexts

    def old_style(policy):  # noqa: ANN001, ANN202
        return real(lambda ctx, func, *args, **kwargs: policy(OldContext(ctx.is_recompute), func, *args, **kwargs))

    monkeypatch.setattr(runtime, "create_selective_checkpoint_contexts", old_style)
    monkeypatch.setattr(runtime, "SAC_CTX_HAS_OUTPUT", False)


@pytest.mark.parametrize("make", [tiny_llama, tiny_opt])
def test_selective_checkpointing_without_op_output(monkeypatch: pytest.MonkeyPatch, make) -> None:  # noqa: ANN001
    """The sac strategy and the per-group selective option run with old-style contexts: the same gradients
    as no checkpointing, and the meter sees the same saved outputs as with ``op_output`` (here they are
    reported by the stacked dispatch mode instead)."""
    model = make()
    ref = grads(model)
    plan = apply_strategy(model, find_blocks(model), "sac")
    modern = peak_of(model) if runtime.SAC_CTX_HAS_OUTPUT else None
    plan.remove()

    _old_torch_contexts(monkeypatch)
    plan = apply_strategy(model, find_blocks(model), "sac")
    assert torch.allclose(grads(model), ref, atol=1e-6, rtol=1e-5)
    old = peak_of(model)
    # without the stacked mode, the outputs the policy saves go unmeasured: the mode is what counts them
    monkeypatch.setattr(runtime._NoteSaved, "__torch_dispatch__",
                        lambda self, func, types, args=(), kwargs=None: func(*args, **(kwargs or {})))
    unnoted = peak_of(model)
    plan.remove()
    assert unnoted < old
    if modern is not None:
        assert old == modern

    blocks = find_blocks(model)
    child = "mlp" if hasattr(blocks[0], "mlp") else "fc1"
    if child in dict(blocks[0].named_children()):
        from leanml.memory.structure import GroupKey

        plan = AppliedPlan(model, blocks, [False] * len(blocks),
                           {GroupKey(i, child): runtime.SELECTIVE for i in range(len(blocks))})
        assert torch.allclose(grads(model), ref, atol=1e-6, rtol=1e-5)
        plan.remove()


def test_adacc_plans_and_trains_with_old_contexts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Adacc's profile, plan and measured steps with old-style contexts (its selective options included)."""
    _old_torch_contexts(monkeypatch)
    model = tiny_llama()
    adacc = Adacc(model, budget=0.6)
    record = adacc.prepare(input_ids=IDS, labels=IDS)
    assert record.measured_peak is not None and record.measured_peak <= record.budget_bytes
    for _ in range(2):
        model(input_ids=IDS, labels=IDS).loss.backward()
        adacc.step()
        model.zero_grad(set_to_none=True)
    assert adacc.report()["steps"]["over_budget"] == 0
    adacc.remove()


def test_meter_without_the_private_expiry_check(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_llama()
    expected = peak_of(model)
    monkeypatch.setattr(meter, "_EXPIRED", None)
    assert peak_of(model) == expected


def test_compile_budgets_without_the_partitioner_knob(monkeypatch: pytest.MonkeyPatch) -> None:
    assert compiled.has_memory_budget() == hasattr(torch._functorch.config, "activation_memory_budget")
    monkeypatch.setattr(compiled, "has_memory_budget", lambda: False)
    with pytest.raises(LeanmlError, match=r"no compiler activation_memory_budget.*use budget 1\.0"):
        compiled.budget_backend(0.5)
    assert callable(compiled.budget_backend(1.0))
    assert compiled.supported_budgets((1.0, 0.5, 0.0)) == (1.0,)
    adacc = Adacc(tiny_llama(), budget=0.5, compile_blocks=True, compile_loss=False)
    assert adacc.compile_budgets == (1.0,)
    adacc.remove()


@pytest.mark.parametrize("version", ["2.4.1+cu121", "2.5.1", "1.13.0", "2.0.0a0+git1234"])
def test_torch_older_than_the_floor_is_refused(version: str) -> None:
    with pytest.raises(leanml.TorchVersionError, match=r"needs torch >= 2\.6, found torch .*upgrade") as err:
        leanml.check_torch_version(version)
    assert "\n" not in str(err.value) and isinstance(err.value, ImportError)


@pytest.mark.parametrize("version", ["2.6.0", "2.6.0+cu124", "2.10.1", "2.13.0+cpu", "2.14.1", "3.0.0", None, "dev"])
def test_torch_at_or_above_the_floor_passes(version: str | None) -> None:
    leanml.check_torch_version(version)


def test_import_checks_the_installed_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """``import leanml`` reads torch's installed version (package metadata) and refuses an old one."""
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "2.3.0" if name == "torch" else real(name))
    with pytest.raises(ImportError, match=r"leanml needs torch >= 2\.6, found torch 2\.3\.0"):
        importlib.reload(leanml)
    monkeypatch.undo()
    importlib.reload(leanml)
    assert isinstance(leanml, types.ModuleType) and leanml.TORCH_FLOOR == (2, 6)


def test_selective_checkpointing_keeps_saved_outputs_out_of_saved_tensor_hooks() -> None:
    """Where torch asks (``respect_saved_tensors_hooks``), the runtime answers as older releases behave:
    what selective checkpointing saves bypasses the surrounding hooks, with no warning about the default."""
    import warnings

    model = tiny_llama()
    plan = apply_strategy(model, find_blocks(model), "sac")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        peak_of(model)  # the meter's hooks surround the selective regions
    plan.remove()
    has = "respect_saved_tensors_hooks" in __import__("inspect").signature(torch.utils.checkpoint.checkpoint).parameters
    assert runtime.SAC_HOOKS_KWARGS == ({"respect_saved_tensors_hooks": False} if has else {})
