"""Benchmark: visual IDs for new-ad CTR on Fashion-MNIST ads and MovieLens-100k (cold start by time).

Stages (each one chunk under the CPU lock; results merge into bench/results/ctr.json by key, so a stage
can be rerun alone):

- ``select:<dataset>``: choose the content-ID design (codebook, M, K, joint or post-hoc codebooks, how
  the codes become fields; with DeepFM) and, per model, how the ad ID is added (ID dropout rate, or the
  residual mode) for every feature set that has it, on a validation split of the TRAINING period
  (``leanml.ctr.data.validation_split``); the test log is not read.
- ``grid:<dataset>``: the fair grid with the chosen design: feature sets id, raw, visual, id+raw,
  id+visual, id+raw+visual x models LR, DNN, DeepFM, DCNv2 x seeds (default 0-4); seed ``s`` fits the
  content-ID model with seed ``s`` AND trains the CTR model with seed ``s``. On Fashion also the content
  ceiling: DeepFM / DCNv2 on the click generator's own content of each ad.

Writes bench/results/ctr.{json,md,png}; the Markdown is generated from the JSON records.

    python bench/ctr.py --only select:fashion        # ~10 min on one shared core
    python bench/ctr.py --only grid:fashion          # ~15 min
    python bench/ctr.py --only select:movielens,grid:movielens
    python bench/ctr.py --render-only
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from _common import markers, replace_block
from leanml.config import as_dict
from leanml.ctr.content import (
    ItemFeatures,
    bytes_per_ad,
    content_config_for,
    content_items,
    fit_dataset_content_ids,
)
from leanml.ctr.content_ids.config import ContentIDConfig
from leanml.ctr.data import CTRData, image_attributes, load_dataset, validation_split
from leanml.ctr.metrics import bootstrap_auc_diff_se
from leanml.ctr.options import DEFAULT_LR, CTRConfig
from leanml.ctr.train import record, run_ctr
from leanml.machine import machine_info, machine_line
from leanml.outputs import atomic_file, write_json

RESULTS = Path(__file__).parent / "results"
DATASETS = ("fashion", "movielens")
MODELS = ("lr", "dnn", "deepfm", "dcnv2")
FEATURES = ("id", "raw", "visual", "id+raw", "id+visual", "id+raw+visual")
TARGET_MODELS = ("deepfm", "dcnv2")
METRICS = ("auc_new", "auc_old", "gauc_new", "gauc_old", "logloss_new", "logloss_old")
# the issue's targets on new-ad AUC: (name, a, b, threshold on a - b, datasets (None: all), also asks for
# >= 10x fewer bytes per ad with visual than with raw)
TARGETS = (("id+visual ≥ id+raw − 0.005 at ≥ 10× fewer bytes", "id+visual", "id+raw", -0.005, None, True),
           ("id+raw+visual ≥ id+raw + 0.003", "id+raw+visual", "id+raw", 0.003, None, False),
           ("adding the ad ID: id+visual ≥ visual − 0.002", "id+visual", "visual", -0.002, None, False),
           ("Fashion: id+visual − id ≥ 0.05", "id+visual", "id", 0.05, ("fashion",), False))
# the feature-set pairs the targets compare; their new-ad scores are kept for the test-set bootstrap
TARGET_PAIRS = tuple(dict.fromkeys((t[1], t[2]) for t in TARGETS))
TARGET_FEATURES = {f for pair in TARGET_PAIRS for f in pair}
N_BOOT = 1000
# how the ad ID is added: (id_mode, id_dropout); "residual" learns the ID as a correction on a frozen
# model without it, so a new ad's prediction is that model's
ID_OPTIONS: list[tuple[str, float]] = [("dropout", 0.0), ("dropout", 0.1), ("dropout", 0.25), ("dropout", 0.5),
                                       ("residual", 0.0)]




# each feature set with the ad ID against the same features without it (``id`` alone has no reference)
ID_REFERENCE = {"id": None, "id+raw": "raw", "id+visual": "visual", "id+raw+visual": "raw+visual"}


def option_name(mode: str, p: float) -> str:
    return "residual" if mode == "residual" else f"dropout {p:g}"


SELECT_SEEDS = (0, 1, 2)
# content-ID fits each design is compared on: every fit trains its own encoder, and with one fit per design
# the raw vector's own validation AUC on MovieLens differed by 0.026 between the five post-hoc designs
SELECT_FIT_SEEDS = (0, 1, 2)
FORMAT = 3  # results of an older record format are not merged: the file starts afresh
# How the continuous (raw) vector is L2-normalized: in G equal groups, chosen on validation by raw's own
# new-ad AUC before the designs are compared; every post-hoc design then uses it, so the designs of one seed
# share one raw vector (jointly trained pq keeps one group per sub-space). Fitted with NORM_PROBE, a post-hoc
# design whose codes do not touch the vector (and one of the candidates, so its fits are reused).
NORM_GROUPS = (1, 4, 8, 16)
NORM_PROBE = {"codebook": "pq", "m": 4, "k": 256, "joint": False}

# Content-ID designs compared on the validation split: (label, content-ID options, variants). A variant
# (visual_fields, codeword_vector) says how the M codes enter the CTR model: "bag" (the first format: one
# pooled table), "codes" (a table per position), "prefix" (prefix n-gram tables, for residual codes),
# "none" (no learned table), each with or without the codeword vector (codebook lookup -> MLP).
CANDIDATES: list[tuple[str, dict[str, Any], list[tuple[str, bool]]]] = [
    ("pq M4 K16 joint", {"codebook": "pq", "m": 4, "k": 16, "joint": True},
     [("bag", False), ("codes", False), ("codes", True), ("none", True)]),
    ("pq M4 K16 joint, no re-seeding", {"codebook": "pq", "m": 4, "k": 16, "joint": True, "reseed_dead": False},
     [("codes", False), ("none", True)]),
    ("pq M4 K64 joint", {"codebook": "pq", "m": 4, "k": 64, "joint": True}, [("codes", False), ("none", True)]),
    ("pq M4 K256 post-hoc", {"codebook": "pq", "m": 4, "k": 256, "joint": False},
     [("codes", False), ("codes", True), ("none", True)]),
    ("pq M8 K256 post-hoc", {"codebook": "pq", "m": 8, "k": 256, "joint": False}, [("codes", True), ("none", True)]),
    ("rq M4 K64 joint", {"codebook": "rq", "m": 4, "k": 64, "joint": True}, [("prefix", False), ("none", True)]),
    ("rq M4 K256 post-hoc", {"codebook": "rq", "m": 4, "k": 256, "joint": False},
     [("prefix", False), ("prefix", True), ("none", True)]),
    ("rq M8 K256 post-hoc", {"codebook": "rq", "m": 8, "k": 256, "joint": False}, [("none", True)]),
    ("pq M16 K64 post-hoc", {"codebook": "pq", "m": 16, "k": 64, "joint": False}, [("none", True)]),
]


def variant_name(fields: str, cw: bool) -> str:
    base = {"none": "codeword vector", "bag": "pooled bag", "codes": "code fields", "prefix": "prefix n-grams",
            "codes+prefix": "codes + prefixes"}[fields]
    return f"{base} + codeword vector" if cw and fields != "none" else base


def ms(values: list[float]) -> str:
    v = np.asarray(values, dtype=float)
    return f"{v.mean():.4f} ± {v.std(ddof=1):.4f}" if len(v) > 1 else f"{v.mean():.4f}"


def group(records: list[dict[str, Any]], **match: Any) -> list[dict[str, Any]]:
    return [r for r in records if all(r.get(k) == v for k, v in match.items())]


def auc_se(auc: float, n_pos: int, n_neg: int) -> float:
    """Hanley-McNeil standard error of an AUC measured on ``n_pos`` positives and ``n_neg`` negatives."""
    q1, q2 = auc / (2 - auc), 2 * auc * auc / (1 + auc)
    var = (auc * (1 - auc) + (n_pos - 1) * (q1 - auc * auc) + (n_neg - 1) * (q2 - auc * auc)) / (n_pos * n_neg)
    return float(math.sqrt(max(var, 0.0)))


class Stage:
    """Wall time, CPU time and load of one stage, for the report."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> Stage:
        self.t0, self.c0, self.load0 = time.perf_counter(), time.process_time(), os.getloadavg()
        return self

    def __exit__(self, *exc: object) -> None:
        self.info = {"wall_s": time.perf_counter() - self.t0, "cpu_s": time.process_time() - self.c0,
                     "load_before": self.load0, "load_after": os.getloadavg(),
                     "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                     "finished": time.strftime("%Y-%m-%d %H:%M:%S")}


def fit_seconds(fit: dict[str, Any]) -> str:
    """A fit's seconds for the tables: measured in the run, the cached run's (marked), or unknown ("–")."""
    if fit.get("seconds") is not None:
        return f"{fit['seconds']:.0f}"
    if fit.get("cached_fit_seconds") is not None:
        return f"{fit['cached_fit_seconds']:.0f} (cached)"
    return "–"


def fit_items(data: CTRData, seed: int, overrides: dict[str, Any]) -> tuple[ItemFeatures, dict[str, Any]]:
    """Fit (or load from the cache) a content-ID model on ``data``'s old ads; item features and fit facts."""
    cfg = content_config_for(data, ContentIDConfig(seed=seed, **overrides))
    model, report = fit_dataset_content_ids(data, cfg, use_cache=True, progress=False)
    items = content_items(data, model)
    def rel_err(rows: np.ndarray) -> float | None:
        if rows.size == 0:
            return None
        z, zq = items.raw[rows], items.decoded[rows]
        return float(((z - zq) ** 2).sum(1).mean() / (z**2).sum(1).mean())

    # a fit loaded from the cache was not timed here: its seconds are the cached run's, recorded apart
    cached = bool(report.get("cached"))
    fit = {"seed_content": seed, "seconds": None if cached else report.get("seconds"), "cached": cached,
           "cached_fit_seconds": report.get("seconds") if cached else None, "caption_top1": report.get("caption_top1"),
           "usage": items.usage, "reseeded": [h.get("reseeded") for h in report["history"] if "reseeded" in h],
           # on the old ads the codebooks were fit on, and on the new ads they never saw
           "quant_rel_err": rel_err(data.old_items),
           "quant_rel_err_new": rel_err(np.flatnonzero(data.is_new_item)),
           "codebook_bytes": int(items.m * items.k * (items.decoded.shape[1] // (items.m if items.codebook == "pq"
                                                                                  else 1)) * 4)}
    return items, fit


