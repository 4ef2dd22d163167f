"""``leanml train`` as a library call: :class:`TrainJob` (every option of the command, each declared once)
and :func:`run_train_job`, which checks the inputs, loads the model and corpus, trains under the memory
strategy (:func:`~leanml.train.run.run_training`) and writes the report atomically."""

from __future__ import annotations

import csv
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from leanml.config import Bounds, Form, option
from leanml.train import TrainConfig


@dataclass(frozen=True)
class TrainJob:
    """``leanml train``: fine-tune ``model`` on the train split of ``data`` under ``train``'s memory
    strategy; the report goes to ``out`` (default ``out/train-<memory>``)."""

    model: str = option("smollm2-135m", "smollm2-135m, a model directory, a .gguf file or a hub id")
    data: str = option("shakespeare", "text corpus (training split)")
    seqlen: int = option(256, "tokens per window", bounds=Bounds(ge=2))
    dtype: Literal["float32", "bfloat16", "float16"] = option("float32", "weights and activations dtype")
    train: TrainConfig = option(default_factory=TrainConfig, form=Form(prefix=""))
    out: str | None = option(None, "output directory (default out/train-<memory>)",
                             form=Form(show_default=False))
    overwrite: bool = option(False, "replace an existing output directory")
    save: bool = option(False, "also save the fine-tuned model into the output directory")
    threads: int | None = option(None, "torch threads (default: the cores this process may use); lower it when "
                                       "other jobs share the machine", form=Form(metavar="N"),
                                 bounds=Bounds(ge=1))

    @property
    def out_dir(self) -> str:
        return self.out or f"out/train-{self.train.strategy}"


def run_train_job(job: TrainJob) -> dict[str, Any]:
    """Run ``leanml train``; returns the report written to ``job.out_dir``/report.json (its ``result``:
    :func:`~leanml.train.run.run_training`'s record)."""
    import torch

    from leanml.data.text import check_corpus, load_text, token_windows
    from leanml.device import default_device
    from leanml.machine import apply_threads, machine_info
    from leanml.models import check_dtype, load_model, save_model
    from leanml.models.check import check_model_input
    from leanml.outputs import atomic_dir, check_output_dir, write_json
    from leanml.train import run_training

    out = job.out_dir
    check_output_dir(out, job.overwrite)
    threads = apply_threads(job.threads)
    device = default_device()
    dtype = getattr(torch, job.dtype)
    check_dtype(dtype, device)
    check_model_input(job.model, job.seqlen)
    check_corpus(job.data, "train", "data")
    model, tokenizer = load_model(job.model, dtype=dtype, device=device)
    windows = token_windows(tokenizer, load_text(job.data, "train"), job.seqlen)
    torch.manual_seed(job.train.seed)
    result = run_training(model, windows, job.train)
    with atomic_dir(out, overwrite=job.overwrite) as tmp:
        report = {"config": asdict(job), "threads": threads, "machine": machine_info(), "result": result}
        write_json(tmp / "report.json", report)
        _write_losses(tmp / "losses.csv", result)
        if job.save:
            save_model(model, tokenizer, tmp / "model")
    return report


def _write_losses(path: Path, result: dict[str, Any]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "loss", "step_s", "peak_bytes"])
        for i, (loss, t, pk) in enumerate(zip(result["losses"], result["step_times"], result["step_peaks"])):
            w.writerow([i, f"{loss:.6f}", f"{t:.4f}", pk])
