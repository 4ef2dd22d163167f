"""CTR datasets with a new-ad (cold-start) split.

Both loaders return a :class:`CTRData`: a table of items (ads) with their content and caption, and click
logs ``train`` / ``test`` with integer columns ``user``, ``item`` (row index into the items), ``context``
and ``label``. ``test`` rows on items that never occur in ``train`` are the *new-ad* rows
(``CTRData.test_is_new``); every other test row is an *old-ad* row from a later period.

**Fashion-MNIST ads** (:func:`fashion_ads`): real product images as ad creatives, semi-synthetic clicks.
Generator (seeded by ``seed``, all parameters in ``CTRData.info``):

1. ``n_ads`` distinct images drawn from the Fashion-MNIST training set; ``new_frac`` of them are new ads.
2. Visual content features per ad, all measured from the pixels: class (10, one-hot), ``brightness`` (mean
   intensity of ink pixels), ``coverage`` (fraction of pixels > 0.2), ``texture`` (mean absolute
   horizontal gradient on ink pixels); the three attributes are z-scored.
3. Caption: tertile words of the three attributes plus the class name, e.g.
   ``"dark bulky patterned pullover"``. Captions are the only supervision the content-ID model sees.
4. Users: preference ``w_class ~ N(0, class_scale^2)`` per class, ``w_attr ~ N(0, attr_scale^2)`` per
   attribute, bias ``~ N(0, user_scale^2)``. Ads: an idiosyncratic quality ``~ N(0, quality_scale^2)``
   that no content reveals (only an ad-ID embedding can learn it).
5. Impressions: ``days`` days of ``per_day`` impressions; user uniform, slot ``context`` uniform in
   ``0..3``; before ``launch_day`` only old ads are shown, from then on a new ad with probability
   ``new_share``. ``P(click) = sigmoid(base + quality + user_bias + w_class[class] + w_attr . attrs
   + slot_bias[context])`` with ``slot_bias = -0.3 * context``.
6. ``train`` = impressions before ``launch_day`` (old ads only); ``test`` = impressions from ``launch_day``.

**MovieLens-100k** (:func:`movielens`): real clicks (rating >= 4). Content is the MiniLM embedding of
``"<title>. Genres: <genres>."``. A time cutoff (the ``time_quantile`` of all rating timestamps) splits
the log: ratings before it are ``train``, ratings from it on are ``test``. Movies whose *first* rating
falls at or after the cutoff are the new ads (a real cold start: they did not exist in the training
period); test rows on the other movies are the old-ad rows, from the same later period. Context is the
weekday of the rating.

**Validation** (:func:`validation_split`): hyper-parameters are chosen on a split of the *training*
rows, never on ``test``: the last ``val_frac`` of the training period (by timestamp or by day) is the
validation log; a seeded ``new_frac`` of the items lose their earlier rows, and they, with the items first
seen inside the window, are the validation new ads.
"""

from __future__ import annotations

import csv
import gzip
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from leanml.config import ConfigError
from leanml.errors import LeanmlError
from leanml.extras import require_extra

FASHION_CLASSES = [
    "t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "ankle boot",
]
ATTR_WORDS = {
    "brightness": ("dark", "grey", "light"),
    "coverage": ("slim", "regular", "bulky"),
    "texture": ("plain", "textured", "patterned"),
}


@dataclass
class CTRData:
    """Items with content and click logs split into train and (new-ad + old-ad) test rows."""

    name: str
    item_ids: np.ndarray  # (n_items,) int64 external ad ids
    content: torch.Tensor  # (n_items, 28, 28) images or (n_items, F) vectors
    content_kind: str  # "cnn" or "mlp"
    captions: list[str]
    is_new_item: np.ndarray  # (n_items,) bool
    train: pd.DataFrame  # columns user, item, context, label
    test: pd.DataFrame
    n_users: int
    n_contexts: int
    info: dict[str, Any] = field(default_factory=dict)
    item_labels: np.ndarray | None = None  # class per item when known (analysis only, never a feature)

    @property
    def n_items(self) -> int:
        return len(self.item_ids)

    @property
    def test_is_new(self) -> np.ndarray:
        return self.is_new_item[self.test["item"].to_numpy()]

    @property
    def old_items(self) -> np.ndarray:
        return np.flatnonzero(~self.is_new_item)

    def check_split(self) -> None:
        """Raise if a new item appears in the training log (a leak)."""
        leaked = self.is_new_item[self.train["item"].to_numpy()]
        if leaked.any():
            raise AssertionError(f"{int(leaked.sum())} training rows are on new items")

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "n_items": self.n_items,
            "n_new_items": int(self.is_new_item.sum()),
            "n_users": self.n_users,
            "n_train": len(self.train),
            "n_test_new": int(self.test_is_new.sum()),
            "n_test_old": int((~self.test_is_new).sum()),
            "ctr_train": float(self.train["label"].mean()),
            "ctr_test": float(self.test["label"].mean()),
            **self.info,
        }