def content_oracle(data: CTRData) -> ItemFeatures:
    """Fashion only: the generator's own content of every ad -- class one-hot and the three z-scored pixel
    attributes the clicks were drawn from -- as a ``raw`` vector. A CTR model on it shows how far any content
    feature can take new ads with this log and training budget (the ad's hidden quality stays unknown)."""
    if data.item_labels is None:
        raise ValueError(f"{data.name} has no generator content to build an oracle from")
    attrs = image_attributes(data.content.numpy())
    attrs = (attrs - attrs.mean(0)) / attrs.std(0).clip(1e-6)
    x = np.concatenate([np.eye(10)[data.item_labels], attrs], 1).astype(np.float32)
    return ItemFeatures(data.item_labels[:, None].astype(np.int64), x, 1, 10)


def val_runs(val: CTRData, items: ItemFeatures, features: str, **cfg: Any) -> dict[str, float]:
    """A CTR model (DeepFM unless ``cfg`` names another) on the validation split, averaged over SELECT_SEEDS."""
    out = []
    for s in SELECT_SEEDS:
        _, _, rep = run_ctr(val, items, CTRConfig(**{"model": "deepfm", **cfg}, features=features, seed=s),
                            progress=False)
        out.append(rep["metrics"])
    return {k: float(np.mean([m[k] for m in out])) for k in ("auc_new", "auc_old", "gauc_new")}


def choose_id_option(rows: list[dict[str, Any]], features: str, reference: dict[str, float] | None
                     ) -> dict[str, Any]:
    """How to add the ad ID to ``features``: the best validation old-ad AUC among the options whose validation
    new-ad AUC is within 0.002 of the same features without the ad ID (``reference``); if none is, the best
    new-ad AUC. For ``id`` alone (no reference) the best mean of new- and old-ad AUC."""
    cands = [r for r in rows if r["features"] == features]
    if reference is None:
        best = max(cands, key=lambda r: r["auc_new"] + r["auc_old"])
    else:
        ok = [r for r in cands if r["auc_new"] >= reference["auc_new"] - 0.002]
        best = max(ok, key=lambda r: r["auc_old"]) if ok else max(cands, key=lambda r: r["auc_new"])
    return {"id_mode": best["id_mode"], "id_dropout": best["id_dropout"], "option": best["option"]}


