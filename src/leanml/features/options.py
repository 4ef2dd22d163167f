"""FeatureBox options, each declared once: a frozen dataclass per concern, validated once when built.

The library takes them (``ExtractConfig(options=PipelineOptions(...))``, ``run_pipelined(cfg,
TrainOptions(...), ProducerOptions(...))``); the ``leanml features`` commands are generated from their
fields (:func:`leanml.flags.add_options`), one job dataclass per command. A refused value raises
:class:`leanml.config.ConfigError` naming the field; the command line shows the flag instead.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

from leanml.config import Form, option, require

Engine = Literal["arrow", "python"]  # log parsers: native, and the line-by-line reference
ENGINES: tuple[str, ...] = get_args(Engine)
Producer = Literal["thread", "process"]
PRODUCERS: tuple[str, ...] = get_args(Producer)
#: rows per chunk = rows per training batch, the default of every FeatureBox job and reader (the batch-size
#: sweep of bench/results/features.md)
BATCH_ROWS = 8192
#: the batches of the MovieLens-100k demo and of a DDP rank: a quarter, for more optimizer steps on small data
SMALL_BATCH_ROWS = BATCH_ROWS // 4


def _at_least_one(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        require(obj, value >= 1, name, f"{name} {value}: use a number >= 1")


@dataclass(frozen=True)
class PipelineOptions:
    """How a producer extracts: chunk size, threads, memory arena, reader engine, per-entity ops, placement."""

    batch_rows: int = option(BATCH_ROWS, "rows per chunk / training batch")
    threads: int = option(1, "threads for the CPU ops of one level")
    arena: bool = option(True, "reuse one memory arena per batch (off: plain allocation)")
    reader: Engine = option(
        "arrow", "log parser: arrow (native) or python (the line-by-line reference); same rows and quarantine "
                 "records")
    entity: bool = option(True, "run the ops of a joined table's features once per user/item "
                                "(off: every op per log row)")
    torch_threads: int = option(1, "torch threads of a producer worker process", cli=False)
    arena_bytes: int = option(8 << 20, "initial arena size in bytes", cli=False)
    device: str | None = option(None, "where GPU-capable ops run (default: CUDA when present)", cli=False)

    def __post_init__(self) -> None:
        _at_least_one(self, "batch_rows", "threads", "torch_threads", "arena_bytes")
        require(self, self.reader in ENGINES, "reader", f"must be one of {', '.join(ENGINES)}, got {self.reader!r}")


@dataclass(frozen=True)
class ProducerOptions:
    """Who extracts while training runs, and how far ahead."""

    producer: Producer = option(
        "process", "extraction in DataLoader worker processes feeding training through shared memory, or in "
                   "one thread of the training process")
    workers: int = option(1, "producer processes (on 2 cores one trains, one extracts)")
    prefetch: int = option(2, "batches made ahead per worker (thread producer: queue depth)")
    plans: bool = option(True, "build the embedding lookup plans in the producers (off: in the training "
                               "step, when extraction, not training, is the bottleneck)")

    def __post_init__(self) -> None:
        require(self, self.producer in PRODUCERS, "producer",
                f"must be {' or '.join(PRODUCERS)}, got {self.producer!r}")
        _at_least_one(self, "workers", "prefetch")


def parse_widths(spec: str) -> tuple[int, ...]:
    """``"128,64"`` -> ``(128, 64)`` (how the command line writes MLP widths)."""
    try:
        return tuple(int(h) for h in spec.split(",") if h.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{spec!r}: give MLP widths as positive integers separated by commas, "
                                         "e.g. 128,64") from None


@dataclass(frozen=True)
class TrainOptions:
    """The CTR model and its training: epochs, learning rate, embedding width, MLP widths, seed."""

    epochs: int = option(1, "passes over the data")
    lr: float = option(2e-3, "learning rate")
    dim: int = option(16, "embedding width")
    hidden: tuple[int, ...] = option((128, 64), "MLP widths, comma-separated", parse=parse_widths,
                                     form=Form(metavar="W,W"))
    seed: int = option(0, "seed of the model's initial weights")

    def __post_init__(self) -> None:
        _at_least_one(self, "epochs", "dim")
        require(self, self.lr > 0, "lr", f"lr {self.lr}: use a learning rate > 0")
        require(self, bool(self.hidden) and min(self.hidden) >= 1, "hidden",
                f"hidden {','.join(map(str, self.hidden))!r}: give MLP widths as positive integers separated by "
                "commas, e.g. 128,64")


# ------------------------------------------------------------------------------------- one per command
@dataclass(frozen=True)
class Inputs:
    """Where a job's logs and tables are."""

    graph: str = option("movielens", "YAML file or bundled graph name")
    log: tuple[str, ...] = option((), "log file: .tsv/.jsonl (optionally .gz) or .parquet; repeatable "
                                      "(default: MovieLens-100k train log)",
                                  form=Form(show_default=False, repeat=True))
    data_dir: str | None = option(None, "where the graph's relative table paths resolve (default: the first log's "
                                        "directory)")
    table: tuple[str, ...] = option((), "override a table path (a relative PATH is relative to the current "
                                        "directory); repeatable",
                                    form=Form(metavar="NAME=PATH", show_default=False, repeat=True))
    quarantine: str | None = option(None, "malformed-row file (default: <report or out>.quarantine.jsonl beside it)")

    def __post_init__(self) -> None:
        for item in self.table:
            name, sep, path = item.partition("=")
            require(self, bool(sep and name.strip() and path.strip()), "table",
                    f"table {item!r}: write it as NAME=PATH")

    @property
    def tables(self) -> dict[str, str]:
        """``table`` as ``{name: absolute path}`` (a relative path is taken from the current directory)."""
        pairs = (item.partition("=") for item in self.table)
        return {name.strip(): str(Path(path).expanduser().absolute()) for name, _, path in pairs}


