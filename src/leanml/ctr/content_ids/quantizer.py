"""Soft quantizers: a D-dim vector -> ``M`` discrete codes of ``K`` values each.

- **Product quantization** (``pq``): split the vector into ``M`` sub-vectors and pick one of ``K``
  codewords per sub-space. Codes are independent: position ``m`` describes sub-space ``m``.
- **Residual quantization** (``rq``): ``M`` levels over the whole vector; level 1 quantizes the vector,
  level ``l`` the residual left by levels ``< l``. Codes are hierarchical (coarse to fine), so a
  prefix ``(c_1 .. c_l)`` names a cluster and its refinements.

Training uses the soft assignment ``p[m, k] = softmax_k(-||x_m - c_mk||^2 / (tau * s_m))`` so gradients
reach both the codebooks and the encoder that produced ``x``; ``tau`` is annealed towards 0, where the
soft assignment becomes the hard argmax used at inference. ``s_m`` is 1 for PQ (unit sub-vectors) and
the mean squared residual norm of level ``m`` for RQ (measured at k-means initialisation), so one tau
schedule fits every level. A straight-through variant (forward hard, backward soft) is available.
Dead codewords (never chosen in an epoch) can be re-seeded from the data (:func:`reseed_dead_codes`).
Pure tensor functions first, then thin ``nn.Module`` s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from leanml.errors import LeanmlError


def split_subvectors(x: torch.Tensor, m: int) -> torch.Tensor:
    """``(N, D) -> (N, M, D/M)``; raises if ``D`` is not divisible by ``M``."""
    if x.dim() != 2:
        raise ValueError(f"expected a (N, D) tensor, got shape {tuple(x.shape)}")
    n, d = x.shape
    if d % m:
        raise LeanmlError(f"vector dim {d} is not divisible by M={m}; choose M dividing {d}")
    return x.reshape(n, m, d // m)


def sq_distances(x: torch.Tensor, codebooks: torch.Tensor) -> torch.Tensor:
    """Squared distances ``(N, M, K)`` between sub-vectors ``(N, M, d)`` and codebooks ``(M, K, d)``."""
    x2 = (x * x).sum(-1, keepdim=True)  # (N, M, 1)
    c2 = (codebooks * codebooks).sum(-1)  # (M, K)
    xc = torch.einsum("nmd,mkd->nmk", x, codebooks)
    return (x2 - 2.0 * xc + c2.unsqueeze(0)).clamp_min(0.0)


def soft_assign(x: torch.Tensor, codebooks: torch.Tensor, tau: float) -> torch.Tensor:
    """Soft assignment probabilities ``(N, M, K)``; ``x`` is ``(N, D)``, ``codebooks`` ``(M, K, d)``."""
    if tau <= 0:
        raise ValueError("tau must be > 0")
    sub = split_subvectors(x, codebooks.shape[0])
    return torch.softmax(-sq_distances(sub, codebooks) / tau, dim=-1)


def hard_assign(x: torch.Tensor, codebooks: torch.Tensor) -> torch.Tensor:
    """Nearest codeword per sub-space: integer codes ``(N, M)`` in ``[0, K)``."""
    sub = split_subvectors(x, codebooks.shape[0])
    return sq_distances(sub, codebooks).argmin(-1)


def reconstruct(codes_or_probs: torch.Tensor, codebooks: torch.Tensor) -> torch.Tensor:
    """Quantized vector ``(N, D)`` from hard codes ``(N, M)`` or soft probabilities ``(N, M, K)``."""
    m, _, d = codebooks.shape
    if codes_or_probs.dim() == 2:
        sub = codebooks[torch.arange(m, device=codebooks.device), codes_or_probs]  # (N, M, d)
    else:
        sub = torch.einsum("nmk,mkd->nmd", codes_or_probs, codebooks)
    return sub.reshape(sub.shape[0], m * d)


def residual_quantize(x: torch.Tensor, codebooks: torch.Tensor, tau: float | None = None,
                      scale: torch.Tensor | None = None, straight_through: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Residual quantization of ``x`` ``(N, D)`` with ``codebooks`` ``(L, K, D)``.

    Returns ``(quantized (N, D), probs (N, L, K), level_inputs (N, L, D))``. With ``tau=None`` every level
    picks its nearest codeword (hard, greedy) and ``probs`` is one-hot; otherwise each level uses the soft
    assignment at temperature ``tau * scale[l]`` and its soft (or straight-through) reconstruction, and
    the next level quantizes what is left. ``level_inputs[:, l]`` is the residual level ``l`` saw.
    """
    if x.dim() != 2 or codebooks.dim() != 3 or x.shape[1] != codebooks.shape[2]:
        raise ValueError(f"x {tuple(x.shape)} and codebooks {tuple(codebooks.shape)} do not match (N, D) / (L, K, D)")
    levels, k, _ = codebooks.shape
    residual, quantized = x, torch.zeros_like(x)
    probs, inputs = [], []
    for lvl in range(levels):
        cb = codebooks[lvl]
        inputs.append(residual)
        d = (residual * residual).sum(-1, keepdim=True) - 2.0 * residual @ cb.T + (cb * cb).sum(-1)
        d = d.clamp_min(0.0)
        hard = d.argmin(-1)
        if tau is None:
            p = torch.nn.functional.one_hot(hard, k).to(x.dtype)
            q = cb[hard]
        else:
            if tau <= 0:
                raise ValueError("tau must be > 0")
            s = 1.0 if scale is None else scale[lvl]
            p = torch.softmax(-d / (tau * s), dim=-1)
            q = p @ cb
            if straight_through:
                q = cb[hard] + (q - q.detach())
        probs.append(p)
        quantized = quantized + q
        residual = residual - q
    return quantized, torch.stack(probs, 1), torch.stack(inputs, 1)


