"""``leanml eval --tasks``: check the request before any model is loaded (:func:`check_tasks`), then run
lm-evaluation-harness on the loaded model (:func:`run_tasks`).

A task is one of the offline tasks (:data:`leanml.eval.tasks.OFFLINE_TASKS`), a task YAML file of the
user's, or a name in lm-eval's own registry (hellaswag, piqa, ...), whose data comes from the hub.
Every refusal is one :class:`LeanmlError` line: lm-eval missing or outside the pin, an unknown task, a
hub task while the hub is unreachable, a malformed task YAML or data file (named).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from leanml.errors import LeanmlError
from leanml.eval.tasks import LM_EVAL_VERSION, OFFLINE_TASKS, YAML_DIR

INSTALL = "pip install 'leanml[eval]'"


def installed_version() -> str | None:
    """The installed lm-eval's version (None when it is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lm-eval")
    except PackageNotFoundError:
        return None


def require_lm_eval(found: str | None | bool = False) -> None:
    """Refuse (one line) a missing lm-eval or one outside the pin :data:`LM_EVAL_VERSION`, before it is
    imported. ``found`` stands for the installed version (tests); by default it is looked up."""
    found = installed_version() if found is False else found
    if found is None:
        from leanml.extras import MissingExtraError, missing_message

        raise MissingExtraError(f"tasks: {missing_message('eval', 'lm_eval', 'eval')}", fields=("tasks",))
    if found != LM_EVAL_VERSION:
        raise LeanmlError(f"lm-eval {found} is installed but leanml's tasks need lm-eval=={LM_EVAL_VERSION}; "
                          f"run `pip install 'lm-eval=={LM_EVAL_VERSION}'` or `{INSTALL}`")


def parse_task_list(text: str) -> tuple[str, ...]:
    """``--tasks a,b,c`` as a tuple of names, refusing an empty entry (the command line puts the option's
    flag before the message)."""
    names = tuple(n.strip() for n in text.split(","))
    if not text.strip() or any(not n for n in names):
        raise LeanmlError(f"{text!r} has an empty name; give NAME[,NAME...], e.g. {','.join(OFFLINE_TASKS)}")
    if len(set(names)) != len(names):
        raise LeanmlError(f"{text!r} names a task twice; list each task once")
    return names


def offline_list() -> str:
    return ", ".join(OFFLINE_TASKS)


@contextlib.contextmanager
def quiet_lm_eval() -> Iterator[None]:
    """lm-eval's info and warning logs off (its progress bars stay); its errors still show."""
    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@dataclass
class TaskPlan:
    """The checked tasks: lm-eval ``Task`` objects by name, their source, and the manager that built them."""

    names: tuple[str, ...]
    tasks: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)  # task -> offline | file <path> | hub
    manager: Any = None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _check_yaml(path: Path) -> dict[str, Any]:
    """A task YAML file read the way lm-eval reads it (functions resolved); one line naming it if not."""
    from lm_eval.tasks._yaml_loader import load_yaml

    try:
        config = load_yaml(path)
    except Exception as exc:  # noqa: BLE001 - yaml, import and value errors alike name the file
        raise LeanmlError(f"task file {path} is malformed ({_first_line(exc)}); fix or replace it") from exc
    if not isinstance(config, dict) or not isinstance(config.get("task"), str):
        raise LeanmlError(f"task file {path} is malformed (no 'task' name at its top level); fix or replace it")
    return config


def _is_file_spec(name: str) -> bool:
    return name.endswith((".yaml", ".yml")) or "/" in name


def check_tasks(names: tuple[str, ...]) -> TaskPlan:
    """Everything about ``--tasks`` that can fail, before the model is loaded: lm-eval present and pinned,
    each name known, hub tasks only with a reachable hub, YAML and data well formed (the offline tasks'
    data is built here on first use). Returns the loaded lm-eval tasks."""
    from leanml.eval.tasks.data import ensure_data

    require_lm_eval()
    plan = TaskPlan(names)
    specs: dict[str, tuple[str, str]] = {}  # name -> (what lm-eval loads, source)
    hub: list[str] = []
    for name in names:
        if name in OFFLINE_TASKS:
            path = YAML_DIR / f"{name}.yaml"
            _check_yaml(path)
            ensure_data(name)
            specs[name] = (str(path), "offline")
        elif _is_file_spec(name):
            path = Path(name).expanduser()
            if not path.is_file():
                raise LeanmlError(f"tasks: no such task file {name!r}; pass a task .yaml file or one of the "
                                  f"offline ones: {offline_list()}", fields=("tasks",))
            _check_yaml(path)
            specs[name] = (str(path.resolve()), f"file {path}")
        else:
            hub.append(name)
    with quiet_lm_eval():
        from lm_eval.tasks import TaskManager

        plan.manager = TaskManager(include_path=str(YAML_DIR), include_defaults=bool(hub))
    if hub:
        _check_hub_tasks(hub, plan.manager)
        specs.update({name: (name, "hub") for name in hub})
    for name in names:
        spec, source = specs[name]
        loaded = _load(plan.manager, name, spec, source)
        plan.tasks.update(loaded)
        plan.sources.update(dict.fromkeys(loaded, source))
    return plan


