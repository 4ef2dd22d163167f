"""End-to-end CTR experiments: fit content IDs on old ads, build fields, train a CTR model, evaluate.

Feature sets (``--features``, any of ``id``, ``raw``, ``visual`` joined by ``,`` or ``+``):

- ``id``: the ad-ID embedding. Ads never seen in training map to the unseen-ad row 0 (zero-initialised;
  trained only through ``id_dropout``, default 0.1): a new ad looks like "an average ad" -- the
  cold-start failure the visual IDs address.
- ``raw``: the continuous content vector (pre-quantization output of the content-ID extractor)
  through a small MLP, as one field.
- ``visual``: the ``M`` visual IDs as one bag field (an ``M * K``-row embedding table, mean-pooled),
  learned from clicks.

User ID and context are always fields. The content-ID model is fitted on the old ads only (their content
and captions, never clicks), so nothing about a new ad is seen before test time.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from leanml.ctr.content_ids.quantizer import global_ids, usage_stats
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
from leanml.ctr.models import CTRModel, FieldSpec, build_model
from leanml.utils import LeanmlError, atomic_dir, cache_dir, default_device, write_json

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
    """Per-item content features: global visual IDs ``(n_items, M)`` and continuous vectors ``(n_items, D)``."""

    visual_ids: np.ndarray
    raw: np.ndarray
    m: int
    k: int
    usage: dict[str, Any] = field(default_factory=dict)


def content_items(data: CTRData, model: ContentIDModel) -> ItemFeatures:
    """Embed every item (old and new) with a fitted content-ID model."""
    z, codes = embed_all(model, data.content)
    cfg = model.config
    return ItemFeatures(np.asarray(global_ids(codes, cfg.k), dtype=np.int64), z.astype(np.float32), cfg.m, cfg.k,
                        usage_stats(codes, cfg.k).as_dict())


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
    return cfg


def fit_dataset_content_ids(
    data: CTRData, config: ContentIDConfig, use_cache: bool = True, progress: bool = True
) -> tuple[ContentIDModel, dict[str, Any]]:
    """Fit a content-ID model on the *old* items of ``data`` (cached on disk by config + data hash)."""
    from leanml.ctr.content_ids.encoders import embed_texts

    old = data.old_items
    key_src = json.dumps({"cfg": asdict(config), "data": data.summary()}, sort_keys=True, default=str)
    key = hashlib.sha256(key_src.encode()).hexdigest()[:20]
    path = cache_dir() / "content_ids" / f"{data.name}-{key}"
    if use_cache and (path / "model.safetensors").exists():
        return load_content_model(path), json.loads((path / "report.json").read_text())
    captions = [data.captions[i] for i in old]
    # embed all captions (one cache entry per dataset), then keep the old items' rows
    text = embed_texts(data.captions)[old] if config.loss == "infonce" else None
    model, report = fit_content_ids(data.content[torch.as_tensor(old)], captions, config, text_emb=text,
                                    device=default_device(), progress=progress)
    model = model.cpu()
    report["fitted_on"] = f"{len(old)} old items of {data.name}"
    if use_cache:
        save_content_model(model, path, report, overwrite=True)
    return model, report


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
    seed: int = 0

    def __post_init__(self) -> None:
        if self.lr is None:
            self.lr = DEFAULT_LR.get(self.model.lower(), 5e-3)


# DCNv2's cross layers multiply small initial embeddings, so it learns slowly at 5e-3 within 3 epochs
# (measured on Fashion: visual-ID AUC on new ads 0.614 at 5e-3 vs 0.689 at 1e-2).
DEFAULT_LR = {"lr": 5e-3, "dnn": 5e-3, "deepfm": 5e-3, "dcnv2": 1e-2}


class FieldBuilder:
    """Turns a log (``user``, ``item``, ``context``) into the model's sparse / dense input tensors."""

    def __init__(self, data: CTRData, items: ItemFeatures | None, features: str) -> None:
        self.features = parse_features(features)
        parts = set(self.features.split("+"))
        if parts & {"raw", "visual"} and items is None:
            raise LeanmlError(f"features {self.features!r} need content features (fit content IDs first)")
        self.parts = parts
        self.items = items
        seen = np.zeros(data.n_items, dtype=bool)
        seen[data.train["item"].to_numpy()] = True
        self.ad_index = np.where(seen, np.arange(data.n_items) + 1, 0)  # 0 = unseen ad (never trained)
        self.specs = [FieldSpec("user", data.n_users), FieldSpec("context", data.n_contexts)]
        if "id" in parts:
            self.specs.append(FieldSpec("ad", data.n_items + 1))
        if "visual" in parts:
            assert items is not None
            self.specs.append(FieldSpec("visual", items.m * items.k, bag=True))
        self.dense_dims = {"raw": int(items.raw.shape[1])} if "raw" in parts and items is not None else {}

    def tensors(self, log: pd.DataFrame) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor]:
        item = log["item"].to_numpy()
        sparse = {"user": torch.tensor(log["user"].to_numpy(), dtype=torch.long),
                  "context": torch.tensor(log["context"].to_numpy(), dtype=torch.long)}
        if "id" in self.parts:
            sparse["ad"] = torch.as_tensor(self.ad_index[item], dtype=torch.long)
        if "visual" in self.parts:
            assert self.items is not None
            sparse["visual"] = torch.as_tensor(self.items.visual_ids[item], dtype=torch.long)
        dense = {}
        if "raw" in self.parts:
            assert self.items is not None
            dense["raw"] = torch.as_tensor(self.items.raw[item], dtype=torch.float32)
        return sparse, dense, torch.tensor(log["label"].to_numpy(), dtype=torch.float32)


