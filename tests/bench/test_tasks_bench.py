"""bench/tasks.py's FISTA-against-SparseGPT line: paired seeds with Student's t, one seed with the items'
standard errors (checked against values computed by hand)."""

from __future__ import annotations

import math

import pytest

from benchload import load_bench


def rec(method, seed, score, se=0.03, pattern="50%"):
    return {"method": method, "pattern": pattern, "seed": seed, "tasks": {"t": {"score": score, "score_stderr": se}}}


def _interval(line):
    lo, hi = line.split("95 % interval ")[1].split(",")[0].split(" to ")
    return float(lo), float(hi)


def test_seeds_are_paired_and_the_interval_is_students_t():
    T = load_bench("tasks")
    recs = [rec("fista", 0, 0.70), rec("fista", 1, 0.60), rec("fista", 2, 0.62),
            rec("sparsegpt", 0, 0.61), rec("sparsegpt", 1, 0.54), rec("sparsegpt", 2, 0.57)]
    line = T.head_to_head(recs, ["t"])[0]
    d = [0.09, 0.06, 0.05]
    mean = sum(d) / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / 2)
    half = 4.302652729911275 * sd / math.sqrt(3)  # t(0.975, 2)
    assert f"{mean:+.3f}" in line and "Student's t" in line and "seeds 0,1,2" in line
    assert _interval(line) == pytest.approx((mean - half, mean + half), abs=6e-4)
    assert "met" in line and "includes 0" not in line


def test_one_seed_uses_the_items_standard_errors_and_says_when_zero_is_inside():
    T = load_bench("tasks")
    recs = [rec("fista", 0, 0.475, 0.022, "2:4"), rec("sparsegpt", 0, 0.478, 0.022, "2:4")]
    lines = T.head_to_head(recs, ["t"])
    assert lines[0].startswith("- 50%: not measured")
    half = 1.96 * math.sqrt(2) * 0.022
    assert _interval(lines[1]) == pytest.approx((-0.003 - half, -0.003 + half), abs=6e-4)
    assert "missed" in lines[1] and "includes 0" in lines[1]
