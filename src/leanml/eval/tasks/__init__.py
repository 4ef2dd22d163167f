"""Zero-shot accuracy through lm-evaluation-harness (``leanml eval --tasks``).

Three offline tasks are built from labels already on the machine (never hand-written examples), as
lm-eval task definitions: the YAML files in ``yaml/`` (package data), whose data files are generated
into ``$LEANML_CACHE/tasks/`` on first use with a fixed seed (:mod:`leanml.eval.tasks.data`):

- ``reviews-recommend``: the Women's Clothing reviews' own "Recommended IND" flag, yes/no from the
  review text;
- ``reviews-rating``: polarity, 1-2 stars against 4-5 (3 stars left out), from the review text;
- ``shakespeare-next-line``: four-way multiple choice, the true next line of a speech against three
  lines drawn from the same play.

Only texts that calibration never reads are used: the reviews' ``val`` and ``test`` splits (the last
600 non-empty review texts, :mod:`leanml.data.text`) and the Shakespeare test play (Hamlet). Both
review tasks are balanced (every minority-class text and as many drawn from the majority class), so
chance is 50 %. :mod:`leanml.eval.tasks.runner` checks the request and runs lm-eval on a loaded model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

#: the lm-eval release these tasks and the runner are tested with (the ``eval`` extra pins it)
LM_EVAL_VERSION = "0.4.13"
#: the folder of the task YAML files (lm-eval's ``TaskManager(include_path=...)``)
YAML_DIR = Path(__file__).resolve().parent / "yaml"


@dataclass(frozen=True)
class TaskInfo:
    """What a report needs to know of an offline task: its chance level and its headline metric."""

    name: str
    chance: float
    metric: str  # acc (the reviews: two one-word answers) or acc_norm (lines of different lengths)
    about: str


OFFLINE_TASKS: dict[str, TaskInfo] = {t.name: t for t in (
    TaskInfo("reviews-recommend", 0.5, "acc", "clothing reviews: does the reviewer recommend the item (yes/no)"),
    TaskInfo("reviews-rating", 0.5, "acc", "clothing reviews: positive (4-5 stars) or negative (1-2 stars)"),
    TaskInfo("shakespeare-next-line", 0.25, "acc_norm",
             "Hamlet: the true next line of a speech against 3 lines of the same play"),
)}
