"""End-to-end CTR experiments: fit content IDs on old ads, build fields, train a CTR model, evaluate.

Feature sets (``--features``, any of ``id``, ``raw``, ``visual`` joined by ``,`` or ``+``):

- ``id``: the ad-ID embedding. Ads without training rows map to the unseen-ad row 0 (zero-initialised).
  ``id_dropout`` (DropoutNet-style) replaces that share of training rows' ad IDs by row 0, so row 0
  learns "an ad without history" and the rest of the model learns to work without the ID: the new-ad
  path is trained on purpose instead of being a side effect. ``id_mode="residual"`` instead trains the
  model without the ad ID first, freezes it, then learns the ad ID as a correction
  ``b_ad + <e_ad, e_user>`` on its logit (:class:`ResidualID`); the correction of an ad without training
  rows is exactly zero, so adding the ID cannot change a new ad's prediction.
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

import hashlib
import json
import math
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from leanml.ctr.content_ids.quantizer import usage_stats
from leanml.ctr.content_ids.schema import global_ids
from leanml.ctr.content_ids.trainer import (
    ContentIDConfig,
    ContentIDModel,
    embed_all,
    fit_content_ids,
    load_content_model,
    save_content_model,
)
from leanml.ctr.data import CTRData
from leanml.ctr.metrics import ctr_metrics
from leanml.ctr.models import MODELS, CTRModel, FieldSpec, build_model
from leanml.utils import EtaBar, LeanmlError, atomic_dir, cache_dir, default_device, write_json

FEATURE_ORDER = ("id", "raw", "visual")


def parse_features(spec: str) -> str:
    """``"id,visual"`` / ``"visual+id"`` -> canonical ``"id+visual"``; raises on unknown parts."""
    parts = {p.strip().lower() for p in spec.replace("+", ",").split(",") if p.strip()}
    unknown = parts - set(FEATURE_ORDER)
    if not parts or unknown:
        raise LeanmlError(f"bad --features {spec!r}: use a combination of {', '.join(FEATURE_ORDER)} (e.g. id,visual)")
    return "+".join(p for p in FEATURE_ORDER if p in parts)


@dataclass
class ItemFeatures:
    """Per-item content features: codes ``(n_items, M)`` in ``[0, K)`` and continuous vectors ``(n_items, D)``
    (``raw`` is ``None`` when only the IDs are known, e.g. read from a serving table)."""

    codes: np.ndarray
    raw: np.ndarray | None
    m: int
    k: int
    codebook: str = "pq"
    usage: dict[str, Any] = field(default_factory=dict)
    decoded: np.ndarray | None = None  # (n_items, D): the codewords of each item's codes, summed / concatenated


def content_items(data: CTRData, model: ContentIDModel) -> ItemFeatures:
    """Embed every item (old and new) with a fitted content-ID model."""
    z, codes = embed_all(model, data.content)
    cfg = model.config
    with torch.no_grad():
        decoded = model.quantizer.decode(torch.as_tensor(codes)).numpy().astype(np.float32)
    return ItemFeatures(np.asarray(codes, dtype=np.int64), z.astype(np.float32), cfg.m, cfg.k, cfg.codebook,
                        usage_stats(codes, cfg.k).as_dict(), decoded)


def bytes_per_ad(features: str, items: ItemFeatures | None) -> float:
    """Bytes of stored content feature per ad: ``M`` codes of ``ceil(log2 K)`` bits each (bit-packed)
    for ``visual``, ``D`` float32 for ``raw``; the ad ID itself is not counted (every set has it or not)."""
    parts = set(features.split("+"))
    if items is None or not parts & {"raw", "visual"}:
        return 0.0
    total = 0.0
    if "visual" in parts:
        total += items.m * math.ceil(math.log2(items.k)) / 8.0
    if "raw" in parts:
        if items.raw is None:
            raise LeanmlError("features with 'raw' need the continuous content vectors")
        total += 4.0 * items.raw.shape[1]
    return total


def content_config_for(data: CTRData, **overrides: Any) -> ContentIDConfig:
    """Default content-ID config for a dataset (CNN for images, MLP for content vectors)."""
    cfg = ContentIDConfig(kind=data.content_kind, in_dim=int(data.content.shape[1]) if data.content_kind == "mlp" else 0)
    if data.content_kind == "mlp":
        cfg.epochs, cfg.warmup_epochs, cfg.batch_size = 30, 5, 128
    else:
        cfg.epochs, cfg.warmup_epochs, cfg.batch_size = 8, 2, 64
    for key, value in overrides.items():
        if not hasattr(cfg, key):
            raise LeanmlError(f"unknown content-ID option {key!r}")
        setattr(cfg, key, value)
    cfg.validate()  # the overrides are checked before any fit
    return cfg


def content_code_hash() -> str:
    """Hash of the source files that fit content IDs (encoders, quantizers, trainer)."""
    from leanml.ctr import content_ids

    root = Path(content_ids.__file__).parent
    h = hashlib.sha256()
    for name in ("encoders.py", "quantizer.py", "trainer.py"):
        h.update((root / name).read_bytes())
    return h.hexdigest()[:16]


def fit_dataset_content_ids(
    data: CTRData, config: ContentIDConfig, use_cache: bool = True, progress: bool = True
) -> tuple[ContentIDModel, dict[str, Any]]:
    """Fit a content-ID model on the *old* items of ``data`` (cached on disk by config, data and the source
    of the code that fits it, so a changed trainer never serves an older fit)."""
    from leanml.ctr.content_ids.encoders import embed_texts

    old = data.old_items
    key_src = json.dumps({"cfg": asdict(config), "data": data.summary(), "code": content_code_hash()},
                         sort_keys=True, default=str)
    key = hashlib.sha256(key_src.encode()).hexdigest()[:20]
    path = cache_dir() / "content_ids" / f"{data.name}-{key}"
    if use_cache and (path / "model.safetensors").exists():
        # ``seconds`` there is the time of the fit that wrote the cache, not of this call
        return load_content_model(path), {**json.loads((path / "report.json").read_text()), "cached": True}
    captions = [data.captions[i] for i in old]
    # embed all captions (one cache entry per dataset), then keep the old items' rows
    text = embed_texts(data.captions)[old] if config.loss == "infonce" else None
    import time

    t0 = time.perf_counter()
    model, report = fit_content_ids(data.content[torch.as_tensor(old)], captions, config, text_emb=text,
                                    device=default_device(), progress=progress)
    report["seconds"] = time.perf_counter() - t0
    model = model.cpu()
    report["fitted_on"] = f"{len(old)} old items of {data.name}"
    if use_cache:
        save_content_model(model, path, report, overwrite=True)
    return model, report


VISUAL_FIELDS = ("codes", "prefix", "codes+prefix", "bag", "none")


@dataclass
class CTRConfig:
    """CTR training hyper-parameters."""

    model: str = "deepfm"
    features: str = "id+visual"
    embed_dim: int = 16
    epochs: int = 3
    batch_size: int = 1024
    lr: float | None = None  # None: DEFAULT_LR of the model
    weight_decay: float = 0.0
    id_dropout: float = 0.1  # probability of replacing a training row's ad ID by the unseen-ad row 0
    visual_fields: str = "codes"  # how the M content IDs become fields (module docstring)
    prefix_buckets: int = 1 << 16  # rows of a prefix field once K^l exceeds it (hashed beyond)
    codeword_vector: bool = False  # also feed the codes' codeword vector (codebook lookup) as a dense field
    content_tower: bool = False  # raw and codeword vectors through one MLP as one field (module docstring)
    id_mode: str = "dropout"  # "dropout": the ad ID is one field; "residual": a correction on a content model
    seed: int = 0

    def __post_init__(self) -> None:
        if self.model.lower() not in MODELS:
            raise LeanmlError(f"unknown CTR model {self.model!r}; choose one of {', '.join(sorted(MODELS))}")
        if self.epochs < 1:
            raise LeanmlError(f"epochs={self.epochs}: train for at least 1 epoch (--epochs 1 or more)")
        if self.embed_dim < 1 or self.batch_size < 1:
            raise LeanmlError(f"embed_dim={self.embed_dim} and batch_size={self.batch_size} must be >= 1")
        if self.lr is None:
            self.lr = DEFAULT_LR.get(self.model.lower(), 5e-3)
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise LeanmlError(f"lr={self.lr}: use a learning rate > 0 (--lr)")
        if self.visual_fields not in VISUAL_FIELDS:
            raise LeanmlError(f"visual_fields {self.visual_fields!r}: use one of {', '.join(VISUAL_FIELDS)}")
        if self.visual_fields == "none" and not self.codeword_vector:
            raise LeanmlError("visual_fields 'none' leaves the IDs unused; add codeword_vector")
        if self.id_mode not in ("dropout", "residual"):
            raise LeanmlError(f"id_mode {self.id_mode!r}: use 'dropout' or 'residual'")
        if not 0.0 <= self.id_dropout < 1.0:
            raise LeanmlError(f"id_dropout={self.id_dropout} must be in [0, 1)")
        if self.content_tower and not ({"raw", "visual"} <= set(parse_features(self.features).split("+"))
                                       and self.codeword_vector):
            raise LeanmlError("content_tower joins the raw vector and the codeword vector into one field; it needs "
                              "features with both raw and visual, and codeword_vector (--codeword-vector)")


# DCNv2's cross layers multiply small initial embeddings, so it learns slowly at 5e-3 within 3 epochs
# (measured on Fashion: visual-ID AUC on new ads 0.614 at 5e-3 vs 0.689 at 1e-2).
DEFAULT_LR = {"lr": 5e-3, "dnn": 5e-3, "deepfm": 5e-3, "dcnv2": 1e-2}


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
        self.features = parse_features(config.features)
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
                raise LeanmlError("codeword_vector needs the content-ID model's codebooks (--content-ids), "
                                  "not only a visual-ID table")
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


@torch.no_grad()
def zero_unseen_rows(model: CTRModel, fields: list[str]) -> None:
    """Set row 0 of each of ``fields`` to zero (embedding and first-order weight), so an id without
    training rows contributes nothing instead of random noise (the ad row is trained by ``id_dropout``)."""
    emb = model.embeddings
    for name in fields:
        if name in emb.emb:
            emb.emb[name].weight[0].zero_()
        if name in emb.lin:
            emb.lin[name].weight[0].zero_()


def _slice(d: dict[str, torch.Tensor], idx: torch.Tensor, device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v[idx].to(device) for k, v in d.items()}


def train_ctr_model(
    model: CTRModel, sparse: dict[str, torch.Tensor], dense: dict[str, torch.Tensor], labels: torch.Tensor,
    config: CTRConfig, device: torch.device | None = None, progress: bool = True,
) -> list[float]:
    """Mini-batch Adam on binary cross-entropy; returns the mean loss per epoch.

    With ``config.id_dropout > 0`` a random share of training rows see the unseen-ad row 0 instead of their
    ad ID, so that row learns "an ad without history" and the model learns to lean on content for it.
    """
    device = device or default_device()
    model.to(device).train()
    opt = torch.optim.Adam(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    gen = torch.Generator().manual_seed(config.seed)
    n = len(labels)
    history = []
    steps = (n + config.batch_size - 1) // config.batch_size
    bar = EtaBar(total=config.epochs * steps, desc=f"{config.model} {config.features}", unit="batch",
                 disable=not progress, leave=False)
    for _ in range(config.epochs):
        perm = torch.randperm(n, generator=gen)
        total = 0.0
        for i in range(0, n, config.batch_size):
            idx = perm[i : i + config.batch_size]
            batch = _slice(sparse, idx, device)
            if config.id_dropout > 0 and "ad" in batch:
                drop = torch.rand(len(idx), generator=gen) < config.id_dropout
                batch["ad"] = batch["ad"].masked_fill(drop.to(device), 0)
            loss = loss_fn(model(batch, _slice(dense, idx, device)), labels[idx].to(device))
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
            bar.update(1)
        history.append(total / n)
    bar.close()
    model.eval()
    return history


@torch.no_grad()
def predict(model: CTRModel, sparse: dict[str, torch.Tensor], dense: dict[str, torch.Tensor],
            batch_size: int = 8192) -> np.ndarray:
    """Click probabilities for all rows."""
    model.eval()
    device = next(model.parameters()).device
    n = len(next(iter(sparse.values())))
    out = []
    for i in range(0, n, batch_size):
        idx = torch.arange(i, min(i + batch_size, n))
        out.append(model.predict_proba(_slice(sparse, idx, device), _slice(dense, idx, device)).cpu())
    return torch.cat(out).numpy()


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


def build_ctr_model(config: CTRConfig, builder: FieldBuilder) -> CTRModel | ResidualID:
    """The model a config asks for over ``builder``'s fields (with the unseen rows zeroed)."""
    residual = config.id_mode == "residual" and "ad" in builder.item_sparse
    specs = [f for f in builder.specs if not (residual and f.name == "ad")]
    model = build_model(config.model, specs, builder.dense_dims, embed_dim=config.embed_dim)
    zero_unseen_rows(model, builder.unseen_rows)
    if not residual:
        return model
    vocab = {f.name: f.vocab for f in builder.specs}
    return ResidualID(model, vocab["ad"], vocab["user"], config.embed_dim)


