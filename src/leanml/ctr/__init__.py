"""Click-through-rate modelling: content IDs for new ads and CTR models.

Subpackages and modules (import them directly; this file imports nothing heavy):

- ``leanml.ctr.content_ids``: image/text encoders, the soft product quantizer, the text-supervised
  trainer and ``assign`` (visual IDs -> Parquet table for serving).
- ``leanml.ctr.models``: LR, DNN, DeepFM, DCNv2 over a dict of integer field tensors.
- ``leanml.ctr.metrics``: AUC, logloss, gAUC and their new-ad / old-ad splits.
- ``leanml.ctr.data``: Fashion-MNIST ads with a seeded click generator; MovieLens-100k clicks.
- ``leanml.ctr.train``: training loop and the end-to-end experiment used by the CLI and benchmark.
"""
