"""Options shared by the commands that load a causal LM and run it on text windows (``leanml eval``,
``leanml prune``), and the options of ``leanml eval`` itself, each declared once (see :mod:`leanml.config`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from leanml.config import option, require


@dataclass(frozen=True)
class ModelInput:
    """Which model to load, in which dtype, with how many torch threads."""

    model: str = option("smollm2-135m", "HF directory, .gguf file, hub id, or smollm2-135m")
    dtype: Literal["float32", "bfloat16", "float16"] = option(
        "float32", "weight dtype to load (statistics and solves stay float32)")
    threads: int | None = option(None, "torch threads (default: the cores this process may use); lower it when "
                                       "other jobs share the machine", metavar="N")

    def __post_init__(self) -> None:
        require(self, self.threads is None or self.threads >= 1, "threads", f"must be at least 1, got {self.threads}")


@dataclass(frozen=True)
class Compute:
    """How the windows run: their length, how many per forward pass, and where each layer works."""

    seqlen: int = option(512, "tokens per window (512 on CPU)")
    batch_size: int = option(4, "windows per forward pass")
    device: str | None = option(None, "where each decoder layer does its work: cpu or cuda (default: cuda when "
                                      "present); the model's weights stay on the CPU and visit the device layer by "
                                      "layer", show_default=False)

    def __post_init__(self) -> None:
        require(self, self.seqlen >= 2, "seqlen", f"must be at least 2, got {self.seqlen}")
        require(self, self.batch_size >= 1, "batch_size", f"must be at least 1, got {self.batch_size}")


@dataclass(frozen=True)
class EvalJob(Compute, ModelInput):
    """``leanml eval``: perplexity of ``model`` on the test split of ``data``."""

    data: str = option("shakespeare", "corpus (shakespeare, reviews, a .txt file, wikitext2, ptb, c4)")
    max_windows: int | None = option(None, "evaluate the first N windows only")
    json: str | None = option(None, "also write the result as JSON to FILE (default: print it only, write nothing)",
                              metavar="FILE", show_default=False)

    def __post_init__(self) -> None:
        ModelInput.__post_init__(self)
        Compute.__post_init__(self)
        require(self, self.max_windows is None or self.max_windows >= 1, "max_windows",
                f"must be at least 1, got {self.max_windows}")
