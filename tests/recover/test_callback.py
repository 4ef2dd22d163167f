"""``KeepMasksCallback`` under a real ``transformers.Trainer`` run."""

from __future__ import annotations

import pytest
import torch

from leanml.errors import LeanmlError
from leanml.recover import KeepMasksCallback, linear_sparsity, masked_linears
from recover.helpers import sparse_llama


class _Windows(torch.utils.data.Dataset):
    def __init__(self, n: int = 16, seqlen: int = 16) -> None:
        self.ids = torch.randint(0, 256, (n, seqlen), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _args(tmp_path, **kw):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, learning_rate=1e-2,
                             weight_decay=0.1, report_to=[], save_strategy="no", logging_strategy="no",
                             use_cpu=True, disable_tqdm=True, **kw)


def test_trainer_keeps_every_zero_with_2_4_masks(tmp_path):
    from transformers import Trainer

    model = sparse_llama(pattern=(2, 4)).train()
    zeros = {n: lin.weight.detach() == 0 for n, lin in masked_linears(model)}
    first = {n: lin.weight.detach().clone() for n, lin in masked_linears(model)}
    callback = KeepMasksCallback()
    Trainer(model=model, args=_args(tmp_path), train_dataset=_Windows(), callbacks=[callback]).train()
    assert callback.violations_at_end == 0 and linear_sparsity(model) == pytest.approx(0.5)
    for name, lin in masked_linears(model):
        w = lin.weight.detach()
        assert torch.equal(w == 0, zeros[name]) and not torch.equal(w, first[name]), name
        assert ((w != 0).reshape(w.shape[0], -1, 4).sum(-1) == 2).all(), name


def test_without_the_callback_the_trainer_fills_the_zeros(tmp_path):
    from transformers import Trainer

    model = sparse_llama().train()
    Trainer(model=model, args=_args(tmp_path, max_grad_norm=1.0), train_dataset=_Windows()).train()
    assert linear_sparsity(model) < 0.01  # so the test above can fail


def test_callback_refuses_a_model_without_zeros(tmp_path):
    from builders import tiny_llama

    callback = KeepMasksCallback()
    with pytest.raises(LeanmlError, match="no pruned weights"):
        callback.on_train_begin(None, None, None, model=tiny_llama())


def test_callback_refuses_chance_zeros_like_leanml_recover():
    from builders import tiny_llama

    model = tiny_llama()
    _, lin = next(iter(masked_linears(model)))
    with torch.no_grad():
        lin.weight[0, :5] = 0.0  # a dense checkpoint's few exact zeros: far under 1 % of the linear weights
    with pytest.raises(LeanmlError, match="no pruned weights"):
        KeepMasksCallback().on_train_begin(None, None, None, model=model)
    lenient = KeepMasksCallback(require=False)
    lenient.on_train_begin(None, None, None, model=model)  # keeps whatever zeros there are
    assert lenient.keeper.fraction() > 0
    lenient.keeper.detach()
