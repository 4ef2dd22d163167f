"""A batch of model inputs and the collate step that copies op outputs into it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from leanml.features.columns import Column, Gathered, Ragged, is_arrow


@dataclass
class FeatureBatch:
    """``label`` [n] float32, ``sparse`` [n, F] int64, ``dense`` [n, D] float32, ``seqs`` list of [n, L] int64."""

    label: torch.Tensor
    sparse: torch.Tensor
    dense: torch.Tensor
    seqs: list[torch.Tensor]

    def __len__(self) -> int:
        return int(self.label.shape[0])

    def to(self, device: torch.device | str) -> FeatureBatch:
        return FeatureBatch(self.label.to(device), self.sparse.to(device), self.dense.to(device),
                            [s.to(device) for s in self.seqs])

    def tensors(self) -> list[torch.Tensor]:
        return [self.label, self.sparse, self.dense, *self.seqs]

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
    """Copy (never alias) the output columns into fresh tensors, so the arena can be reset afterwards."""
    n = len(cols[label])
    lab = torch.from_numpy(_np(cols[label]).astype(np.float32, copy=True))
    sp = np.empty((n, len(sparse)), dtype=np.int64)
    for j, c in enumerate(sparse):
        sp[:, j] = _np(cols[c])
    de = np.empty((n, len(dense)), dtype=np.float32)
    for j, c in enumerate(dense):
        de[:, j] = _np(cols[c])
    seqs = []
    for c in sequence:
        col = cols[c]
        s = _np(col)
        fresh = isinstance(col, Gathered) and s.dtype == np.int64 and s.flags.c_contiguous and s.flags.writeable
        seqs.append(torch.from_numpy(s.reshape(n, -1) if fresh else np.array(s.reshape(n, -1), dtype=np.int64)))
    return FeatureBatch(lab, torch.from_numpy(sp), torch.from_numpy(de), seqs)