def fit_ctr_model(model: CTRModel | ResidualID, sparse: dict[str, torch.Tensor], dense: dict[str, torch.Tensor],
                  labels: torch.Tensor, config: CTRConfig, device: torch.device | None = None,
                  progress: bool = True) -> list[float]:
    """Train ``model``; a :class:`ResidualID` trains its base first (no ad ID), then only the correction."""
    if not isinstance(model, ResidualID):
        return train_ctr_model(model, sparse, dense, labels, config, device, progress)
    base_sparse = {k: v for k, v in sparse.items() if k != "ad"}  # the base never sees the ad ID
    history = train_ctr_model(model.base, base_sparse, dense, labels, config, device, progress)
    for p in model.base.parameters():
        p.requires_grad_(False)
    stage2 = CTRConfig(**{**asdict(config), "id_dropout": 0.0})
    history += train_ctr_model(model, sparse, dense, labels, stage2, device, progress)
    for p in model.base.parameters():
        p.requires_grad_(True)
    return history


def run_ctr(
    data: CTRData, items: ItemFeatures | None, config: CTRConfig, progress: bool = True,
    device: torch.device | None = None, keep_test_probs: bool = False,
) -> tuple[CTRModel | ResidualID, FieldBuilder, dict[str, Any]]:
    """Train one CTR model on ``data.train`` and evaluate on ``data.test`` (new / old ads).

    ``keep_test_probs``: also return the click probability of every test row as ``report["test_probs"]``
    (a NumPy array, not JSON-ready; for callers that compare models row by row)."""
    data.check_split()
    torch.manual_seed(config.seed)
    builder = FieldBuilder(data, items, config)
    config.features = builder.features
    model = build_ctr_model(config, builder)
    sparse, dense, labels = builder.tensors(data.train)
    history = fit_ctr_model(model, sparse, dense, labels, config, device, progress)
    t_sparse, t_dense, t_labels = builder.tensors(data.test)
    probs = predict(model, t_sparse, t_dense)
    metrics = ctr_metrics(t_labels.numpy(), probs, data.test["user"].to_numpy(), data.test_is_new)
    report = {"config": asdict(config), "train_loss": history, "metrics": metrics, "data": data.summary(),
              "bytes_per_ad": bytes_per_ad(builder.features, items)}
    if keep_test_probs:
        report["test_probs"] = probs
    return model, builder, report


