"""The options of a pruning run, each declared once (see :mod:`leanml.config`).

:class:`PruneConfig` is what :func:`leanml.prune` takes: the mask (sparsity or N:M pattern, scope), the
method and its options object (one dataclass per method, beside its pruner in ``prune/methods/``), the
per-layer sparsity profile, the calibration windows and how the engine walks the model. It checks itself
once, when made; everything derived from it (the resolved mask, the pruner) comes from its methods.
:class:`PruneJob` adds what ``leanml prune`` does around the library call: which model to load, where to
save it, whether to evaluate and to stream. The command line is generated from both.

Example::

    from leanml.prune.config import PruneConfig
    from leanml.prune.methods.fista import FistaOptions

    config = PruneConfig(method="fista", pattern="2:4", options=FistaOptions(iters=10))
    report = leanml.prune(model, calib_ids, config)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Literal

from leanml.config import Bounds, ConfigError, Form, default, given, option, require
from leanml.errors import LeanmlError
from leanml.eval.config import Compute, ModelInput
from leanml.prune.engine.allocation import OwlOptions, check_profile
from leanml.prune.engine.walk import check_spec
from leanml.prune.masks import MaskSpec, parse_pattern
from leanml.prune.methods import available, pruner_class

__all__ = ["OwlOptions", "PruneConfig", "PruneJob"]


@dataclass(frozen=True)
class PruneConfig(Compute):
    """One pruning run of the layer-wise engine (the model and calibration ids are given apart)."""

    method: str = option("sparsegpt", "pruning method", form=Form(choices=tuple(available())))
    sparsity: float = option(default(0.5), "fraction of weights to remove, in (0, 1)")
    pattern: str | None = option(None, "N:M semi-structured pattern, e.g. 2:4 (it sets the sparsity: 1 - N/M; "
                                       "not with another sparsity)")
    scope: Literal["row", "layer"] | None = option(
        None, "unstructured mask: same count per output row, or one threshold per matrix (default: the method's)")
    sparsity_profile: str | tuple[float, ...] = option(
        "uniform", "per-layer sparsity of unstructured methods: uniform, or owl (outlier-weighted, Yin et al. "
        "2024; the total stays exact); from Python also one sparsity per decoder layer",
                                                       form=Form(choices=("uniform", "owl")))
    owl: OwlOptions = option(default_factory=OwlOptions, form=Form(prefix="owl-"))
    calib: str = option("shakespeare", "calibration corpus (shakespeare, a .txt, wikitext2, c4, ptb)")
    nsamples: int = option(64, "calibration windows", bounds=Bounds(ge=1))
    calib_samples: float = option(
        0.0, "share F in [0, 1] of the calibration windows sampled from the model itself (temperature 1, from its "
        "BOS token; self-generated calibration beside the calib corpus)", form=Form(metavar="F"),
                                  bounds=Bounds(ge=0, le=1))
    seed: int = option(0, "calibration sampling seed")
    mode: Literal["sequential", "dense"] = option(
        "sequential", "sequential: pruned outputs feed the next layer; dense: every layer sees dense inputs")
    intra_layer: bool | None = option(
        None, "intra-layer cumulative error correction: later groups of a layer see the pruned earlier ones "
        "(default: the method's; on for fista and structured methods; off, it gathers a layer's "
        "statistics in one pass of the dense layer, the default of magnitude, wanda, sparsegpt)")
    stream_device: Literal["auto", "device", "cpu"] = option(
        "auto", "where activations live between layers: auto (on the GPU while its free memory allows, else "
        "pinned host memory), device, or cpu")
    checkpoint_interval: float = option(
        0.0, "write the activation streams for resuming at most every SECONDS (0: after every layer); finished "
        "layers are always written; all writes run in the background", form=Form(metavar="SECONDS"),
                                        bounds=Bounds(ge=0))
    options: Any = option(None, "the method's options object (None: its defaults)", cli=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        cls = pruner_class(self.method)
        # a subclass of the method's options (FaspOptions for wanda-sp) would carry fields the method ignores
        extra = sorted({f.name for f in fields(type(self.options))} - {f.name for f in fields(cls.Options)}
                       if is_dataclass(self.options) else ())
        require(self, self.options is None or (isinstance(self.options, cls.Options) and not extra), "options",
                f"{self.method} takes {cls.Options.__name__}, got {type(self.options).__name__}"
                + (f" (whose {', '.join(extra)} {self.method} does not read)" if extra else ""))
        require(self, self.mode in ("sequential", "dense"), "mode", f"must be sequential or dense, got {self.mode!r}")
        check_spec(cls, self.spec)  # the engine's own checks, once (leanml.prune tells the engine they ran)
        if self.spec.pattern is not None:  # the pattern sets the sparsity: refuse another one given beside it
            n, m = self.spec.pattern
            require(self, not given(self.sparsity) or abs(self.sparsity - (1 - n / m)) < 1e-9, ("sparsity", "pattern"),
                    f"pattern {n}:{m} removes {1 - n / m:g} of the weights; sparsity {self.sparsity} conflicts with "
                    "it: drop one of them")
            require(self, self.scope is None, ("scope", "pattern"),
                    f"scope {self.scope} is for unstructured masks; pattern {n}:{m} keeps N of every M weights: "
                    "drop one of them")
        check_profile(self.sparsity_profile, self.spec, cls)

    @functools.cached_property
    def spec(self) -> MaskSpec:
        """The mask, its open scope resolved to the method's default (the one place a scope is chosen)."""
        try:
            pattern = parse_pattern(self.pattern)
        except LeanmlError as exc:
            raise ConfigError(str(exc), type(self)) from None  # quotes the pattern as the user wrote it
        return pruner_class(self.method).resolve_spec(MaskSpec(self.sparsity, pattern, self.scope))  # checks sparsity

    @property
    def profile_name(self) -> str:
        """``uniform``, ``owl`` or ``custom`` (one sparsity per layer)."""
        return self.sparsity_profile if isinstance(self.sparsity_profile, str) else "custom"

    @property
    def intra_layer_on(self) -> bool:
        """Intra-layer correction as asked, else the method's default."""
        return pruner_class(self.method).resolve_intra_layer(self.intra_layer)

    def engine_kwargs(self) -> dict[str, Any]:
        """The walk's settings as :func:`leanml.prune.engine.prune_model` takes them."""
        return {"sequential": self.mode == "sequential", "intra_layer": self.intra_layer,
                "batch_size": self.batch_size, "sparsity_profile": self.sparsity_profile,
                "owl": {"m": self.owl.m, "lam": self.owl.lam}, "stream_device": self.stream_device,
                "checkpoint_interval": self.checkpoint_interval}

    def method_options(self) -> Any:
        """The method's options: the given object, or the method's defaults."""
        return self.options if self.options is not None else pruner_class(self.method).Options()

    def pruner(self) -> Any:
        """A fresh pruner of ``method`` with these options."""
        return pruner_class(self.method)(self.method_options())