def load_fashion_mnist(split: str = "train") -> tuple[np.ndarray, np.ndarray]:
    """``(images uint8 (N, 28, 28), labels uint8 (N,))`` of the offline Fashion-MNIST ``train`` / ``t10k``."""
    from leanml.data.offline import fashion_mnist_dir

    root = fashion_mnist_dir()
    with gzip.open(root / f"{split}-images-idx3-ubyte.gz") as f:
        images = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 28, 28)
    with gzip.open(root / f"{split}-labels-idx1-ubyte.gz") as f:
        labels = np.frombuffer(f.read(), np.uint8, offset=8)
    return images, labels


def image_attributes(images: np.ndarray) -> np.ndarray:
    """Raw ``(N, 3)`` attributes measured from ``(N, 28, 28)`` images in [0, 1]: brightness, coverage, texture."""
    x = images.astype(np.float32)
    ink = x > 0.2
    n_ink = ink.sum((1, 2)).clip(1)
    brightness = (x * ink).sum((1, 2)) / n_ink
    coverage = ink.mean((1, 2))
    grad = np.abs(np.diff(x, axis=2))
    texture = (grad * ink[:, :, 1:]).sum((1, 2)) / n_ink
    return np.stack([brightness, coverage, texture], 1)


def caption_for(label: int, attrs: np.ndarray, cuts: np.ndarray) -> str:
    """Caption from the class and the tertile word of each attribute (``cuts`` is ``(3, 2)``)."""
    words = [ATTR_WORDS[name][int(np.searchsorted(cuts[j], attrs[j]))] for j, name in enumerate(ATTR_WORDS)]
    return f"{words[0]} {words[1]} {words[2]} {FASHION_CLASSES[label]}"


@dataclass(frozen=True)
class Launch:
    """When new ads appear in the log: ``days`` days, the new ads launch on ``launch_day`` and then take
    ``new_share`` of the impressions."""

    days: int = 10
    launch_day: int = 7
    new_share: float = 0.5


@dataclass(frozen=True)
class ClickModel:
    """The click logit of :func:`fashion_ads`: ``base`` plus per-user class and attribute tastes, a user
    bias and an ad quality, drawn with these scales (standard deviations)."""

    base: float = -1.4
    class_scale: float = 0.8
    attr_scale: float = 0.5
    user_scale: float = 0.3
    quality_scale: float = 0.5