def record(dataset: str, config: CTRConfig, metrics: dict[str, float], seed_content: int | None = None,
           bytes_ad: float = 0.0, **extra: Any) -> dict[str, Any]:
    """A benchmark record with the fixed keys of ``bench/results/ctr.json`` (plus ``extra``)."""
    rec: dict[str, Any] = {"dataset": dataset, "model": config.model, "features": config.features,
                           "seed": config.seed, "seed_content": seed_content, "bytes_per_ad": bytes_ad}
    for key in ("auc_new", "auc_old", "gauc_new", "gauc_old", "logloss_new", "logloss_old", "n_new", "n_old"):
        rec[key] = metrics[key]
    rec.update(extra)
    return rec


def save_ctr_run(out: str | Path, model: CTRModel, builder: FieldBuilder, report: dict[str, Any],
                 overwrite: bool = False) -> Path:
    """Write ``model.safetensors``, ``fields.npz`` (per-item field ids and content vectors) and
    ``report.json`` atomically."""
    from safetensors.torch import save_file

    state = builder.state()
    with atomic_dir(out, overwrite=overwrite) as tmp:
        save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, str(tmp / "model.safetensors"))
        arrays = {f"sparse__{k}": v for k, v in state["item_sparse"].items()}
        arrays.update({f"dense__{k}": v for k, v in builder.dense.items()})
        np.savez(tmp / "fields.npz", user_index=state["user_index"], **arrays)
        write_json(tmp / "report.json", {**report, "fields": state["specs"]})
    return Path(out)


