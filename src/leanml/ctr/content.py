"""Content features of every ad: content IDs fitted on the old ads (cached on disk), or read from a serving
table, and the bytes each ad stores for them."""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from leanml.ctr.content_ids.quantizer import usage_stats
from leanml.ctr.content_ids.trainer import (
    ContentIDConfig,
    ContentIDModel,
    embed_all,
    fit_content_ids,
    load_content_model,
    save_content_model,
)
from leanml.ctr.data import CTRData
from leanml.device import default_device
from leanml.errors import LeanmlError
from leanml.outputs import cache_dir

# training schedule of the built-in data (a config's unset epochs / warm-up / batch size): Fashion-MNIST ad
# images ("cnn") and MovieLens content vectors ("mlp")
DATA_SCHEDULES = {"cnn": {"epochs": 8, "warmup_epochs": 2, "batch_size": 64},
                  "mlp": {"epochs": 30, "warmup_epochs": 5, "batch_size": 128}}


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


def content_config_for(data: CTRData, config: ContentIDConfig | None = None) -> ContentIDConfig:
    """``config`` (default: the defaults) for ``data``: its encoder (CNN for images, MLP for content vectors)
    and, where ``config`` leaves them unset, its training schedule."""
    config = config or ContentIDConfig()
    in_dim = int(data.content.shape[1]) if data.content_kind == "mlp" else 0
    return replace(config, kind=data.content_kind, in_dim=in_dim).scheduled(DATA_SCHEDULES[data.content_kind])


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
    t0 = time.perf_counter()
    model, report = fit_content_ids(data.content[torch.as_tensor(old)], captions, config, text_emb=text,
                                    device=default_device(), progress=progress)
    report["seconds"] = time.perf_counter() - t0
    model = model.cpu()
    report["fitted_on"] = f"{len(old)} old items of {data.name}"
    if use_cache:
        save_content_model(model, path, report, overwrite=True)
    return model, report


def items_from_table(data: CTRData, table_path: str | Path,
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
                              "on_missing skip", fields=("on_missing",))
        keep_tr = ~bad[data.train["item"].to_numpy()]
        keep_te = ~bad[data.test["item"].to_numpy()]
        info["rows_dropped_train"] = int((~keep_tr).sum())
        info["rows_dropped_test"] = int((~keep_te).sum())
        data = CTRData(**{**data.__dict__, "train": data.train[keep_tr].reset_index(drop=True),
                          "test": data.test[keep_te].reset_index(drop=True)})
    codes = np.where(missing[:, None], 0, codes)  # rows of ads without IDs are never used (dropped above)
    return ItemFeatures(codes, None, table.m, table.k, table.codebook), data, info
