"""``leanml eval --tasks``: the offline tasks' data (deterministic, from the real labels, from texts no
calibration reads), their YAML in lm-eval's TaskManager, a run through the real CLI on a tiny random
LLaMA, and every refusal (one line, exit 2, before the model loads)."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import pandas as pd
import pytest

from cli.conftest import ROOT, SAMPLE_TEXT, assert_user_error, run_cli, save_tiny_llama
from leanml.eval.tasks import LM_EVAL_VERSION, OFFLINE_TASKS, YAML_DIR, data

pytest.importorskip("lm_eval")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A fresh LEANML_CACHE holding only (a link to) the Shakespeare texts, which live in the cache."""
    from leanml.data.offline import shakespeare_dir

    plays = shakespeare_dir()
    path = tmp_path / "cache"
    path.mkdir()
    (path / plays.name).symlink_to(plays)
    monkeypatch.setenv("LEANML_CACHE", str(path))
    return path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """``model/``: a tiny random LLaMA with a word-level tokenizer; ``text.txt``: a short UTF-8 text."""
    root = tmp_path_factory.mktemp("task-inputs")
    save_tiny_llama(root / "model")
    (root / "text.txt").write_text(SAMPLE_TEXT, encoding="utf-8")
    return root


# ------------------------------------------------------------------ data


def test_review_tasks_are_the_real_labels_of_unseen_texts_balanced_and_deterministic() -> None:
    from leanml.data.offline import widedeep_data_dir
    from leanml.data.text import REVIEWS_TEST, REVIEWS_VAL, load_text, review_texts

    df = pd.read_parquet(widedeep_data_dir() / "WomensClothingE-CommerceReviews.parquet.brotli")
    unseen = load_text("reviews", "val") + "\n\n" + load_text("reviews", "test")
    rec, rating = data.reviews_recommend_items(), data.reviews_rating_items()
    assert rec == data.reviews_recommend_items() and rating == data.reviews_rating_items()  # seeded
    for items, label_of in ((rec, lambda row: int(row["Recommended IND"])),
                            (rating, lambda row: int(row["Rating"] >= 4))):
        labels = [it["label"] for it in items]
        assert labels.count(0) == labels.count(1) > 10  # balanced: chance is 50 %
        assert len({it["row"] for it in items}) == len(items)
        for it in items:
            row = df.loc[it["row"]]
            assert row["Review Text"].strip() == it["text"] and label_of(row) == it["label"]
            assert it["text"] in unseen
        if items is rating:
            assert all(df.loc[it["row"], "Rating"] != 3 for it in items)
    # only the val + test texts: no item's text is a calibration text
    texts = review_texts()
    calib_texts = set(texts[: len(texts) - REVIEWS_VAL - REVIEWS_TEST])
    assert not any(it["text"] in calib_texts for it in rec + rating)
    assert len(rec) <= REVIEWS_VAL + REVIEWS_TEST


PLAY = """PERSONS REPRESENTED.

Hamlet, Prince.

ACT I.

Scene I. A room.

[Enter Ham.]

Ham.
one two three four alpha
five six seven eight beta
nine ten eleven twelve gamma [Aside.]
thirteen fourteen fifteen sixteen delta

Hor.
Short.
seventeen eighteen nineteen twenty epsilon
twenty-one twenty-two twenty-three twenty-four zeta

Ham.
twenty-five twenty-six twenty-seven twenty-eight eta
"""


def test_next_line_items_ask_the_true_next_line_of_a_speech() -> None:
    speeches = data.speeches(PLAY)
    assert [len(s) for s in speeches] == [4, 3, 1]  # the cast list and stage directions are not speech
    assert speeches[0][2][1] == "nine ten eleven twelve gamma"  # the bracketed direction removed
    items = data.next_line_items(PLAY, n_items=50, seed=3)
    assert items == data.next_line_items(PLAY, n_items=50, seed=3)
    lines = PLAY.splitlines()
    assert len(items) == 5  # every line after a speech's first with >= 4 words (3 + 2 + 0)
    for it in items:
        true = it["choices"][it["label"]]
        assert lines[it["line"] - 1].startswith(true)
        assert len(set(it["choices"])) == 4 and true not in it["context"].split("\n")
        context = it["context"].split("\n")
        assert 1 <= len(context) <= data.CONTEXT_LINES


