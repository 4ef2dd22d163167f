"""``leanml ctr`` through the real CLI: bad options and damaged run folders are refused with one line before
any data is loaded or content IDs are fitted, and nothing is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli.parallel import Case, check_refused, readonly_dir, run_cases


def _run_folder(report: str):
    """A run folder as `ctr train` writes it, with ``report`` as its report.json."""
    def setup(d: Path, shared: Path) -> None:
        run = d / "run"
        run.mkdir()
        (run / "report.json").write_text(report)
        (run / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
        (run / "fields.npz").write_bytes(b"")
    return setup


def _train(*extra: str):
    return lambda d, s: ["ctr", "train", "--out", str(d / "run"), *extra]


GOOD_CONFIG = {"model": "deepfm", "features": "id", "epochs": 1}

CASES = [
    # rejected before the content-ID fit (about 14 s on Fashion) that visual features need
    Case("unknown_model_with_visual", _train("--model", "foo", "--features", "id,visual"),
         ("unknown CTR model", "foo")),
    Case("epochs_zero", _train("--epochs", "0"), ("epochs", "at least 1")),
    Case("lr_zero", _train("--lr", "0"), ("lr",)),
    Case("embed_dim_zero", _train("--embed-dim", "0", "--features", "id"), ("--embed-dim",)),
    Case("codebook_k_one", _train("--K", "1"), ("K >= 2",)),
    Case("content_epochs_zero", _train("--content-epochs", "0"), ("--content-epochs",)),
    Case("threads_zero", _train("--threads", "0"), ("--threads",)),
    Case("readonly_out",
         lambda d, s: ["ctr", "train", "--features", "id", "--out", str(readonly_dir(d / "ro") / "run")],
         ("--out",), lambda d, s: readonly_dir(d / "ro") and None),
    Case("visual_ids_missing", _train("--features", "visual", "--visual-ids", "nope.parquet"), ("nope.parquet",)),
    Case("visual_ids_not_parquet", _train("--features", "visual", "--visual-ids", "ids.parquet"),
         ("ids.parquet", "Parquet"), lambda d, s: (d / "ids.parquet").write_bytes(b"not parquet at all")),
    Case("content_ids_not_a_model", _train("--content-ids", "cid"), ("cid", "content-ID model folder"),
         lambda d, s: (d / "cid").mkdir()),
    Case("eval_corrupt_report", lambda d, s: ["ctr", "eval", "--run", str(d / "run")],
         ("report.json", "not valid JSON"), _run_folder('{"config": {"model": "deepfm", ')),
    Case("eval_report_without_config", lambda d, s: ["ctr", "eval", "--run", str(d / "run")],
         ("report.json", "config"), _run_folder('{"metrics": {}}')),
    Case("eval_report_unknown_option", lambda d, s: ["ctr", "eval", "--run", str(d / "run")],
         ("report.json", "config"), _run_folder(json.dumps({"config": {**GOOD_CONFIG, "colour": 1}, "fields": []}))),
    Case("assign_readonly_out", lambda d, s: ["ctr", "content-ids", "assign", "--model", str(d / "cid"), "--data",
                                              "fashion", "--out", str(readonly_dir(d / "ro") / "ids.parquet")],
         ("--out",), lambda d, s: readonly_dir(d / "ro") and None),
    Case("eval_missing_run", lambda d, s: ["ctr", "eval", "--run", str(d / "nope")], ("--run",)),
]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    shared = tmp_path_factory.mktemp("ctr-shared")
    return run_cases(CASES, tmp_path_factory.mktemp("ctr-cases"), shared)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_and_writes_nothing(case: Case, outcomes) -> None:
    check_refused(outcomes[case.id], case)
