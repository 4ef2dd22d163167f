"""The model's input fields: a click log (user, ad, context) and the ads' content become sparse / dense tensors.

Feature sets (``features``, any of ``id``, ``raw``, ``visual`` joined by ``,`` or ``+``):

- ``id``: the ad-ID embedding. Ads without training rows map to the unseen-ad row 0 (zero-initialised).
  ``id_dropout`` (DropoutNet-style) replaces that share of training rows' ad IDs by row 0, so row 0
  learns "an ad without history" and the rest of the model learns to work without the ID: the new-ad
  path is trained on purpose instead of being a side effect. ``id_mode="residual"`` instead trains the
  model without the ad ID first, freezes it, then learns the ad ID as a correction
  ``b_ad + <e_ad, e_user>`` on its logit (:class:`leanml.ctr.models.ResidualID`); the correction of an ad without
  training rows is exactly zero, so adding the ID cannot change a new ad's prediction.
- ``raw``: the continuous content vector (the content-ID extractor's output before quantization)
  through a small MLP, as one field.
- ``content_tower``: with both ``raw`` and the codeword vector, feed their concatenation through one MLP
  as one field instead of one field each. Two fields of the same ad otherwise form a pairwise term
  (FM / cross) of the ad with itself, which the model fits per training ad and which does not carry
  over to new ads.
- ``visual``: the ``M`` content IDs, embedded per ``visual_fields``:

  - ``codes`` (default): each position ``m`` is its own field with its own ``K``-row table;
  - ``prefix``: prefix n-grams ``(c_1)``, ``(c_1, c_2)``, ..., ``(c_1 .. c_M)``, each its own field (exact
    ids while ``K^l <= prefix_buckets``, hashed into ``prefix_buckets`` rows beyond) -- for residual
    (coarse-to-fine) codes, where a prefix names a cluster;
  - ``codes+prefix``: both (prefixes of length >= 2 next to the single codes);
  - ``bag``: the first format, all ``M`` ids in one ``M * K`` table, mean-pooled into one field.

User ID and context are always fields. Every id that occurs in no training row (a new user, a content
ID only new ads have) maps to its field's row 0, zero-initialised, instead of an untrained random row.
The content-ID model is fitted on the old ads only (their content and captions, never clicks), so
nothing about a new ad is seen before test time.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import torch

from leanml.ctr.content import ItemFeatures
from leanml.ctr.content_ids.schema import global_ids
from leanml.ctr.data import CTRData
from leanml.ctr.models import FieldSpec
from leanml.ctr.options import VISUAL_FIELDS, CTRConfig
from leanml.errors import LeanmlError

_MERSENNE = (1 << 31) - 1


def prefix_ids(codes: np.ndarray, k: int, buckets: int) -> tuple[list[np.ndarray], list[int]]:
    """Prefix n-gram ids of codes ``(N, M)``: for ``l = 1..M`` the id of ``(c_1 .. c_l)`` and its vocabulary.

    The id is the mixed-radix number ``c_1 K^(l-1) + ... + c_l`` (exact, distinct prefixes never collide)
    while ``K^l <= buckets``; beyond, that number modulo ``2^31 - 1`` then modulo ``buckets`` (hashed).
    """
    codes = np.asarray(codes, dtype=np.int64)
    h = np.zeros(len(codes), dtype=np.int64)
    ids, vocabs = [], []
    for lvl in range(codes.shape[1]):
        h = (h * k + codes[:, lvl]) % _MERSENNE
        exact = k ** (lvl + 1) <= buckets
        ids.append(h.copy() if exact else h % buckets)
        vocabs.append(k ** (lvl + 1) if exact else buckets)
    return ids, vocabs


def content_fields(items: ItemFeatures, mode: str, prefix_buckets: int = 1 << 16
                   ) -> list[tuple[str, np.ndarray, int, bool]]:
    """The visual fields of every item: ``(name, ids per item, vocabulary, is_bag)``; ids ``(n_items,)``,
    or ``(n_items, M)`` for the bag."""
    codes, m, k = items.codes, items.m, items.k
    if mode == "none":
        return []
    if mode == "bag":
        return [("visual", global_ids(codes, k), m * k, True)]
    out: list[tuple[str, np.ndarray, int, bool]] = []
    if mode in ("codes", "codes+prefix"):
        out += [(f"visual{j}", codes[:, j], k, False) for j in range(m)]
    if mode in ("prefix", "codes+prefix"):
        ids, vocabs = prefix_ids(codes, k, prefix_buckets)
        first = 0 if mode == "prefix" else 1
        out += [(f"visual_p{j + 1}", ids[j], vocabs[j], False) for j in range(first, m)]
    if mode not in VISUAL_FIELDS:
        raise LeanmlError(f"visual_fields {mode!r}: use one of {', '.join(VISUAL_FIELDS)}")
    return out


def seen_remap(ids: np.ndarray, seen_rows: np.ndarray, vocab: int) -> np.ndarray:
    """Shift ids by one and send every id that no ``seen_rows`` entry carries to row 0 (the unseen row)."""
    seen = np.zeros(vocab, dtype=bool)
    seen[np.asarray(ids)[seen_rows].ravel()] = True
    return np.where(seen[ids], ids + 1, 0)


class FieldBuilder:
    """Turns a log (``user``, ``item``, ``context``) into the model's sparse / dense input tensors.

    Per-item field ids are computed once (``item_sparse``: name -> ``(n_items,)`` or ``(n_items, M)``),
    with ids unseen in ``data.train`` sent to row 0; a log is then a gather by item.
    """

    def __init__(self, data: CTRData | None, items: ItemFeatures | None, config: CTRConfig,
                 state: dict[str, Any] | None = None) -> None:
        self.features = config.feature_set
        parts = set(self.features.split("+"))
        if parts & {"raw", "visual"} and items is None:
            raise LeanmlError(f"features {self.features!r} need content features (fit content IDs first)")
        self.parts, self.items = parts, items
        if state is not None:  # reloaded run
            self.user_index = state["user_index"]
            self.item_sparse = state["item_sparse"]
            self.specs = [FieldSpec(n, v, b) for n, v, b in state["specs"]]
        else:
            assert data is not None
            self._build(data, items, config)
        self.dense: dict[str, np.ndarray] = {}
        if "raw" in parts:
            if items is None or items.raw is None:
                raise LeanmlError("features with 'raw' need the continuous content vectors; a visual-ID table has none")
            self.dense["raw"] = items.raw
        if "visual" in parts and config.codeword_vector:
            if items is None or items.decoded is None:
                raise LeanmlError("codeword_vector needs the content-ID model's codebooks (content_ids), "
                                  "not only a visual-ID table", fields=("codeword_vector", "content_ids"))
            self.dense["codeword"] = items.decoded
        self.tower = config.content_tower  # CTRConfig checked that both raw and the codeword vector are fed
        self.dense_dims = {k: int(v.shape[1]) for k, v in self.dense.items()}
        if self.tower:
            self.dense_dims = {"content": sum(self.dense_dims.values())}

    def _build(self, data: CTRData, items: ItemFeatures | None, config: CTRConfig) -> None:
        train_items = np.unique(data.train["item"].to_numpy())
        seen_users = np.zeros(data.n_users, dtype=bool)
        seen_users[data.train["user"].to_numpy()] = True
        self.user_index = np.where(seen_users, np.arange(data.n_users) + 1, 0)
        self.specs = [FieldSpec("user", data.n_users + 1), FieldSpec("context", data.n_contexts)]
        self.item_sparse: dict[str, np.ndarray] = {}
        if "id" in self.parts:
            self.item_sparse["ad"] = seen_remap(np.arange(data.n_items), train_items, data.n_items)
            self.specs.append(FieldSpec("ad", data.n_items + 1))
        if "visual" in self.parts:
            assert items is not None
            for name, ids, vocab, bag in content_fields(items, config.visual_fields, config.prefix_buckets):
                self.item_sparse[name] = seen_remap(ids, train_items, vocab)
                self.specs.append(FieldSpec(name, vocab + 1, bag))

    def state(self) -> dict[str, Any]:
        return {"user_index": self.user_index, "item_sparse": self.item_sparse,
                "specs": [(f.name, f.vocab, f.bag) for f in self.specs]}

    @property
    def unseen_rows(self) -> list[str]:
        """Fields whose row 0 stands for "not seen in training"."""
        return ["user", *self.item_sparse]

    def tensors(self, log: pd.DataFrame) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor]:
        item = log["item"].to_numpy()
        sparse = {"user": torch.as_tensor(self.user_index[log["user"].to_numpy()], dtype=torch.long),
                  "context": torch.tensor(log["context"].to_numpy(), dtype=torch.long)}
        for name, ids in self.item_sparse.items():
            sparse[name] = torch.as_tensor(ids[item], dtype=torch.long)
        dense = {k: torch.as_tensor(v[item], dtype=torch.float32) for k, v in self.dense.items()}
        if self.tower:
            dense = {"content": torch.cat([dense["raw"], dense["codeword"]], 1)}
        return sparse, dense, torch.tensor(log["label"].to_numpy(), dtype=torch.float32)
