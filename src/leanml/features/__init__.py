"""FeatureBox: raw ad logs -> feature operators pipelined straight into CTR training.

Native (arrow) readers stream raw TSV / JSON-lines / Parquet logs in chunks (malformed rows go to a
quarantine file); an operator graph (declared in Python or YAML) is cut into topological levels and run
layer by layer, CPU ops in a thread pool and GPU ops on one CUDA stream, with a per-batch memory arena;
features of a joined user/item are computed once per entity and gathered per row. Finished batches
reach training from DataLoader worker processes through shared memory (or from a producer thread)
while the next batches are extracted; the CTR model looks all fields up in one fused embedding table.
The two-stage baseline (extract to Parquet, then train) runs the same graph for comparison, and the
same graph runs on Ray Data and feeds ``torchrun`` DDP training. See docs/features.md.
"""

from leanml.features.ops import (
    OPS,
    Bucketize,
    ContentIdLookup,
    Cross,
    DictJoin,
    Filter,
    Hash,
    LogTransform,
    Normalize,
    Op,
    Ragged,
    Split,
    TruncatePad,
)
from leanml.features.options import PipelineOptions, ProducerOptions, TrainOptions
from leanml.features.read.logschema import Quarantine, Schema
from leanml.features.read.readers import LogReader
from leanml.features.run.arena import Arena, NoArena
from leanml.features.run.batch import FeatureBatch
from leanml.features.run.extract import ExtractConfig, Extractor
from leanml.features.run.graph import FeatureGraph, OutputSpec, graph, load_graph
from leanml.features.run.producers import FeatureStream, Prefetcher
from leanml.features.run.scheduler import LayerwiseExecutor, Plan, make_plan
from leanml.features.train.model import CTROptimizer, FeatureDNN, FusedEmbedding, model_for_graph
from leanml.features.train.pipeline import run_pipelined
from leanml.features.train.twostage import extract_to_parquet, read_parquet_batches, run_two_stage

__all__ = [
    "OPS", "Arena", "Bucketize", "CTROptimizer", "ContentIdLookup", "Cross", "DictJoin", "ExtractConfig", "Extractor",
    "FeatureBatch", "FeatureDNN", "FeatureGraph", "FeatureStream", "FusedEmbedding", "Filter", "Hash", "LayerwiseExecutor", "LogReader", "LogTransform", "NoArena",
    "Normalize", "Op", "OutputSpec", "PipelineOptions", "Plan", "Prefetcher", "ProducerOptions", "Quarantine", "Ragged", "Schema", "Split",
    "TrainOptions", "TruncatePad", "extract_to_parquet", "graph", "load_graph", "make_plan", "model_for_graph", "read_parquet_batches",
    "run_pipelined", "run_two_stage",
]