@torch.no_grad()
def zero_unseen_ad(model: CTRModel) -> None:
    """Set the unseen-ad row 0 of the ``ad`` field to zero (embedding and first-order weight), so an ad
    without training rows contributes nothing instead of random noise (unless ``id_dropout`` trains it)."""
    emb = model.embeddings
    if "ad" in emb.emb:
        emb.emb["ad"].weight[0].zero_()
    if "ad" in emb.lin:
        emb.lin["ad"].weight[0].zero_()


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
    bar = tqdm(total=config.epochs * steps, desc=f"{config.model} {config.features}", disable=not progress, leave=False)
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


def run_ctr(
    data: CTRData, items: ItemFeatures | None, config: CTRConfig, progress: bool = True,
    device: torch.device | None = None,
) -> tuple[CTRModel, FieldBuilder, dict[str, Any]]:
    """Train one CTR model on ``data.train`` and evaluate on ``data.test`` (new / old ads)."""
    data.check_split()
    torch.manual_seed(config.seed)
    builder = FieldBuilder(data, items, config.features)
    config.features = builder.features
    model = build_model(config.model, builder.specs, builder.dense_dims, embed_dim=config.embed_dim)
    zero_unseen_ad(model)
    sparse, dense, labels = builder.tensors(data.train)
    history = train_ctr_model(model, sparse, dense, labels, config, device, progress)
    t_sparse, t_dense, t_labels = builder.tensors(data.test)
    probs = predict(model, t_sparse, t_dense)
    metrics = ctr_metrics(t_labels.numpy(), probs, data.test["user"].to_numpy(), data.test_is_new)
    report = {"config": asdict(config), "train_loss": history, "metrics": metrics, "data": data.summary()}
    return model, builder, report


def record(dataset: str, config: CTRConfig, metrics: dict[str, float]) -> dict[str, Any]:
    """A benchmark record with the fixed keys of ``bench/results/ctr.json``."""
    rec: dict[str, Any] = {"dataset": dataset, "model": config.model, "features": config.features, "seed": config.seed}
    for key in ("auc_new", "auc_old", "gauc_new", "gauc_old", "logloss_new", "logloss_old"):
        rec[key] = metrics[key]
    return rec