def reseed_dead_codes(codebooks: torch.Tensor, counts: torch.Tensor, inputs: torch.Tensor,
                      generator: torch.Generator | None = None, noise: float = 0.01) -> int:
    """Re-seed dead codewords in place; returns how many were re-seeded.

    ``codebooks`` ``(M, K, d)``, ``counts`` ``(M, K)`` (how often each codeword was chosen),
    ``inputs`` ``(N, M, d)`` (the vectors each sub-space / level quantizes). Every codeword with count 0
    becomes a randomly drawn input of its sub-space plus a little noise, so it starts where data is.
    """
    n = inputs.shape[0]
    if n == 0:
        return 0
    total = 0
    with torch.no_grad():
        for j in range(codebooks.shape[0]):
            dead = torch.nonzero(counts[j] == 0).flatten()
            if len(dead) == 0:
                continue
            pick = torch.randint(n, (len(dead),), generator=generator)
            new = inputs[pick, j].to(codebooks) + noise * torch.randn(len(dead), codebooks.shape[2],
                                                                      generator=generator).to(codebooks)
            codebooks[j, dead.to(codebooks.device)] = new
            total += len(dead)
    return total


def kmeans(x: torch.Tensor, k: int, iters: int = 20, seed: int = 0) -> torch.Tensor:
    """Plain Lloyd k-means with k-means++ seeding; returns ``(k, d)`` centroids. Empty clusters are
    re-seeded with the points farthest from their centroid."""
    n = x.shape[0]
    if n < k:
        raise LeanmlError(f"k-means needs at least K={k} vectors, got {n}; use more data or a smaller K")
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = x.detach().float()
    centroids = [x[torch.randint(n, (1,), generator=g).item()]]
    d2 = ((x - centroids[0]) ** 2).sum(1)
    for _ in range(1, k):
        probs = d2 / d2.sum() if d2.sum() > 0 else torch.full_like(d2, 1.0 / n)
        idx = torch.multinomial(probs.cpu(), 1, generator=g).item()
        centroids.append(x[idx])
        d2 = torch.minimum(d2, ((x - x[idx]) ** 2).sum(1))
    c = torch.stack(centroids)
    for _ in range(iters):
        dist = torch.cdist(x, c) ** 2
        assign = dist.argmin(1)
        counts = torch.bincount(assign, minlength=k)
        new_c = torch.zeros_like(c).index_add_(0, assign, x) / counts.clamp_min(1).unsqueeze(1).to(x.dtype)
        empty = counts == 0
        if empty.any():
            far = dist.gather(1, assign[:, None]).squeeze(1).argsort(descending=True)[: int(empty.sum())]
            new_c[empty] = x[far]
        c = new_c
    return c


