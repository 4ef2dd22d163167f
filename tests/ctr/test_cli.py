"""The ``leanml ctr`` command line end to end on small inputs, including bad-input handling."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from leanml.cli import main
from leanml.ctr.content_ids.assign import write_visual_ids
from leanml.ctr.data import fashion_ads, load_fashion_mnist

# single-threaded torch: faster and fairer on a shared 2-core machine
pytestmark = pytest.mark.usefixtures("one_thread")


def test_fit_and_assign_from_an_image_folder(tmp_path, capsys) -> None:
    images, labels = load_fashion_mnist("t10k")
    folder = tmp_path / "ads"
    folder.mkdir()
    names = ["t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "boot"]
    rows = ["ad_id,caption"]
    for i in range(96):
        Image.fromarray(images[i]).save(folder / f"{100 + i}.png")
        rows.append(f"{100 + i},a {names[labels[i]]}")
    (folder / "999.png").write_bytes(b"\x89PNG broken")  # unreadable image
    rows.append("999,a broken ad")
    (tmp_path / "captions.csv").write_text("\n".join(rows) + "\n")
    cid = tmp_path / "cid"
    rc = main(["ctr", "content-ids", "fit", "--images", str(folder), "--captions", str(tmp_path / "captions.csv"),
               "--M", "2", "--K", "4", "--dim", "8", "--content-epochs", "1", "--out", str(cid)])
    assert rc == 0
    report = json.loads((cid / "report.json").read_text())
    assert report["n_ads"] == 96 and len(report["skipped"]) == 1
    out = tmp_path / "ids.parquet"
    assert main(["ctr", "content-ids", "assign", "--model", str(cid), "--images", str(folder), "--out", str(out)]) == 0
    table = pq.read_table(out)
    assert table.num_rows == 96 and table.schema.metadata[b"M"] == b"2"
    rep = json.loads((tmp_path / "ids.parquet.report.json").read_text())
    assert rep["n_skipped"] == 1 and "cannot read image" in rep["skipped"][0]["reason"]
    # the same folder with --on-bad error fails with exit code 2 and a one-line message
    assert main(["ctr", "content-ids", "assign", "--model", str(cid), "--images", str(folder),
                 "--out", str(tmp_path / "x.parquet"), "--on-bad", "error"]) == 2
    assert "cannot read image" in capsys.readouterr().err
    # the image model's codes, and their codeword vector, as CTR features on the Fashion ads; eval reloads the run
    run = tmp_path / "run"
    assert main(["ctr", "train", "--data", "fashion", "--content-ids", str(cid), "--features", "id,visual",
                 "--visual-fields", "none", "--codeword-vector", "--epochs", "1", "--out", str(run)]) == 0
    saved = json.loads((run / "report.json").read_text())
    assert saved["bytes_per_ad"] == 2 * 2 / 8 and [f[0] for f in saved["fields"]] == ["user", "context", "ad"]
    assert main(["ctr", "eval", "--run", str(run)]) == 0
    assert json.loads((run / "eval.json").read_text())["metrics"]["auc_new"] == pytest.approx(
        saved["metrics"]["auc_new"], abs=1e-6)
    # K < 2 is refused
    assert main(["ctr", "content-ids", "fit", "--images", str(folder), "--captions", str(tmp_path / "captions.csv"),
                 "--K", "1", "--out", str(tmp_path / "k1")]) == 2
    assert "K >= 2" in capsys.readouterr().err


def test_train_with_visual_id_table_reports_missing_ads_and_evals(tmp_path, capsys) -> None:
    data = fashion_ads()
    rng = np.random.default_rng(0)
    vis = rng.integers(0, 8, (data.n_items, 2))
    table = tmp_path / "ids.parquet"
    write_visual_ids(table, data.item_ids[3:], vis[3:], 8)  # three ads of the log have no image
    run = tmp_path / "run"
    args = ["ctr", "train", "--data", "fashion", "--model", "dcnv2", "--features", "id,visual",
            "--visual-ids", str(table), "--epochs", "1", "--out", str(run)]
    assert main(args) == 2
    assert "have no content IDs" in capsys.readouterr().err
    assert main([*args, "--on-missing", "skip"]) == 0
    report = json.loads((run / "report.json").read_text())
    info = report["visual_table"]
    assert info["ads_missing"] == 3 and info["rows_dropped_train"] + info["rows_dropped_test"] > 0
    assert len(data.train) - info["rows_dropped_train"] == report["data"]["n_train"]
    assert main(["ctr", "eval", "--run", str(run)]) == 0
    evaluated = json.loads((run / "eval.json").read_text())["metrics"]
    for key in ("auc_new", "auc_old", "gauc_new", "logloss_old"):
        assert evaluated[key] == pytest.approx(report["metrics"][key], abs=1e-6)
    assert "new ads" in capsys.readouterr().out
    assert main(["ctr", "train", "--features", "id,colour", "--out", str(tmp_path / "bad")]) == 2
    assert "bad --features" in capsys.readouterr().err


def test_content_tower_without_both_vectors_fails_before_any_fit(tmp_path, capsys, monkeypatch) -> None:
    import leanml.ctr.content as content_mod

    def no_fit(*a, **k):
        raise AssertionError("the options should be rejected before content IDs are fitted")

    monkeypatch.setattr(content_mod, "fit_dataset_content_ids", no_fit)
    args = ["ctr", "train", "--data", "fashion", "--features", "id,visual", "--visual-fields", "none",
            "--codeword-vector", "--content-tower", "--out", str(tmp_path / "run")]
    assert main(args) == 2
    assert "--content-tower" in capsys.readouterr().err and not (tmp_path / "run").exists()