def save_ctr_run(out: str | Path, model: CTRModel, builder: FieldBuilder, report: dict[str, Any],
                 overwrite: bool = False) -> Path:
    """Write ``model.safetensors``, ``items.npz`` (per-item features) and ``report.json`` atomically."""
    from safetensors.torch import save_file

    with atomic_dir(out, overwrite=overwrite) as tmp:
        save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, str(tmp / "model.safetensors"))
        items = builder.items
        np.savez(tmp / "items.npz", ad_index=builder.ad_index,
                 visual_ids=items.visual_ids if items is not None else np.zeros((0, 0), np.int64),
                 raw=items.raw if items is not None else np.zeros((0, 0), np.float32),
                 mk=np.array([items.m, items.k] if items is not None else [0, 0]))
        write_json(tmp / "report.json", report)
    return Path(out)


def load_ctr_run(path: str | Path, data: CTRData) -> tuple[CTRModel, FieldBuilder, dict[str, Any]]:
    """Load a run written by :func:`save_ctr_run` for evaluation on ``data`` (same dataset and seed)."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / "report.json").exists() or not (path / "model.safetensors").exists():
        raise LeanmlError(f"{path} is not a CTR run folder; create one with `leanml ctr train --out DIR`")
    report = json.loads((path / "report.json").read_text())
    cfg = CTRConfig(**report["config"])
    npz = np.load(path / "items.npz")
    m, k = (int(v) for v in npz["mk"])
    items = ItemFeatures(npz["visual_ids"], npz["raw"], m, k) if m else None
    if items is not None and len(items.visual_ids) != data.n_items:
        raise LeanmlError(f"run {path} has features for {len(items.visual_ids)} items but the data has {data.n_items}; "
                          "evaluate with the dataset and seed it was trained on")
    builder = FieldBuilder(data, items, cfg.features)
    builder.ad_index = npz["ad_index"]
    model = build_model(cfg.model, builder.specs, builder.dense_dims, embed_dim=cfg.embed_dim)
    model.load_state_dict(load_file(str(path / "model.safetensors")))
    return model.eval(), builder, report


def evaluate_run(model: CTRModel, builder: FieldBuilder, data: CTRData) -> dict[str, float]:
    """Metrics of a trained model on ``data.test``."""
    sparse, dense, labels = builder.tensors(data.test)
    return ctr_metrics(labels.numpy(), predict(model, sparse, dense), data.test["user"].to_numpy(), data.test_is_new)


def items_from_table(data: CTRData, table_path: str | Path, raw: np.ndarray | None = None,
                     on_missing: str = "error") -> tuple[ItemFeatures, CTRData, dict[str, Any]]:
    """Item features from an exported visual-ID table. Ads of the log missing from the table raise
    (``on_missing="error"``) or their log rows are dropped, counted and reported (``"skip"``)."""
    from leanml.ctr.content_ids.assign import lookup_visual_ids, read_visual_ids

    t_ids, t_vis, m, k = read_visual_ids(table_path)
    vis, missing = lookup_visual_ids(t_ids, t_vis, data.item_ids)
    used = np.zeros(data.n_items, dtype=bool)
    used[data.train["item"].to_numpy()] = True
    used[data.test["item"].to_numpy()] = True
    bad = missing & used
    info = {"table": str(table_path), "ads_missing": int(bad.sum()), "rows_dropped_train": 0, "rows_dropped_test": 0}
    if bad.any():
        examples = ", ".join(str(a) for a in data.item_ids[bad][:5])
        if on_missing == "error":
            raise LeanmlError(f"{int(bad.sum())} ads in the click log have no visual IDs in {table_path} "
                              f"(e.g. ad {examples}); re-run `assign` on all ads or pass --on-missing skip")
        keep_tr = ~bad[data.train["item"].to_numpy()]
        keep_te = ~bad[data.test["item"].to_numpy()]
        info["rows_dropped_train"] = int((~keep_tr).sum())
        info["rows_dropped_test"] = int((~keep_te).sum())
        data = CTRData(**{**data.__dict__, "train": data.train[keep_tr].reset_index(drop=True),
                          "test": data.test[keep_te].reset_index(drop=True)})
    vis = np.where(vis < 0, 0, vis)
    raw_arr = raw if raw is not None else np.zeros((data.n_items, 1), np.float32)
    return ItemFeatures(vis, raw_arr, m, k), data, info