def stage_select(name: str, out: dict[str, Any]) -> None:
    data = load_dataset(name)
    val = validation_split(data)
    out.setdefault("val_data", {})[name] = val.summary()
    cand_rows = []
    best: tuple[float, dict[str, Any]] | None = None
    raw_bytes = None
    def over_fits(fitted: tuple[ItemFeatures, ...], features: str, **cfg: Any) -> dict[str, float]:
        runs = [val_runs(val, it, features, **cfg) for it in fitted]
        return {k: float(np.mean([r[k] for r in runs])) for k in runs[0]}

    norm_rows = []
    for g in tqdm(NORM_GROUPS, desc=f"{name} raw-vector normalization"):
        fitted = tuple(fit_items(val, s, {**NORM_PROBE, "norm_groups": g})[0] for s in SELECT_FIT_SEEDS)
        norm_rows.append({"norm_groups": g, **over_fits(fitted, "raw")})
    norm_groups = max(norm_rows, key=lambda r: r["auc_new"])["norm_groups"]
    for label, ov, variants in tqdm(CANDIDATES, desc=f"{name} designs"):
        if not ov.get("joint", True):
            ov = {**ov, "norm_groups": norm_groups}
        fitted, fits = zip(*(fit_items(val, s, ov) for s in SELECT_FIT_SEEDS))
        items, fit = fitted[0], fits[0]
        raw_ref = over_fits(fitted, "raw")
        raw_bytes = bytes_per_ad("raw", items)
        fit_means = {k: float(np.mean([f[k] for f in fits])) for k in ("quant_rel_err", "quant_rel_err_new")
                     if all(f.get(k) is not None for f in fits)}
        for fields, cw in variants:
            vis = over_fits(fitted, "visual", visual_fields=fields, codeword_vector=cw)
            idvis = over_fits(fitted, "id+visual", visual_fields=fields, codeword_vector=cw)
            row = {"design": label, "content": ov, "visual_fields": fields, "codeword_vector": cw,
                   "variant": variant_name(fields, cw), "bytes_per_ad": bytes_per_ad("visual", items),
                   "raw_bytes_per_ad": raw_bytes, "fit": fit, "fit_seeds": list(SELECT_FIT_SEEDS),
                   "fit_means": fit_means, "raw_auc_new": raw_ref["auc_new"],
                   "visual_auc_new": vis["auc_new"], "visual_auc_old": vis["auc_old"],
                   "id+visual_auc_new": idvis["auc_new"], "id+visual_auc_old": idvis["auc_old"]}
            cand_rows.append(row)
            score = 0.5 * (vis["auc_new"] + idvis["auc_new"])
            if row["bytes_per_ad"] * 10 <= raw_bytes and (best is None or score > best[0]):
                best = (score, row)
    assert best is not None
    chosen = {"design": best[1]["design"], "content": best[1]["content"],
              "visual_fields": best[1]["visual_fields"], "codeword_vector": best[1]["codeword_vector"]}
    items, _ = fit_items(val, 0, chosen["content"])
    vis_cfg = {"visual_fields": chosen["visual_fields"], "codeword_vector": chosen["codeword_vector"]}
    # raw and the codeword vector together: one field each, or one content tower (per model); these runs
    # are also the references of the ad-ID choice below
    runs: dict[tuple[str, str, bool], dict[str, float]] = {}  # (model, features, tower) -> validation metrics
    if chosen["codeword_vector"]:
        for model in MODELS:
            runs[model, "raw", False] = val_runs(val, items, "raw", model=model)
            for tower in (False, True):
                runs[model, "raw+visual", tower] = val_runs(val, items, "raw+visual", model=model,
                                                            content_tower=tower, **vis_cfg)
    tower_rows = [{"model": m, "raw": runs[m, "raw", False]["auc_new"],
                   "apart": runs[m, "raw+visual", False]["auc_new"],
                   "tower": runs[m, "raw+visual", True]["auc_new"]} for m in MODELS if (m, "raw", False) in runs]
    chosen["tower"] = {r["model"]: bool(r["tower"] > r["apart"]) for r in tower_rows}
    # how the ad ID is added: chosen per model and feature set, against the same model without the ad ID
    refs: dict[str, dict[str, dict[str, float]]] = {}
    drop_rows: list[dict[str, Any]] = []
    chosen["id"] = {}
    for model in tqdm(MODELS, desc=f"{name} ad-ID handling"):
        both_cfg = {**vis_cfg, "content_tower": chosen["tower"].get(model, False)}  # raw and visual together
        refs[model] = {}
        for f in ("raw", "visual", "raw+visual"):
            cfg = both_cfg if f == "raw+visual" else vis_cfg
            key = (model, f, bool(cfg.get("content_tower")))
            refs[model][f] = runs[key] if key in runs else val_runs(val, items, f, model=model, **cfg)
        rows = []
        for features in ID_REFERENCE:
            for mode, p in ID_OPTIONS:
                rows.append({"model": model, "features": features, "id_mode": mode, "id_dropout": p,
                             "option": option_name(mode, p),
                             **val_runs(val, items, features, model=model, id_mode=mode, id_dropout=p,
                                        **(both_cfg if features == "id+raw+visual" else vis_cfg))})
        drop_rows += rows
        chosen["id"][model] = {f: choose_id_option(rows, f, refs[model][r] if r else None)
                               for f, r in ID_REFERENCE.items()}
    out.setdefault("selection", {})[name] = {"candidates": cand_rows, "dropout": drop_rows, "tower": tower_rows,
                                             "references": refs, "chosen": chosen, "norm": norm_rows}


def stage_grid(name: str, out: dict[str, Any], seeds: list[int], models: tuple[str, ...] = MODELS) -> None:
    sel = out.get("selection", {}).get(name)
    if sel is None:
        raise SystemExit(f"run --only select:{name} first: the grid uses the design chosen on validation")
    chosen = sel["chosen"]
    data = load_dataset(name)
    out.setdefault("data", {})[name] = data.summary()
    y, new = data.test["label"].to_numpy(), data.test_is_new
    ads = data.test["item"].to_numpy()[new]  # the ad of every new-ad test row, for the bootstrap
    out.setdefault("test_counts", {})[name] = {"new_pos": int(y[new].sum()), "new_neg": int((1 - y[new]).sum()),
                                               "old_pos": int(y[~new].sum()), "old_neg": int((1 - y[~new]).sum())}
    records = [r for r in out.get("records", [])
               if r["dataset"] != name or r["seed"] not in seeds or r["model"] not in models]
    fits = [f for f in out.get("content_fits", []) if f["dataset"] != name or f["seed_content"] not in seeds]
    ablation = [a for a in out.get("tower_ablation", [])
                if a["dataset"] != name or a["seed"] not in seeds or a["model"] not in models]
    scores: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for seed in seeds:
        items, fit = fit_items(data, seed, chosen["content"])
        fits.append({"dataset": name, "design": chosen["design"], **fit})
        for model in tqdm(models, desc=f"{name} seed {seed}"):
            for features in FEATURES:
                how = chosen["id"][model].get(features, {"id_mode": "dropout", "id_dropout": 0.0, "option": "–"})
                tower = {"raw", "visual"} <= set(features.split("+")) and chosen.get("tower", {}).get(model, False)
                cfg = CTRConfig(model=model, features=features, seed=seed, id_dropout=how["id_dropout"],
                                id_mode=how["id_mode"], content_tower=tower,
                                visual_fields=chosen["visual_fields"], codeword_vector=chosen["codeword_vector"])
                t = time.perf_counter()
                keep = model in TARGET_MODELS and features in TARGET_FEATURES  # new-ad scores for the bootstrap
                _, _, rep = run_ctr(data, items, cfg, progress=False, keep_test_probs=keep)
                if keep:
                    scores.setdefault((model, features), {})[seed] = rep.pop("test_probs")[new]
                records.append(record(name, cfg, rep["metrics"], seed_content=seed, bytes_ad=rep["bytes_per_ad"],
                                      id_dropout=how["id_dropout"], id_mode=how["id_mode"], id_option=how["option"],
                                      content_tower=tower,
                                      train_s=time.perf_counter() - t))
                if features == "id+raw+visual" and chosen["codeword_vector"] and model in TARGET_MODELS:
                    # the other way of joining raw and the codeword vector, for the report only (not a choice)
                    other = dataclasses.replace(cfg, content_tower=not tower)
                    _, _, rep = run_ctr(data, items, other, progress=False)
                    ablation.append({"dataset": name, "model": model, "seed": seed, "content_tower": not tower,
                                     **{k: rep["metrics"][k] for k in METRICS}})
    if data.item_labels is not None:  # the content ceiling (generator's own content), same models and seeds
        oracle = content_oracle(data)
        ceiling = [c for c in out.get("ceiling", [])
                   if c["dataset"] != name or c["seed"] not in seeds or c["model"] not in models]
        for seed in tqdm(seeds, desc=f"{name} content oracle"):
            for model in [m for m in TARGET_MODELS if m in models]:
                cfg = CTRConfig(model=model, features="raw", seed=seed)
                _, _, rep = run_ctr(data, oracle, cfg, progress=False)
                ceiling.append({"dataset": name, "model": model, "seed": seed,
                                **{k: rep["metrics"][k] for k in METRICS}})
        out["ceiling"] = ceiling
    out["records"], out["content_fits"], out["tower_ablation"] = records, fits, ablation
    out["seeds"] = sorted({r["seed"] for r in records})
    row_se = out.setdefault("row_se", {})
    row_se.setdefault(name, {})
    for model in [m for m in TARGET_MODELS if m in models]:
        for a, b in TARGET_PAIRS:
            sa, sb = scores.get((model, a), {}), scores.get((model, b), {})
            common = sorted(set(sa) & set(sb))
            if common:
                pa, pb = [sa[s] for s in common], [sb[s] for s in common]
                row_se[name][f"{model}|{a}|{b}"] = {
                    # resampling whole new ads: an ad's rows share its content features, so their errors move
                    # together; the row bootstrap (kept for comparison) treats them as independent
                    "se": bootstrap_auc_diff_se(y[new], pa, pb, n_boot=N_BOOT, seed=0, groups=ads),
                    "se_rows": bootstrap_auc_diff_se(y[new], pa, pb, n_boot=N_BOOT, seed=0),
                    "unit": "ad", "seeds": common, "n_boot": N_BOOT}


