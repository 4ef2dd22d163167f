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

from leanml.lazy import lazy_exports

#: the operators and their column types, re-exported from :mod:`leanml.features.ops`
_OPS = ("OPS", "Op", "Ragged", "Bucketize", "ContentIdLookup", "Cross", "DictJoin", "Filter", "Hash", "LogTransform",
        "Normalize", "Split", "TruncatePad")
__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "leanml.features.ops": _OPS,
    "leanml.features.options": ("PipelineOptions", "ProducerOptions", "TrainOptions"),
    "leanml.features.read.logschema": ("Quarantine", "Schema"),
    "leanml.features.read.readers": ("LogReader",),
    "leanml.features.run.arena": ("Arena", "NoArena"),
    "leanml.features.run.batch": ("FeatureBatch",),
    "leanml.features.run.extract": ("ExtractConfig", "Extractor"),
    "leanml.features.run.graph": ("FeatureGraph", "OutputSpec", "graph", "load_graph"),
    "leanml.features.run.producers": ("FeatureStream", "Prefetcher"),
    "leanml.features.run.scheduler": ("LayerwiseExecutor", "Plan", "make_plan"),
    "leanml.features.train.model": ("CTROptimizer", "FeatureDNN", "FusedEmbedding", "model_for_graph"),
    "leanml.features.train.pipeline": ("run_pipelined",),
    "leanml.features.train.twostage": ("extract_to_parquet", "read_parquet_batches", "run_two_stage"),
})
