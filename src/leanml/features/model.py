"""A small CTR model over FeatureBox batches: per-field embeddings, mean-pooled sequences, an MLP.

Embedding tables use sparse gradients (only the rows a batch touches are updated, by ``SparseAdam``),
as CTR trainers do: a dense Adam step over every hashed bucket would dominate the step time.
"""

from __future__ import annotations

import torch
from torch import nn

from leanml.features.batch import FeatureBatch
from leanml.features.graph import FeatureGraph
from leanml.utils import LeanmlError


class FeatureDNN(nn.Module):
    """Embeds each sparse field (its own table), mean-pools each sequence (ids < 0 are padding),
    concatenates the dense floats and runs an MLP to one logit.

    >>> m = FeatureDNN([10, 5], [100], n_dense=2, dim=4, hidden=(8,))
    >>> b = FeatureBatch(torch.zeros(3), torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 2),
    ...                  [torch.full((3, 4), -1)])
    >>> m(b).shape
    torch.Size([3])
    """

    def __init__(self, sparse_sizes: list[int], seq_sizes: list[int], n_dense: int, dim: int = 16,
                 hidden: tuple[int, ...] = (128, 64), sparse_grad: bool = True) -> None:
        super().__init__()
        self.sparse = nn.ModuleList(nn.Embedding(n, dim, sparse=sparse_grad) for n in sparse_sizes)
        self.seq = nn.ModuleList(nn.Embedding(n, dim, sparse=sparse_grad) for n in seq_sizes)
        width = dim * (len(sparse_sizes) + len(seq_sizes)) + n_dense
        layers: list[nn.Module] = []
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, 1))
        self.mlp = nn.Sequential(*layers)
        for e in [*self.sparse, *self.seq]:
            nn.init.normal_(e.weight, std=0.05)

    def forward(self, batch: FeatureBatch) -> torch.Tensor:
        parts = [emb(batch.sparse[:, j]) for j, emb in enumerate(self.sparse)]
        for ids, emb in zip(batch.seqs, self.seq):
            mask = (ids >= 0).unsqueeze(-1).to(torch.float32)
            pooled = (emb(ids.clamp_min(0)) * mask).sum(1) / mask.sum(1).clamp_min(1.0)
            parts.append(pooled)
        parts.append(batch.dense)
        return self.mlp(torch.cat(parts, dim=1)).squeeze(-1)


class CTROptimizer:
    """``SparseAdam`` for the embedding tables, ``Adam`` for the MLP, driven as one optimizer."""

    def __init__(self, model: nn.Module, lr: float = 1e-3) -> None:
        sparse = [p for m in model.modules() if isinstance(m, nn.Embedding) and m.sparse for p in m.parameters()]
        ids = {id(p) for p in sparse}
        dense = [p for p in model.parameters() if id(p) not in ids]
        self.opts: list[torch.optim.Optimizer] = []
        if sparse:
            self.opts.append(torch.optim.SparseAdam(sparse, lr=lr))
        if dense:
            self.opts.append(torch.optim.Adam(dense, lr=lr))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.opts:
            o.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for o in self.opts:
            o.step()


def model_for_graph(graph: FeatureGraph, dim: int = 16, hidden: tuple[int, ...] = (128, 64),
                    cardinalities: dict[str, int] | None = None, sparse_grad: bool = True) -> FeatureDNN:
    """A :class:`FeatureDNN` sized from the graph's output cardinalities (hash buckets, bucket counts)."""
    cards = dict(cardinalities or {})

    def size(col: str) -> int:
        n = cards.get(col) or graph.cardinality(col)
        if not n:
            raise LeanmlError(f"output {col!r} has no known number of ids; give its hash op `buckets:` "
                              "(or pass cardinalities)")
        return int(n)

    o = graph.outputs
    return FeatureDNN([size(c) for c in o.sparse], [size(c) for c in o.sequence], len(o.dense), dim, hidden,
                      sparse_grad=sparse_grad)