@dataclass(frozen=True)
class PlanJob:
    """``leanml features plan``."""

    graph: str = option(help="YAML file or bundled graph name (movielens)", flag="graph")
    assume_cuda: bool = option(False, "plan as if a CUDA GPU were present")
    json: bool = option(False, "print the plan as JSON")


@dataclass(frozen=True)
class ExtractJob:
    """``leanml features extract``: the graph over logs into Parquet."""

    out: str = option(help="output directory")
    overwrite: bool = option(False, "replace an existing output directory")
    inputs: Inputs = option(default_factory=Inputs, form=Form(prefix=""))
    options: PipelineOptions = option(default_factory=PipelineOptions, form=Form(prefix=""))


@dataclass(frozen=True)
class TrainJob:
    """``leanml features train``: pipelined from logs, from Parquet features, or on Ray."""

    inputs: Inputs = option(default_factory=Inputs, form=Form(prefix=""))
    options: PipelineOptions = option(default_factory=PipelineOptions, form=Form(prefix=""))
    features: str | None = option(None, "train from this Parquet feature directory instead of logs")
    engine: Literal["local", "ray"] = option("local", "local pipeline or Ray Data")
    producer: ProducerOptions = option(default_factory=ProducerOptions, form=Form(prefix=""))
    train: TrainOptions = option(default_factory=TrainOptions, form=Form(prefix=""))
    train_threads: int = option(1, "torch threads for training (1: one core trains, the producer extracts)")
    test_log: tuple[str, ...] = option((), "log to evaluate AUC/logloss on; repeatable (default without a log: "
                                           "the MovieLens-100k test log)",
                                       form=Form(show_default=False, repeat=True))
    report: str | None = option(None, "JSON report path (default: <cache>/features/train_report.json)")

    def __post_init__(self) -> None:
        _at_least_one(self, "train_threads")
        require(self, not (self.features and self.inputs.log), ("features", "log"),
                "give either features (the Parquet of an extract run) or log, not both")
        require(self, not (self.features and self.engine == "ray"), ("engine", "features"),
                "engine ray reads logs; drop it with features")


@dataclass(frozen=True)
class GenerateJob:
    """``leanml features generate``: a seeded synthetic log with the MovieLens schema."""

    rows: int = option(help="impressions to write")
    out: str = option(help="output folder")
    seed: int = option(0, "seed of the generator")
    files: int = option(1, "log files the rows are spread over")
    gzip: bool = option(False, "gzip the logs")
    malformed_rate: float = option(0.0, "share of lines corrupted on purpose (for quarantine tests)")
    overwrite: bool = option(False, "replace an output folder that has files")

    def __post_init__(self) -> None:
        _at_least_one(self, "rows", "files")
        require(self, self.files <= self.rows, ("files", "rows"),
                f"files {self.files} is more than rows {self.rows}; use at most one file per row")
        require(self, 0 <= self.malformed_rate < 1, "malformed_rate",
                f"malformed_rate {self.malformed_rate}: use a share in [0, 1)")
