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
    ge.set_defaults(func=cmd_generate)
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])


def _input_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--graph", default="movielens", help="YAML file or bundled graph name (default movielens)")
    p.add_argument("--log", action="append", help="log file: .tsv/.jsonl (optionally .gz) or .parquet; repeatable "
                                                  "(default: MovieLens-100k train log)")
    p.add_argument("--data-dir", help="where relative table paths resolve (default: the first log's directory)")
    p.add_argument("--table", action="append", default=[], metavar="NAME=PATH", help="override a table path")
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
    out = {}
    for it in items:
        if "=" not in it:
            raise LeanmlError(f"--table {it!r}: write it as NAME=PATH")
        k, v = it.split("=", 1)
        out[k] = v
    return out


def _config(args: argparse.Namespace, quarantine: Path) -> Any:
    from leanml.features.data import movielens_logs
    from leanml.features.pipeline import ExtractConfig

    logs = args.log
    if not logs:
        d = movielens_logs()
        logs = [str(d / "impressions_train.tsv")]
        if getattr(args, "test_log", None) is None and hasattr(args, "test_log"):
            args.test_log = [str(d / "impressions_test.tsv")]
    if args.batch_rows < 1:
        raise LeanmlError("--batch-rows must be >= 1")
    return ExtractConfig.build(args.graph, logs, data_dir=args.data_dir, tables=_tables(args.table),
                               batch_rows=args.batch_rows, threads=args.threads, arena=not args.no_arena,
                               quarantine=str(args.quarantine or quarantine), engine=args.reader,
                               entity=not args.no_entity)


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

    out = Path(args.out)
    cfg = _config(args, out.parent / f"{out.name}.quarantine.jsonl")
    report = extract_to_parquet(cfg, out, overwrite=args.overwrite, progress=True)
    _print_summary(report["extract"], report["wall_s"], report["rows"])
    print(f"wrote {report['files']} file(s) to {out} (report: {out / 'report.json'})")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from leanml.features.pipeline import ExtractConfig, Extractor, evaluate, run_pipelined
    from leanml.features.twostage import train_from_parquet

    if args.epochs < 1 or args.lr <= 0 or args.dim < 1:
        raise LeanmlError("--epochs and --dim must be >= 1 and --lr > 0")
    torch.set_num_threads(max(1, args.train_threads))
    report_path = Path(args.report) if args.report else cache_dir() / "features" / "train_report.json"
    hidden = tuple(int(h) for h in args.hidden.split(",") if h.strip())
    kw = dict(epochs=args.epochs, lr=args.lr, dim=args.dim, hidden=hidden, progress=True)
    cfg = None
    if args.features:
        if args.log:
            raise LeanmlError("give either --features (Parquet from `features extract`) or --log, not both")
        model, report = train_from_parquet(args.features, **kw)
        report["mode"] = "two_stage_train"
    else:
        cfg = _config(args, report_path.with_name(report_path.stem + ".quarantine.jsonl"))
        if args.engine == "ray":
            from leanml.features.ray_runner import run_ray

            model, report = run_ray(cfg, quarantine_dir=str(report_path.parent / "ray_quarantine"), **kw)
        else:
            model, report = run_pipelined(cfg, prefetch=args.prefetch, producer=args.producer,
                                          workers=args.workers, plans=not args.no_plans, **kw)
    if args.test_log:
        tcfg = ExtractConfig.build(cfg.graph if cfg else args.graph, args.test_log,
                                   data_dir=args.data_dir or (cfg.data_dir if cfg else None),
                                   tables=_tables(args.table), batch_rows=args.batch_rows, engine=args.reader)
        report["test"] = evaluate(model, Extractor(tcfg), "cuda" if torch.cuda.is_available() else "cpu")
    report["config"] = {k: v for k, v in vars(args).items() if k != "func"}
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    write_json(report_path, report)
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
    from leanml.features.data import generate_logs

    if not 0 <= args.malformed_rate < 1:
        raise LeanmlError("--malformed-rate must be in [0, 1)")
    out = generate_logs(args.out, args.rows, seed=args.seed, files=args.files, gz=args.gzip,
                        malformed_rate=args.malformed_rate)
    print(f"wrote {args.rows} impressions and user/item tables to {out}")
    return 0
