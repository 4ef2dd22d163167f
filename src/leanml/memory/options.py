"""Adacc's settings (:class:`AdaccOptions`), each declared once and checked when made, apart from the
runtime in :mod:`leanml.memory.adacc` that reads them."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Literal

from leanml.config import check_argument, option, require
from leanml.memory.budget import DEFAULT_BUDGET, Budget, BudgetLike
from leanml.memory.compiled import DEFAULT_COMPILE_BUDGETS
from leanml.memory.compressors import FLOAT_COMPRESSORS
from leanml.memory.policy import DriftThresholds


@dataclass(frozen=True)
class AdaccOptions:
    """Adacc's settings, each declared once (the real objects, the model, its blocks, the loss function, a
    given profile and the timer, are :class:`Adacc`'s own arguments). Checked when made: a value of the
    wrong kind raises :class:`TypeError`, one out of range a :class:`~leanml.config.ConfigError`, both
    naming the field.

    ``budget``: bytes, a size string ("2GB", "512MiB") or a fraction in (0, 1] of the unoptimized
    activation peak of the batch being planned (parsed once, see :class:`~leanml.memory.budget.Budget`).
    ``max_error`` caps the relative error of any lossy compressor (``error_caps`` overrides it per
    compressor). ``compress_head`` allows compressing the activations after the last block
    (log-probabilities of the loss; off by default because small relative errors there become large
    errors in probabilities). ``compile_blocks``: ``True`` (budgets 1.0, 0.5, 0.0) or a sequence of the
    compiler's recomputation budgets; each layer may then run as a compiled block at one of them, with
    its saved tensors retained or compressed (needs a working ``torch.compile``). ``on_new_shape``:
    ``"replan"`` (default: profile and plan a batch of a new shape before running it, plans cached per
    shape) or ``"error"``. ``measure_steps``: measure every training step's peak (``step_peaks``).
    ``pool_layers``: plan from times pooled over layers that do the same work (median over the measured
    ones, :func:`~leanml.memory.costs.pool_timings`) rather than each layer's own, noisier, timing.
    ``compile_loss``: run a Hugging Face model's loss function (log-softmax and NLL over the vocabulary) as
    compiled kernels; default: when ``compile_blocks`` is on. Its saved bytes are those of the eager loss;
    only its time drops.
    """

    budget: BudgetLike = option(DEFAULT_BUDGET, "activation memory budget: a fraction of the unoptimized peak "
                                "or a size", cli=False)
    max_error: float = option(0.05, "cap on the relative error of lossy compressors", cli=False)
    error_caps: dict[str, float] | None = option(None, "per-compressor caps overriding max_error", cli=False)
    compressors: tuple[str, ...] = option(FLOAT_COMPRESSORS, "the compressors a plan may use", cli=False)
    outlier_frac: float = option(0.01, "share of channels kept exact as outliers by the int compressors", cli=False)
    compress_head: bool = option(False, "allow compressing the activations after the last block", cli=False)
    time_limit: float = option(5.0, "seconds the MILP solver may take", cli=False)
    check_every: int = option(50, "steps between drift checks (0: none)", cli=False)
    thresholds: DriftThresholds = option(default_factory=DriftThresholds, help="when to re-plan", cli=False)
    calibrate: bool = option(True, "measure a plan's peak and tighten it until it holds", cli=False)
    max_calibrations: int = option(4, "plans tried per calibration", cli=False)
    compress_layers: list[int] | tuple[int, ...] | None = option(
        None, "the layers whose activations may be compressed (default all)", cli=False)
    compile_blocks: bool | tuple[float, ...] = option(False, "offer compiled blocks at these compiler budgets",
                                                      cli=False)
    on_new_shape: Literal["replan", "error"] = option("replan", "what a batch of a new shape does", cli=False)
    measure_steps: bool = option(True, "measure every training step's peak", cli=False)
    progress: bool = option(False, "show progress bars while profiling", cli=False)
    pool_layers: bool = option(True, "plan from times pooled over identical layers", cli=False)
    compile_loss: bool | None = option(None, "run the model's loss as compiled kernels (default: with "
                                       "compile_blocks)", cli=False)

    def __post_init__(self) -> None:
        _kinds(self, bool, "compress_head", "calibrate", "measure_steps", "progress", "pool_layers")
        _kinds(self, int, "check_every", "max_calibrations")
        _kinds(self, (int, float), "max_error", "outlier_frac", "time_limit")
        _kind(self, "compile_loss", (bool, type(None)), "True, False or None")
        _kind(self, "thresholds", DriftThresholds, "a DriftThresholds")
        _kind(self, "compressors", (tuple, list), "a tuple of compressor names")
        _kind(self, "error_caps", (dict, type(None)), "a dict of compressor name -> cap, or None")
        _kind(self, "compress_layers", (list, tuple, type(None)), "a list of layer indices, or None")
        _kind(self, "compile_blocks", (bool, tuple, list), "True, False or a sequence of compiler budgets")
        object.__setattr__(self, "budget", Budget.parse(self.budget))
        object.__setattr__(self, "compressors", tuple(self.compressors))
        if isinstance(self.compile_blocks, list):
            object.__setattr__(self, "compile_blocks", tuple(self.compile_blocks))
        require(self, 0 < self.max_error <= 1, "max_error", f"must be in (0, 1], got {self.max_error}")
        require(self, 0 <= self.outlier_frac < 1, "outlier_frac", f"must be in [0, 1), got {self.outlier_frac}")
        require(self, self.time_limit > 0, "time_limit", f"must be > 0 seconds, got {self.time_limit}")
        require(self, self.check_every >= 0, "check_every", f"must be >= 0 (0: no drift checks), got "
                f"{self.check_every}")
        require(self, self.max_calibrations >= 1, "max_calibrations", f"must be >= 1, got {self.max_calibrations}")
        require(self, self.on_new_shape in ("replan", "error"), "on_new_shape",
                f"must be 'replan' or 'error', got {self.on_new_shape!r}")
        blocks = () if isinstance(self.compile_blocks, bool) else self.compile_blocks
        require(self, all(isinstance(b, int | float) and 0.0 <= b <= 1.0 for b in blocks), "compile_blocks",
                f"takes compiler budgets in [0, 1], got {self.compile_blocks}")

    @property
    def compile_budgets(self) -> tuple[float, ...]:
        """The compiler budgets ``compile_blocks`` asks for (``True``: the defaults)."""
        return DEFAULT_COMPILE_BUDGETS if self.compile_blocks is True else tuple(self.compile_blocks or ())


def _kind(obj: AdaccOptions, name: str, kinds: type | tuple[type, ...], what: str) -> None:
    value = getattr(obj, name)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in _as_tuple(kinds)):
        raise TypeError(f"Adacc {name} must be {what}, got {value!r} ({type(value).__name__})")


def _as_tuple(kinds: type | tuple[type, ...]) -> tuple[type, ...]:
    return kinds if isinstance(kinds, tuple) else (kinds,)


def _kinds(obj: AdaccOptions, kinds: type | tuple[type, ...], *names: str) -> None:
    what = {bool: "True or False", int: "an integer"}.get(kinds, "a number")  # type: ignore[call-overload]
    for name in names:
        _kind(obj, name, kinds, what)


OPTION_NAMES = frozenset(f.name for f in fields(AdaccOptions))


def with_values(options: AdaccOptions | None, values: dict[str, Any]) -> AdaccOptions:
    """``options`` with the fields given by name changed (checked: an unknown name is a TypeError)."""
    check_argument(options, "options", (AdaccOptions, type(None)), "an AdaccOptions or None",
                   "give other settings by name (budget=0.5, max_error=0.05, ...)")
    unknown = sorted(set(values) - OPTION_NAMES)
    if unknown:
        raise TypeError(f"Adacc got unknown argument(s) {', '.join(unknown)}; its options are "
                        f"{', '.join(sorted(OPTION_NAMES))}")
    return replace(options, **values) if options is not None else AdaccOptions(**values)
