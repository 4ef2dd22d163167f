"""Checks run before any expensive step, and files published as a whole.

* :func:`check_file_target`: an output file can be created (probed with a real file by
  :func:`leanml.outputs.check_writable`), before the work that would then be lost.
* :func:`check_log`: a log exists, is not empty, is not a truncated gzip or an unreadable Parquet file,
  has at least one non-blank line and lines shaped like the graph's schema (the columns it needs);
  returns an estimate of its line count (for the progress bar and the estimated time).
* :func:`staged_files`: temporary siblings for a set of files that are published together (a report
  and its quarantine file): nothing appears under the final names until the work succeeded, a stale
  file of an earlier run is removed, and the temporaries go on any exit.

Each failure is a :class:`LeanmlError` with one line that names the fix.
"""

from __future__ import annotations

import contextlib
import glob
import gzip
import json
import os
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from leanml.errors import LeanmlError
from leanml.outputs import check_writable, clean_stale

if TYPE_CHECKING:
    from leanml.features.read.logschema import Schema

SNIFF_BYTES = 1 << 16  # decompressed bytes read to check a text log's first lines
SNIFF_LINES = 200
GZIP_FULL_CHECK_BYTES = 256 << 20  # gzip files up to this compressed size are decompressed once to check them


def check_file_target(path: str | os.PathLike, what: str) -> Path:
    """``path`` will be written as a file: refuse a folder there, and an unwritable location."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise LeanmlError(f"{what} {path} is a folder; give a file path")
    check_writable(path.parent, what)
    return path


# ---------------------------------------------------------------------------------------------- logs
@dataclass
class LogInfo:
    """What the check learned about one log: its format and about how many lines it has."""

    path: Path
    fmt: str
    lines_estimate: int


def _gzip_problem(path: Path) -> str | None:
    """Why a gzip file cannot be read to its end (None when it can), decompressing it once."""
    try:
        with gzip.open(path, "rb") as fh:
            while fh.read(1 << 22):
                pass
    except (EOFError, OSError, zlib.error) as exc:
        return str(exc) or type(exc).__name__
    return None


def _gzip_size(path: Path) -> int:
    """Uncompressed size from the gzip trailer (modulo 2**32, so exact below 4 GiB)."""
    with open(path, "rb") as fh:
        fh.seek(-4, os.SEEK_END)
        return int.from_bytes(fh.read(4), "little")


def check_log(path: str | os.PathLike, schema: Schema, what: str = "the log", sep: str = "\t") -> LogInfo:
    """Raise unless ``path`` is a readable, non-empty log with the fields of ``schema``, of which at least one
    of the first rows can be read (a log whose first rows all go to quarantine is the wrong file). The errors
    begin with ``what``: the flag that gave the log on the command line (``flag_of``: a field name would also
    match in ``*.log``)."""
    from leanml.features.read.linelogs import parse_lines
    from leanml.features.read.logschema import Quarantine
    from leanml.features.read.readers import detect_format

    names = schema.names
    path = Path(path)
    if not path.exists():
        raise LeanmlError(f"{what} {path} does not exist; check the path (or generate logs with "
                          "`leanml features generate`)")
    if not path.is_file():
        raise LeanmlError(f"{what} {path} is not a file; pass a log file")
    fmt = detect_format(path)
    size = path.stat().st_size
    if size == 0:
        raise LeanmlError(f"{what} {path} is empty (0 bytes); pass a log with rows")
    if not os.access(path, os.R_OK):
        raise LeanmlError(f"{what} {path} is not readable; fix its permissions")
    if fmt == "parquet":
        return LogInfo(path, fmt, _check_parquet(path, names, what))
    gz = path.suffix == ".gz"
    if gz:
        with open(path, "rb") as fh:
            if fh.read(2) != b"\x1f\x8b":
                raise LeanmlError(f"{what} {path} is not gzip data although its name ends in .gz; "
                                  "rename it or re-compress it")
        if size <= GZIP_FULL_CHECK_BYTES:
            problem = _gzip_problem(path)
            if problem:
                raise LeanmlError(f"{what} {path} is a truncated or corrupt gzip file ({problem}); "
                                  "copy or compress it again")
    try:
        with (gzip.open(path, "rb") if gz else open(path, "rb")) as fh:
            head = fh.read(SNIFF_BYTES)
    except (EOFError, OSError, zlib.error) as exc:
        raise LeanmlError(f"{what} {path} cannot be read ({exc}); copy or compress it again") from None
    lines = head.split(b"\n")
    if len(head) == SNIFF_BYTES and len(lines) > 1:
        lines = lines[:-1]  # the last line of the sample may be cut
    lines = [ln for ln in lines[:SNIFF_LINES] if ln.strip()]
    if not lines:
        raise LeanmlError(f"{what} {path} has no rows (only blank lines); pass a log with rows")
    if fmt == "tsv":
        counts = [len(ln.rstrip(b"\r").split(sep.encode())) for ln in lines]
        if len(names) not in counts:
            got = max(set(counts), key=counts.count)
            raise LeanmlError(f"{what} {path}: its lines have {got} tab-separated fields but the graph's schema "
                              f"needs {len(names)} ({', '.join(names)}); pass a log with these columns in this order")
    else:
        missing = _jsonl_missing(lines, names)
        if missing:
            raise LeanmlError(f"{what} {path} lacks the columns {', '.join(missing)} that the graph needs; "
                              "pass a log with them (or a graph whose schema matches the log)")
    q = Quarantine()
    chunk = parse_lines(lines, schema, q, str(path), 1, fmt=fmt, sep=sep, engine="python")
    if not len(next(iter(chunk.values()))):
        reasons = ", ".join(f"{k}={v}" for k, v in q.counts.most_common(3))
        raise LeanmlError(f"{what} {path}: none of its first {len(lines)} rows can be read ({reasons}); "
                          "check that it is a log of the graph's schema, in the right format")
    total = _gzip_size(path) if gz else size
    per_line = max(1.0, len(b"\n".join(lines)) / len(lines))
    return LogInfo(path, fmt, max(len(lines), int(total / per_line)))


def _jsonl_missing(lines: list[bytes], names: Sequence[str]) -> list[str]:
    """Columns absent from every sampled JSON line ([] when some line has them all or no line parses)."""
    absent = set(names)
    parsed = False
    for ln in lines:
        try:
            obj = json.loads(ln)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if not isinstance(obj, dict):
            continue
        parsed = True
        lacking = {n for n in names if n not in obj}
        if not lacking:
            return []
        absent &= lacking
    if not parsed:
        return []  # not one JSON object in the sample: rows are quarantined as bad_json one by one
    return [n for n in names if n in absent]


def _check_parquet(path: Path, names: Sequence[str], what: str) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise LeanmlError(f"{what} {path} is not a readable Parquet file ({str(exc).splitlines()[0]}); "
                          "write it again") from None
    have = pf.schema_arrow.names
    missing = [n for n in names if n not in have]
    if missing:
        raise LeanmlError(f"{what} {path} lacks the columns {', '.join(missing)} that the graph needs "
                          f"(it has {', '.join(have)}); pass a log with them")
    if pf.metadata.num_rows == 0:
        raise LeanmlError(f"{what} {path} has no rows; pass a log with rows")
    return pf.metadata.num_rows


def check_logs(paths: Sequence[str | os.PathLike], schema: Schema, what: str) -> list[LogInfo]:
    """:func:`check_log` for every path (at least one); ``what``: the flag that gives them."""
    if not paths:
        raise LeanmlError(f"no log files given; pass at least one {what} PATH")
    return [check_log(p, schema, what) for p in paths]


# ----------------------------------------------------------------------------------------- publishing
def temp_sibling(final: Path) -> Path:
    """``DIR/.NAME.tmp-PID.SUFFIX``: the temporary name of ``final`` while this process writes it (the
    suffix is kept for writers that derive names from it, e.g. the per-worker quarantine files
    ``.NAME.tmp-PID.workerN.SUFFIX``); :func:`leanml.outputs.clean_stale` removes those of killed runs."""
    return final.with_name(f".{final.name}.tmp-{os.getpid()}{final.suffix}")


def _remove_temps(final: Path) -> None:
    tmp = temp_sibling(final)
    for p in [tmp, *final.parent.glob(glob.escape(tmp.stem) + ".*")]:
        with contextlib.suppress(OSError):
            p.unlink()


@contextlib.contextmanager
def staged_files(report: Path, *companions: Path) -> Iterator[tuple[Path, ...]]:
    """Temporary paths for ``report`` and its ``companions`` (e.g. a quarantine file), published together.

    Write the temporaries inside the block. On success the old ``report`` is removed first, then each
    companion is renamed into place (or, when its temporary was not written, a stale file of that name
    from an earlier or killed run is removed), and the report is renamed last: a report on disk always
    describes the companions beside it. On any exception the temporaries are removed and the old files
    are left as they were. Temporaries of killed runs are removed at the start.
    """
    finals = [Path(report), *map(Path, companions)]
    made: list[Path] = []  # folders created here, removed again when the run fails
    for f in finals:
        missing = [d for d in [f.parent, *f.parent.parents] if not d.exists()]
        f.parent.mkdir(parents=True, exist_ok=True)
        made += reversed(missing)
        clean_stale(f)
    temps = tuple(temp_sibling(f) for f in finals)
    for t in temps:
        t.unlink(missing_ok=True)
    ok = False
    try:
        yield temps
        if not temps[0].exists():
            raise RuntimeError(f"staged_files: the report {finals[0]} was not written")
        finals[0].unlink(missing_ok=True)
        for f, t in zip(finals[1:], temps[1:]):
            if t.exists():
                t.replace(f)
            else:
                f.unlink(missing_ok=True)
        temps[0].replace(finals[0])
        ok = True
    finally:
        for f in finals:
            _remove_temps(f)
        if not ok:
            for d in reversed(made):
                with contextlib.suppress(OSError):
                    d.rmdir()
