"""Visual IDs for serving: content -> ``M`` global IDs (``m * K + k``) -> a Parquet table.

Table schema (fixed; read by the feature pipeline's content-ID lookup):

- column ``ad_id``: int64
- column ``visual_ids``: list<int64>, length ``M``, global id ``m * K + k``
- file-level key-value metadata ``M`` and ``K`` (strings)

Files are written atomically (temp file in the same folder, then rename).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from leanml.ctr.content_ids.quantizer import global_ids
from leanml.ctr.content_ids.trainer import ContentIDModel, embed_all
from leanml.utils import LeanmlError, atomic_file


def assign_visual_ids(model: ContentIDModel, inputs: torch.Tensor, batch_size: int = 1024) -> np.ndarray:
    """Global visual IDs ``(N, M)`` int64 for ``inputs`` (hard nearest codeword per sub-space)."""
    _, codes = embed_all(model, inputs, batch_size)
    return np.asarray(global_ids(codes, model.config.k), dtype=np.int64)


def visual_ids_table(ad_ids: np.ndarray, visual_ids: np.ndarray, m: int, k: int) -> pa.Table:
    """The serving table with the fixed schema (see module docstring)."""
    ad_ids = np.asarray(ad_ids, dtype=np.int64)
    visual_ids = np.asarray(visual_ids, dtype=np.int64)
    if visual_ids.ndim != 2 or visual_ids.shape != (len(ad_ids), m):
        raise LeanmlError(f"visual_ids must be (n_ads, M)=({len(ad_ids)}, {m}), got {visual_ids.shape}")
    if len(np.unique(ad_ids)) != len(ad_ids):
        raise LeanmlError("ad ids are not unique; each ad needs exactly one row")
    if visual_ids.size and (visual_ids.min() < 0 or visual_ids.max() >= m * k):
        raise LeanmlError(f"visual ids must lie in [0, M*K)=[0, {m * k})")
    flat = pa.array(visual_ids.ravel(), type=pa.int64())
    offsets = pa.array(np.arange(0, visual_ids.size + 1, m, dtype=np.int32))
    lists = pa.ListArray.from_arrays(offsets, flat, type=pa.list_(pa.int64()))
    schema = pa.schema([("ad_id", pa.int64()), ("visual_ids", pa.list_(pa.int64()))],
                       metadata={"M": str(m), "K": str(k)})
    return pa.Table.from_arrays([pa.array(ad_ids, type=pa.int64()), lists], schema=schema)


def write_visual_ids(path: str | os.PathLike, ad_ids: np.ndarray, visual_ids: np.ndarray, m: int, k: int) -> Path:
    """Write the serving table to ``path`` atomically."""
    path = Path(path)
    table = visual_ids_table(ad_ids, visual_ids, m, k)
    with atomic_file(path) as tmp:
        pq.write_table(table, tmp)
    return path


def read_visual_ids(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray, int, int]:
    """``(ad_ids (N,), visual_ids (N, M), M, K)`` from a table written by :func:`write_visual_ids`."""
    path = Path(path)
    if not path.exists():
        raise LeanmlError(f"visual-ID table {path} does not exist; create it with `leanml ctr content-ids assign`")
    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise LeanmlError(f"{path} is not a readable Parquet file ({exc})") from exc
    meta = table.schema.metadata or {}
    if b"M" not in meta or b"K" not in meta or not {"ad_id", "visual_ids"} <= set(table.column_names):
        raise LeanmlError(f"{path} lacks columns ad_id, visual_ids or metadata M, K; re-export it with `assign`")
    m, k = int(meta[b"M"]), int(meta[b"K"])
    ad_ids = table.column("ad_id").to_numpy()
    lists = table.column("visual_ids").combine_chunks()
    vis = lists.flatten().to_numpy(zero_copy_only=False).reshape(-1, m) if len(lists) else np.zeros((0, m), np.int64)
    return ad_ids.astype(np.int64), vis.astype(np.int64), m, k


def lookup_visual_ids(table_ad_ids: np.ndarray, table_ids: np.ndarray, ad_ids: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray]:
    """Visual IDs ``(N, M)`` for ``ad_ids`` and a bool mask of ads missing from the table (rows of -1)."""
    order = np.argsort(table_ad_ids)
    sorted_ids = table_ad_ids[order]
    pos = np.searchsorted(sorted_ids, ad_ids).clip(0, max(len(sorted_ids) - 1, 0))
    found = (sorted_ids[pos] == ad_ids) if len(sorted_ids) else np.zeros(len(ad_ids), dtype=bool)
    out = np.full((len(ad_ids), table_ids.shape[1]), -1, dtype=np.int64)
    out[found] = table_ids[order[pos[found]]]
    return out, ~found
