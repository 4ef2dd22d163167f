"""Encoders for content IDs.

- :class:`SmallCNN`: a small image CNN trainable from scratch on CPU (28x28 grey images by default).
- :class:`MLPEncoder`: for content that already is a vector (e.g. a text embedding of a movie).
- :class:`ContentEncoder`: any backbone (``nn.Module`` mapping a batch to ``(N, F)`` features, e.g. a
  torchvision-style ResNet with its ``fc`` replaced by ``nn.Identity()``) plus a linear head to ``D``.
- :func:`embed_texts`: the frozen all-MiniLM-L6-v2 text encoder with mean pooling; results are cached
  on disk keyed by a hash of the texts, so tests and demos do not recompute them.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from leanml.errors import LeanmlError
from leanml.outputs import atomic_file, cache_dir


class SmallCNN(nn.Module):
    """Three 3x3 conv blocks and global average pooling: ``(N, C, H, W) -> (N, width * 4)``."""

    def __init__(self, in_channels: int = 1, width: int = 16) -> None:
        super().__init__()
        self.out_dim = width * 4
        self.net = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, width * 2, 3, padding=1),
            nn.BatchNorm2d(width * 2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width * 2, width * 4, 3, padding=1),
            nn.BatchNorm2d(width * 4),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 3:  # (N, H, W) grey images
            x = x.unsqueeze(1)
        return self.net(x)


class MLPEncoder(nn.Module):
    """A two-layer MLP for vector content: ``(N, in_dim) -> (N, hidden)``."""

    def __init__(self, in_dim: int, hidden: int = 128) -> None:
        super().__init__()
        self.out_dim = hidden
        self.net = nn.Sequential(nn.Linear(in_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ContentEncoder(nn.Module):
    """``backbone`` then a linear head to ``dim``; ``backbone_dim`` defaults to ``backbone.out_dim``.

    >>> enc = ContentEncoder(SmallCNN(), dim=32)
    >>> enc(torch.zeros(2, 28, 28)).shape
    torch.Size([2, 32])
    """

    def __init__(self, backbone: nn.Module, dim: int, backbone_dim: int | None = None) -> None:
        super().__init__()
        feat = backbone_dim if backbone_dim is not None else getattr(backbone, "out_dim", None)
        if feat is None:
            raise LeanmlError("pass backbone_dim: the backbone has no `out_dim` attribute")
        self.backbone = backbone
        self.head = nn.Linear(int(feat), dim)
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


def _texts_key(texts: Sequence[str], model_dir: Path) -> str:
    h = hashlib.sha256(str(model_dir).encode())
    for t in texts:
        h.update(t.encode("utf-8"))
        h.update(b"\x00")
    return h.hexdigest()[:24]


def embed_texts(
    texts: Sequence[str], batch_size: int = 128, use_cache: bool = True, model_dir: Path | None = None
) -> np.ndarray:
    """Mean-pooled all-MiniLM-L6-v2 embeddings ``(N, 384)`` (float32, not normalized) of ``texts``.

    Unique texts are embedded once; the result is cached in ``cache_dir()/text_emb`` keyed by a hash of
    the texts and the model folder.
    """
    from leanml.data.offline import minilm_dir

    texts = list(texts)
    for i, t in enumerate(texts):
        if not isinstance(t, str) or not t.strip():
            raise LeanmlError(f"text #{i} is empty or missing; every ad needs a non-empty caption")
    model_dir = Path(model_dir) if model_dir is not None else minilm_dir()
    path = cache_dir() / "text_emb" / f"{_texts_key(texts, model_dir)}.npy"
    if use_cache and path.exists():
        return np.load(path)
    uniq, inverse = np.unique(np.array(texts, dtype=object), return_inverse=True)
    emb = _encode_minilm(list(uniq), batch_size, model_dir)[inverse.ravel()]
    if use_cache:
        with atomic_file(path, suffix=".npy") as tmp:
            np.save(tmp, emb)
    return emb


@torch.no_grad()
def _encode_minilm(texts: list[str], batch_size: int, model_dir: Path) -> np.ndarray:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tqdm.auto import tqdm
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir).eval()
    out = []
    for i in tqdm(range(0, len(texts), batch_size), desc="MiniLM", leave=False, disable=len(texts) < 4 * batch_size):
        batch = tok(texts[i : i + batch_size], padding=True, truncation=True, max_length=128, return_tensors="pt")
        hidden = model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        out.append(((hidden * mask).sum(1) / mask.sum(1).clamp_min(1e-9)).float().numpy())
    return np.concatenate(out).astype(np.float32)