@dataclass(frozen=True, kw_only=True)
class PruneJob(ModelInput):
    """``leanml prune``: load ``model``, calibrate, prune with ``config``, evaluate, save to ``out``."""

    out: str = option(help="output directory (appears only when complete)")
    overwrite: bool = option(False, "replace an existing output directory")
    resume: bool = option(False, "continue from the per-layer checkpoint of an interrupted run")
    save_format: Literal["safetensors", "compressed"] = option(
        "safetensors", "safetensors (plain from_pretrained loads it) or compressed (sparse-bitmask layout that "
        "leanml reloads: a 50% model is 0.63x the dense directory; python -m leanml.models.compressed writes "
        "the dense copy other tools read)")
    eval: bool = option(True, "perplexity before and after (off: neither)")
    eval_data: str = option(default("shakespeare"), "corpus whose test split gives perplexity")
    eval_windows: int | None = option(None, "evaluate on the first N test windows (default all)",
                                      form=Form(show_default=False))
    stream: bool = option(False, "never hold the whole model: read each layer from the safetensors shards, write "
                                 "it pruned, free it (models bigger than memory; no perplexity)")
    max_memory: str | None = option(None, "streaming (implies stream): host-memory cap, e.g. 1.2GB; activations "
                                          "spill to disk above it",
                                    form=Form(metavar="SIZE", show_default=False))
    config: PruneConfig = option(default_factory=PruneConfig, form=Form(prefix=""))

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self, self.eval_windows is None or self.eval_windows >= 1, "eval_windows",
                f"must be at least 1, got {self.eval_windows}")
        require(self, self.eval_windows is None or (self.eval and not self.streamed),
                ("eval_windows", "eval", "stream"),
                "eval_windows sets the perplexity's windows, which stream and a run without eval skip: drop one of "
                "them")
        require(self, not given(self.eval_data) or (self.eval and not self.streamed), ("eval_data", "eval", "stream"),
                "eval_data sets the perplexity's corpus, which stream and a run without eval skip: drop one of them")
        if self.streamed:
            require(self, not self.config.calib_samples, ("calib_samples", "stream"),
                    "calib_samples samples from the whole model, which stream never holds; drop one of them")
            require(self, self.save_format == "safetensors", ("stream", "save_format"),
                    "stream writes safetensors shards; drop save_format compressed")
            require(self, self.config.stream_device == "auto" and self.config.checkpoint_interval == 0,
                    ("stream_device", "checkpoint_interval", "stream"),
                    "stream keeps its own activation streams (in memory, spilled to disk under a cap) and "
                    "checkpoints every layer; drop stream_device and checkpoint_interval")
            require(self, self.config.sparsity_profile != "owl", ("sparsity_profile", "stream"),
                    "sparsity_profile owl is not streamed (it needs a pass over the whole dense model first); "
                    "drop stream or use sparsity_profile uniform")

    @property
    def streamed(self) -> bool:
        """Whether the run reads the model layer by layer from its shards (``stream`` or a memory cap)."""
        return self.stream or self.max_memory is not None

    def fingerprint(self) -> dict[str, Any]:
        """What a checkpoint must match besides the engine's own settings."""
        c = self.config
        extra = {"stream": True} if self.streamed else {"calib_samples": c.calib_samples}
        return {"model": self.model, "calib": c.calib, "seed": c.seed, "seqlen": c.seqlen, "dtype": self.dtype,
                **extra}
