"""Running a feature graph: the graph itself (``graph``), its layer-wise scheduler and memory arena, the
extractor that turns log chunks into :class:`~leanml.features.run.batch.FeatureBatch` es (``extract``) and
the producers (threads, processes, shared-memory rings) that run it beside training."""
