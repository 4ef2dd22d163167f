"""Training and evaluation of one CTR model: the mini-batch loop, the residual ad-ID stage, and
:func:`run_ctr`, which trains on ``data.train`` and evaluates on the new and old ads of ``data.test``."""

from __future__ import annotations

import dataclasses
from dataclasses import asdict
from typing import Any

import numpy as np
import torch

from leanml.ctr.content import ItemFeatures, bytes_per_ad
from leanml.ctr.data import CTRData
from leanml.ctr.fields import FieldBuilder
from leanml.ctr.metrics import ctr_metrics
from leanml.ctr.models import CTRModel, ResidualID, build_model
from leanml.ctr.options import CTRConfig
from leanml.device import default_device
from leanml.finite import check_finite_step, lr_hint
from leanml.progress import EtaBar


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
    opt = torch.optim.Adam(model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    gen = torch.Generator().manual_seed(config.seed)
    n = len(labels)
    history = []
    steps = (n + config.batch_size - 1) // config.batch_size
    named, step = list(model.named_parameters()), 0
    hint = lr_hint(config.learning_rate, f"weight decay {config.weight_decay:g}" if config.weight_decay else "")
    bar = EtaBar(total=config.epochs * steps, desc=f"{config.model} {config.feature_set}", unit="batch",
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
            step += 1
            check_finite_step(loss, named, step, hint, "CTR training")
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
    stage2 = dataclasses.replace(config, id_dropout=0.0)
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
    config = config.resolved()  # the report records the learning rate and features used
    torch.manual_seed(config.seed)
    builder = FieldBuilder(data, items, config)
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
    rec: dict[str, Any] = {"dataset": dataset, "model": config.model, "features": config.feature_set,
                           "seed": config.seed, "seed_content": seed_content, "bytes_per_ad": bytes_ad}
    for key in ("auc_new", "auc_old", "gauc_new", "gauc_old", "logloss_new", "logloss_old", "n_new", "n_old"):
        rec[key] = metrics[key]
    rec.update(extra)
    return rec


def evaluate_run(model: CTRModel, builder: FieldBuilder, data: CTRData) -> dict[str, float]:
    """Metrics of a trained model on ``data.test``."""
    sparse, dense, labels = builder.tensors(data.test)
    return ctr_metrics(labels.numpy(), predict(model, sparse, dense), data.test["user"].to_numpy(), data.test_is_new)
