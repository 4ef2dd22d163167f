"""CTR models over named sparse fields: LR, DNN, DeepFM and DCNv2.

Interface (shared by every model)::

    fields = [FieldSpec("user", 1000), FieldSpec("ad", 3001), FieldSpec("context", 4),
              FieldSpec("visual", 64, bag=True)]          # a bag field: (B, L) ids, mean-pooled
    model = build_model("deepfm", fields, dense_dims={"raw": 32}, embed_dim=16)
    logits = model({"user": u, "ad": a, "context": c, "visual": v}, {"raw": x})   # (B,) logits

- Single fields take ``(B,)`` int64 ids in ``[0, vocab)``; bag fields take ``(B, L)`` ids (padding with
  ``-1`` is ignored) and are mean-pooled into one field embedding (``nn.EmbeddingBag``).
- Dense inputs ``(B, d)`` go through a small MLP to one field embedding each (e.g. a raw image vector).
- Every field embedding has ``embed_dim`` dims; first-order weights are 1-dim embeddings.
- Wrong field names or shapes raise ``ValueError`` naming the field and the expected shape.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from leanml.errors import LeanmlError


@dataclass(frozen=True)
class FieldSpec:
    """A categorical field: ``name``, ``vocab`` size and whether it is a pooled bag of ids."""

    name: str
    vocab: int
    bag: bool = False


def mlp(in_dim: int, hidden: Sequence[int], dropout: float = 0.0) -> nn.Sequential:
    layers: list[nn.Module] = []
    for h in hidden:
        layers += [nn.Linear(in_dim, h), nn.ReLU()]
        if dropout:
            layers.append(nn.Dropout(dropout))
        in_dim = h
    return nn.Sequential(*layers)


class FieldEmbeddings(nn.Module):
    """Embeds every sparse field (and projects every dense input) to ``(B, F, embed_dim)``; optionally
    also returns first-order terms ``(B,)``."""

    def __init__(self, fields: Sequence[FieldSpec], dense_dims: Mapping[str, int], embed_dim: int,
                 first_order: bool = False, init_std: float = 0.05) -> None:
        super().__init__()
        if not fields and not dense_dims:
            raise LeanmlError("a CTR model needs at least one field")
        names = [f.name for f in fields] + list(dense_dims)
        if len(set(names)) != len(names):
            raise LeanmlError(f"duplicate field names in {names}")
        self.fields = list(fields)
        self.dense_names = list(dense_dims)
        self.embed_dim = embed_dim
        self.emb = nn.ModuleDict()
        self.lin = nn.ModuleDict()
        for f in self.fields:
            if f.vocab < 1:
                raise LeanmlError(f"field {f.name!r} has vocab {f.vocab}; it must be >= 1")
            self.emb[f.name] = nn.EmbeddingBag(f.vocab, embed_dim, mode="mean", padding_idx=None) if f.bag \
                else nn.Embedding(f.vocab, embed_dim)
            nn.init.normal_(self.emb[f.name].weight, std=init_std)
            if first_order:
                self.lin[f.name] = nn.EmbeddingBag(f.vocab, 1, mode="mean") if f.bag else nn.Embedding(f.vocab, 1)
                nn.init.zeros_(self.lin[f.name].weight)
        self.dense = nn.ModuleDict({n: nn.Sequential(nn.Linear(d, 64), nn.ReLU(), nn.Linear(64, embed_dim))
                                    for n, d in dense_dims.items()})
        self.dense_lin = nn.ModuleDict({n: nn.Linear(d, 1) for n, d in dense_dims.items()}) if first_order else None

    @property
    def num_fields(self) -> int:
        return len(self.fields) + len(self.dense_names)

    @staticmethod
    def _bag(table: nn.EmbeddingBag, ids: torch.Tensor) -> torch.Tensor:
        mask = ids >= 0
        flat = ids[mask]
        offsets = torch.zeros(ids.shape[0], dtype=torch.long, device=ids.device)
        offsets[1:] = mask.sum(1).cumsum(0)[:-1]
        return table(flat, offsets)

    def _lookup(self, f: FieldSpec, ids: torch.Tensor, table: nn.Module) -> torch.Tensor:
        if f.bag:
            if ids.dim() != 2:
                raise ValueError(f"bag field {f.name!r} expects (B, L) ids, got shape {tuple(ids.shape)}")
            return self._bag(table, ids)
        if ids.dim() != 1:
            raise ValueError(f"field {f.name!r} expects (B,) ids, got shape {tuple(ids.shape)}")
        return table(ids)

    def forward(self, sparse: Mapping[str, torch.Tensor], dense: Mapping[str, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        dense = dense or {}
        missing = ([f.name for f in self.fields if f.name not in sparse]
                   + [n for n in self.dense_names if n not in dense])
        if missing:
            raise ValueError(f"missing inputs for fields {missing}")
        vecs = [self._lookup(f, sparse[f.name], self.emb[f.name]) for f in self.fields]
        vecs += [self.dense[n](dense[n].float()) for n in self.dense_names]
        emb = torch.stack(vecs, 1)
        first = None
        if self.lin:
            terms = [self._lookup(f, sparse[f.name], self.lin[f.name]).squeeze(-1) for f in self.fields]
            assert self.dense_lin is not None
            terms += [self.dense_lin[n](dense[n].float()).squeeze(-1) for n in self.dense_names]
            first = torch.stack(terms, 1).sum(1)
        return emb, first


class CTRModel(nn.Module):
    """Base class: ``forward(sparse, dense=None) -> logits (B,)``; ``predict_proba`` gives probabilities."""

    def __init__(self, fields: Sequence[FieldSpec], dense_dims: Mapping[str, int] | None, embed_dim: int,
                 first_order: bool) -> None:
        super().__init__()
        self.embeddings = FieldEmbeddings(fields, dense_dims or {}, embed_dim, first_order)
        self.bias = nn.Parameter(torch.zeros(()))

    @torch.no_grad()
    def predict_proba(self, sparse: Mapping[str, torch.Tensor], dense: Mapping[str, torch.Tensor] | None = None
                      ) -> torch.Tensor:
        return torch.sigmoid(self(sparse, dense))


class LR(CTRModel):
    """Logistic regression: bias + sum of first-order field weights."""

    def __init__(self, fields: Sequence[FieldSpec], dense_dims: Mapping[str, int] | None = None, embed_dim: int = 1,
                 **_: object) -> None:
        super().__init__(fields, dense_dims, 1, first_order=True)

    def forward(self, sparse: Mapping[str, torch.Tensor],
                dense: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
        _, first = self.embeddings(sparse, dense)
        assert first is not None
        return self.bias + first


class DNN(CTRModel):
    """Concatenated field embeddings through an MLP."""

    def __init__(self, fields: Sequence[FieldSpec], dense_dims: Mapping[str, int] | None = None, embed_dim: int = 16,
                 hidden: Sequence[int] = (128, 64), dropout: float = 0.0, **_: object) -> None:
        super().__init__(fields, dense_dims, embed_dim, first_order=False)
        width = self.embeddings.num_fields * embed_dim
        self.deep = mlp(width, hidden, dropout)
        self.out = nn.Linear(hidden[-1] if hidden else width, 1)

    def forward(self, sparse: Mapping[str, torch.Tensor],
                dense: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
        emb, _ = self.embeddings(sparse, dense)
        return self.bias + self.out(self.deep(emb.flatten(1))).squeeze(-1)


def fm_interaction(emb: torch.Tensor) -> torch.Tensor:
    """Factorization-machine second-order term of ``(B, F, E)`` embeddings: ``sum_{i<j} <e_i, e_j>``."""
    square_of_sum = emb.sum(1) ** 2
    sum_of_square = (emb**2).sum(1)
    return 0.5 * (square_of_sum - sum_of_square).sum(1)


class DeepFM(CTRModel):
    """DeepFM: first-order + FM pairwise interactions + an MLP over the same shared embeddings."""

    def __init__(self, fields: Sequence[FieldSpec], dense_dims: Mapping[str, int] | None = None, embed_dim: int = 16,
                 hidden: Sequence[int] = (128, 64), dropout: float = 0.0, **_: object) -> None:
        super().__init__(fields, dense_dims, embed_dim, first_order=True)
        width = self.embeddings.num_fields * embed_dim
        self.deep = mlp(width, hidden, dropout)
        self.out = nn.Linear(hidden[-1] if hidden else width, 1)

    def forward(self, sparse: Mapping[str, torch.Tensor],
                dense: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
        emb, first = self.embeddings(sparse, dense)
        assert first is not None
        return self.bias + first + fm_interaction(emb) + self.out(self.deep(emb.flatten(1))).squeeze(-1)


class CrossLayer(nn.Module):
    """DCNv2 cross layer ``x_{l+1} = x0 * (W x_l + b) + x_l``; ``W`` full rank or ``U V^T`` of ``rank``."""

    def __init__(self, dim: int, rank: int | None = None) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim) if rank is None else nn.Sequential(nn.Linear(dim, rank, bias=False),
                                                                           nn.Linear(rank, dim))

    def forward(self, x0: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x0 * self.proj(x) + x


class DCNv2(CTRModel):
    """DCNv2 (parallel): a cross network and an MLP over the concatenated embeddings, combined linearly."""

    def __init__(self, fields: Sequence[FieldSpec], dense_dims: Mapping[str, int] | None = None, embed_dim: int = 16,
                 hidden: Sequence[int] = (128, 64), cross_layers: int = 2, rank: int | None = None,
                 dropout: float = 0.0, **_: object) -> None:
        super().__init__(fields, dense_dims, embed_dim, first_order=False)
        width = self.embeddings.num_fields * embed_dim
        self.cross = nn.ModuleList(CrossLayer(width, rank) for _ in range(cross_layers))
        self.deep = mlp(width, hidden, dropout)
        self.out = nn.Linear(width + (hidden[-1] if hidden else width), 1)

    def forward(self, sparse: Mapping[str, torch.Tensor],
                dense: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
        emb, _ = self.embeddings(sparse, dense)
        x0 = emb.flatten(1)
        x = x0
        for layer in self.cross:
            x = layer(x0, x)
        return self.bias + self.out(torch.cat([x, self.deep(x0)], 1)).squeeze(-1)


MODELS: dict[str, type[CTRModel]] = {"lr": LR, "dnn": DNN, "deepfm": DeepFM, "dcnv2": DCNv2}


def build_model(name: str, fields: Sequence[FieldSpec], dense_dims: Mapping[str, int] | None = None,
                embed_dim: int = 16, **kwargs: object) -> CTRModel:
    """Build a CTR model by name (``lr``, ``dnn``, ``deepfm``, ``dcnv2``)."""
    key = name.lower()
    if key not in MODELS:
        raise LeanmlError(f"unknown CTR model {name!r}; choose one of {sorted(MODELS)}")
    return MODELS[key](fields, dense_dims, embed_dim=embed_dim, **kwargs)


class ResidualID(torch.nn.Module):
    """``base(sparse, dense) + b[ad] + <e[ad], u[user]>``: the ad ID as a correction on a model without it.

    Row 0 of ``b`` and ``e`` (ads without training rows) is zero and receives no gradient (no training row
    maps to it: the residual stage uses no ID dropout), so for a new ad the prediction is the base model's.
    """

    def __init__(self, base: CTRModel, n_ads: int, n_users: int, dim: int) -> None:
        super().__init__()
        self.base = base
        self.ad_bias = torch.nn.Embedding(n_ads, 1)
        self.ad = torch.nn.Embedding(n_ads, dim)
        self.user = torch.nn.Embedding(n_users, dim)
        torch.nn.init.zeros_(self.ad_bias.weight)
        torch.nn.init.normal_(self.ad.weight, std=0.05)
        torch.nn.init.normal_(self.user.weight, std=0.05)
        with torch.no_grad():
            self.ad.weight[0].zero_()

    def correction(self, sparse: dict[str, torch.Tensor]) -> torch.Tensor:
        ad = sparse["ad"]
        return self.ad_bias(ad).squeeze(-1) + (self.ad(ad) * self.user(sparse["user"])).sum(-1)

    def forward(self, sparse: dict[str, torch.Tensor], dense: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        return self.base(sparse, dense) + self.correction(sparse)

    @torch.no_grad()
    def predict_proba(self, sparse: dict[str, torch.Tensor], dense: dict[str, torch.Tensor] | None = None
                      ) -> torch.Tensor:
        return torch.sigmoid(self(sparse, dense))
