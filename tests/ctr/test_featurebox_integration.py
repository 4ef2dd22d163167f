"""The two halves fit: `leanml ctr content-ids assign` writes a table that a FeatureBox graph reads and
trains on, with no conversion in between."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from leanml.cli import main
from leanml.ctr.content_ids.encoders import embed_texts
from leanml.ctr.content_ids.schema import read_table
from leanml.ctr.content_ids.trainer import ContentIDConfig, fit_content_ids, save_content_model
from leanml.ctr.data import FASHION_CLASSES, load_fashion_mnist
from leanml.features import (
    ContentIdLookup,
    ExtractConfig,
    Extractor,
    FeatureBatch,
    Hash,
    PipelineOptions,
    TrainOptions,
    graph,
    run_pipelined,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_assign_output_feeds_a_featurebox_graph_that_trains(tmp_path, capsys) -> None:
    images, labels = load_fashion_mnist("t10k")
    n_ads = 120
    folder = tmp_path / "ads"
    folder.mkdir()
    for i in range(n_ads):
        Image.fromarray(images[i]).save(folder / f"{1000 + i}.png")
    captions = [f"a {FASHION_CLASSES[labels[i]]}" for i in range(n_ads)]
    cfg = ContentIDConfig(kind="cnn", dim=8, m=2, k=4, width=4, epochs=1, warmup_epochs=1, batch_size=64)
    model, report = fit_content_ids(torch.from_numpy(images[:n_ads] / 255.0).float(), captions, cfg,
                                    text_emb=embed_texts(captions), progress=False)
    save_content_model(model, tmp_path / "cid", report)

    data_dir = tmp_path / "data"
    data_dir.mkdir()
    table_path = data_dir / "visual_ids.parquet"
    assert main(["ctr", "content-ids", "assign", "--model", str(tmp_path / "cid"), "--images", str(folder),
                 "--out", str(table_path)]) == 0
    capsys.readouterr()
    table = read_table(table_path, m=2, k=4)
    assert json.loads((tmp_path / "data" / "visual_ids.parquet.report.json").read_text())["schema"] == \
        "leanml.content_ids/2"

    # impressions: clicks depend on the ad's class (which the content IDs partly encode); ad 5 has no IDs
    rng = np.random.default_rng(0)
    ads = np.concatenate([rng.integers(1000, 1000 + n_ads, 1999), [5]])
    users = rng.integers(0, 50, len(ads))
    p = np.where(ads >= 1000, 0.15 + 0.7 * (labels[np.clip(ads - 1000, 0, n_ads - 1)] < 5), 0.3)
    clicks = (rng.random(len(ads)) < p).astype(int)
    (data_dir / "log.tsv").write_text("".join(f"{u}\t{a}\t{c}\n" for u, a, c in zip(users, ads, clicks)))

    g = graph("ads_visual", {"user_id": "int", "ad_id": "int", "click": "int"},
              [Hash(input="user_id", output="user", buckets=101),
               ContentIdLookup(input="ad_id", output="ad_visual", table="visual", k=4, m=2, offset=True)],
              label="click", sparse=["user"], sequence=["ad_visual"], tables={"visual": "visual_ids.parquet"})
    ecfg = ExtractConfig.build(g, [data_dir / "log.tsv"], PipelineOptions(batch_rows=256))

    batch = FeatureBatch.concat(list(Extractor(ecfg)))
    got = batch.seqs[0].numpy()
    codes, missing = table.lookup(ads)
    assert missing.tolist() == [False] * 1999 + [True]
    assert np.array_equal(got, codes + np.arange(2) * 5)  # offset: position m uses rows [5m, 5m + 5)
    assert got[-1].tolist() == [4, 9]  # the ad without IDs gets each position's unknown row

    torch.manual_seed(0)
    _, rep = run_pipelined(ecfg, TrainOptions(epochs=3, lr=1e-2, dim=8, hidden=(16,)), device="cpu")
    losses = [t["loss"] for t in rep["train"]]
    assert rep["rows"] == 3 * len(ads) and all(np.isfinite(losses))
    assert losses[-1] < losses[0]
