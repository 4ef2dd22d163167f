"""Click-through-rate modelling: content IDs for new ads and CTR models.

Subpackages and modules (import them directly; this file imports nothing heavy):

- ``leanml.ctr.content_ids``: image/text encoders, the soft product quantizer, the text-supervised
  trainer and ``assign`` (visual IDs -> Parquet table for serving).
- ``leanml.ctr.models``: LR, DNN, DeepFM, DCNv2 over a dict of integer field tensors.
- ``leanml.ctr.metrics``: AUC, logloss, gAUC and their new-ad / old-ad splits.
- ``leanml.ctr.data``: Fashion-MNIST ads with a seeded click generator; MovieLens-100k clicks.
- ``leanml.ctr.options``: :class:`CTRConfig`, the options of one CTR model's training.
- ``leanml.ctr.content``: content features of every ad (content IDs fitted on the old ads and cached, or
  read from a serving table).
- ``leanml.ctr.fields``: the model's input fields from a click log and the ads' content.
- ``leanml.ctr.train``: the training loop and :func:`run_ctr` (train, then evaluate on new / old ads).
- ``leanml.ctr.runs``: a trained run saved to and loaded from a folder.
- ``leanml.ctr.jobs``: the ``leanml ctr`` commands' options dataclasses and the functions that run them.
"""
