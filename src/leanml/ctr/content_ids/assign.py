"""Content IDs for serving: content -> ``M`` codes in ``[0, K)`` -> the Parquet serving table.

The table format is defined once, in :mod:`leanml.ctr.content_ids.schema` (columns ``ad_id`` and
``visual_ids``, metadata ``M``, ``K``, ``codebook``, ``schema``); FeatureBox's ``content_ids`` op reads
the same module. Files are written atomically.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from leanml.ctr.content_ids.schema import ContentIdTable, read_table, write_table
from leanml.ctr.content_ids.trainer import ContentIDModel, embed_all


def assign_visual_ids(model: ContentIDModel, inputs: torch.Tensor, batch_size: int = 1024) -> np.ndarray:
    """Codes ``(N, M)`` int64 in ``[0, K)`` for ``inputs`` (hard nearest codeword per sub-space / level)."""
    _, codes = embed_all(model, inputs, batch_size)
    return np.asarray(codes, dtype=np.int64)


def write_visual_ids(path: str | os.PathLike, ad_ids: np.ndarray, codes: np.ndarray, k: int,
                     codebook: str = "pq") -> Path:
    """Write the serving table (see :mod:`~leanml.ctr.content_ids.schema`) to ``path`` atomically."""
    return write_table(path, ad_ids, codes, k, codebook)


def read_visual_ids(path: str | os.PathLike, on_empty: str = "error") -> ContentIdTable:
    """Read and validate a serving table written by :func:`write_visual_ids`."""
    return read_table(path, on_empty=on_empty)
