"""Options shared by the commands that load a causal LM and run it on text windows (``leanml eval``,
``leanml prune``), and the options of ``leanml eval`` itself, each declared once (see :mod:`leanml.config`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from leanml.config import Bounds, Form, option, require
from leanml.eval.tasks.runner import parse_task_list


@dataclass(frozen=True)
class Runtime:
    """The weights' dtype and the torch threads."""

    dtype: Literal["float32", "bfloat16", "float16"] = option(
        "float32", "weight dtype to load (pruning's statistics and solves stay float32; sparse kernels need "
                   "bfloat16 or float16)")
    threads: int | None = option(None, "torch threads (default: the cores this process may use); lower it when "
                                       "other jobs share the machine", form=Form(metavar="N"),
                                 bounds=Bounds(ge=1))


@dataclass(frozen=True)
class ModelInput(Runtime):
    """Which model to load, in which dtype, with how many torch threads."""

    model: str = option("smollm2-135m", "HF directory, .gguf file, hub id, or smollm2-135m")


@dataclass(frozen=True)
class Compute:
    """How the windows run: their length, how many per forward pass, and where each layer works."""

    seqlen: int = option(512, "tokens per window (512 on CPU)", bounds=Bounds(ge=2))
    batch_size: int = option(4, "windows per forward pass", bounds=Bounds(ge=1))
    device: str | None = option(None, "where each decoder layer does its work: cpu or cuda (default: cuda when "
                                      "present); the model's weights stay on the CPU and visit the device layer by "
                                      "layer", form=Form(show_default=False))


@dataclass(frozen=True)
class EvalJob(Compute, ModelInput):
    """``leanml eval``: perplexity of ``model`` on the test split of ``data``, and/or its zero-shot accuracy
    on lm-eval ``tasks``. Without ``tasks`` perplexity runs on ``data`` (default shakespeare); with
    ``tasks`` perplexity runs only when ``data`` is given."""

    data: str | None = option(None, "corpus for perplexity (shakespeare, reviews, a .txt file, wikitext2, ptb, "
                                    "c4; default shakespeare; with zero-shot tasks, no perplexity unless given)",
                              form=Form(show_default=False))
    max_windows: int | None = option(None, "evaluate the first N windows only")
    tasks: tuple[str, ...] = option((), "zero-shot accuracy through lm-eval on these tasks: the offline "
                                        "reviews-recommend, reviews-rating, shakespeare-next-line, a task .yaml "
                                        "file, or an lm-eval task name (needs the hub)", parse=parse_task_list,
                                    form=Form(metavar="NAME[,NAME...]", show_default=False))
    limit: int | None = option(None, "zero-shot tasks: the first N items of each task only",
                               form=Form(metavar="N"))
    num_fewshot: int | None = option(None, "zero-shot tasks: examples put before each item (default: the task's "
                                           "own, 0 for the offline tasks)",
                                     form=Form(metavar="N", show_default=False))
    json: str | None = option(None, "also write the result as JSON to FILE (default: print it only, write nothing)",
                              form=Form(metavar="FILE", show_default=False))

    def __post_init__(self) -> None:
        ModelInput.__post_init__(self)
        Compute.__post_init__(self)
        require(self, self.max_windows is None or self.max_windows >= 1, "max_windows",
                f"must be at least 1, got {self.max_windows}")
        require(self, isinstance(self.tasks, tuple), "tasks", "must be a tuple of task names")
        require(self, self.limit is None or self.limit >= 1, "limit", f"must be at least 1, got {self.limit}")
        require(self, self.num_fewshot is None or self.num_fewshot >= 0, "num_fewshot",
                f"must be at least 0, got {self.num_fewshot}")
        for name in ("limit", "num_fewshot"):
            require(self, getattr(self, name) is None or bool(self.tasks), (name, "tasks"), f"{name} needs tasks")

    @property
    def corpus(self) -> str | None:
        """The corpus perplexity runs on: ``data``, else shakespeare unless only tasks were asked."""
        return self.data if self.data is not None else None if self.tasks else "shakespeare"


@dataclass(frozen=True)
class SpeedSettings:
    """How :func:`leanml.eval.speed.measure_speeds` times models: lengths, batch, repeats."""

    prompt_len: int = option(256, "prefill tokens per sequence", bounds=Bounds(ge=1))
    gen_len: int = option(32, "decode steps timed (0: skip decode)", bounds=Bounds(ge=0))
    gen_prompt_len: int = option(32, "prompt put in the KV cache before decoding", bounds=Bounds(ge=1))
    batch_size: int = option(1, "sequences per run", bounds=Bounds(ge=1))
    repeats: int = option(5, "timed runs per model (median reported)", bounds=Bounds(ge=1))
    warmup: int = option(1, "untimed runs per model first", bounds=Bounds(ge=0))
    seed: int = option(0, "seed of the random token ids", cli=False)


@dataclass(frozen=True)
class SpeedJob(Runtime):
    """``leanml speed``: prefill and decode speed, peak memory and size on disk of one or more models."""

    models: tuple[str, ...] = option(("smollm2-135m",), "one or more HF directories, .gguf files, hub ids, or "
                                     "smollm2-135m", flag="--model", form=Form(nargs="+"))
    device: str | None = option(None, "cpu or cuda (default: cuda when present)",
                                form=Form(show_default=False))
    settings: SpeedSettings = option(default_factory=SpeedSettings, form=Form(prefix=""))
    sparse_kernels: bool = option(False, "run the 2:4-sparse models among those timed on semi-structured sparse "
                                         "kernels (CUDA, bfloat16/float16; on the CPU they stay dense with a "
                                         "warning); the others run dense")
    json: str | None = option(None, "where to write the JSON report (default runs/speed-*.json)",
                              form=Form(metavar="FILE", show_default=False))

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self, len(set(self.models)) == len(self.models), "models",
                "lists the same model twice; list each model once")
