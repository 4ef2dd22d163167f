"""The training-memory benchmark's rendering (bench/memory.py): the targets' met/missed verdicts are
computed from the records, the protocol coverage is stated, and the docs block is generated only on request."""

from __future__ import annotations

from pathlib import Path

from benchload import load_bench

MIB = 2**20


def load_bench_memory():
    """bench/memory.py as a module."""
    return load_bench("memory")


def rec(label: str, tokens_s: float, peak_mib: float, repeat: int = 0, over: int = 0, **kw) -> dict:
    strategy = label.split("@")[0].split("+")[0]
    frac = float(label.split("@")[1].split("%")[0]) / 100 if "@" in label else None
    budget = frac * 1000 * MIB if frac is not None else None
    r = {"section": "smollm2", "repeat": repeat, "part": "all", "seed": 0, "label": label, "strategy": strategy,
         "compile_blocks": "+compile" in label, "budget_fraction": frac, "budget_bytes": budget,
         "tokens_s": tokens_s, "step_s": 1000 / tokens_s, "step_cpu_s": 1.0, "spread": 0.01,
         "peak_bytes": peak_mib * MIB, "unoptimized_peak_bytes": 1000 * MIB, "step_peaks": [peak_mib * MIB] * 12,
         "step_budget_bytes": [budget] * 12 if budget else None, "warmup": 2, "steps": 12,
         "steps_over_budget": over if budget else None, "peak_measured_every_step": True, "setup_s": 1.0,
         "replan_s": 0.0, "final_loss": 3.0, "model": "smollm2-135m", "dtype": "float32", "batch_size": 2,
         "seqlen": 512, "threads": 2, "load_before": [1.0], "load_after": [1.0], "cuda_step_peaks": None}
    if strategy == "adacc":
        r["profile_peak_bytes"] = 0.5 * budget
    r.update(kw)
    return r


def run(adacc25: float, adacc50: float, repeats: int = 1, over: int = 0) -> list[dict]:
    out = []
    for k in range(repeats):
        out += [rec("checkpoint", 100, 200, k), rec("compile@50%", 100, 400, k), rec("compile@25%", 100, 240, k),
                rec("adacc@25%", adacc25, 250, k, over=over), rec("adacc@50%", adacc50, 500, k)]
    return out


def test_targets_follow_the_records() -> None:
    bm = load_bench_memory()
    records = run(adacc25=115, adacc50=120)
    lines = "\n".join(bm.targets(records, bm.aggregate(records, "smollm2"), "smollm2"))
    # compile@25% used less memory than adacc@25%, so the comparator is compile@50%
    assert "adacc@25% (the faster Adacc variant) ran 1.15x the tokens/s of compile@50%" in lines
    assert "target >= 1.10x: met" in lines and "target >= 1.00x: met" in lines and "target >= 1.15x: met" in lines
    assert "Protocol: 5/13 strategies measured" in lines and "**incomplete**" in lines
    assert "bf16 run: **not run**" in lines and "0/3 seeds" in lines
    assert "adacc runs: 20/20 timed steps" in lines and "CUDA max_memory_allocated per step: not measured" in lines
    records = run(adacc25=105, adacc50=110, repeats=3, over=1)
    lines = "\n".join(bm.targets(records, bm.aggregate(records, "smollm2"), "smollm2"))
    assert "1.05x (1.05-1.05)" in lines and "target >= 1.10x: **missed**" in lines
    assert "target >= 1.15x: **missed**" in lines and "target >= 1.00x: met" in lines
    assert "3 repeat(s) each of 3 asked" in lines
    assert "adacc runs: 57/60 timed steps" in lines and "budget): **missed**" in lines