def _check_hub_tasks(names: list[str], manager: Any) -> None:
    from leanml.models.check import hub_offline, hub_reachable

    known = set(manager.all_tasks)
    for name in names:
        if name not in known:
            raise LeanmlError(f"tasks: unknown task {name!r}; the offline ones are {offline_list()} (a task "
                              f".yaml file or an lm-eval task name also works, the latter with a reachable hub)",
                              fields=("tasks",))
    if hub_offline() or not hub_reachable():
        raise LeanmlError(f"tasks: task {names[0]!r} reads its data from the hub, which is unreachable"
                          f"{' (offline mode)' if hub_offline() else ''}; use an offline task: {offline_list()}",
                          fields=("tasks",))


def _load(manager: Any, name: str, spec: str, source: str) -> dict[str, Any]:
    """Build one task (its data read now, before the model loads); one line naming what failed."""
    try:
        with quiet_lm_eval():
            return manager.load([spec])["tasks"]
    except LeanmlError:
        raise
    except Exception as exc:  # noqa: BLE001 - lm-eval raises many types for bad configs and data
        if source == "hub":
            raise LeanmlError(f"tasks: could not load task {name!r} from the hub ({_first_line(exc)})",
                              fields=("tasks",)) from exc
        raise LeanmlError(f"task file {spec} is malformed ({_first_line(exc)}); fix or replace it") from exc


def _number(value: Any) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):  # lm-eval writes "N/A" for a stderr of one sample
        return None
    return None if math.isnan(value) else value


def task_record(name: str, metrics: dict[str, Any], samples: dict[str, Any], source: str) -> dict[str, Any]:
    """One task's report entry: each metric and its stderr, the headline metric (``score``), the items
    evaluated, the chance level and whether the score is above it at 95 % (offline tasks)."""
    info = OFFLINE_TASKS.get(name)
    rec: dict[str, Any] = {"source": source}
    for key, value in metrics.items():
        metric, _, filt = key.partition(",")
        if filt == "none" and metric != "alias":
            rec[metric] = _number(value)
    primary = info.metric if info else "acc" if "acc" in rec else None
    rec["metric"] = primary
    rec["score"] = rec.get(primary) if primary else None
    rec["score_stderr"] = rec.get(f"{primary}_stderr") if primary else None
    rec["n"] = int(samples.get("effective", 0))
    rec["size"] = int(samples.get("original", 0))
    rec["chance"] = info.chance if info else None
    score, se = rec["score"], rec["score_stderr"]
    if score is not None and se is not None:
        rec["ci95"] = [score - 1.96 * se, score + 1.96 * se]
        rec["above_chance"] = None if rec["chance"] is None else bool(score - 1.96 * se > rec["chance"])
    return rec


def run_tasks(model: Any, tokenizer: Any, plan: TaskPlan, *, limit: int | None, num_fewshot: int | None,
              batch_size: int) -> dict[str, Any]:
    """Run the planned tasks on ``model`` (on the device it is on) through lm-eval's ``HFLM``; lm-eval's
    progress bar runs over the requests. Returns ``{task: record}`` (see :func:`task_record`)."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    with quiet_lm_eval():
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
        out = lm_eval.simple_evaluate(model=lm, tasks=list(plan.tasks.values()), num_fewshot=num_fewshot,
                                      limit=limit, task_manager=plan.manager, log_samples=False)
    if out is None:  # pragma: no cover - only on a non-zero rank
        return {}
    records = {}
    for key in plan.tasks:
        records[key] = task_record(key, out["results"].get(key, {}), out.get("n-samples", {}).get(key, {}),
                                   plan.sources[key])
        records[key]["num_fewshot"] = out.get("configs", {}).get(key, {}).get("num_fewshot")
    return records