def load_ctr_run(path: str | Path, data: CTRData) -> tuple[CTRModel, FieldBuilder, dict[str, Any]]:
    """Load a run written by :func:`save_ctr_run` for evaluation on ``data`` (same dataset and seed)."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / "report.json").exists() or not (path / "model.safetensors").exists() \
            or not (path / "fields.npz").exists():
        raise LeanmlError(f"{path} is not a CTR run folder; create one with `leanml ctr train --out DIR`")
    report = read_run_report(path)
    cfg = run_config(report, path)
    try:
        npz = np.load(path / "fields.npz")
        item_sparse = {k[len("sparse__"):]: npz[k] for k in npz.files if k.startswith("sparse__")}
        npz["user_index"]
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError) as exc:
        raise LeanmlError(f"{path / 'fields.npz'} is damaged ({exc}); train the run again") from None
    if any(len(v) != data.n_items for v in item_sparse.values()) or len(npz["user_index"]) != data.n_users:
        raise LeanmlError(f"run {path} was trained on other items or users than this data; evaluate with the "
                          "dataset and seed it was trained on")
    dense = {k[len("dense__"):]: npz[k] for k in npz.files if k.startswith("dense__")}
    items = ItemFeatures(np.zeros((data.n_items, 0), np.int64), dense.get("raw"), 0, 0, decoded=dense.get("codeword"))
    state = {"user_index": npz["user_index"], "item_sparse": item_sparse, "specs": report["fields"]}
    builder = FieldBuilder(None, items, cfg, state=state)
    model = build_ctr_model(cfg, builder)
    try:
        model.load_state_dict(load_file(str(path / "model.safetensors")))
    except Exception as exc:  # safetensors' own error types, a truncated file, shapes that do not match
        raise LeanmlError(f"{path / 'model.safetensors'} cannot be loaded ({str(exc).splitlines()[0]}); "
                          "train the run again") from None
    return model.eval(), builder, report


def read_run_report(path: str | Path) -> dict[str, Any]:
    """``report.json`` of a run folder, checked: valid JSON with the keys evaluation needs."""
    path = Path(path)
    file = path / "report.json"
    if not file.is_file():
        raise LeanmlError(f"{path} has no report.json; pass a folder written by `leanml ctr train --out`")
    try:
        report = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LeanmlError(f"{file} is not valid JSON ({exc}); the run folder is damaged: train it again") from None
    if not isinstance(report, dict) or not isinstance(report.get("config"), dict) or "fields" not in report:
        raise LeanmlError(f"{file} lacks the run's config or fields; the run folder is damaged: train it again")
    return report


def run_config(report: dict[str, Any], path: str | Path) -> CTRConfig:
    """The :class:`CTRConfig` a run report records (a damaged one is a one-line error)."""
    try:
        return CTRConfig(**report["config"])
    except (TypeError, AttributeError) as exc:
        raise LeanmlError(f"{Path(path) / 'report.json'} has a config this version cannot read ({exc}); "
                          "train the run again") from None


def evaluate_run(model: CTRModel, builder: FieldBuilder, data: CTRData) -> dict[str, float]:
    """Metrics of a trained model on ``data.test``."""
    sparse, dense, labels = builder.tensors(data.test)
    return ctr_metrics(labels.numpy(), predict(model, sparse, dense), data.test["user"].to_numpy(), data.test_is_new)


def items_from_table(data: CTRData, table_path: str | Path, raw: np.ndarray | None = None,
                     on_missing: str = "error") -> tuple[ItemFeatures, CTRData, dict[str, Any]]:
    """Item features from a serving table (schema: ``content_ids.schema``). Ads of the log missing from
    the table raise an error naming the first one (``on_missing="error"``), or their log rows are dropped,
    counted and reported (``"skip"``); ads in the table with no IDs are treated as missing."""
    from leanml.ctr.content_ids.schema import read_table

    if on_missing not in ("error", "skip"):
        raise LeanmlError(f"on_missing={on_missing!r}; use 'error' or 'skip'")
    table = read_table(table_path, on_empty=on_missing)
    codes, missing = table.lookup(data.item_ids)
    used = np.zeros(data.n_items, dtype=bool)
    used[data.train["item"].to_numpy()] = True
    used[data.test["item"].to_numpy()] = True
    bad = missing & used
    info = {"table": str(table_path), "M": table.m, "K": table.k, "codebook": table.codebook,
            "ads_missing": int(bad.sum()), "ads_without_ids_in_table": len(table.skipped),
            "rows_dropped_train": 0, "rows_dropped_test": 0}
    if bad.any():
        if on_missing == "error":
            raise LeanmlError(f"{int(bad.sum())} ads in the click log have no content IDs in {table_path} "
                              f"(first: ad {int(data.item_ids[bad][0])}); re-run `assign` on all ads or pass "
                              "--on-missing skip")
        keep_tr = ~bad[data.train["item"].to_numpy()]
        keep_te = ~bad[data.test["item"].to_numpy()]
        info["rows_dropped_train"] = int((~keep_tr).sum())
        info["rows_dropped_test"] = int((~keep_te).sum())
        data = CTRData(**{**data.__dict__, "train": data.train[keep_tr].reset_index(drop=True),
                          "test": data.test[keep_te].reset_index(drop=True)})
    codes = np.where(missing[:, None], 0, codes)  # rows of ads without IDs are never used (dropped above)
    return ItemFeatures(codes, raw, table.m, table.k, table.codebook), data, info
