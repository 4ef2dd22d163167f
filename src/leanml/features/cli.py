"""``leanml features …``: plan a graph, extract to Parquet (two-stage), train pipelined, generate logs."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from leanml.utils import LeanmlError, cache_dir, write_json

EPILOG = """examples:
  leanml features plan movielens --assume-cuda
  leanml features generate --rows 1000000 --out logs/1m
  leanml features extract --graph movielens --log logs/1m/impressions_000.tsv --out feats/1m
  leanml features train --graph movielens --features feats/1m          # two-stage, stage 2
  leanml features train --graph movielens --log logs/1m/impressions_000.tsv --workers 2 --prefetch 4
  leanml features train --log logs/1m/impressions_000.tsv --producer thread --reader python --no-entity
  leanml features train --graph movielens                              # MovieLens-100k, pipelined
  leanml features train --graph movielens --engine ray --log logs/1m/impressions_000.tsv
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("features", help="FeatureBox: raw logs -> feature ops pipelined into CTR training",
                       description="FeatureBox: stream raw ad logs through an operator graph into CTR training.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    fs = p.add_subparsers(dest="features_command", metavar="SUBCOMMAND")

    pl = fs.add_parser("plan", help="print the levels, placements and transfers of a graph",
                       description="Cut a graph into topological levels and show where each op runs and which "
                                   "columns cross devices at level boundaries.",
                       epilog="examples:\n  leanml features plan movielens\n"
                              "  leanml features plan my_graph.yaml --assume-cuda --json",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    pl.add_argument("graph", help="YAML file or bundled graph name (movielens)")
    pl.add_argument("--assume-cuda", action="store_true", help="plan as if a CUDA GPU were present")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    pl.set_defaults(func=cmd_plan)

    ex = fs.add_parser("extract", help="two-stage, stage 1: run the graph over logs into Parquet",
                       description="Run the graph to completion and write the model inputs to Parquet "
                                   "(what the pipelined mode replaces). Writes OUT/part-*.parquet and OUT/report.json.",
                       epilog="examples:\n  leanml features extract --graph movielens --log logs/impressions_000.tsv "
                              "--out feats/\n  leanml features extract --out feats/ml   # MovieLens-100k train log",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _input_args(ex)
    ex.add_argument("--out", required=True, help="output directory")
    ex.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    ex.set_defaults(func=cmd_extract)

    tr = fs.add_parser("train", help="train a CTR model: pipelined from logs, from Parquet, or on Ray",
                       description="Train the graph's CTR model. With --log (or MovieLens by default) the logs "
                                   "stream through the graph into training (pipelined); with --features it "
                                   "reads the Parquet written by `features extract` (two-stage, stage 2).",
                       epilog="examples:\n  leanml features train\n"
                              "  leanml features train --log logs/impressions_000.tsv --producer process\n"
                              "  leanml features train --features feats/ml --epochs 2",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _input_args(tr)
    tr.add_argument("--features", help="train from this Parquet feature directory instead of logs")
    tr.add_argument("--engine", choices=["local", "ray"], default="local", help="local pipeline or Ray Data")
    tr.add_argument("--producer", choices=["thread", "process"], default="process",
                    help="extraction in DataLoader worker processes feeding training through shared memory "
                         "(default), or in one thread of the training process")
    tr.add_argument("--workers", type=int, default=1,
                    help="producer processes (default 1: on 2 cores one trains, one extracts)")
    tr.add_argument("--prefetch", type=int, default=2,
                    help="batches made ahead per worker (thread producer: queue depth; default 2)")
    tr.add_argument("--no-plans", action="store_true",
                    help="build the embedding lookup plans in the training step instead of in the producers "
                         "(when extraction, not training, is the bottleneck)")
    tr.add_argument("--epochs", type=int, default=1)
    tr.add_argument("--lr", type=float, default=2e-3)
    tr.add_argument("--dim", type=int, default=16, help="embedding width")
    tr.add_argument("--hidden", default="128,64", help="MLP widths, comma-separated")
    tr.add_argument("--train-threads", type=int, default=1,
                    help="torch threads for training (default 1: one core trains, the producer extracts)")
    tr.add_argument("--test-log", action="append", help="log to evaluate AUC/logloss on (repeatable)")
    tr.add_argument("--report", help="JSON report path (default: <cache>/features/train_report.json)")
    tr.set_defaults(func=cmd_train)

    ge = fs.add_parser("generate", help="write a synthetic log with the MovieLens schema at any scale",
                       description="Seeded generator: Zipf-distributed users/items, long-tail histories, "
                                   "user/item tables, optional corrupted lines.",
                       epilog="examples:\n  leanml features generate --rows 10000000 --files 8 --out logs/10m\n"
                              "  leanml features generate --rows 10000 --malformed-rate 0.01 --out logs/dirty",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ge.add_argument("--rows", type=int, required=True)
    ge.add_argument("--out", required=True)
    ge.add_argument("--seed", type=int, default=0)
    ge.add_argument("--files", type=int, default=1)
    ge.add_argument("--gzip", action="store_true")
    ge.add_argument("--malformed-rate", type=float, default=0.0)
    ge.add_argument("--overwrite", action="store_true", help="replace an existing --out folder that has files")
    ge.set_defaults(func=cmd_generate)
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])


def _input_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--graph", default="movielens", help="YAML file or bundled graph name (default movielens)")
    p.add_argument("--log", action="append", help="log file: .tsv/.jsonl (optionally .gz) or .parquet; repeatable "
                                                  "(default: MovieLens-100k train log)")
    p.add_argument("--data-dir", help="where the graph's relative table paths resolve (default: the first log's "
                                      "directory)")
    p.add_argument("--table", action="append", default=[], metavar="NAME=PATH",
                   help="override a table path (a relative PATH is relative to the current directory)")
    p.add_argument("--batch-rows", type=int, default=8192, help="rows per chunk / training batch (default 8192)")
    p.add_argument("--threads", type=int, default=1, help="threads for the CPU ops of one level (default 1)")
    p.add_argument("--no-arena", action="store_true", help="plain allocation instead of the per-batch arena")
    p.add_argument("--reader", choices=["arrow", "python"], default="arrow",
                   help="log parser: arrow (native, default) or python (the line-by-line reference); "
                        "same rows and quarantine records")
    p.add_argument("--no-entity", action="store_true",
                   help="run every op per log row instead of once per user/item for features of a joined table")
    p.add_argument("--quarantine", help="malformed-row file (default: quarantine.jsonl next to the report)")


def _tables(items: list[str]) -> dict[str, str]:
    """``NAME=PATH`` overrides; a relative PATH is taken from the current directory (as every other path)."""
    out = {}
    for it in items:
        k, sep, v = it.partition("=")
        if not sep or not k.strip() or not v.strip():
            raise LeanmlError(f"--table {it!r}: write it as NAME=PATH")
        out[k.strip()] = str(Path(v).expanduser().absolute())
    return out


def _at_least(value: int | float, least: int | float, flag: str) -> None:
    if value < least:
        raise LeanmlError(f"{flag} {value}: use a number >= {least}")


def _hidden(spec: str) -> tuple[int, ...]:
    try:
        hidden = tuple(int(h) for h in spec.split(",") if h.strip())
    except ValueError:
        hidden = ()
    if not hidden or min(hidden) < 1:
        raise LeanmlError(f"--hidden {spec!r}: give MLP widths as positive integers separated by commas, e.g. 128,64")
    return hidden


def _check_tables(cfg: Any) -> None:
    """Every table the graph reads exists (a --table override must name one of them)."""
    from leanml.features.graph import FeatureGraph

    graph = FeatureGraph.from_dict(cfg.graph)
    used = {t for t in (getattr(op, "table", None) for op in graph.ops) if isinstance(t, str)}
    known = set(graph.tables) | used
    data_dir = Path(cfg.data_dir) if cfg.data_dir else None
    for name in cfg.tables:
        if name not in known:
            raise LeanmlError(f"--table {name}=...: graph {graph.name} has no table {name!r}; its tables are "
                              f"{', '.join(sorted(known)) or 'none'}")
    paths = {**graph.tables, **cfg.tables}
    for name in sorted(used):
        path = Path(paths.get(name, name))
        if name in cfg.tables:
            if not path.exists():
                raise LeanmlError(f"table {name!r} not found at {path} (--table paths are relative to the current "
                                  f"directory); pass --table {name}=PATH to an existing file")
            continue
        if not path.is_absolute() and data_dir is not None:
            path = data_dir / path
        if not path.exists():
            raise LeanmlError(f"table {name!r} not found at {path}; pass --table {name}=PATH or --data-dir")


def _config(args: argparse.Namespace, quarantine: Path) -> tuple[Any, int]:
    """The extraction config of --graph/--log/... with every input checked; also the logs' estimated lines."""
    from leanml.features.checks import check_logs
    from leanml.features.data import movielens_logs
    from leanml.features.graph import load_graph
    from leanml.features.pipeline import ExtractConfig

    _at_least(args.batch_rows, 1, "--batch-rows")
    _at_least(args.threads, 1, "--threads")
    if args.data_dir is not None and not Path(args.data_dir).is_dir():
        raise LeanmlError(f"--data-dir {args.data_dir} is not a folder; pass the folder that holds the tables")
    tables = _tables(args.table)
    graph = load_graph(args.graph)
    logs = args.log
    if not logs:
        d = movielens_logs()
        logs = [str(d / "impressions_train.tsv")]
        if getattr(args, "test_log", None) is None and hasattr(args, "test_log"):
            args.test_log = [str(d / "impressions_test.tsv")]
    infos = check_logs(logs, graph.schema)
    if getattr(args, "test_log", None):
        check_logs(args.test_log, graph.schema, what="--test-log")
    cfg = ExtractConfig.build(graph, logs, data_dir=args.data_dir, tables=tables,
                              batch_rows=args.batch_rows, threads=args.threads, arena=not args.no_arena,
                              quarantine=str(quarantine), engine=args.reader, entity=not args.no_entity)
    _check_tables(cfg)
    return cfg, sum(i.lines_estimate for i in infos)


def _quarantine_path(args: argparse.Namespace, default: Path) -> Path:
    from leanml.features.checks import check_file_target

    return check_file_target(Path(args.quarantine) if args.quarantine else default, "--quarantine")


def cmd_plan(args: argparse.Namespace) -> int:
    from leanml.features.graph import load_graph
    from leanml.features.scheduler import make_plan

    graph = load_graph(args.graph)
    plan = make_plan(graph, cuda=True if args.assume_cuda else None)
    if args.json:
        print(json.dumps(plan.as_dict(), indent=2))
    else:
        where = "with CUDA" if (args.assume_cuda or torch.cuda.is_available()) else "CPU only"
        print(f"graph {graph.name} ({where})")
        print(plan.table())
    return 0


def cmd_extract(args: argparse.Namespace) -> int:
    from leanml.features.twostage import extract_to_parquet
    from leanml.utils import check_output_dir

    out = check_output_dir(args.out, args.overwrite)
    quarantine = _quarantine_path(args, out.parent / f"{out.name}.quarantine.jsonl")
    cfg, rows_estimate = _config(args, quarantine)
    report = extract_to_parquet(cfg, out, overwrite=args.overwrite, progress=True, total_rows=rows_estimate)
    _print_summary(report["extract"], report["wall_s"], report["rows"])
    print(f"wrote {report['files']} file(s) to {out} (report: {out / 'report.json'})")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from leanml.features.checks import check_file_target, staged_files, temp_sibling
    from leanml.features.pipeline import ExtractConfig, Extractor, evaluate, no_rows_message, run_pipelined
    from leanml.features.twostage import check_features_dir, train_from_parquet

    _at_least(args.epochs, 1, "--epochs")
    _at_least(args.dim, 1, "--dim")
    _at_least(args.workers, 1, "--workers")
    _at_least(args.prefetch, 1, "--prefetch")
    _at_least(args.train_threads, 1, "--train-threads")
    if not args.lr > 0:
        raise LeanmlError(f"--lr {args.lr}: use a learning rate > 0")
    hidden = _hidden(args.hidden)
    report_path = check_file_target(Path(args.report) if args.report else cache_dir() / "features" /
                                    "train_report.json", "--report")
    quarantine = _quarantine_path(args, report_path.with_name(report_path.stem + ".quarantine.jsonl"))
    if args.features:
        if args.log:
            raise LeanmlError("give either --features (Parquet from `features extract`) or --log, not both")
        if args.engine == "ray":
            raise LeanmlError("--engine ray reads logs; drop it with --features")
        rows_estimate = check_features_dir(args.features)
        if args.test_log:
            from leanml.features.checks import check_logs
            from leanml.features.graph import load_graph

            check_logs(args.test_log, load_graph(args.graph).schema, what="--test-log")
        cfg = None
    else:  # quarantine records go to the temporary name staged_files publishes
        cfg, rows_estimate = _config(args, temp_sibling(quarantine))
    torch.set_num_threads(args.train_threads)
    kw = dict(epochs=args.epochs, lr=args.lr, dim=args.dim, hidden=hidden, progress=True)
    with staged_files(report_path, quarantine) as (tmp_report, _):
        if cfg is None:
            model, report = train_from_parquet(args.features, total_rows=rows_estimate, **kw)
            report["mode"] = "two_stage_train"
        else:
            if args.engine == "ray":
                from leanml.features.ray_runner import run_ray

                model, report = run_ray(cfg, quarantine_dir=str(report_path.parent / "ray_quarantine"), **kw)
            else:
                model, report = run_pipelined(cfg, prefetch=args.prefetch, producer=args.producer,
                                              workers=args.workers, plans=not args.no_plans,
                                              total_rows=rows_estimate, **kw)
            ext = report.get("extract") or {}
            if ext.get("quarantine_file"):
                ext["quarantine_file"] = str(quarantine)
        if not report["rows"]:
            raise LeanmlError(no_rows_message(report.get("extract") or {}, "train on"))
        if args.test_log:
            tcfg = ExtractConfig.build(cfg.graph if cfg else args.graph, args.test_log,
                                       data_dir=args.data_dir or (cfg.data_dir if cfg else None),
                                       tables=_tables(args.table), batch_rows=args.batch_rows, engine=args.reader)
            report["test"] = evaluate(model, Extractor(tcfg), "cuda" if torch.cuda.is_available() else "cpu")
        report["config"] = {k: v for k, v in vars(args).items() if k != "func"}
        report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        write_json(tmp_report, report)
    print(f"{report['mode']}: {report['rows']} rows in {report['wall_s']:.2f} s "
          f"({report['samples_s']:.0f} samples/s), train loss {report['loss']:.4f}" if "samples_s" in report else
          f"{report['mode']}: {report['rows']} rows in {report['wall_s']:.2f} s, train loss {report['loss']:.4f}")
    if "extract" in report:
        _print_summary(report["extract"], report["wall_s"], report["rows"])
    if "test" in report:
        print(f"test: AUC {report['test']['auc']:.4f}, logloss {report['test']['logloss']:.4f} "
              f"on {report['test']['rows']} rows")
    print(f"report: {report_path}")
    return 0


def _print_summary(ext: dict[str, Any], wall: float, rows: int) -> None:
    q = ext.get("quarantined") or {}
    qs = ", ".join(f"{k}={v}" for k, v in sorted(q.items())) or "none"
    print(f"rows read {ext.get('rows_read', 0)}, rows out {ext.get('rows_out', rows)}, quarantined: {qs}")
    ops = ext.get("exec", {}).get("op_seconds", {})
    if ops:
        top = sorted(ops.items(), key=lambda kv: -kv[1])[:5]
        print("slowest ops: " + ", ".join(f"{k} {v:.2f}s" for k, v in top))
    ar = ext.get("arena") or {}
    if ar.get("allocations"):
        print(f"arena: peak {ar['peak_bytes'] / 2**20:.1f} MiB, reused {ar['bytes_reused'] / 2**20:.0f} MiB "
              f"of {ar['bytes_allocated'] / 2**20:.0f} MiB, grows {ar['grows']}")


def cmd_generate(args: argparse.Namespace) -> int:
    from leanml.features.checks import check_writable
    from leanml.features.data import check_generate_target, generate_logs

    _at_least(args.rows, 1, "--rows")
    _at_least(args.files, 1, "--files")
    if args.files > args.rows:
        raise LeanmlError(f"--files {args.files} is more than --rows {args.rows}; use at most one file per row")
    if not 0 <= args.malformed_rate < 1:
        raise LeanmlError(f"--malformed-rate {args.malformed_rate}: use a share in [0, 1)")
    check_writable(check_generate_target(args.out, args.overwrite).parent, "--out")
    out = generate_logs(args.out, args.rows, seed=args.seed, files=args.files, gz=args.gzip,
                        malformed_rate=args.malformed_rate, overwrite=args.overwrite)
    print(f"wrote {args.rows} impressions and user/item tables to {out}")
    return 0