def _grid_covers(key: str, stage: str, seeds: set[int], models: set[str]) -> bool:
    """Whether the grid stage ``key`` ("grid:<dataset> seeds 0,1 models lr,dnn") ran only seeds and models
    that a new run of ``stage`` over ``seeds`` x ``models`` recomputes."""
    head, _, rest = key.partition(" seeds ")
    if head != stage or " models " not in rest:
        return False
    old_seeds, _, old_models = rest.partition(" models ")
    return {int(x) for x in old_seeds.split(",")} <= seeds and set(old_models.split(",")) <= models


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(f"{s}:{d}" for d in DATASETS for s in ("select", "grid")),
                    help="comma-separated stages: select:<dataset>, grid:<dataset> (default: all, in order)")
    ap.add_argument("--seeds", default="0,1,2,3,4", help="grid seeds (content-ID fit and CTR model), default 0-4")
    ap.add_argument("--models", default=",".join(MODELS),
                    help=f"grid models (default all: {','.join(MODELS)}); the targets need deepfm and dcnv2")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the machine is shared)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--render-only", action="store_true", help="rewrite ctr.md / ctr.png from ctr.json")
    args = ap.parse_args()
    path = args.out / "ctr.json"
    out: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    if out.get("format") != FORMAT:  # a results file of an older record format: start afresh
        out = {"format": FORMAT}
    if not args.render_only:
        torch.set_num_threads(args.threads)
        seeds = [int(s) for s in args.seeds.split(",")]
        models = tuple(m.strip() for m in args.models.split(","))
        if not set(models) <= set(MODELS):
            ap.error(f"--models {args.models!r}: use any of {','.join(MODELS)}")
        for stage in args.only.split(","):
            kind, _, name = stage.partition(":")
            if kind not in ("select", "grid") or name not in DATASETS:
                ap.error(f"unknown stage {stage!r}; use select:<dataset> or grid:<dataset> with {DATASETS}")
            command = f"python bench/ctr.py --only {stage}"
            if kind == "grid":
                command += f" --seeds {args.seeds}" + (f" --models {args.models}" if models != MODELS else "")
            with Stage(stage) as st:
                stage_select(name, out) if kind == "select" else stage_grid(name, out, seeds, models)
            key = stage if kind == "select" else f"{stage} seeds {args.seeds} models {','.join(models)}"
            stages = out.setdefault("stages", {})
            if kind == "grid":  # an earlier grid chunk whose records this one all replaced is no longer a source
                for old in [k for k in stages if _grid_covers(k, stage, set(seeds), set(models))]:
                    del stages[old]
            stages[key] = {**st.info, "command": command}
            out["machine"], out["machine_line"] = machine_info(), machine_line()
            out["ctr_defaults"] = {k: v for k, v in as_dict(CTRConfig().resolved()).items()
                                  if k not in ("features", "model")}
            args.out.mkdir(parents=True, exist_ok=True)
            write_json(path, out)  # after every stage: a later failure keeps what is done
    with atomic_file(args.out / "ctr.md") as tmp:
        tmp.write_text(render_md(out))
    if out.get("records"):
        plot(out, args.out / "ctr.png")
        write_docs_block(out)
    print((args.out / "ctr.md").read_text())
    return 0


DOCS = Path(__file__).parent.parent / "docs" / "ctr.md"
MARK_START, MARK_END = markers("ctr")


def write_docs_block(out: dict[str, Any]) -> None:
    """Replace the summary between the bench markers of docs/ctr.md (DeepFM / DCNv2 rows and the targets)."""
    if not DOCS.exists() or MARK_START not in DOCS.read_text():
        return
    recs = out["records"]
    lines = ["", "| dataset | model | features | bytes/ad | seeds | AUC new | AUC old |",
             "|---|---|---|---|---|---|---|"]
    for d in DATASETS:
        for mdl in TARGET_MODELS:
            for f in FEATURES:
                g = group(recs, dataset=d, model=mdl, features=f)
                if g:
                    lines.append(f"| {d} | {mdl} | {f} | {g[0]['bytes_per_ad']:g} | {len(g)} "
                                 f"| {ms([r['auc_new'] for r in g])} | {ms([r['auc_old'] for r in g])} |")
    lines += ["", "| dataset | model | target | difference (mean ± seed std) | verdict | resolved (2 SE) |",
              "|---|---|---|---|---|---|"]
    for r in targets(out):
        lines.append(f"| {r['dataset']} | {r['model']} | {r['target']} | {r['diff']:+.4f} ± {r['std']:.4f} "
                     f"| {'met' if r['met'] else '**missed**'} | {'yes' if r['clear'] else 'no'} |")
    chosen = "; ".join(f"{d}: {c['chosen']['design']}, "
                       f"{variant_name(c['chosen']['visual_fields'], c['chosen']['codeword_vector'])}"
                       + (f", raw vector normalized in {c['chosen']['content']['norm_groups']} group(s)"
                          if c["chosen"]["content"].get("norm_groups") else "")
                       for d, c in out.get("selection", {}).items())
    lines += ["", f"Design chosen on validation: {chosen}. Machine: {out['machine_line']}. The same settings from "
              "the command line (id+visual, DeepFM):", "", "```bash"]
    lines += [cli_line(d, c["chosen"]) for d, c in out.get("selection", {}).items()]
    lines += ["```", ""]
    replace_block(DOCS, "ctr", "\n".join(lines))


# ----------------------------------------------------------------------------------------------- report
def mean_of(recs: list[dict[str, Any]], key: str, **match: Any) -> float:
    return float(np.mean([r[key] for r in group(recs, **match)]))


