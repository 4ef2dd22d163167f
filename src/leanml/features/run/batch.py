"""A batch of model inputs and the collate step that copies op outputs into it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from leanml.features.ops.columns import Column, Gathered, Ragged, is_arrow


@dataclass
class FeatureBatch:
    """``label`` [n] float32, ``sparse`` [n, F] int64, ``dense`` [n, D] float32, ``seqs`` list of [n, L] int64;
    ``plan``: the ids' :class:`~leanml.features.train.lookup.LookupPlan` when a producer built it (else None)."""

    label: torch.Tensor
    sparse: torch.Tensor
    dense: torch.Tensor
    seqs: list[torch.Tensor]
    plan: Any = None

    def __len__(self) -> int:
        return int(self.label.shape[0])

    def to(self, device: torch.device | str) -> FeatureBatch:
        return FeatureBatch(self.label.to(device), self.sparse.to(device), self.dense.to(device),
                            [s.to(device) for s in self.seqs], None if self.plan is None else self.plan.to(device))

    def pin_memory(self) -> FeatureBatch:
        """Page-locked copies (what ``DataLoader(pin_memory=True)`` calls), the lookup plan included."""
        ids = self.ids().pin_memory()
        b = split_ids(self.label.pin_memory(), ids, self.dense.pin_memory(), [s.shape[1] for s in self.seqs])
        b.plan = None if self.plan is None else self.plan.pin_memory()
        return b

    def layout(self) -> tuple[int, ...]:
        """``(sparse fields, *sequence widths)``: how the columns of :meth:`ids` are laid out."""
        return (self.sparse.shape[1], *(s.shape[1] for s in self.seqs))

    def tensors(self) -> list[torch.Tensor]:
        return [self.label, self.sparse, self.dense, *self.seqs]

    def ids(self) -> torch.Tensor:
        """``[n, F + sum(L)]``: the sparse ids then every sequence, side by side. Free (a view) when the batch
        is packed (:meth:`packed`: what collate and the Parquet reader build), a copy otherwise."""
        parts = [self.sparse, *self.seqs]
        n, width = self.sparse.shape[0], sum(p.shape[1] for p in parts)
        first = self.sparse
        if (all(p.dtype == first.dtype and p.device == first.device for p in parts)
                and all(p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() for p in parts)
                and all(n < 2 or p.stride() == (width, 1) for p in parts)):
            off, ok = first.storage_offset(), True
            for p in parts:
                ok = ok and p.storage_offset() == off
                off += p.shape[1]
            if ok and (first.storage_offset() + n * width) * first.element_size() <= first.untyped_storage().nbytes():
                return first.as_strided((n, width), (width, 1), first.storage_offset())
        return torch.cat(parts, 1) if self.seqs else self.sparse

    def packed(self) -> FeatureBatch:
        """The same batch with sparse ids and sequences as views of one ``[n, F + sum(L)]`` int64 buffer
        (one tensor to share between processes, no concatenation in the model)."""
        ids = torch.cat([self.sparse.long(), *(s.long() for s in self.seqs)], 1)
        b = split_ids(self.label, ids, self.dense, [s.shape[1] for s in self.seqs])
        b.plan = self.plan
        return b

    @staticmethod
    def concat(batches: list[FeatureBatch]) -> FeatureBatch:
        if not batches:
            raise ValueError("no batches")
        return FeatureBatch(
            torch.cat([b.label for b in batches]), torch.cat([b.sparse for b in batches]),
            torch.cat([b.dense for b in batches]),
            [torch.cat([b.seqs[i] for b in batches]) for i in range(len(batches[0].seqs))],
        )

    def equal(self, other: FeatureBatch) -> bool:
        a, b = self.tensors(), other.tensors()
        return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def split_ids(label: torch.Tensor, ids: torch.Tensor, dense: torch.Tensor, widths: list[int]) -> FeatureBatch:
    f = ids.shape[1] - sum(widths)
    seqs, start = [], f
    for w in widths:
        seqs.append(ids[:, start : start + w])
        start += w
    return FeatureBatch(label, ids[:, :f], dense, seqs)


def _np(col: Column) -> np.ndarray:
    if isinstance(col, Gathered):
        return _np(col.entity.values)[col.index]
    if isinstance(col, Ragged):
        raise TypeError("a list column cannot be a model input; truncate_pad it first")
    if is_arrow(col):
        raise TypeError("a string column cannot be a model input; hash it first")
    if isinstance(col, torch.Tensor):
        return col.detach().cpu().numpy()
    if col.dtype == object:
        raise TypeError("a string column cannot be a model input; hash it first")
    return col


def collate(cols: dict[str, Column], label: str, sparse: list[str], dense: list[str],
            sequence: list[str]) -> FeatureBatch:
    """Copy (never alias) the output columns into fresh tensors, so the arena can be reset afterwards.

    The batch comes out packed: sparse ids and sequences are views of one int64 buffer (see
    :meth:`FeatureBatch.packed`)."""
    n = len(cols[label])
    lab = torch.from_numpy(_np(cols[label]).astype(np.float32, copy=True))
    seq_cols = [_np(cols[c]) for c in sequence]
    widths = [int(np.prod(s.shape[1:])) if s.ndim > 1 else 1 for s in seq_cols]
    ids = np.empty((n, len(sparse) + sum(widths)), dtype=np.int64)
    for j, c in enumerate(sparse):
        ids[:, j] = _np(cols[c])
    start = len(sparse)
    for s, w in zip(seq_cols, widths):
        ids[:, start : start + w] = s.reshape(n, w)
        start += w
    de = np.empty((n, len(dense)), dtype=np.float32)
    for j, c in enumerate(dense):
        de[:, j] = _np(cols[c])
    return split_ids(lab, torch.from_numpy(ids), torch.from_numpy(de), widths)
