"""``leanml features`` through the real CLI: bad inputs refused before any work with one line, the output
tree unchanged; generated logs and the quarantine + report pair published as a whole, also across SIGKILL."""

from __future__ import annotations

import gzip
import json
import signal
import time
from pathlib import Path

import pytest

from cli.conftest import assert_unchanged, run_cli, snapshot, start_cli
from cli.parallel import Case, check_refused, readonly_dir, run_cases
from leanml.features.read.data import LogSpec, generate_logs

LOG = "logs/impressions_000.tsv"


def _write(name: str, data: bytes | str):
    def setup(d: Path, shared: Path) -> None:
        (d / name).write_bytes(data if isinstance(data, bytes) else data.encode())
    return setup


def _truncated_gz(d: Path, shared: Path) -> None:
    (d / "cut.tsv.gz").write_bytes(gzip.compress((shared / LOG).read_bytes())[:3000])


def _unknown_items(d: Path, shared: Path) -> None:
    rows = [line.split("\t") for line in (shared / LOG).read_text().splitlines()]
    (d / "unknown.tsv").write_text("".join(f"{r[0]}\t{r[1]}\t99999999\t{r[3]}\t{r[4]}\n" for r in rows))


def _filled_out(d: Path, shared: Path) -> None:
    (d / "gen").mkdir()
    (d / "gen" / "impressions_000.tsv").write_text((shared / LOG).read_text())


def _narrow_parquet(d: Path, shared: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"ts": [1, 2], "user_id": [3, 4], "click": [0, 1]}), d / "narrow.parquet")


def _readonly(d: Path, shared: Path) -> None:
    readonly_dir(d / "ro")


def _ro(d: Path) -> Path:
    return readonly_dir(d / "ro")


def _train(*extra: str):
    return lambda d, s: ["features", "train", "--producer", "thread", "--report", str(d / "r.json"), *extra]


def _log(d: Path, s: Path) -> list[str]:
    return ["--log", str(s / LOG)]


CASES = [
    Case("hidden_not_numbers", lambda d, s: [*_train("--hidden", "abc")(d, s), *_log(d, s)], ("--hidden",)),
    Case("epochs_zero", lambda d, s: [*_train("--epochs", "0")(d, s), *_log(d, s)], ("--epochs",)),
    Case("batch_rows_zero", lambda d, s: ["features", "extract", *_log(d, s), "--batch-rows", "0",
                                          "--out", str(d / "out")], ("--batch-rows",)),
    Case("zero_byte_parquet", lambda d, s: [*_train()(d, s), "--log", str(d / "empty.parquet")],
         ("empty.parquet", "empty"), _write("empty.parquet", b"")),
    Case("corrupt_parquet_extract", lambda d, s: ["features", "extract", "--log", str(d / "bad.parquet"),
                                                  "--out", str(d / "out")],
         ("bad.parquet", "not a readable Parquet"), _write("bad.parquet", b"PAR1" + b"\x07" * 500)),
    Case("truncated_gz_train", lambda d, s: [*_train()(d, s), "--log", str(d / "cut.tsv.gz")],
         ("cut.tsv.gz", "truncated"), _truncated_gz),
    Case("truncated_gz_extract", lambda d, s: ["features", "extract", "--log", str(d / "cut.tsv.gz"),
                                               "--out", str(d / "out")], ("truncated",), _truncated_gz),
    Case("empty_log", lambda d, s: [*_train()(d, s), "--log", str(d / "e.tsv")], ("empty",), _write("e.tsv", "")),
    Case("blank_lines_log", lambda d, s: [*_train()(d, s), "--log", str(d / "b.tsv")], ("no rows",),
         _write("b.tsv", "\n\n  \n")),
    Case("malformed_rows_only", lambda d, s: [*_train()(d, s), "--log", str(d / "m.tsv")],
         ("none of its first", "bad_int"), _write("m.tsv", "a\tb\tc\td\te\nx\ty\tz\tw\tv\n")),
    Case("jsonl_missing_columns", lambda d, s: [*_train()(d, s), "--log", str(d / "few.jsonl")],
         ("item_id, click, hist",), _write("few.jsonl", '{"ts": 1, "user_id": 2}\n')),
    Case("parquet_missing_columns", lambda d, s: ["features", "extract", "--log", str(d / "narrow.parquet"),
                                                  "--out", str(d / "out")], ("item_id, hist",), _narrow_parquet),
    Case("tsv_too_few_fields", lambda d, s: [*_train()(d, s), "--log", str(d / "n.tsv")],
         ("2 tab-separated fields", "needs 5"), _write("n.tsv", "1\t2\n3\t4\n")),
    Case("readonly_extract_out", lambda d, s: ["features", "extract", *_log(d, s), "--out", str(_ro(d) / "out")],
         ("--out",), _readonly),
    Case("readonly_report", lambda d, s: [*_train()(d, s), *_log(d, s), "--report", str(_ro(d) / "r.json")],
         ("--report",), _readonly),
    Case("missing_test_log", lambda d, s: [*_train("--test-log", str(d / "nope.tsv"))(d, s), *_log(d, s)],
         ("--test-log", "nope.tsv")),
    # the log's folder has users.jsonl, the current directory does not: --table paths are cwd-relative
    Case("table_relative_to_cwd", lambda d, s: [*_train("--table", "users=users.jsonl")(d, s), *_log(d, s)],
         ("users", "current directory")),
    Case("table_unknown_name", lambda d, s: [*_train("--table", f"visitors={s / 'logs/users.jsonl'}")(d, s),
                                             *_log(d, s)], ("visitors", "items, users")),
    Case("generate_over_logs", lambda d, s: ["features", "generate", "--rows", "100", "--out", str(d / "gen")],
         ("--overwrite",), _filled_out),
    Case("generate_zero_rows", lambda d, s: ["features", "generate", "--rows", "0", "--out", str(d / "gen")],
         ("--rows",)),
    Case("features_dir_missing", lambda d, s: [*_train("--features", str(d / "feats"))(d, s)], ("--features",)),
    # every row names an unknown item, so the graph's filter drops them all: found while reading, nothing written
    Case("all_rows_filtered", lambda d, s: [*_train()(d, s), "--log", str(d / "unknown.tsv"),
                                            "--data-dir", str(s / "logs")],
         ("no rows to train on", "nothing was written"), _unknown_items, after_work=True),
]


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("features-shared")
    generate_logs(root / "logs", LogSpec(300, seed=0), progress=False)
    return root


