"""The jobs of ``leanml features``: one function per command, taking that command's options
(:mod:`leanml.features.options`). Each checks every input before any work (a bad one is a one-line
:class:`~leanml.errors.LeanmlError` naming the flag that set it), writes its outputs atomically and returns
its report.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from leanml.config import as_dict
from leanml.errors import LeanmlError
from leanml.features.options import ExtractJob, GenerateJob, Inputs, PipelineOptions, PlanJob, TrainJob
from leanml.flags import flag_of
from leanml.machine import apply_threads
from leanml.outputs import cache_dir, write_json

if TYPE_CHECKING:  # the heavy modules load when a job runs
    from leanml.features.run.extract import ExtractConfig
    from leanml.features.run.graph import FeatureGraph
    from leanml.features.run.scheduler import Plan


def plan_job(job: PlanJob) -> tuple[FeatureGraph, Plan]:
    """The graph and its plan (levels, placements, transfers) for this machine or, with ``assume_cuda``, a GPU one."""
    from leanml.features.run.graph import load_graph
    from leanml.features.run.scheduler import make_plan

    graph = load_graph(job.graph)
    return graph, make_plan(graph, cuda=True if job.assume_cuda else None)


def extract_config(inputs: Inputs, options: PipelineOptions, quarantine: Path,
                   test_logs: tuple[str, ...] = (), graph: FeatureGraph | None = None) -> tuple[ExtractConfig, int]:
    """The extraction config of ``inputs`` with every log (``test_logs`` too) and table checked; also the
    logs' estimated lines. No log given: the MovieLens-100k train log. ``graph``: ``inputs.graph`` already
    parsed (the config carries it, so the run parses it once)."""
    from leanml.features.read.checks import check_logs
    from leanml.features.read.data import movielens_logs
    from leanml.features.run.extract import ExtractConfig
    from leanml.features.run.graph import load_graph

    if inputs.data_dir is not None and not Path(inputs.data_dir).is_dir():
        raise LeanmlError(f"{flag_of(Inputs, 'data_dir')} {inputs.data_dir} is not a folder; pass the folder that "
                          "holds the tables")
    graph = graph if graph is not None else load_graph(inputs.graph)
    logs = inputs.log or (str(movielens_logs() / "impressions_train.tsv"),)
    infos = check_logs(logs, graph.schema, flag_of(Inputs, "log"))
    if test_logs:
        check_logs(test_logs, graph.schema, what=flag_of(TrainJob, "test_log"))
    cfg = ExtractConfig.build(graph, logs, options, data_dir=inputs.data_dir, tables=inputs.tables,
                              quarantine=str(quarantine))
    _check_tables(cfg, inputs.tables)
    return cfg, sum(i.lines_estimate for i in infos)


def _check_tables(cfg: ExtractConfig, overrides: dict[str, str]) -> None:
    """Every table the graph reads exists (an override must name one of them)."""
    table, data_dir_flag = flag_of(Inputs, "table"), flag_of(Inputs, "data_dir")
    graph = cfg.graph
    used = {t for t in (getattr(op, "table", None) for op in graph.ops) if isinstance(t, str)}
    known = set(graph.tables) | used
    data_dir = Path(cfg.data_dir) if cfg.data_dir else None
    for name in overrides:
        if name not in known:
            raise LeanmlError(f"{table} {name}=...: graph {graph.name} has no table {name!r}; its tables are "
                              f"{', '.join(sorted(known)) or 'none'}")
    paths = {**graph.tables, **overrides}
    for name in sorted(used):
        path = Path(paths.get(name, name))
        if name in overrides:
            if not path.exists():
                raise LeanmlError(f"table {name!r} not found at {path} ({table} paths are relative to the current "
                                  f"directory); pass {table} {name}=PATH to an existing file")
            continue
        if not path.is_absolute() and data_dir is not None:
            path = data_dir / path
        if not path.exists():
            raise LeanmlError(f"table {name!r} not found at {path}; pass {table} {name}=PATH or {data_dir_flag}")


def _quarantine_path(inputs: Inputs, default: Path) -> Path:
    from leanml.features.read.checks import check_file_target

    return check_file_target(Path(inputs.quarantine) if inputs.quarantine else default, flag_of(Inputs, "quarantine"))


def extract_job(job: ExtractJob, progress: bool = True) -> tuple[dict[str, Any], Path]:
    """Stage 1 of two-stage: the graph over the logs into ``job.out`` (Parquet + ``report.json``); returns the
    report and the folder."""
    from leanml.features.train.twostage import extract_to_parquet
    from leanml.outputs import check_output_dir

    out = check_output_dir(job.out, job.overwrite, flag_of(ExtractJob, "out"))
    quarantine = _quarantine_path(job.inputs, out.parent / f"{out.name}.quarantine.jsonl")
    cfg, rows_estimate = extract_config(job.inputs, job.options, quarantine)
    return extract_to_parquet(cfg, out, overwrite=job.overwrite, progress=progress, total_rows=rows_estimate), out


def train_job(job: TrainJob, progress: bool = True) -> tuple[dict[str, Any], Path]:
    """Train the graph's CTR model pipelined from logs (or on Ray), or from Parquet features; evaluate it on
    the test logs. Writes the report (and the quarantine file beside it) atomically; returns both."""
    from leanml.features.read.checks import check_file_target, staged_files
    from leanml.features.run.extract import no_rows_message

    report_path = check_file_target(Path(job.report) if job.report else cache_dir() / "features" /
                                    "train_report.json", flag_of(TrainJob, "report"))
    quarantine = _quarantine_path(job.inputs, report_path.with_name(report_path.stem + ".quarantine.jsonl"))
    graph, cfg, test_logs, rows_estimate = _train_inputs(job, quarantine)
    apply_threads(job.train_threads)
    with staged_files(report_path, quarantine) as (tmp_report, _):
        model, report = _train(job, cfg, rows_estimate, report_path, quarantine, progress)
        if not report["rows"]:
            raise LeanmlError(no_rows_message(report.get("extract") or {}, "train on"))
        if test_logs:
            report["test"] = _test(model, job, graph, cfg, test_logs)
        report["config"] = {**as_dict(job), "logs": list(cfg.logs) if cfg else [], "test_logs": list(test_logs)}
        report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        write_json(tmp_report, report)
    return report, report_path


def _train_inputs(job: TrainJob, quarantine: Path
                  ) -> tuple[FeatureGraph | None, ExtractConfig | None, tuple[str, ...], int]:
    """Every input of a training run checked: the graph (parsed once for the run; None when only Parquet
    features and no test log are given), the extraction config (None for Parquet features), the test logs
    (without any log: the MovieLens-100k test log) and the estimated rows per epoch."""
    from leanml.features.read.checks import check_logs, temp_sibling
    from leanml.features.read.data import movielens_logs
    from leanml.features.run.graph import load_graph
    from leanml.features.train.twostage import check_features_dir

    test_logs = job.test_log
    if job.features:
        rows_estimate = check_features_dir(job.features, flag_of(TrainJob, "features"))
        graph = load_graph(job.inputs.graph) if test_logs else None
        if graph is not None:
            check_logs(test_logs, graph.schema, what=flag_of(TrainJob, "test_log"))
        return graph, None, test_logs, rows_estimate
    if not job.inputs.log and not test_logs:
        test_logs = (str(movielens_logs() / "impressions_test.tsv"),)
    graph = load_graph(job.inputs.graph)
    # quarantine records go to the temporary name staged_files publishes
    cfg, rows_estimate = extract_config(job.inputs, job.options, temp_sibling(quarantine), test_logs, graph)
    return graph, cfg, test_logs, rows_estimate


def _train(job: TrainJob, cfg: ExtractConfig | None, rows_estimate: int, report_path: Path, quarantine: Path,
           progress: bool) -> tuple[Any, dict[str, Any]]:
    """The model and the training report: from Parquet features (``cfg`` None), on Ray, or pipelined."""
    if cfg is None:
        from leanml.features.train.twostage import train_from_parquet

        model, report = train_from_parquet(job.features, job.train, progress=progress, total_rows=rows_estimate)
        report["mode"] = "two_stage_train"
        return model, report
    if job.engine == "ray":
        from leanml.features.train.ray_runner import run_ray

        model, report = run_ray(cfg, job.train, quarantine_dir=str(report_path.parent / "ray_quarantine"),
                                progress=progress)
    else:
        from leanml.features.train.pipeline import run_pipelined

        model, report = run_pipelined(cfg, job.train, job.producer, progress=progress, total_rows=rows_estimate)
    ext = report.get("extract") or {}
    if ext.get("quarantine_file"):
        ext["quarantine_file"] = str(quarantine)
    return model, report


def _test(model: Any, job: TrainJob, graph: FeatureGraph | None, cfg: ExtractConfig | None,
          test_logs: tuple[str, ...]) -> dict[str, Any]:
    """AUC and logloss of ``model`` on ``test_logs``, extracted with the job's own options (threads, arena,
    per-entity ops as for training) and the run's graph."""
    import torch

    from leanml.features.run.extract import ExtractConfig, Extractor
    from leanml.features.train.pipeline import evaluate

    assert graph is not None  # _train_inputs parses it whenever there are test logs
    tcfg = ExtractConfig.build(graph, test_logs, job.options, tables=job.inputs.tables,
                               data_dir=job.inputs.data_dir or (cfg.data_dir if cfg else None))
    return evaluate(model, Extractor(tcfg), "cuda" if torch.cuda.is_available() else "cpu")


