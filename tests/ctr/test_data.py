"""CTR data: cold-start split without leaks, seeded generator, bad ad folders are reported."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image

from leanml.ctr.data import (
    ATTR_WORDS,
    FASHION_CLASSES,
    fashion_ads,
    image_attributes,
    load_ad_folder,
    movielens,
    validation_split,
)
from leanml.errors import LeanmlError

SMALL = dict(n_ads=400, n_users=50, per_day=1500)


@pytest.fixture(scope="module")
def fashion():
    return fashion_ads(seed=3, **SMALL)


def test_no_new_ad_row_in_training(fashion) -> None:
    train_items = fashion.train["item"].to_numpy()
    assert not fashion.is_new_item[train_items].any()
    fashion.check_split()
    test_new = fashion.test_is_new
    assert 0 < test_new.sum() < len(fashion.test)
    # new-ad test rows are exactly the rows on items never seen in training
    assert np.array_equal(test_new, ~np.isin(fashion.test["item"].to_numpy(), train_items))
    assert fashion.is_new_item.sum() == round(0.2 * SMALL["n_ads"])


def test_generator_is_seeded_and_documented(fashion) -> None:
    again = fashion_ads(seed=3, **SMALL)
    assert again.train.equals(fashion.train) and again.test.equals(fashion.test)
    assert again.captions == fashion.captions
    other = fashion_ads(seed=4, **SMALL)
    assert not other.train.equals(fashion.train)
    for key in ("base", "class_scale", "attr_scale", "quality_scale", "seed"):
        assert key in fashion.info


def test_captions_describe_class_and_measured_attributes(fashion) -> None:
    images = fashion.content.numpy()
    attrs = image_attributes(images)
    for i in range(0, fashion.n_items, 37):
        cap = fashion.captions[i]
        assert cap.endswith(FASHION_CLASSES[fashion.item_labels[i]])
        for j, words in enumerate(ATTR_WORDS.values()):
            word = cap.split()[j]
            assert word in words
            # the tertile word is consistent with the measured attribute
            rank = words.index(word)
            lo = np.quantile(attrs[:, j], rank / 3) - 1e-6
            hi = np.quantile(attrs[:, j], (rank + 1) / 3) + 1e-6
            assert lo <= attrs[i, j] <= hi


def test_movielens_cold_start_split_is_by_time() -> None:
    data = movielens()
    assert data.n_items == 1682 and data.n_users == 943 and data.content.shape == (1682, 384)
    data.check_split()
    cutoff = data.info["cutoff"]
    assert (data.train["timestamp"] < cutoff).all() and (data.test["timestamp"] >= cutoff).all()
    # new movies: first rating at or after the cutoff (brute force over the whole log)
    log = pd.concat([data.train, data.test])
    first = log.groupby("item")["timestamp"].min()
    rated = np.zeros(data.n_items, dtype=bool)
    rated[first.index] = True
    assert np.array_equal(data.is_new_item[rated], (first >= cutoff).to_numpy())
    assert data.info["new_movies"] == int((first >= cutoff).sum()) > 100
    # old-ad test rows come after the cutoff too, and every rating is a train or test row
    assert data.test_is_new.sum() > 1000 and (~data.test_is_new).sum() > 1000
    assert len(data.train) + len(data.test) == 100_000
    val = validation_split(data)
    val.check_split()
    assert val.test["timestamp"].max() < cutoff and val.test_is_new.sum() > 100


def test_ad_folder_reports_unreadable_images_and_missing_captions(tmp_path) -> None:
    rng = np.random.default_rng(0)
    for ad in (1, 2, 3):
        Image.fromarray(rng.integers(0, 255, (28, 28), dtype=np.uint8)).save(tmp_path / f"{ad}.png")
    np.save(tmp_path / "4.npy", rng.random((28, 28)))
    (tmp_path / "5.png").write_bytes(b"not a png")
    Image.fromarray(rng.integers(0, 255, (40, 30), dtype=np.uint8)).save(tmp_path / "6.jpg")
    captions = tmp_path / "captions.csv"
    captions.write_text("ad_id,caption\n1,red dress\n2,\n3,blue coat\n4,bag\n5,shoe\n6,shirt\n9,orphan\n")
    ids, images, caps, skipped = load_ad_folder(tmp_path, captions)
    assert ids.tolist() == [1, 3, 4, 6]
    assert images.shape == (4, 28, 28) and images.dtype == torch.float32
    assert caps == ["red dress", "blue coat", "bag", "shirt"]
    reasons = {s["item"].split("/")[-1]: s["reason"] for s in skipped}
    assert "caption missing" in reasons["ad 2"]
    assert "cannot read image" in reasons["5.png"]
    assert "no image" in reasons["ad 9"]
    assert len(skipped) == 3
    with pytest.raises(LeanmlError, match="cannot read image"):
        load_ad_folder(tmp_path, None, on_bad="error")
    with pytest.raises(LeanmlError, match="does not exist"):
        load_ad_folder(tmp_path / "nope")
