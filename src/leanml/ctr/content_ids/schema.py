"""The content-ID serving table: ONE contract for the writer (``leanml ctr content-ids assign``) and
every reader (``leanml ctr train --visual-ids``, FeatureBox's ``content_ids`` op).

This module depends only on NumPy, pyarrow, ``leanml.errors`` and ``leanml.outputs`` (no torch model code), so
FeatureBox imports it without pulling in the CTR models.

A Parquet file with

================  =========================  ==============================================================
column / key      type                       meaning
================  =========================  ==============================================================
``ad_id``         int64, unique, not null    the ad
``visual_ids``    list<int64> of length M    the ad's codes; position ``m`` is sub-space ``m`` (``pq``) or
                                             level ``m`` (``rq``, coarse to fine); each code in ``[0, K)``
metadata ``M``    decimal string             codes per ad
metadata ``K``    decimal string             codewords per position (codes lie in ``[0, K)``)
metadata          ``"pq"`` or ``"rq"``       how the codes were made (``rq``: a prefix names a cluster)
``codebook``
metadata          ``"leanml.content_ids/2"``  this contract's version
``schema``
================  =========================  ==============================================================

Codes are *local* (``[0, K)`` at every position). A consumer that wants one shared embedding table
computes ``m * K + k`` itself (:func:`global_ids`); one with a table per position uses the codes as they
are. Readers accept any integer list type (list, large_list, fixed_size_list).

Bad tables fail with one line naming the file and the first offending ad: metadata missing or not an
integer, ``M``/``K`` other than the caller expects, a list of the wrong length, a code outside
``[0, K)`` (tables of the first format, which stored global ids ``m * K + k``, are recognised and named
as such), a duplicate or null ``ad_id``. An ad whose ``visual_ids`` is null or empty has no IDs: an
error naming it, or with ``on_empty="skip"`` the row is dropped and counted in
:attr:`ContentIdTable.skipped`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from leanml.errors import LeanmlError
from leanml.outputs import atomic_file

SCHEMA_VERSION = "leanml.content_ids/2"
AD_ID = "ad_id"
CODES = "visual_ids"
CODEBOOKS = ("pq", "rq")
FIX = "re-export it with `leanml ctr content-ids assign`"


def global_ids(codes: np.ndarray, k: int) -> np.ndarray:
    """Local codes ``(N, M)`` in ``[0, K)`` -> ids ``m * K + k`` unique across positions (one shared table)."""
    codes = np.asarray(codes)
    return codes + np.arange(codes.shape[1], dtype=codes.dtype) * k


@dataclass
class ContentIdTable:
    """A validated serving table: ``ad_ids (N,)``, local ``codes (N, M)`` in ``[0, K)``."""

    ad_ids: np.ndarray
    codes: np.ndarray
    m: int
    k: int
    codebook: str = "pq"
    path: str = ""
    skipped: list[int] = field(default_factory=list)  # ads dropped for having no IDs (on_empty="skip")
    _sorted: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False, compare=False)

    def lookup(self, ad_ids: np.ndarray, on_missing: str = "unknown") -> tuple[np.ndarray, np.ndarray]:
        """Codes ``(n, M)`` of ``ad_ids`` and a bool mask of ads absent from the table.

        Absent ads get code ``K`` at every position (``on_missing="unknown"``, one extra row per
        position) or raise an error naming the first one (``on_missing="error"``).
        """
        if on_missing not in ("unknown", "error"):
            raise LeanmlError(f"on_missing={on_missing!r}; use 'unknown' or 'error'")
        ad_ids = np.asarray(ad_ids, dtype=np.int64)
        if self._sorted is None:
            order = np.argsort(self.ad_ids, kind="stable")
            self._sorted = (order, self.ad_ids[order])
        order, sorted_ids = self._sorted
        pos = np.searchsorted(sorted_ids, ad_ids).clip(0, max(len(sorted_ids) - 1, 0))
        found = sorted_ids[pos] == ad_ids if len(sorted_ids) else np.zeros(len(ad_ids), dtype=bool)
        if on_missing == "error" and not found.all():
            first = int(ad_ids[~found][0])
            raise LeanmlError(f"ad {first} has no content IDs in {self.path or 'the table'} "
                              f"({int((~found).sum())} rows without IDs); run `assign` on every ad")
        out = np.full((len(ad_ids), self.m), self.k, dtype=np.int64)
        out[found] = self.codes[order[pos[found]]]
        return out, ~found


def _check_codes(ad_ids: np.ndarray, codes: np.ndarray, m: int, k: int, where: str) -> None:
    if codes.ndim != 2 or codes.shape != (len(ad_ids), m):
        raise LeanmlError(f"{where}: codes must be (n_ads, M)=({len(ad_ids)}, {m}), got {codes.shape}")
    if not codes.size:
        return
    bad = (codes < 0) | (codes >= k)
    if bad.any():
        row, pos = (int(v) for v in np.argwhere(bad)[0])
        legacy = (codes.min() >= 0 and codes.max() < m * k
                  and ((codes // k) == np.arange(m)).all())
        hint = (" (these look like global ids m*K+k of the first table format)" if legacy else "")
        raise LeanmlError(f"{where}: ad {int(ad_ids[row])} has code {int(codes[row, pos])} at position {pos}, "
                          f"outside [0, K={k}){hint}; {FIX}")


def to_arrow(ad_ids: np.ndarray, codes: np.ndarray, k: int, codebook: str = "pq") -> pa.Table:
    """The serving table for local ``codes (N, M)`` in ``[0, K)``; validates before building."""
    ad_ids = np.asarray(ad_ids, dtype=np.int64).ravel()
    codes = np.asarray(codes, dtype=np.int64)
    if codes.ndim != 2:
        raise LeanmlError(f"codes must be a (n_ads, M) matrix, got shape {codes.shape}")
    m = codes.shape[1]
    if m < 1 or k < 2:
        raise LeanmlError(f"a content-ID table needs M >= 1 and K >= 2 (got M={m}, K={k})")
    if codebook not in CODEBOOKS:
        raise LeanmlError(f"codebook {codebook!r}: use one of {CODEBOOKS}")
    _check_codes(ad_ids, codes, m, k, "content-ID table")
    uniq, counts = np.unique(ad_ids, return_counts=True)
    if (counts > 1).any():
        raise LeanmlError(f"ad {int(uniq[counts > 1][0])} appears twice; each ad needs exactly one row")
    offsets = pa.array(np.arange(0, codes.size + 1, m, dtype=np.int32))
    lists = pa.ListArray.from_arrays(offsets, pa.array(codes.ravel(), type=pa.int64()), type=pa.list_(pa.int64()))
    meta = {"M": str(m), "K": str(k), "codebook": codebook, "schema": SCHEMA_VERSION}
    schema = pa.schema([(AD_ID, pa.int64()), (CODES, pa.list_(pa.int64()))], metadata=meta)
    return pa.Table.from_arrays([pa.array(ad_ids, type=pa.int64()), lists], schema=schema)


def write_table(path: str | os.PathLike, ad_ids: np.ndarray, codes: np.ndarray, k: int, codebook: str = "pq") -> Path:
    """Write the serving table to ``path`` atomically (temp file in the same folder, then rename)."""
    path = Path(path)
    table = to_arrow(ad_ids, codes, k, codebook)
    with atomic_file(path) as tmp:
        pq.write_table(table, tmp)
    return path


def read_table(path: str | os.PathLike, m: int | None = None, k: int | None = None,
               on_empty: str = "error") -> ContentIdTable:
    """Read and validate a serving table; ``m`` / ``k``, when given, must match the table's metadata.

    ``on_empty``: an ad with a null or empty ``visual_ids`` raises (``"error"``) or is dropped and
    listed in ``skipped`` (``"skip"``).
    """
    if on_empty not in ("error", "skip"):
        raise LeanmlError(f"on_empty={on_empty!r}; use 'error' or 'skip'")
    path = Path(path)
    where = f"content-ID table {path}"
    if not path.exists():
        raise LeanmlError(f"{where} does not exist; create it with `leanml ctr content-ids assign`")
    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise LeanmlError(f"{where} is not readable Parquet ({exc}); {FIX}") from exc
    meta = {a.decode(): b.decode() for a, b in (table.schema.metadata or {}).items()}
    for key in ("M", "K"):
        if not meta.get(key, "").strip().isdigit():
            raise LeanmlError(f"{where}: metadata key {key!r} missing or not an integer; {FIX}")
    tm, tk = int(meta["M"]), int(meta["K"])
    codebook = meta.get("codebook", "pq")
    if tm < 1 or tk < 2:
        raise LeanmlError(f"{where}: metadata M={tm}, K={tk}; a table needs M >= 1 and K >= 2; {FIX}")
    if m is not None and tm != m:
        raise LeanmlError(f"{where} has M={tm} codes per ad but {m} are expected; use a table made by the "
                          f"same content-ID model, or set m: {tm}")
    if k is not None and tk != k:
        raise LeanmlError(f"{where} has K={tk} codewords but K={k} is expected; use a table made by the "
                          f"same content-ID model, or set k: {tk}")
    schema = table.schema
    if AD_ID not in schema.names or not pa.types.is_integer(schema.field(AD_ID).type):
        raise LeanmlError(f"{where}: needs an integer column {AD_ID!r}; {FIX}")
    t = schema.field(CODES).type if CODES in schema.names else None
    if t is None or not (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)) \
            or not pa.types.is_integer(t.value_type):
        raise LeanmlError(f"{where}: needs a column {CODES!r} of integer lists; {FIX}")
    ids_col = table.column(AD_ID).combine_chunks()
    if ids_col.null_count:
        raise LeanmlError(f"{where}: {ids_col.null_count} rows have no ad_id; {FIX}")
    ad_ids = np.asarray(ids_col.to_numpy(zero_copy_only=False), dtype=np.int64)
    col = table.column(CODES).combine_chunks()
    if pa.types.is_fixed_size_list(t):
        lengths = np.full(len(col), t.list_size, dtype=np.int64)
    else:
        lengths = np.asarray(col.value_lengths().fill_null(0), dtype=np.int64)
    valid = np.asarray(col.is_valid(), dtype=bool) & (lengths > 0)
    skipped: list[int] = []
    if not valid.all():
        if on_empty == "error":
            raise LeanmlError(f"{where}: ad {int(ad_ids[~valid][0])} has no content IDs (null or empty list; "
                              f"{int((~valid).sum())} such ads); {FIX}, or skip such ads (on_empty='skip')")
        skipped = [int(a) for a in ad_ids[~valid]]
    wrong = valid & (lengths != tm)
    if wrong.any():
        i = int(np.flatnonzero(wrong)[0])
        raise LeanmlError(f"{where}: ad {int(ad_ids[i])} has {int(lengths[i])} codes but metadata says M={tm}; {FIX}")
    col = col.filter(pa.array(valid)) if not valid.all() else col
    ad_ids = ad_ids[valid]
    codes = np.asarray(col.flatten().to_numpy(zero_copy_only=False), dtype=np.int64).reshape(len(ad_ids), tm)
    _check_codes(ad_ids, codes, tm, tk, where)
    uniq, counts = np.unique(ad_ids, return_counts=True)
    if (counts > 1).any():
        raise LeanmlError(f"{where}: ad {int(uniq[counts > 1][0])} has more than one row; {FIX}")
    return ContentIdTable(ad_ids, codes, tm, tk, codebook, str(path), skipped)
