"""Bad-input cases run as real ``python -m leanml`` subprocesses, two at a time.

Each case gets its own folder (also the command's working directory); the folder and the shared
inputs are snapshotted before the command runs, so a test can check that a refused command left the
tree as it was. Starting Python and torch costs about 3 s a process, so the cases of a file run
concurrently from one module fixture and each test only checks its own result.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from cli.conftest import CliResult, assert_unchanged, assert_user_error, run_cli, snapshot


@dataclass(frozen=True)
class Case:
    """``args(case_dir, shared_dir)`` -> the command line after ``leanml``; ``setup(case_dir, shared_dir)``
    prepares inputs first; ``needles`` must appear in the one error line."""

    id: str
    args: Callable[[Path, Path], list[str]]
    needles: tuple[str, ...]
    setup: Callable[[Path, Path], None] | None = None
    after_work: bool = False  # refused only once reading began: progress-bar lines may precede the error


@dataclass
class Outcome:
    result: CliResult
    before: dict[str, tuple[int, int]]
    roots: tuple[Path, ...]


def visible(result: CliResult) -> CliResult:
    """The output as a terminal shows it: of each line, what follows its last carriage return (a progress
    bar that was cleared leaves nothing)."""
    def clean(text: str) -> str:
        return "\n".join(line.rsplit("\r", 1)[-1] for line in text.split("\n"))

    return CliResult(result.code, clean(result.stdout), clean(result.stderr))


def run_cases(cases: Sequence[Case], root: Path, shared: Path, workers: int = 2) -> dict[str, Outcome]:
    """Set up every case, snapshot its folder and ``shared``, then run the commands ``workers`` at a time."""
    prepared = []
    for case in cases:
        d = root / case.id
        d.mkdir(parents=True)
        if case.setup is not None:
            case.setup(d, shared)
        roots = (d, shared)
        prepared.append((case, d, roots, snapshot(*roots)))

    def one(item: tuple[Case, Path, tuple[Path, ...], dict]) -> tuple[str, Outcome]:
        case, d, roots, before = item
        return case.id, Outcome(visible(run_cli(case.args(d, shared), cwd=d)), before, roots)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return dict(pool.map(one, prepared))


def check_refused(out: Outcome, case: Case) -> None:
    """``case`` was refused cleanly (:func:`~cli.conftest.assert_user_error` with its needles; progress bars
    may come first when it is refused ``after_work``) and left its folder and the shared inputs unchanged."""
    assert_user_error(out.result, *case.needles, before_work=not case.after_work)
    assert_unchanged(out.before, *out.roots)


def readonly_dir(path: Path) -> Path:
    """A folder nothing can be written into: ``path`` made read-only, or, when that does not stop this user
    (root ignores permissions), ``/sys`` (sysfs refuses new files even to root)."""
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(stat.S_IRUSR | stat.S_IXUSR)
    probe = path / ".probe"
    try:
        probe.write_text("")
    except OSError:
        return path
    probe.unlink()
    path.chmod(stat.S_IRWXU)
    fallback = Path("/sys")
    assert not os.access(fallback / "leanml-probe", os.F_OK)
    return fallback