def fashion_ads(
    n_ads: int = 3000,
    n_users: int = 300,
    new_frac: float = 0.2,
    per_day: int = 15000,
    launch: Launch | None = None,
    clicks: ClickModel | None = None,
    seed: int = 0,
) -> CTRData:
    """Fashion-MNIST ads with captions and the seeded click generator described in the module docstring
    (``launch``: :class:`Launch`, ``clicks``: :class:`ClickModel`; default: their defaults)."""
    la, cm = launch or Launch(), clicks or ClickModel()
    days, launch_day, new_share = la.days, la.launch_day, la.new_share
    base, class_scale, attr_scale = cm.base, cm.class_scale, cm.attr_scale
    user_scale, quality_scale = cm.user_scale, cm.quality_scale
    if not 0 < new_frac < 1:
        raise LeanmlError(f"new_frac={new_frac} must be in (0, 1)")
    if not 0 < launch_day < days:
        raise LeanmlError(f"launch_day={launch_day} must be in (0, days={days})")
    rng = np.random.default_rng(seed)
    images, labels = load_fashion_mnist("train")
    if n_ads > len(images):
        raise LeanmlError(f"n_ads={n_ads} exceeds the {len(images)} Fashion-MNIST training images")
    pick = np.sort(rng.choice(len(images), n_ads, replace=False))
    img = images[pick].astype(np.float32) / 255.0
    lab = labels[pick].astype(np.int64)
    raw = image_attributes(img)
    cuts = np.quantile(raw, [1 / 3, 2 / 3], axis=0).T  # (3, 2)
    captions = [caption_for(int(lab[i]), raw[i], cuts) for i in range(n_ads)]
    attrs = (raw - raw.mean(0)) / raw.std(0).clip(1e-6)
    is_new = np.zeros(n_ads, dtype=bool)
    is_new[rng.choice(n_ads, int(round(new_frac * n_ads)), replace=False)] = True

    w_class = rng.normal(0, class_scale, (n_users, 10))
    w_attr = rng.normal(0, attr_scale, (n_users, 3))
    u_bias = rng.normal(0, user_scale, n_users)
    quality = rng.normal(0, quality_scale, n_ads)
    old_idx, new_idx = np.flatnonzero(~is_new), np.flatnonzero(is_new)
    rows = []
    for day in range(days):
        users = rng.integers(0, n_users, per_day)
        ctx = rng.integers(0, 4, per_day)
        items = old_idx[rng.integers(0, len(old_idx), per_day)]
        if day >= launch_day:
            show_new = rng.random(per_day) < new_share
            items[show_new] = new_idx[rng.integers(0, len(new_idx), int(show_new.sum()))]
        logit = (base + quality[items] + u_bias[users] + w_class[users, lab[items]]
                 + (w_attr[users] * attrs[items]).sum(1) - 0.3 * ctx)
        clicks = (rng.random(per_day) < 1.0 / (1.0 + np.exp(-logit))).astype(np.int64)
        rows.append(pd.DataFrame({"user": users, "item": items, "context": ctx, "label": clicks, "day": day}))
    log = pd.concat(rows, ignore_index=True)
    info = dict(
        generator="fashion_ads", n_ads=n_ads, n_users=n_users, new_frac=new_frac, days=days, launch_day=launch_day,
        per_day=per_day, new_share=new_share, base=base, class_scale=class_scale, attr_scale=attr_scale,
        user_scale=user_scale, quality_scale=quality_scale, seed=seed,
    )
    return CTRData(
        name="fashion",
        item_ids=(pick + 1).astype(np.int64),  # ad id = Fashion-MNIST train index + 1
        content=torch.from_numpy(img),
        content_kind="cnn",
        captions=captions,
        is_new_item=is_new,
        train=log[log["day"] < launch_day].reset_index(drop=True),
        test=log[log["day"] >= launch_day].reset_index(drop=True),
        n_users=n_users,
        n_contexts=4,
        info=info,
        item_labels=lab,
    )


def movielens(time_quantile: float = 0.4, seed: int = 0) -> CTRData:
    """MovieLens-100k clicks (rating >= 4) with a time cutoff; movies first rated after it are new.

    ``seed`` does not change the split (it is set by time); it is kept for a uniform loader signature.
    """
    from leanml.ctr.content_ids.encoders import embed_texts
    from leanml.data.offline import widedeep_data_dir

    if not 0 < time_quantile < 1:
        raise LeanmlError(f"time_quantile={time_quantile} must be in (0, 1)")
    root = widedeep_data_dir()
    ratings = pd.read_parquet(root / "MovieLens100k_data.parquet.brotli")
    items = pd.read_parquet(root / "MovieLens100k_items.parquet.brotli").sort_values("movie_id").reset_index(drop=True)
    genre_cols = list(items.columns[5:])
    captions = []
    for _, row in items.iterrows():
        genres = [g for g in genre_cols if row[g] == 1 and g != "unknown"] or ["unknown genre"]
        title = str(row["movie_title"]).strip() or f"movie {row['movie_id']}"
        captions.append(f"{title}. Genres: {', '.join(genres)}.")
    content = torch.from_numpy(embed_texts(captions))
    n_items = len(items)
    item_index = pd.Series(np.arange(n_items), index=items["movie_id"].to_numpy())
    missing = ~ratings["movie_id"].isin(item_index.index)
    if missing.any():
        raise LeanmlError(f"{int(missing.sum())} ratings refer to movies without content; the data files are "
                          "inconsistent")
    user_codes, _ = pd.factorize(ratings["user_id"], sort=True)
    log = pd.DataFrame({
        "user": user_codes.astype(np.int64),
        "item": item_index.loc[ratings["movie_id"].to_numpy()].to_numpy().astype(np.int64),
        "context": pd.to_datetime(ratings["timestamp"], unit="s").dt.day_of_week.to_numpy().astype(np.int64),
        "label": (ratings["rating"] >= 4).astype(np.int64).to_numpy(),
        "timestamp": ratings["timestamp"].to_numpy(),
    }).sort_values("timestamp", kind="stable").reset_index(drop=True)
    cutoff = float(np.quantile(log["timestamp"], time_quantile))
    train, test, is_new = _time_split(log, cutoff, n_items)
    info = dict(generator="movielens", split="time", time_quantile=time_quantile, cutoff=cutoff,
                cutoff_date=str(pd.to_datetime(cutoff, unit="s").date()), new_movies=int(is_new.sum()),
                unrated_movies=int((~np.isin(np.arange(n_items), log["item"].to_numpy())).sum()))
    return CTRData(
        name="movielens",
        item_ids=items["movie_id"].to_numpy().astype(np.int64),
        content=content,
        content_kind="mlp",
        captions=captions,
        is_new_item=is_new,
        train=train,
        test=test,
        n_users=int(user_codes.max()) + 1,
        n_contexts=7,
        info=info,
    )