def test_render_writes_docs_only_when_asked(tmp_path: Path) -> None:
    bm = load_bench_memory()
    doc = tmp_path / "docs_memory.md"
    doc.write_text("intro\n<!-- bench:memory:start -->\nstale 999\n<!-- bench:memory:end -->\noutro\n")
    payload = {"records": run(adacc25=115, adacc50=120), "machine_line": "test machine",
               "chunks": [{"command": "python bench/memory.py --section smollm2"}]}
    bm.render(payload, tmp_path, None)
    assert "stale 999" in doc.read_text()
    table = (tmp_path / "memory.md").read_text()
    assert "| adacc@25% | 250.0 | 25% | 0/10 |" in table and (tmp_path / "memory.png").exists()
    bm.render(payload, tmp_path, doc)
    text = doc.read_text()
    assert "stale 999" not in text and text.startswith("intro\n") and text.endswith("outro\n")
    assert "### Targets (SmolLM2-135M)" in text and "| adacc@25% | 250.0 |" in text


def test_timing_lines_compare_pooled_and_per_layer_side_by_side() -> None:
    bm = load_bench_memory()
    records = []
    for k, (pooled, own) in enumerate([(110, 100), (99, 90)]):
        for frac in (25, 50):
            records += [rec(f"compile@{frac}%", 100, 300, k, section="timings"),
                        rec(f"adacc+compile@{frac}%", pooled, 250, k, section="timings", pool_layers=True),
                        rec(f"adacc+compile@{frac}% per-layer", own, 250, k, section="timings", pool_layers=False)]
    records += [rec("adacc@50%", 100, 500, 0, pool_layers=True), rec("adacc@25%", 100, 250, 0),
                rec("adacc+compile@50%", 100, 500, 0, pool_layers=True, compiled_loss=True),
                rec("adacc+compile@25%", 100, 250, 0, pool_layers=True, compiled_loss=False)]
    lines = "\n".join(bm.timing_lines(records))
    # per repeat: 110/100 = 1.10 and 99/90 = 1.10; against compile 1.10 and 0.99 (pooled), 1.00 and 0.90
    assert "50% budget: pooled times ran 1.10x (1.10-1.10) the tokens/s of per-layer times" in lines
    assert "pooled 1.04x (0.99-1.10), per-layer 0.95x (0.90-1.00) (2 repeat(s)" in lines
    assert "Section smollm2: 3/4 Adacc records planned from pooled times (the others" in lines
    assert ("Section smollm2: 1/2 Adacc-on-compiled-blocks records ran the model's loss as compiled kernels "
            "(the others ran it eagerly") in lines


def test_per_layer_label() -> None:
    bm = load_bench_memory()
    assert bm.label("adacc", 0.5, True, False) == "adacc+compile@50% per-layer"
    assert bm.label("adacc", 0.5, True) == "adacc+compile@50%"
    assert bm.label("compile", 0.5, False, False) == "compile@50%"


def test_a_strategy_planned_against_its_own_unoptimized_peak_is_named_and_the_column_uses_the_sections() -> None:
    bench = load_bench_memory()
    recs = [rec("adacc+compile@50%", 130, 400, compiled_loss=True), rec("checkpoint", 100, 200),
            rec("compile@50%", 120, 300)]  # the Adacc record first: the section's peak is still the others'
    recs[0]["unoptimized_peak_bytes"] = 800 * MIB  # its own profile measured less than the section's 1000 MiB
    header = bench.section_header(recs, "smollm2", "Headline")
    line = next(ln for ln in header if ln.startswith("Unoptimized peak measured by Adacc's own profile"))
    assert "adacc+compile@50%: 800.0 MiB" in line and "against 1000.0 MiB" in line and "compiled kernels" in line
    row = next(ln for ln in bench.table(bench.aggregate(recs, "smollm2")) if ln.startswith("| adacc+compile@50%"))
    assert "| 400.0 | 40% |" in row  # against the section's 1000 MiB, not its own 800
    assert "unoptimized peak 1000.0 MiB" in header[0]
    assert not any(ln.startswith("Unoptimized peak measured") for ln in bench.section_header(recs[1:], "smollm2", "H"))
