"""The Python API checks its arguments where they come in: a wrong kind (a dict for the config, a list for
the token ids, swapped arguments) is a ``TypeError`` or ``ValueError`` naming the argument and what it
takes, raised before the model is touched."""

from __future__ import annotations

import pytest
import torch

import leanml
from leanml.models.tiny import tiny_llama
from leanml.prune.config import PruneConfig
from leanml.recover import MaskKeeper, RecoverConfig, recover, recover_training


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))


def _weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


PRUNE_CASES = [
    (lambda m, x: (m, x.tolist(), None), TypeError, "calibration must be a torch.Tensor of token ids"),
    (lambda m, x: (m, x, {"sparsity": 0.5}), TypeError, "config must be a leanml.prune.config.PruneConfig or None, "
                                                        "got dict; build one with PruneConfig(**options)"),
    (lambda m, x: (x, m, None), TypeError, "model must be a torch.nn.Module (a causal LM), got Tensor; the order is"),
    (lambda m, x: (m, PruneConfig(), x), TypeError, "calibration must be a torch.Tensor of token ids "
                                                    "(nsamples, seqlen), got PruneConfig; the order is"),
    (lambda m, x: (m, x.float(), None), ValueError, "calibration must hold integer token ids, got dtype float32"),
    (lambda m, x: (m, x[0], None), ValueError, "calibration must be token ids (nsamples, seqlen) (2-D), got shape"),
]


@pytest.mark.parametrize("make,error,message", PRUNE_CASES)
def test_prune_refuses_wrong_kinds_naming_the_argument(make, error: type, message: str, ids: torch.Tensor) -> None:
    model = tiny_llama()
    before = _weights(model)
    with pytest.raises(error) as err:
        leanml.prune(*make(model, ids))
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(model)))  # refused before any work


def test_prune_keyword_arguments_are_checked_too(ids: torch.Tensor) -> None:
    with pytest.raises(TypeError, match="checkpoint_dir must be a path or None, got int"):
        leanml.prune(tiny_llama(), ids, checkpoint_dir=3)
    with pytest.raises(TypeError, match="progress must be True or False, got str"):
        leanml.prune(tiny_llama(), ids, progress="no")


RECOVER_CASES = [
    (dict(windows="w"), TypeError, "windows must be a torch.Tensor of token ids (n, seqlen), got str"),
    (dict(config={"lr": 1e-3}), TypeError, "config must be a leanml.recover.config.RecoverConfig or None, got dict"),
    (dict(swap=True), TypeError, "model must be a torch.nn.Module (a causal LM), got Tensor; the order is "
                                 "recover(model, windows, config)"),
    (dict(teacher="dense"), TypeError, "teacher must be a torch.nn.Module or None, got str"),
    (dict(masks={"q": 1}), TypeError, "masks must be a leanml.recover.masks.MaskKeeper or None, got dict"),
    (dict(eval_sets=[1]), TypeError, "eval_sets must be a dict of name -> token ids"),
    (dict(eval_sets={"t": torch.zeros(4)}), ValueError, "eval_sets['t'] must be token ids (n, seqlen) (2-D)"),
    (dict(on_step=3), TypeError, "on_step must be a function (step, log) or None, got int"),
    (dict(device=0.5), TypeError, "device must be a str, a torch.device or None, got float"),
]


@pytest.mark.parametrize("changes,error,message", RECOVER_CASES)
def test_recover_refuses_wrong_kinds_naming_the_argument(changes: dict, error: type, message: str,
                                                         ids: torch.Tensor) -> None:
    model = tiny_llama()
    before = _weights(model)
    changes = dict(changes)
    args = [ids, model] if changes.pop("swap", False) else [model, changes.pop("windows", ids)]
    config = changes.pop("config", RecoverConfig(train=recover_training(steps=1, batch_size=1), keep_masks=False))
    with pytest.raises(error) as err:
        recover(*args, config, progress=False, **changes)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(model)))


def test_the_trainer_callback_checks_its_arguments() -> None:
    from leanml.recover import KeepMasksCallback

    with pytest.raises(TypeError, match="masks must be a leanml.recover.masks.MaskKeeper or None, got LlamaFor"):
        KeepMasksCallback(tiny_llama())
    with pytest.raises(TypeError, match="require must be True or False, got int"):
        KeepMasksCallback(None, 1)
    assert KeepMasksCallback(MaskKeeper.from_zeros(tiny_llama())).require