def test_shakespeare_task_comes_from_the_test_play_only() -> None:
    from leanml.data.text import SHAKESPEARE_CALIB, SHAKESPEARE_TEST, _play_text

    items = data.shakespeare_next_line_items()
    assert len(items) == data.NEXT_LINE_ITEMS and {it["play"] for it in items} == set(SHAKESPEARE_TEST)
    assert "hamlet" not in SHAKESPEARE_CALIB
    lines = _play_text("hamlet").splitlines()
    for it in items:
        raw = lines[it["line"] - 1]
        assert " ".join(data._DIRECTION.sub(" ", raw).split()) == it["choices"][it["label"]]
    labels = [it["label"] for it in items]
    assert all(labels.count(k) > 80 for k in range(4))  # the gold's place is drawn, not fixed


def test_data_is_written_once_into_the_cache_and_read_back(cache) -> None:
    path = data.ensure_data("reviews-rating")
    assert path.parent == cache / "tasks" and path.exists()
    items = data.read_items(path, "reviews-rating")
    assert items == data.reviews_rating_items()
    stamp = path.stat().st_mtime_ns
    data.ensure_data("reviews-rating")
    assert path.stat().st_mtime_ns == stamp


# ------------------------------------------------------------------ lm-eval


def test_yaml_loads_in_lm_eval_task_manager(cache) -> None:
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(YAML_DIR), include_defaults=False)
    assert set(OFFLINE_TASKS) <= set(manager.all_tasks)
    loaded = manager.load(list(OFFLINE_TASKS))["tasks"]
    for name, task in loaded.items():
        docs = list(task.test_docs())
        expected = data.read_items(data.data_path(name), name)
        assert len(docs) == len(expected)
        doc = docs[0]
        assert task.doc_to_target(doc) == expected[0]["label"]
        assert len(task.doc_to_choice(doc)) == (4 if name == "shakespeare-next-line" else 2)


def _tiny(inputs: Path) -> str:
    return str(inputs / "model")


def test_cli_runs_a_task_on_a_tiny_llama_and_writes_acc_and_stderr(inputs, tmp_path) -> None:
    out = tmp_path / "report.json"
    result = run_cli(["eval", "--model", _tiny(inputs), "--tasks", "reviews-recommend", "--limit", "8",
                      "--threads", "1", "--json", str(out)], env={"LEANML_CACHE": str(tmp_path / "cache")})
    assert result.code == 0, str(result)
    assert "reviews-recommend: acc" in result.stdout and "perplexity" not in result.stdout
    assert "Running loglikelihood requests" in result.stderr  # lm-eval's progress bar
    report = json.loads(out.read_text())
    rec = report["tasks"]["reviews-recommend"]
    assert rec["n"] == 8 and rec["size"] > 8 and rec["chance"] == 0.5
    assert 0 <= rec["acc"] <= 1 and rec["acc_stderr"] > 0 and rec["score"] == rec["acc"]
    assert "ppl" not in report and report["lm_eval"] == LM_EVAL_VERSION and report["limit"] == 8


def test_cli_tasks_beside_perplexity_when_data_is_given(inputs, tmp_path) -> None:
    out = tmp_path / "report.json"
    result = run_cli(["eval", "--model", _tiny(inputs), "--data", str(inputs / "text.txt"),
                      "--seqlen", "32", "--max-windows", "2", "--tasks", "reviews-rating", "--limit", "4",
                      "--json", str(out)], env={"LEANML_CACHE": str(tmp_path / "cache")})
    assert result.code == 0, str(result)
    report = json.loads(out.read_text())
    assert report["ppl"] > 1 and report["windows"] == 2
    assert report["tasks"]["reviews-rating"]["n"] == 4


# ------------------------------------------------------------------ refusals


def _eval_tasks(inputs: Path, tasks: str, *extra: str) -> list[str]:
    return ["eval", "--model", _tiny(inputs), "--tasks", tasks, *extra]


def test_unknown_task_is_refused_listing_the_offline_tasks(inputs) -> None:
    result = run_cli(_eval_tasks(inputs, "reviews-recomend"))
    assert_user_error(result, "unknown task", "reviews-recomend", *OFFLINE_TASKS)


def test_hub_task_is_refused_when_the_hub_is_unreachable(inputs) -> None:
    result = run_cli(_eval_tasks(inputs, "hellaswag"))  # the CLI tests run with HF_HUB_OFFLINE=1
    assert_user_error(result, "hellaswag", "hub", "unreachable")


