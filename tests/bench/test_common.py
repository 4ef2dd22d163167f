"""bench/_common.py: merging a run's records into those on disk."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from _common import key_of, load_json, merge_records, replace_block  # noqa: E402


def test_merge_replaces_by_key_and_keeps_the_rest() -> None:
    old = [{"m": "a", "s": 1, "v": 1}, {"m": "b", "s": 1, "v": 2}, {"m": "a", "s": 2, "v": 3}]
    new = [{"m": "a", "s": 1, "v": 10}, {"m": "c", "s": 1, "v": 4}]
    key = key_of(("m", "s"))
    moved = merge_records(old, new, key)
    assert [r["v"] for r in moved] == [2, 3, 10, 4]  # the replaced record goes to the end
    kept = merge_records(old, new, key, keep_place=True)
    assert [r["v"] for r in kept] == [10, 2, 3, 4]  # ... or stays where it stood
    assert old[0]["v"] == 1  # the inputs are not changed
    assert merge_records(old, [{"m": "b", "s": 1, "v": 5}, {"m": "b", "s": 1, "v": 6}], key)[-1]["v"] == 6


def test_key_of_missing_field_is_none_and_load_json_default(tmp_path: Path) -> None:
    assert key_of(("a", "b"))({"a": 1}) == (1, None)
    assert load_json(tmp_path / "none.json", {"records": []}) == {"records": []}
    (tmp_path / "r.json").write_text('{"records": [1]}')
    assert load_json(tmp_path / "r.json", None) == {"records": [1]}


def test_replace_block_between_markers_only(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("head\n<!-- bench:x:start -->old<!-- bench:x:end -->\ntail\n")
    assert replace_block(page, "x", "\nnew\n")
    assert page.read_text() == "head\n<!-- bench:x:start -->\nnew\n<!-- bench:x:end -->\ntail\n"
    assert not replace_block(page, "y", "z")  # no markers: left alone
    assert not replace_block(tmp_path / "missing.md", "x", "z")
