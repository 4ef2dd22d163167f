"""AdaccCallback in a real transformers.Trainer run of a few steps on a tiny LLaMA."""

import json
from pathlib import Path

import torch

from leanml.memory import AdaccCallback

from .test_runtime import tiny_llama


def test_trainer_callback_keeps_the_budget(tmp_path: Path) -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    torch.set_num_threads(1)
    model = tiny_llama()
    gen = torch.Generator().manual_seed(0)
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (12, 32), generator=gen)]
    logs: list[dict] = []

    class Keep(TrainerCallback):
        def on_log(self, args, state, control, logs_=None, **kwargs):  # noqa: ANN001, ANN201
            logs.append(dict(kwargs.get("logs") or logs_ or {}))

    callback = AdaccCallback(budget=0.6)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2,
                             learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                             dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[callback, Keep()])
    out = trainer.train()
    report = json.loads((tmp_path / "adacc.json").read_text())
    assert report["steps"]["measured"] == 4 and report["steps"]["over_budget"] == 0
    assert report["history"][0]["reason"] == "first training step"
    assert report["steps"]["max_peak_bytes"] <= report["budget_bytes"] <= 0.6 * report["unoptimized_peak_bytes"] + 1
    assert any("adacc_peak_mib" in entry for entry in logs)
    assert out.global_step == 4
    assert not model._forward_pre_hooks  # the callback removed Adacc when training ended