@dataclass
class UsageStats:
    """How well the codebooks are used, measured on a set of (distinct) items."""

    n_items: int
    dead_codes: int  # codewords never chosen, summed over sub-spaces (of M*K)
    dead_fraction: float
    entropy_bits: float  # mean over sub-spaces of the code entropy (max log2 K)
    norm_entropy: float  # entropy_bits / log2 K, in [0, 1]
    unique_tuples: int  # distinct full M-code tuples
    collision_rate: float  # fraction of items sharing their full code tuple with another item

    def as_dict(self) -> dict[str, float | int]:
        return dict(self.__dict__)


def usage_stats(codes: np.ndarray | torch.Tensor, k: int) -> UsageStats:
    """Dead codes, entropy and collisions of hard codes ``(N, M)`` (local codes in ``[0, K)``)."""
    codes = np.asarray(codes.cpu() if isinstance(codes, torch.Tensor) else codes)
    n, m = codes.shape
    dead, ent = 0, 0.0
    for j in range(m):
        counts = np.bincount(codes[:, j], minlength=k)
        dead += int((counts == 0).sum())
        p = counts[counts > 0] / n
        ent += float(-(p * np.log2(p)).sum())
    ent /= m
    _, inverse, tuple_counts = np.unique(codes, axis=0, return_inverse=True, return_counts=True)
    shared = tuple_counts[inverse.ravel()] > 1
    return UsageStats(
        n_items=n,
        dead_codes=dead,
        dead_fraction=dead / (m * k),
        entropy_bits=ent,
        norm_entropy=ent / math.log2(k),
        unique_tuples=int(tuple_counts.size),
        collision_rate=float(shared.mean()) if n else 0.0,
    )