def test_hub_task_is_refused_without_a_connection(monkeypatch) -> None:
    from leanml.errors import LeanmlError
    from leanml.eval.tasks import runner
    from leanml.models import check

    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(check, "hub_reachable", lambda timeout=3.0: False)

    class Known:  # the registry's answer, without scanning lm-eval's thousands of YAML files
        all_tasks = ["piqa"]

    with pytest.raises(LeanmlError, match="'piqa' reads its data from the hub, which is unreachable;"):
        runner._check_hub_tasks(["piqa"], Known())


def test_malformed_task_yaml_is_refused_naming_the_file(inputs, tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("task: x\ndoc_to_text: [unclosed\n")
    assert_user_error(run_cli(_eval_tasks(inputs, str(bad))), "task file", str(bad), "malformed")
    nameless = tmp_path / "nameless.yaml"
    nameless.write_text("output_type: multiple_choice\n")
    assert_user_error(run_cli(_eval_tasks(inputs, str(nameless))), str(nameless), "no 'task' name")
    missing = tmp_path / "missing.yaml"
    assert_user_error(run_cli(_eval_tasks(inputs, str(missing))), "no such task file", *OFFLINE_TASKS)


def test_malformed_task_data_is_refused_naming_the_file(inputs, cache) -> None:
    path = data.data_path("reviews-recommend")
    path.parent.mkdir(parents=True)
    good = data.reviews_recommend_items()
    for body, why in ((json.dumps(good[0]) + "\n{\"text\": \"cut", "line 2"),
                      (json.dumps({**good[0], "label": 2}) + "\n", "'label'")):
        path.write_text(body)
        result = run_cli(_eval_tasks(inputs, "reviews-recommend"), env={"LEANML_CACHE": str(cache)})
        assert_user_error(result, str(path), "malformed", why, "delete it")


def test_options_that_need_tasks_and_empty_names_are_refused(inputs) -> None:
    text = str(inputs / "text.txt")
    assert_user_error(run_cli(["eval", "--model", _tiny(inputs), "--data", text, "--limit", "5"]),
                      "--limit needs --tasks")
    assert_user_error(run_cli(_eval_tasks(inputs, "reviews-rating,,reviews-recommend")), "empty name")
    assert_user_error(run_cli(_eval_tasks(inputs, "reviews-rating,reviews-rating")), "twice")
    assert_user_error(run_cli(_eval_tasks(inputs, "reviews-rating", "--limit", "0")), "--limit")


def test_lm_eval_outside_the_pin_is_refused_naming_the_version(inputs, tmp_path) -> None:
    fake = tmp_path / "site"
    info = fake / "lm_eval-0.4.2.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lm-eval\nVersion: 0.4.2\n")
    env = {"PYTHONPATH": f"{ROOT / 'src'}:{fake}"}  # a fresh process that finds the fake release first
    result = run_cli(_eval_tasks(inputs, "reviews-recommend"), env=env)
    assert_user_error(result, "lm-eval 0.4.2", f"lm-eval=={LM_EVAL_VERSION}")


def test_missing_lm_eval_is_refused_naming_the_extra(inputs, monkeypatch, capsys) -> None:
    from leanml.cli import main

    real = importlib.metadata.version

    def version(name: str) -> str:
        if name == "lm-eval":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert main(_eval_tasks(inputs, "reviews-recommend")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("leanml: error:")
    assert "pip install 'leanml[eval]'" in err[0]


def test_ptb_is_read_from_a_parquet_export_not_a_loading_script(monkeypatch) -> None:
    """datasets >= 4 refuses loading scripts (ptb_text_only is one): ptb goes through the parquet builder."""
    import datasets

    from leanml.data import text
    from leanml.models import check

    calls = []

    def load_dataset(path, *args, **kwargs):
        calls.append((path, args, kwargs))
        return {"sentence": ["a b", "c d"]}

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(check, "hub_reachable", lambda timeout=3.0: True)
    assert text._hub_text("ptb", "test") == "a b c d"
    (path, args, kwargs), = calls
    assert path == "parquet" and not args
    assert kwargs["split"] == "test" and kwargs["data_files"]["test"].startswith(text.PTB_PARQUET + "/test/")