def _time_split(log: pd.DataFrame, cutoff: float, n_items: int) -> tuple[pd.DataFrame, pd.DataFrame, np.ndarray]:
    """Rows before ``cutoff`` train, the rest test; items whose first row is at or after it are new."""
    before = log["timestamp"].to_numpy() < cutoff
    train = log[before].reset_index(drop=True)
    test = log[~before].reset_index(drop=True)
    seen = np.zeros(n_items, dtype=bool)
    seen[train["item"].to_numpy()] = True
    return train, test, ~seen


def validation_split(data: CTRData, val_frac: float = 0.25, new_frac: float = 0.2, seed: int = 0) -> CTRData:
    """A train / validation split of ``data.train`` made like the train / test split (module docstring).

    The last ``val_frac`` of the training period (by ``timestamp``, or by ``day``) is the validation log;
    the earlier rows train, except the rows of a seeded ``new_frac`` of the items seen before the window
    (held out, so the validation log has enough new-ad rows). Validation new ads are the items without a
    training row: held-out ones and, with timestamps, items first seen inside the window. The result's
    ``test`` is the validation log; ``data.test`` is not used.
    """
    if not 0 < val_frac < 1:
        raise LeanmlError(f"val_frac={val_frac} must be in (0, 1)")
    if not 0 <= new_frac < 1:
        raise LeanmlError(f"new_frac={new_frac} must be in [0, 1)")
    log = data.train
    if "timestamp" in log.columns:
        t = log["timestamp"].to_numpy()
        start = float(np.quantile(t, 1.0 - val_frac))
        rule = {"rule": "time", "window_start": start}
    elif "day" in log.columns:
        t = log["day"].to_numpy()
        days = np.unique(t)
        n_val = max(1, int(round(val_frac * len(days))))
        if n_val >= len(days):
            raise LeanmlError(f"val_frac={val_frac} leaves no training day of {len(days)}")
        start = float(days[-n_val])
        rule = {"rule": "days", "first_val_day": int(start)}
    else:
        raise LeanmlError(f"{data.name}: the log has neither 'timestamp' nor 'day'; cannot make a validation split")
    in_window = t >= start
    before_items = np.unique(log["item"].to_numpy()[~in_window])
    rng = np.random.default_rng(seed)
    held = np.zeros(data.n_items, dtype=bool)
    held[rng.choice(before_items, int(round(new_frac * len(before_items))), replace=False)] = True
    keep = ~in_window & ~held[log["item"].to_numpy()]
    train, val = log[keep].reset_index(drop=True), log[in_window].reset_index(drop=True)
    is_new = np.ones(data.n_items, dtype=bool)
    is_new[train["item"].to_numpy()] = False
    info = {**data.info, "validation": {"val_frac": val_frac, "new_frac": new_frac, "seed": seed,
                                        "held_out_items": int(held.sum()), **rule}}
    return CTRData(**{**data.__dict__, "name": f"{data.name}-val", "train": train, "test": val,
                      "is_new_item": is_new, "info": info})