@pytest.fixture(scope="module")
def outcomes(shared, tmp_path_factory):
    return run_cases(CASES, tmp_path_factory.mktemp("features-cases"), shared)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_and_writes_nothing(case: Case, outcomes) -> None:
    check_refused(outcomes[case.id], case)


def _wait_for(pred, proc, timeout: float = 60.0) -> None:
    t0 = time.monotonic()
    while not pred():
        assert proc.poll() is None, f"finished before it could be killed: {proc.communicate()}"
        assert time.monotonic() - t0 < timeout, "timed out waiting for the command to start writing"
        time.sleep(0.02)


def test_generate_killed_midway_leaves_no_half_set(tmp_path) -> None:
    out = tmp_path / "gen"
    proc = start_cli(["features", "generate", "--rows", "1500000", "--files", "3", "--out", str(out)], cwd=tmp_path)
    try:  # the first of three log files is complete in the temporary folder: kill it there
        _wait_for(lambda: any(tmp_path.glob(".gen.tmp-*/impressions_000.tsv")), proc)
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    finally:
        proc.kill()
    assert not out.exists()
    again = run_cli(["features", "generate", "--rows", "500", "--files", "2", "--out", str(out)], cwd=tmp_path)
    assert again.code == 0, str(again)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gen"]  # the killed run's temporary folder is gone
    assert sorted(p.name for p in out.iterdir()) == ["impressions_000.tsv", "impressions_001.tsv", "items.jsonl",
                                                     "users.jsonl"]
    assert sum(len(p.read_text().splitlines()) for p in out.glob("impressions_*")) == 500