def generate_job(job: GenerateJob, progress: bool = True) -> Path:
    """A seeded synthetic log set (impressions plus user/item tables) in ``job.out``; returns the folder."""
    from leanml.features.read.checks import check_writable
    from leanml.features.read.data import LogSpec, check_generate_target, generate_logs

    check_writable(check_generate_target(job.out, job.overwrite).parent, flag_of(GenerateJob, "out"))
    spec = LogSpec(job.rows, seed=job.seed, files=job.files, gz=job.gzip, malformed_rate=job.malformed_rate)
    return generate_logs(job.out, spec, overwrite=job.overwrite, progress=progress)


def summary_lines(ext: dict[str, Any], rows: int) -> list[str]:
    """What extraction did, in a few lines: rows and quarantine, the slowest ops, the arena."""
    q = ext.get("quarantined") or {}
    qs = ", ".join(f"{k}={v}" for k, v in sorted(q.items())) or "none"
    lines = [f"rows read {ext.get('rows_read', 0)}, rows out {ext.get('rows_out', rows)}, quarantined: {qs}"]
    ops = ext.get("exec", {}).get("op_seconds", {})
    if ops:
        top = sorted(ops.items(), key=lambda kv: -kv[1])[:5]
        lines.append("slowest ops: " + ", ".join(f"{k} {v:.2f}s" for k, v in top))
    ar = ext.get("arena") or {}
    if ar.get("allocations"):
        lines.append(f"arena: peak {ar['peak_bytes'] / 2**20:.1f} MiB, reused {ar['bytes_reused'] / 2**20:.0f} MiB "
                     f"of {ar['bytes_allocated'] / 2**20:.0f} MiB, grows {ar['grows']}")
    return lines