def load_dataset(name: str, seed: int = 0, **kwargs: Any) -> CTRData:
    """``"fashion"`` or ``"movielens"``."""
    if name == "fashion":
        return fashion_ads(seed=seed, **kwargs)
    if name == "movielens":
        return movielens(seed=seed, **kwargs)
    raise LeanmlError(f"unknown dataset {name!r}; use 'fashion' or 'movielens'")


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".npy")


def read_image(path: Path, size: int = 28) -> np.ndarray:
    """A grey ``(size, size)`` float32 image in [0, 1] from an image file or a ``.npy`` array."""
    if path.suffix == ".npy":
        arr = np.load(path).astype(np.float32)
        if arr.ndim != 2:
            raise ValueError(f"expected a 2-D array, got shape {arr.shape}")
        arr = arr / 255.0 if arr.max() > 1.0 else arr
    else:
        Image = require_extra("ctr", "PIL.Image")

        with Image.open(path) as im:
            arr = np.asarray(im.convert("L").resize((size, size)), dtype=np.float32) / 255.0
    if arr.shape != (size, size):
        Image = require_extra("ctr", "PIL.Image")
        arr = np.asarray(Image.fromarray((arr * 255).astype(np.uint8)).resize((size, size)), dtype=np.float32) / 255.0
    return arr


def load_ad_folder(
    images_dir: str | Path, captions_csv: str | Path | None = None, on_bad: str = "skip"
) -> tuple[np.ndarray, torch.Tensor, list[str] | None, list[dict[str, str]]]:
    """Ads from a folder of images named ``<ad_id>.<png|jpg|npy>`` and an optional ``ad_id,caption`` CSV.

    Returns ``(ad_ids, images (N, 28, 28), captions or None, skipped)``. An unreadable image is skipped
    and listed in ``skipped`` (``on_bad="skip"``) or raises (``on_bad="error"``). With a captions file,
    an ad without a caption, or a caption without an image, is handled the same way.
    """
    if on_bad not in ("skip", "error"):
        raise LeanmlError(f"on_bad={on_bad!r}; use 'skip' or 'error'")
    images_dir = Path(images_dir)
    if not images_dir.is_dir():
        raise LeanmlError(f"image folder {images_dir} does not exist; pass a folder of <ad_id>.png files")
    files: dict[int, Path] = {}
    skipped: list[dict[str, str]] = []

    def bad(item: str, reason: str) -> None:
        if on_bad == "error":
            raise ConfigError(f"{item}: {reason} (fix it, or pass on_bad skip to skip and report such ads)", None,
                              ("on_bad",))
        skipped.append({"item": item, "reason": reason})

    for p in sorted(images_dir.iterdir()):
        if p.suffix.lower() not in IMAGE_SUFFIXES:
            continue
        try:
            files[int(p.stem)] = p
        except ValueError:
            bad(str(p), "file name is not an integer ad id")
    caption_map: dict[int, str] | None = None
    if captions_csv is not None:
        caption_map = {}
        path = Path(captions_csv)
        if not path.exists():
            raise LeanmlError(f"captions file {path} does not exist; pass a CSV with columns ad_id,caption")
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            if reader.fieldnames is None or not {"ad_id", "caption"} <= set(reader.fieldnames):
                raise LeanmlError(f"{path} must have a header with columns ad_id,caption")
            for line, row in enumerate(reader, start=2):
                try:
                    caption_map[int(row["ad_id"])] = (row["caption"] or "").strip()
                except (TypeError, ValueError):
                    bad(f"{path}:{line}", f"ad_id {row.get('ad_id')!r} is not an integer")
    ids, imgs, caps = [], [], []
    for ad_id, p in sorted(files.items()):
        if caption_map is not None and not caption_map.get(ad_id):
            bad(f"ad {ad_id}", "caption missing or empty")
            continue
        try:
            imgs.append(read_image(p))
        except Exception as exc:  # noqa: BLE001 - any decoder failure means an unreadable image
            bad(str(p), f"cannot read image ({type(exc).__name__}: {exc})")
            continue
        ids.append(ad_id)
        if caption_map is not None:
            caps.append(caption_map[ad_id])
    if caption_map is not None:
        for ad_id in sorted(set(caption_map) - set(files)):
            bad(f"ad {ad_id}", "caption has no image file")
    if not ids:
        raise LeanmlError(f"no readable images in {images_dir} ({len(skipped)} skipped)")
    return (np.asarray(ids, dtype=np.int64), torch.from_numpy(np.stack(imgs)),
            caps if caption_map is not None else None, skipped)
