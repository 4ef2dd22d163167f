"""The options of one training run under a memory strategy, shared by ``leanml train``, ``leanml recover``,
the benchmark and the demo: one :class:`TrainConfig` (validated once, when made; its fields are the
command line's flags). Strategies: ``none``, ``checkpoint`` (every layer), ``sac`` (torch selective
checkpointing, save matmuls), ``compile`` (``torch.compile`` with ``activation_memory_budget`` = the budget
fraction) and ``adacc`` (optionally with compiled blocks among its options: ``compile_blocks``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from leanml.config import Bounds, Form, option, require
from leanml.errors import LeanmlError
from leanml.memory.budget import DEFAULT_BUDGET, Budget
from leanml.memory.compiled import DEFAULT_COMPILE_BUDGETS
from leanml.memory.options import AdaccOptions

Strategy = Literal["none", "checkpoint", "sac", "compile", "adacc"]
STRATEGIES: tuple[str, ...] = get_args(Strategy)
#: the compiler budgets ``--compile-blocks`` offers without a value
COMPILE_BUDGETS = ",".join(f"{b:g}" for b in DEFAULT_COMPILE_BUDGETS)


def parse_compile_budgets(spec: str) -> tuple[float, ...]:
    """``"1,0.5,0"`` -> ``(1.0, 0.5, 0.0)``. Raises :class:`LeanmlError` on anything but comma-separated
    numbers in [0, 1]."""
    try:
        budgets = tuple(float(b) for b in spec.split(","))
    except ValueError:
        budgets = ()
    if not budgets or not all(0.0 <= b <= 1.0 for b in budgets):
        raise LeanmlError(f"must be comma-separated compiler budgets in [0, 1] (like 1,0.5,0), got {spec!r}")
    return budgets


@dataclass(frozen=True)
class TrainConfig:
    """One training run under a memory strategy. ``budget``: a :class:`~leanml.memory.budget.Budget`
    (:meth:`Budget.parse <leanml.memory.budget.Budget.parse>` reads ``0.5`` or ``"2GB"``) for ``adacc``
    and ``compile`` (for ``compile`` a fraction: the compiler's ``activation_memory_budget``); None: the
    default, :data:`~leanml.memory.budget.DEFAULT_BUDGET` (:attr:`memory_budget`). ``warmup``: steps
    left out of the timing."""

    strategy: Strategy = option("adacc", "training-memory strategy", flag="--memory")
    budget: Budget | None = option(
        None, "Adacc's budget (compile's: a fraction): a fraction of the unoptimized activation peak in (0, 1], "
        f"or a size with its unit like 2GB or 3000000B (default {DEFAULT_BUDGET.value:g})",
        flag="--memory-budget", parse=Budget.parse, form=Form(metavar="BUDGET"))
    compile_blocks: tuple[float, ...] = option(
        (), "adacc: also offer each layer as a compiled block (torch.compile; minutes of compile time) at these "
        f"recomputation budgets of the compiler (comma-separated, default {COMPILE_BUDGETS})",
        parse=parse_compile_budgets,
        form=Form(metavar="BUDGETS", show_default=False, nargs="?", const=COMPILE_BUDGETS))
    batch_size: int = option(4, "windows per step", bounds=Bounds(ge=1))
    steps: int = option(50, "optimizer steps", bounds=Bounds(ge=1))
    lr: float = option(1e-4, "learning rate (AdamW)", bounds=Bounds(gt=0))
    seed: int = option(0, "batch order seed")
    max_error: float = option(AdaccOptions.max_error, "Adacc: cap on the relative error of lossy compressors",
                              bounds=Bounds(gt=0, le=1))
    warmup: int = option(2, "steps left out of the timing", cli=False, bounds=Bounds(ge=0))
    progress: bool = option(True, "show a progress bar", cli=False)
    compress_layers: list[int] | None = option(None, "Adacc: the layers whose activations may be compressed",
                                               cli=False)
    pool_layers: bool = option(True, "Adacc plans from times pooled over identical layers (False: each layer's own)",
                               cli=False)

    def __post_init__(self) -> None:
        require(self, self.strategy in STRATEGIES, "strategy",
                f"strategy {self.strategy!r} is unknown; choose one of {', '.join(STRATEGIES)}")
        require(self, self.budget is None or isinstance(self.budget, Budget), "budget",
                f"must be a Budget (Budget.parse reads 0.5 or '2GB'), got {self.budget!r}")
        require(self, self.strategy != "compile" or self.memory_budget.kind == "fraction", "budget",
                f"of the compile strategy must be a fraction (its activation_memory_budget), got "
                f"{self.memory_budget.label()}")
        require(self, not self.compile_blocks or self.strategy == "adacc", ("compile_blocks", "strategy"),
                f"compile_blocks is an option of strategy adacc, not of strategy {self.strategy}")
        require(self, all(0.0 <= b <= 1.0 for b in self.compile_blocks), "compile_blocks",
                f"takes compiler budgets in [0, 1], got {self.compile_blocks}")

    @property
    def memory_budget(self) -> Budget:
        """The budget in force: ``budget``, else :data:`~leanml.memory.budget.DEFAULT_BUDGET`."""
        return self.budget if self.budget is not None else DEFAULT_BUDGET

    @property
    def timing_warmup(self) -> int:
        """Steps left out of the timing: ``warmup``, or none when the run is not longer than it."""
        return self.warmup if self.warmup < self.steps else 0

    @property
    def label(self) -> str:
        """``adacc@50%``, ``compile@25%``, ``checkpoint``..."""
        name = self.strategy + ("+compile" if self.strategy == "adacc" and self.compile_blocks else "")
        name += f"@{self.memory_budget.label()}" if self.strategy in ("adacc", "compile") else ""
        return name + (" per-layer" if self.strategy == "adacc" and not self.pool_layers else "")
