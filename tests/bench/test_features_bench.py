"""bench/features.py's summary and generated Markdown: medians and spreads over interleaved repeats,
ratios taken within each repeat, and the targets judged from the recorded numbers (met, missed, or not
testable with the CPU-second projection when fewer than 1.6 cores were available)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
_spec = importlib.util.spec_from_file_location("bench_features", BENCH / "features.py")  # "features" is taken
B = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(B)


def _runs(pipe_wall: float) -> list[dict]:
    runs = []
    for k, jitter in enumerate((1.0, 1.1, 0.9)):
        base = {"repeat": k, "rows": 1_000_000, "loadavg_before": [1.0, 1.0, 1.0], "utilisation": 1.0}
        runs += [
            {**base, "mode": "extract_only", "producer": None, "wall_s": 2.0 * jitter, "extract_cpu_s": 2.0 * jitter,
             "total_cpu_s": 2.0 * jitter, "op_seconds": {"hash": 1.0}, "op_rows_per_s": {"hash": 1e6}, "arena": {}},
            {**base, "mode": "train_only", "producer": None, "wall_s": 8.0 * jitter, "train_cpu_s": 8.0 * jitter,
             "total_cpu_s": 8.0 * jitter},
            {**base, "mode": "two_stage", "producer": None, "wall_s": 11.0 * jitter, "extract_cpu_s": 2.0 * jitter,
             "train_cpu_s": 8.0 * jitter, "total_cpu_s": 11.0 * jitter, "write_s": 0.5, "read_s": 0.4},
            {**base, "mode": "pipelined", "producer": "process", "wall_s": pipe_wall * jitter, "utilisation": 1.6,
             "extract_cpu_s": 2.5 * jitter, "train_cpu_s": 8.2 * jitter, "total_cpu_s": 11.0 * jitter,
             "handoff": {"ring": 120, "copied": 2}},
        ]
    return runs


def _render(tmp_path: Path, cores: float, pipe_wall: float, identical: bool = True) -> str:
    res = {"rows": 1_000_000, "batch_rows": 8192, "workers": 1, "prefetch": 2, "commands": ["python bench/features.py"],
           "cores": {"cores": cores, "affinity": 2, "quota": None}, "runs": _runs(pipe_wall),
           "setup": {"identity": {"rows": 1000, "fast_equals_reference": identical, "fast_equals_code_before": True}}}
    res["records"], res["ratios"] = B.summarise(res["runs"], res["cores"])
    return B.render(res, tmp_path)


def test_summary_records_carry_medians_spreads_and_cores(tmp_path):
    recs, ratios = B.summarise(_runs(9.0), {"cores": 2.0})
    by = {r["mode"]: r for r in recs}
    assert by["extract_only"]["extract_cpu_s"] == 2.0 and by["extract_only"]["spread"]["extract_cpu_s"] == [1.8, 2.2]
    assert by["train_only"]["train_cpu_s"] == 8.0 and by["train_only"]["repeats"] == 3
    assert all(r["cores_available"] == 2.0 for r in recs)
    assert ratios["process"]["vs_train_only"] == round(9.0 / 8.0, 3)  # within each repeat, jitter cancels
    assert ratios["process"]["spread"]["vs_two_stage"] == [round(9 / 11, 3)] * 2


def test_targets_are_judged_from_the_numbers(tmp_path):
    text = _render(tmp_path, cores=2.0, pipe_wall=9.0)
    assert (tmp_path / "features.md").read_text() == text
    lines = {ln.split(" >=")[0].split(" <=")[0]: ln for ln in text.splitlines() if ln.startswith("- ")}
    assert "500,000 rows per CPU second" in lines["- Extraction"] and "**met**" in lines["- Extraction"]
    assert "125,000" in lines["- Training"] and "**met**" in lines["- Training"]
    pipe = lines["- Pipelined (process)"]
    assert "1.12 x" in pipe and "0.82 x" in pipe  # <= 1.15 met, <= 0.6 missed
    assert pipe.count("**met**") == 1 and pipe.count("**MISSED**") == 1
    assert "360 of 366 batches came through" in text
    assert "**MISSED**" in _render(tmp_path, cores=2.0, pipe_wall=9.0, identical=False).split("\n- Training")[0]


def test_wall_targets_not_testable_with_few_cores_show_the_projection(tmp_path):
    text = _render(tmp_path, cores=1.2, pipe_wall=10.0)
    pipe = next(ln for ln in text.splitlines() if ln.startswith("- Pipelined (process)"))
    assert "**met**" not in pipe and "**MISSED**" not in pipe and "not testable" in pipe
    # projection: max(extract 2.0, train 8.0) / train 8.0 = 1.00; / (2 + 8 + (11 - 2 - 8)) = 0.73
    assert "CPU-second projection 1.00 x" in pipe and "CPU-second projection 0.73 x" in pipe
    assert "Only 1.2 cores are available" in text