class SoftProductQuantizer(nn.Module):
    """``M`` codebooks of ``K`` codewords over ``dim / M``-dim sub-spaces.

    ``forward(x, tau)`` returns ``(quantized, probs)``: in training the soft reconstruction (or, with
    ``straight_through=True``, the hard one with the soft gradient); in eval the hard reconstruction.

    >>> q = SoftProductQuantizer(dim=16, m=4, k=8)
    >>> z, p = q(torch.randn(5, 16), tau=0.5)
    >>> z.shape, p.shape
    (torch.Size([5, 16]), torch.Size([5, 4, 8]))
    """

    def __init__(self, dim: int, m: int, k: int, straight_through: bool = False) -> None:
        super().__init__()
        if k < 2:
            raise LeanmlError(f"K={k}: a codebook needs at least 2 codewords; use K >= 2")
        if m < 1 or dim % m:
            raise LeanmlError(f"M={m} must be >= 1 and divide the vector dim {dim}")
        self.dim, self.m, self.k = dim, m, k
        self.straight_through = straight_through
        self.codebooks = nn.Parameter(torch.randn(m, k, dim // m) * 0.1)

    @torch.no_grad()
    def init_kmeans(self, x: torch.Tensor, iters: int = 20, seed: int = 0) -> None:
        """Initialize each sub-space's codebook with k-means of the sub-vectors of ``x`` ``(N, D)``."""
        sub = split_subvectors(x.detach(), self.m)
        for j in range(self.m):
            self.codebooks[j] = kmeans(sub[:, j], self.k, iters=iters, seed=seed + j).to(self.codebooks)

    def forward(self, x: torch.Tensor, tau: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        probs = soft_assign(x, self.codebooks, tau)
        if not self.training:
            return reconstruct(probs.argmax(-1), self.codebooks), probs
        soft = reconstruct(probs, self.codebooks)
        if self.straight_through:
            hard = reconstruct(probs.argmax(-1), self.codebooks)
            return hard + (soft - soft.detach()), probs
        return soft, probs

    @torch.no_grad()
    def codes(self, x: torch.Tensor) -> torch.Tensor:
        """Hard codes ``(N, M)`` in ``[0, K)``."""
        return hard_assign(x, self.codebooks)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """The quantized vector ``(N, D)`` of hard codes ``(N, M)``."""
        return reconstruct(codes, self.codebooks)

    @torch.no_grad()
    def level_inputs(self, x: torch.Tensor) -> torch.Tensor:
        """What each sub-space quantizes: the sub-vectors ``(N, M, D/M)``."""
        return split_subvectors(x, self.m)


class SoftResidualQuantizer(nn.Module):
    """``M`` levels of ``K`` codewords over the whole ``dim``-dim vector (residual quantization).

    Same interface as :class:`SoftProductQuantizer`: ``forward(x, tau) -> (quantized, probs (N, M, K))``,
    ``codes``, ``decode``, ``init_kmeans``, ``level_inputs``.

    >>> q = SoftResidualQuantizer(dim=16, m=3, k=8)
    >>> z, p = q(torch.randn(5, 16), tau=0.5)
    >>> z.shape, p.shape
    (torch.Size([5, 16]), torch.Size([5, 3, 8]))
    """

    def __init__(self, dim: int, m: int, k: int, straight_through: bool = False) -> None:
        super().__init__()
        if k < 2:
            raise LeanmlError(f"K={k}: a codebook needs at least 2 codewords; use K >= 2")
        if m < 1:
            raise LeanmlError(f"M={m}: residual quantization needs at least one level")
        self.dim, self.m, self.k = dim, m, k
        self.straight_through = straight_through
        self.codebooks = nn.Parameter(torch.randn(m, k, dim) * 0.1 / math.sqrt(dim))
        self.register_buffer("scale", torch.ones(m))

    @torch.no_grad()
    def init_kmeans(self, x: torch.Tensor, iters: int = 20, seed: int = 0) -> None:
        """Level by level: k-means of the residuals left by the levels above; sets ``scale``."""
        residual = x.detach().float()
        for j in range(self.m):
            self.scale[j] = (residual * residual).sum(-1).mean().clamp_min(1e-8)
            self.codebooks[j] = kmeans(residual, self.k, iters=iters, seed=seed + j).to(self.codebooks)
            residual = residual - self.codebooks[j][torch.cdist(residual, self.codebooks[j]).argmin(1)]

    def forward(self, x: torch.Tensor, tau: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.training:
            q, probs, _ = residual_quantize(x, self.codebooks)
            return q, probs
        q, probs, _ = residual_quantize(x, self.codebooks, tau, self.scale, self.straight_through)
        return q, probs

    @torch.no_grad()
    def codes(self, x: torch.Tensor) -> torch.Tensor:
        """Hard (greedy) codes ``(N, M)`` in ``[0, K)``."""
        _, probs, _ = residual_quantize(x, self.codebooks)
        return probs.argmax(-1)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """The quantized vector ``(N, D)``: the sum of each level's codeword."""
        return self.codebooks[torch.arange(self.m, device=codes.device), codes].sum(1)

    @torch.no_grad()
    def level_inputs(self, x: torch.Tensor) -> torch.Tensor:
        """What each level quantizes under hard assignment: the residuals ``(N, M, D)``."""
        return residual_quantize(x, self.codebooks)[2]


QUANTIZERS: dict[str, type[nn.Module]] = {"pq": SoftProductQuantizer, "rq": SoftResidualQuantizer}


def anneal_tau(step: int, total: int, tau_start: float, tau_end: float) -> float:
    """Geometric schedule from ``tau_start`` (step 0) to ``tau_end`` (last step)."""
    if total <= 1:
        return tau_end
    frac = min(max(step / (total - 1), 0.0), 1.0)
    return float(tau_start * (tau_end / tau_start) ** frac)