def test_train_killed_then_clean_rerun_has_no_stale_quarantine(tmp_path) -> None:
    data = tmp_path / "data"
    generate_logs(data, LogSpec(60000, seed=1, malformed_rate=0.05), progress=False)
    # ids within the ranges of data's tables
    generate_logs(tmp_path / "clean", LogSpec(300, seed=2), progress=False)
    (tmp_path / "clean" / "impressions_000.tsv").rename(data / "clean.tsv")
    run = tmp_path / "run"
    run.mkdir()
    report, quarantine = run / "r.json", run / "r.quarantine.jsonl"
    quarantine.write_text('{"source": "an older killed run", "line": 1}\n' * 5)  # what the old code left
    train = ["features", "train", "--producer", "thread", "--batch-rows", "256", "--report", str(report),
             "--dim", "4", "--hidden", "8"]
    proc = start_cli([*train, "--log", str(data / "impressions_000.tsv")], cwd=tmp_path)
    try:  # killed while it writes its quarantine records (under a temporary name)
        _wait_for(lambda: any(run.glob(".r.quarantine.jsonl.tmp-*")), proc)
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    finally:
        proc.kill()
    assert not report.exists() and len(quarantine.read_text().splitlines()) == 5  # nothing published
    # the clean rerun: tables given relative to the current directory, not to the log's folder
    (tmp_path / "tables").mkdir()
    for t in ("users.jsonl", "items.jsonl"):
        (tmp_path / "tables" / t).write_text((data / t).read_text())
    again = run_cli([*train, "--log", str(data / "clean.tsv"), "--table", "users=tables/users.jsonl",
                     "--table", "items=tables/items.jsonl"], cwd=tmp_path)
    assert again.code == 0, str(again)
    assert "quarantined: none" in again.stdout and "estimated" in again.stderr
    rep = json.loads(report.read_text())
    assert rep["extract"]["quarantined"] == {} and rep["extract"]["quarantine_file"] is None
    assert sorted(p.name for p in run.iterdir()) == ["r.json"]  # stale quarantine and temporaries gone
    # a rerun with malformed rows publishes its quarantine beside the report that counts them
    small = data / "small.tsv"
    small.write_text("".join((data / "impressions_000.tsv").read_text().splitlines(True)[:400]))
    before = snapshot(data)
    third = run_cli([*train, "--log", str(small)], cwd=tmp_path)
    assert third.code == 0, str(third)
    assert_unchanged(before, data)
    rep = json.loads(report.read_text())
    records = quarantine.read_text().splitlines()
    assert rep["extract"]["quarantine_file"] == str(quarantine)
    assert sum(rep["extract"]["quarantined"].values()) == len(records) > 0


def _mutate(data: bytes, rng) -> tuple[str, bytes]:
    """One random damage of a log: cut anywhere, random bytes spliced in, a line's tabs lost, or gzip cut."""
    kind = rng.choice(["cut", "splice", "untab", "gzip_cut"])
    at = int(rng.integers(1, len(data)))
    if kind == "cut":
        return f"{kind}@{at}.tsv", data[:at]
    if kind == "splice":
        return f"{kind}@{at}.tsv", data[:at] + rng.integers(0, 256, 40, dtype="uint8").tobytes() + data[at:]
    if kind == "untab":
        start = data.rfind(b"\n", 0, at) + 1
        end = data.find(b"\n", at)
        return f"{kind}@{at}.tsv", data[:start] + data[start:end].replace(b"\t", b" ") + data[end:]
    packed = gzip.compress(data)
    return f"{kind}@{at}.tsv.gz", packed[: int(rng.integers(10, len(packed) - 1))]


def test_fuzzed_logs_train_or_fail_in_one_line(tmp_path) -> None:
    import numpy as np

    logs = tmp_path / "logs"
    generate_logs(logs, LogSpec(300, seed=3), progress=False)
    data = (logs / "impressions_000.tsv").read_bytes()
    rng = np.random.default_rng(0)
    for k in range(8):
        name, damaged = _mutate(data, rng)
        log = logs / f"{k}-{name}"
        log.write_bytes(damaged)
        report = tmp_path / f"r{k}.json"
        res = run_cli(["features", "train", "--producer", "thread", "--batch-rows", "128", "--dim", "4",
                       "--hidden", "8", "--log", log, "--report", report], cwd=tmp_path)
        assert res.code in (0, 2), f"{name}: {res}"
        assert "Traceback" not in res.stderr, f"{name}: {res}"
        if res.code == 2:
            assert len(res.error_lines) == 1 and not report.exists(), f"{name}: {res}"
            continue
        ext = json.loads(report.read_text())["extract"]  # every line is a row or a quarantine record
        assert ext["rows_read"] + sum(ext["quarantined"].values()) == ext["lines_read"], f"{name}: {ext}"


def test_gzip_damage_past_the_upfront_check_is_one_line(tmp_path, monkeypatch) -> None:
    """A .gz log too large to check up front and cut short fails, when the reader reaches the cut, with a
    LeanmlError naming the file and the last line read (so a worker passes it on as one line)."""
    from leanml.errors import LeanmlError
    from leanml.features.read import checks
    from leanml.features.read.data import LOG_SCHEMA
    from leanml.features.read.readers import LogReader

    generate_logs(tmp_path / "g", LogSpec(3000, seed=4), progress=False)
    packed = gzip.compress((tmp_path / "g" / "impressions_000.tsv").read_bytes())
    log = tmp_path / "cut.tsv.gz"
    log.write_bytes(packed[: len(packed) // 2])
    monkeypatch.setattr(checks, "GZIP_FULL_CHECK_BYTES", 100)
    info = checks.check_log(log, LOG_SCHEMA)  # only the head is read: the cut is not seen yet
    assert info.fmt == "tsv" and info.lines_estimate > 0
    with pytest.raises(LeanmlError, match=r"cut\.tsv\.gz is truncated or corrupt after line \d+"):
        for _ in LogReader([log], LOG_SCHEMA, chunk_rows=100):
            pass