def paired(recs: list[dict[str, Any]], a: str, b: str, key: str, **match: Any) -> tuple[float, float, int]:
    """Mean and std over seeds of ``key(features=a) - key(features=b)`` (same seed, same content fit)."""
    by_seed = {}
    for r in group(recs, **match):
        by_seed.setdefault(r["seed"], {})[r["features"]] = r[key]
    diffs = [v[a] - v[b] for v in by_seed.values() if a in v and b in v]
    return float(np.mean(diffs)), float(np.std(diffs, ddof=1)) if len(diffs) > 1 else 0.0, len(diffs)


def targets(out: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, checked from the grid records."""
    recs = out.get("records", [])
    rows = []
    for d in DATASETS:
        if not group(recs, dataset=d):
            continue
        for m in TARGET_MODELS:
            if not group(recs, dataset=d, model=m):  # not run: listed as such above the grid
                continue
            ratio = mean_of(recs, "bytes_per_ad", dataset=d, model=m, features="raw") / \
                max(mean_of(recs, "bytes_per_ad", dataset=d, model=m, features="visual"), 1e-9)
            for name, a, b, threshold, only, fewer_bytes in TARGETS:
                if only is not None and d not in only:
                    continue
                mean, std, n = paired(recs, a, b, "auc_new", dataset=d, model=m)
                seeds = sorted({r["seed"] for r in group(recs, dataset=d, model=m, features=a)}
                               & {r["seed"] for r in group(recs, dataset=d, model=m, features=b)})
                boot = out.get("row_se", {}).get(d, {}).get(f"{m}|{a}|{b}")
                # same runs only, and only a bootstrap over whole ads (an older row bootstrap is not used)
                if boot is None or boot["seeds"] != seeds or boot.get("unit") != "ad":
                    boot = {}
                row_se = boot.get("se")
                # standard error of the mean difference: training seeds (std / sqrt(n)) and the test set (the
                # paired bootstrap over the new ads every seed was tested on), combined as independent sources
                seed_se = std / math.sqrt(n) if n > 1 else math.nan
                se = math.sqrt(seed_se ** 2 + (row_se or 0.0) ** 2)
                rows.append({"dataset": d, "model": m, "target": name, "a": a, "b": b, "diff": mean, "std": std,
                             "n": n, "threshold": threshold,
                             "met": bool(mean >= threshold and (ratio >= 10 or not fewer_bytes)),
                             "note": f"{ratio:.0f}× fewer bytes" if fewer_bytes else "",
                             "seed_se": seed_se, "row_se": row_se, "se": se,
                             "se_rows": boot.get("se_rows"),  # the same bootstrap over rows, for comparison
                             # the verdict holds beyond two standard errors of the mean difference
                             "clear": bool(n > 1 and abs(mean - threshold) > 2 * se)})
    return rows


def render_md(out: dict[str, Any]) -> str:
    if not out:
        return "# Visual IDs for new-ad CTR\n\nNo results yet: run `python bench/ctr.py`.\n"
    m = out.get("machine", {})
    lines = ["# Visual IDs for new-ad CTR", "",
             f"Machine: {out.get('machine_line', '?')} (torch threads: {m.get('torch_threads', '?')}; shared with "
             "other jobs). Stages (each one chunk under the exclusive CPU lock):", "",
             "| stage | command | wall min | CPU min | load before → after | finished |", "|---|---|---|---|---|---|"]
    for name, st in out.get("stages", {}).items():
        lb, la = st["load_before"], st["load_after"]
        lines.append(f"| {name} | `{st['command']}` | {st['wall_s'] / 60:.1f} | {st['cpu_s'] / 60:.1f} "
                     f"| {lb[0]:.1f} → {la[0]:.1f} | {st['finished']} |")
    cd = out.get("ctr_defaults", {})
    lrs = ", ".join(f"{k} {v:g}" for k, v in DEFAULT_LR.items())
    lines += ["", f"CTR training: {cd.get('epochs')} epochs, batch {cd.get('batch_size')}, Adam (lr: {lrs}), "
              f"embedding dim {cd.get('embed_dim')}; the same for every feature set and not tuned. Seeds "
              f"{out.get('seeds', [])} (per dataset and model below): seed s fits the content-ID model with seed s "
              "and trains the CTR model with "
              "seed s (content IDs and CTR model both vary). `bytes/ad` is the stored content feature per ad: M "
              "codes of log2 K bits (bit-packed) for visual, D float32 for raw; the shared codebook is counted "
              "once per model, not per ad (see the content-ID fits).", ""]
    for name, s in out.get("data", {}).items():
        lines.append(f"- **{name}** (test): {s['n_items']} items ({s['n_new_items']} new), {s['n_users']} users, "
                     f"{s['n_train']} train rows, {s['n_test_new']} new-ad and {s['n_test_old']} old-ad test rows, "
                     f"train CTR {s['ctr_train']:.3f}" + (f"; cutoff {s['cutoff_date']}" if "cutoff_date" in s else ""))
    for name, s in out.get("val_data", {}).items():
        lines.append(f"- **{name}** (validation, inside the training period): {s['n_train']} train rows, "
                     f"{s['n_test_new']} new-ad and {s['n_test_old']} old-ad validation rows")
    lines.append("")
    lines += render_grid(out)
    lines += render_targets(out)
    lines += render_selection(out)
    lines += render_fits(out)
    return "\n".join(lines)


def render_grid(out: dict[str, Any]) -> list[str]:
    recs = out.get("records", [])
    if not recs:
        return []
    lines = ["## The grid: AUC / gAUC / logloss on new and old ads (mean ± std over seeds)", ""]
    for d in DATASETS:
        if not group(recs, dataset=d):
            continue
        cover = []
        for mdl in MODELS:
            seeds = sorted({r["seed"] for r in group(recs, dataset=d, model=mdl)})
            cover.append(f"{mdl}: seeds {', '.join(map(str, seeds))}" if seeds else f"{mdl}: **not run**")
        lines.append(f"- {d}: " + "; ".join(cover))
    missing = [(d, mdl) for d in DATASETS if group(recs, dataset=d) for mdl in MODELS
               if not group(recs, dataset=d, model=mdl)]
    if missing:
        lines.append("- Models marked **not run** were left out of this grid to fit the CPU budget of the run; the "
                     "targets concern DeepFM and DCNv2 only.")
    lines += ["", "| dataset | model | features | ad ID added by | bytes/ad | AUC new | AUC old | gAUC new | gAUC old "
             "| logloss new | logloss old |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for d in DATASETS:
        for mdl in MODELS:
            for f in FEATURES:
                g = group(recs, dataset=d, model=mdl, features=f)
                if not g:
                    continue
                lines.append(f"| {d} | {mdl} | {f} | {g[0]['id_option'] if 'id' in f.split('+') else '–'} "
                             f"| {g[0]['bytes_per_ad']:g} | "
                             + " | ".join(ms([r[k] for r in g]) for k in METRICS) + " |")
    lines.append("")
    return lines


def render_targets(out: dict[str, Any]) -> list[str]:
    rows = targets(out)
    if not rows:
        return []
    counts = out.get("test_counts", {})
    lines = ["## Targets (new-ad AUC, DeepFM and DCNv2; differences paired by seed, mean ± std)", "",
             "Standard errors of the mean difference: `seeds` = seed std / √seeds (training randomness); "
             "`test ads` = a paired bootstrap over the new ads of the test set (1000 resamples of whole ads with "
             "all their test rows, since the rows of one ad share its content and their errors move together; "
             "each resample scores every seed's two runs on the same rows, so their correlation is kept). "
             "`resolved`: the threshold lies more than two combined standard errors (√(seeds² + ads²)) from the "
             "mean difference; otherwise the verdict is within noise.", "",
             "| dataset | model | target | difference (mean ± seed std) | verdict | SE: seeds / test ads | resolved |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        verdict = "met" if r["met"] else "**missed**"
        note = f"; {r['note']}" if r["note"] else ""
        row = "–" if r["row_se"] is None else f"{r['row_se']:.4f}"
        lines.append(f"| {r['dataset']} | {r['model']} | {r['target']} | {r['a']} − {r['b']} = "
                     f"{r['diff']:+.4f} ± {r['std']:.4f}{note} | {verdict} | {r['seed_se']:.4f} / {row} "
                     f"| {'yes' if r['clear'] else 'no'} |")
    deepfm_new = {d: mean_of(out["records"], "auc_new", dataset=d, model="deepfm", features="id+visual")
                  for d in counts}
    lines += ["", "Test-set sampling error of one new-ad AUC (Hanley-McNeil, rows taken as independent): "
              + ", ".join(f"{d} {auc_se(deepfm_new[d], c['new_pos'], c['new_neg']):.4f} "
                          f"({c['new_pos'] + c['new_neg']} rows)" for d, c in counts.items()) + "."]
    both: dict[str, list[tuple[float, float]]] = {}  # the targets' pairs only, with the seeds they used
    for r in rows:
        if r["row_se"] is not None and r["se_rows"] is not None:
            both.setdefault(r["dataset"], []).append((r["row_se"], r["se_rows"]))
    lines += [f"The same paired bootstrap over rows instead of ads gives, for {d}, test-set SEs of "
              f"{min(r for _, r in b):.4f}-{max(r for _, r in b):.4f} instead of "
              f"{min(a for a, _ in b):.4f}-{max(a for a, _ in b):.4f} (ads as the unit)." for d, b in both.items() if b]
    lines += [""]
    ceil = out.get("ceiling", [])
    if ceil:
        lines += ["Content ceiling (Fashion only, where the click generator is known): the same CTR model on the "
                  "generator's own content of each ad (class one-hot + the three pixel attributes the clicks were "
                  "drawn from) as the `raw` vector, same training, same seeds. In the generator no other content "
                  "drives clicks, so this estimates how far any content feature can take new ads here.", "",
                  "| dataset | model | oracle AUC new | oracle AUC old | raw AUC new | id+raw AUC new "
                  "| oracle − id+raw |",
                  "|---|---|---|---|---|---|---|"]
        recs = out["records"]
        for d in DATASETS:
            for mdl in TARGET_MODELS:
                g = group(ceil, dataset=d, model=mdl)
                if g and group(recs, dataset=d, model=mdl, features="id+raw"):
                    o = ceiling_of(out, d, mdl)
                    lines.append(f"| {d} | {mdl} | {ms([c['auc_new'] for c in g])} | {ms([c['auc_old'] for c in g])} "
                                 f"| {ms([r['auc_new'] for r in group(recs, dataset=d, model=mdl, features='raw')])} "
                                 f"| {ms([r['auc_new'] for r in group(recs, dataset=d, model=mdl, features='id+raw')])}"
                                 f" | {o - mean_of(recs, 'auc_new', dataset=d, model=mdl, features='id+raw'):+.4f} |")
        lines.append("")
    lines += render_tower_ablation(out)
    missed = [r for r in rows if not r["met"]]
    if missed:
        lines += ["### Missed targets: measured reasons", ""]
        lines += explain(out, missed)
        lines.append("")
    return lines


def render_tower_ablation(out: dict[str, Any]) -> list[str]:
    """id+raw+visual on test with the way of joining raw and the codeword vector that validation did not pick,
    paired by seed with the grid's row (reported only; nothing is chosen on it)."""
    abl = out.get("tower_ablation", [])
    if not abl:
        return []
    lines = ["id+raw+visual with raw and the codeword vector joined the other way (one content tower vs one field "
             "each) than validation chose, same seeds; reported, not used for any choice. Differences are new-ad "
             "AUC, paired by seed.", "",
             "| dataset | model | chosen on validation | id+raw+visual (chosen) | id+raw+visual (other) "
             "| chosen − other | id+raw |", "|---|---|---|---|---|---|---|"]
    for d in DATASETS:
        for mdl in TARGET_MODELS:
            g = group(abl, dataset=d, model=mdl)
            grid = {r["seed"]: r for r in group(out["records"], dataset=d, model=mdl, features="id+raw+visual")}
            pairs = [(grid[a["seed"]]["auc_new"], a["auc_new"]) for a in g if a["seed"] in grid]
            if not pairs:
                continue
            seeds = {a["seed"] for a in g if a["seed"] in grid}
            idraw = [r["auc_new"] for r in group(out["records"], dataset=d, model=mdl, features="id+raw")
                     if r["seed"] in seeds]
            chosen = "one tower" if not g[0]["content_tower"] else "one field each"
            diff = [c - o for c, o in pairs]
            lines.append(f"| {d} | {mdl} | {chosen} | {ms([c for c, _ in pairs])} | {ms([o for _, o in pairs])} "
                         f"| {ms(diff)} | {ms(idraw)} |")
    lines.append("")
    return lines


def explain(out: dict[str, Any], missed: list[dict[str, Any]]) -> list[str]:
    """One line per missed target, built from this run's numbers (the grid, validation and content fits)."""
    recs, lines = out["records"], []
    for r in missed:
        d, mdl = r["dataset"], r["model"]
        sel = out["selection"][d]
        fits = [f for f in out.get("content_fits", []) if f["dataset"] == d]
        qerr = float(np.mean([f["quant_rel_err"] for f in fits])) if fits else float("nan")
        qnew = [f["quant_rel_err_new"] for f in fits if f.get("quant_rel_err_new") is not None]
        ids = {f: mean_of(recs, "auc_new", dataset=d, model=mdl, features=f) for f in FEATURES}
        text = (f"- **{d} / {mdl}: {r['target']}** — {r['a']} − {r['b']} = {r['diff']:+.4f} ± {r['std']:.4f} "
                f"over {r['n']} seeds (threshold {r['threshold']:+.3f}). ")
        if r["b"] == "id+raw" and r["a"] == "id+visual":
            vg = val_gap(sel)
            text += (f"The codes keep {1 - qerr:.1%} of the content vector's energy on the old ads they were fit on "
                     f"(relative squared quantization error {qerr:.3f}, mean over the seeds' fits)"
                     + (f" and {1 - float(np.mean(qnew)):.1%} on the new ads, which they never saw "
                        f"({float(np.mean(qnew)):.3f}, {float(np.mean(qnew)) / qerr:.0f}x)"
                        if qnew and qerr > 0 else "")
                     + f"; without the ad ID the gap is visual − raw = "
                     f"{ids['visual'] - ids['raw']:+.4f}. On validation the chosen design had visual − raw = "
                     f"{vg:+.4f} ("
                     + ("the same sign as on test)" if vg < 0 else
                        "no loss there: the test gap is not predicted by validation)") + ".")
        elif r["a"] == "id+raw+visual":
            tables = [x for x in sel["candidates"] if x["visual_fields"] != "none"]
            best_t = max(tables, key=lambda x: x["visual_auc_new"]) if tables else None
            text += ("The codes are computed from the raw vector, so on a new ad they hold no content the raw vector "
                     "lacks (by construction); what they could add is what clicks teach a table per code (or prefix). ")
            if best_t is not None:
                cw = [x for x in sel["candidates"] if x["visual_fields"] == "none"]
                best_c = max(cw, key=lambda x: x["visual_auc_new"]) if cw else None
                text += (f"On validation, the best visual-only new-ad AUC with learned code tables was "
                         f"{best_t['visual_auc_new']:.4f} ({best_t['design']}, {best_t['variant']}; its old-ad AUC "
                         f"with the ad ID {best_t['id+visual_auc_old']:.4f})")
                if best_c is not None:
                    text += (f", without a table (codeword vector only) {best_c['visual_auc_new']:.4f} "
                             f"({best_c['design']}; {best_c['id+visual_auc_old']:.4f})")
                text += ". "
            text += (f"In the grid, raw + ad ID reaches {ids['id+raw']:.4f} and id+raw+visual "
                     f"{ids['id+raw+visual']:.4f} "
                     f"(ad ID added by {sel['chosen']['id'][mdl]['id+raw+visual']['option']}).")
            trow = [x for x in sel.get("tower", []) if x["model"] == mdl]
            if trow:
                t = trow[0]
                how = "one content tower" if sel["chosen"]["tower"].get(mdl) else "one field each"
                text += (f" Raw and the codeword vector enter as {how}; on validation raw+visual − raw was "
                         f"{t['apart'] - t['raw']:+.4f} with one field each and {t['tower'] - t['raw']:+.4f} with "
                         "one tower.")
            ceil = ceiling_of(out, d, mdl)
            if not math.isnan(ceil):
                text += (f" The content oracle reaches {ceil:.4f} on new ads: id+raw is {ceil - ids['id+raw']:.4f} "
                         "below what any content feature can give here, and the codes would have to recover "
                         f"{0.003 / max(ceil - ids['id+raw'], 1e-9):.0%} of that gap from the vector they are "
                         "computed from.")
        elif r["b"] == "visual":
            p = sel["chosen"]["id"][mdl]["id+visual"]["option"]
            vrow = [x for x in sel["dropout"]
                    if x["model"] == mdl and x["features"] == "id+visual" and x["option"] == p]
            vref = sel["references"][mdl]["visual"]["auc_new"]
            text += (f"The ad ID added by {p} was chosen on validation ({mdl}), where id+visual reached "
                     f"{vrow[0]['auc_new']:.4f} against visual {vref:.4f} ({vrow[0]['auc_new'] - vref:+.4f})."
                     + (" The residual mode leaves a new ad's prediction that of its base model without the ID "
                        "(the correction of an ad without training rows is zero)." if p == "residual" else ""))
        elif r["b"] == "id":
            text += f"ID only reaches {ids['id']:.4f}; id+visual {ids['id+visual']:.4f}."
        gap = (r["threshold"] - r["diff"]) / r["se"] if r["se"] > 0 else math.inf
        rows_part = "" if r["row_se"] is None else f" and {r['row_se']:.4f} from the test set's new ads"
        text += (f" The mean difference has a standard error of {r['se']:.4f} ({r['seed_se']:.4f} from the "
                 f"{r['n']} training seeds{rows_part}); the threshold is {gap:.1f} of them above it"
                 + (": within noise, not resolved." if not r["clear"] else ": resolved."))
        lines.append(text)
    return lines


def ceiling_of(out: dict[str, Any], dataset: str, model: str) -> float:
    """Mean new-ad AUC of the content oracle (NaN where the dataset has none)."""
    g = group(out.get("ceiling", []), dataset=dataset, model=model)
    return float(np.mean([c["auc_new"] for c in g])) if g else float("nan")


def val_gap(sel: dict[str, Any]) -> float:
    c = sel["chosen"]
    row = [x for x in sel["candidates"] if x["design"] == c["design"] and x["visual_fields"] == c["visual_fields"]
           and x["codeword_vector"] == c["codeword_vector"]][0]
    return row["visual_auc_new"] - row["raw_auc_new"]


def cli_line(dataset: str, chosen: dict[str, Any], features: str = "id+visual", model: str = "deepfm") -> str:
    """The ``leanml ctr train`` command that trains ``features`` with the design chosen on validation."""
    c = chosen["content"]
    args = [f"leanml ctr train --data {dataset} --model {model} --features {features.replace('+', ',')}",
            f"--codebook {c['codebook']} --M {c['m']} --K {c['k']}"]
    if not c.get("joint", True):
        args.append("--posthoc")
    if not c.get("reseed_dead", True):
        args.append("--no-reseed")
    if c.get("norm_groups"):
        args.append(f"--norm-groups {c['norm_groups']}")
    args.append(f"--visual-fields {chosen['visual_fields']}")
    if chosen["codeword_vector"]:
        args.append("--codeword-vector")
    if {"raw", "visual"} <= set(features.split("+")) and chosen.get("tower", {}).get(model, False):
        args.append("--content-tower")
    how = chosen["id"].get(model, {}).get(features)
    if how is not None:
        args.append("--id-mode residual" if how["id_mode"] == "residual" else f"--id-dropout {how['id_dropout']:g}")
    return " ".join(args) + " --out out/run"


def render_selection(out: dict[str, Any]) -> list[str]:
    sels = out.get("selection", {})
    if not sels:
        return []
    fit_seeds = sorted({s for sel in sels.values() for r in sel["candidates"] for s in r.get("fit_seeds", [0])})
    lines = ["## Chosen on validation (inside the training period; designs with DeepFM, mean of CTR seeds "
             f"{list(SELECT_SEEDS)} on each of the content-ID fits with seeds {fit_seeds})", ""]
    norm = [(d, sel) for d, sel in sels.items() if sel.get("norm")]
    if norm:
        lines += ["First, how the continuous (raw) vector is L2-normalized: in G equal groups (1: as a whole), "
                  f"fitted post-hoc ({NORM_PROBE['codebook']} M{NORM_PROBE['m']} K{NORM_PROBE['k']}; the codes do "
                  "not touch the vector); the best validation raw new-ad AUC wins, and every post-hoc design below "
                  "uses it, so the post-hoc designs of one seed share one raw vector (jointly trained pq keeps one "
                  "group per sub-space).", "",
                  "| dataset | " + " | ".join(f"G = {g}" for g in NORM_GROUPS) + " | chosen |",
                  "|---|" + "---|" * (len(NORM_GROUPS) + 1)]
        for d, sel in norm:
            by_g = {r["norm_groups"]: r["auc_new"] for r in sel["norm"]}
            lines.append(f"| {d} | " + " | ".join(f"{by_g[g]:.4f}" if g in by_g else "–" for g in NORM_GROUPS)
                         + f" | {max(by_g, key=by_g.__getitem__)} |")
        lines.append("")
    lines += ["Content-ID designs × how the codes enter the model. The winner has the best mean validation new-ad "
              f"AUC of visual and id+visual (ID dropout {CTRConfig().id_dropout:g}) among designs with ≥ 10× fewer "
              "bytes per ad than the raw vector. Re-seeding replaces codewords no item uses after each epoch (counts "
              "per epoch). Dead codes, tuples, caption top-1 and fit seconds are those of the first fit; the "
              "quantization errors are means over the fits.", "",
              "| dataset | design | dead codes | distinct tuples | quant. err old / new ads | caption top-1 | fit s "
              "| codes enter as | bytes/ad | raw AUC new | visual AUC new | id+visual AUC new | id+visual AUC old |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for d, sel in sels.items():
        c = sel["chosen"]
        for r in sel["candidates"]:
            win = (r["design"], r["visual_fields"], r["codeword_vector"]) == (c["design"], c["visual_fields"],
                                                                             c["codeword_vector"])
            f, u = {**r["fit"], **r.get("fit_means", {})}, r["fit"]["usage"]
            top1 = f"{f['caption_top1']:.3f}" if f.get("caption_top1") is not None else "–"
            mark = " **(chosen)**" if win else ""
            lines.append(f"| {d} | {r['design']} | {u['dead_codes']} (re-seeded {f['reseeded'] or '–'}) "
                         f"| {u['unique_tuples']} | {qerrs(f)} | {top1} | {fit_seconds(f)} "
                         f"| {r['variant']}{mark} | {r['bytes_per_ad']:g} | {r['raw_auc_new']:.4f} "
                         f"| {r['visual_auc_new']:.4f} | {r['id+visual_auc_new']:.4f} | {r['id+visual_auc_old']:.4f} |")
    lines += ["", "How the ad ID is added: ID dropout (DropoutNet-style: a training row's ad ID is replaced by the "
              "unseen-ad row with this probability), or residual (the model is trained without the ad ID, frozen, "
              "and the ID learned as a correction b_ad + <e_ad, e_user> on its logit; zero for an ad without "
              "training rows). Chosen per model and feature set with that model. Rule: the best validation "
              "old-ad AUC among the options whose validation new-ad AUC is "
              "within 0.002 of the same features without the ad ID; if none is, the best new-ad AUC; for `id` "
              "alone, the best mean of new and old.", "",
              "| dataset | model | features | " + " | ".join(f"{option_name(*o)}: new / old" for o in ID_OPTIONS)
              + " | without ID: new | chosen |", "|---|---|---|" + "---|" * (len(ID_OPTIONS) + 2)]
    for d, sel in sels.items():
        for mdl, how in sel["chosen"]["id"].items():
            for f, ref in ID_REFERENCE.items():
                cells = []
                for o in ID_OPTIONS:
                    r = [x for x in sel["dropout"]
                         if x["model"] == mdl and x["features"] == f and x["option"] == option_name(*o)]
                    cells.append(f"{r[0]['auc_new']:.4f} / {r[0]['auc_old']:.4f}" if r else "not tried")
                refv = f"{sel['references'][mdl][ref]['auc_new']:.4f}" if ref else "–"
                lines.append(f"| {d} | {mdl} | {f} | " + " | ".join(cells) + f" | {refv} | {how[f]['option']} |")
    tower = [(d, r) for d, sel in sels.items() for r in sel.get("tower", [])]
    if tower:
        lines += ["", "Raw vector and codeword vector together (raw+visual, new-ad AUC on validation, per model, the "
                  "chosen design): one field each, or one content tower (both vectors through one MLP as one "
                  "field). Two fields of the same ad also form a pairwise term (FM, cross layers) of the ad with "
                  "itself. The better of the two is used wherever raw and visual are both features (id+raw+visual "
                  "rows of the grid).", "",
                  "| dataset | model | raw | raw+visual, one field each | raw+visual, one tower | chosen |",
                  "|---|---|---|---|---|---|"]
        for d, r in tower:
            pick = "tower" if sels[d]["chosen"]["tower"].get(r["model"]) else "one field each"
            lines.append(f"| {d} | {r['model']} | {r['raw']:.4f} | {r['apart']:.4f} | {r['tower']:.4f} | {pick} |")
    notes = [f"- {d}: {sel['note']}" for d, sel in sels.items() if sel.get("note")]
    if notes:
        lines += [""] + notes
    lines += ["", "The chosen settings from the command line (id+visual and id+raw+visual, DeepFM and DCNv2):", "",
              "```bash"]
    lines += [cli_line(d, sel["chosen"], f, m) for d, sel in sels.items() for m in TARGET_MODELS
              for f in ("id+visual", "id+raw+visual")]
    lines += ["```", ""]
    return lines


def qerrs(fit: dict[str, Any]) -> str:
    """Relative squared quantization error on the old ads (the fit set) / on the new ads (never seen)."""
    new = fit.get("quant_rel_err_new")
    return f"{fit['quant_rel_err']:.3f} / " + ("–" if new is None else f"{new:.3f}")


def render_fits(out: dict[str, Any]) -> list[str]:
    fits = out.get("content_fits", [])
    if not fits:
        return []
    lines = ["## Content-ID fits of the grid (fitted on the old ads only)", "",
             "| dataset | design | seed | fit s | dead codes | distinct tuples | collision rate "
             "| quant. err old / new ads | caption top-1 | codebook bytes (once) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for f in fits:
        u = f["usage"]
        top1 = f"{f['caption_top1']:.3f}" if f.get("caption_top1") is not None else "–"
        lines.append(f"| {f['dataset']} | {f['design']} | {f['seed_content']} | {fit_seconds(f)} "
                     f"| {u['dead_codes']} | {u['unique_tuples']} | {u['collision_rate']:.3f} "
                     f"| {qerrs(f)} | {top1} | {f['codebook_bytes']} |")
    lines.append("")
    return lines


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = out["records"]
    datasets = [d for d in DATASETS if group(recs, dataset=d)]
    models = [mdl for mdl in MODELS if group(recs, model=mdl)]
    fig, axes = plt.subplots(len(datasets), 2, figsize=(15, 4.2 * len(datasets)), squeeze=False)
    colors = dict(zip(FEATURES, ["#888888", "#4c72b0", "#55a868", "#8172b2", "#c44e52", "#dd8452"]))
    width = 0.13
    for row, d in enumerate(datasets):
        for col, key in enumerate(("auc_new", "auc_old")):
            ax = axes[row][col]
            vals = []
            for j, f in enumerate(FEATURES):
                g = [group(recs, dataset=d, model=mdl, features=f) for mdl in models]
                means = [float(np.mean([r[key] for r in x])) if x else float("nan") for x in g]
                stds = [float(np.std([r[key] for r in x], ddof=1)) if len(x) > 1 else 0.0 for x in g]
                vals += [v for v in means if not math.isnan(v)]
                ax.bar(np.arange(len(models)) + (j - 2.5) * width, means, width, yerr=stds, label=f, color=colors[f])
            ax.set_xticks(np.arange(len(models)), models)
            ax.set_ylim(min(vals) - 0.02, max(vals) + 0.01)
            ax.set_title(f"{d}: AUC on {'new' if key == 'auc_new' else 'old'} ads")
            ax.legend(fontsize=7, ncol=3)
    fig.suptitle(f"Visual IDs for new-ad CTR — {out['machine_line']}", fontsize=9)
    fig.tight_layout()
    with atomic_file(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
