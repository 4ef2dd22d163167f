"""``leanml features …``: plan a graph, extract to Parquet (two-stage), train pipelined, generate logs.

Every option is a field of the command's job (:mod:`leanml.features.options`); the work is one call
into :mod:`leanml.features.jobs`.
"""

from __future__ import annotations

import argparse
import json

from leanml.features.options import ExtractJob, GenerateJob, PlanJob, TrainJob
from leanml.flags import add_command

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

COMMANDS = {  # name: (job, help, description, examples)
    "plan": (PlanJob, "print the levels, placements and transfers of a graph",
             "Cut a graph into topological levels and show where each op runs and which columns cross devices "
             "at level boundaries.",
             "leanml features plan movielens\n  leanml features plan my_graph.yaml --assume-cuda --json"),
    "extract": (ExtractJob, "two-stage, stage 1: run the graph over logs into Parquet",
                "Run the graph to completion and write the model inputs to Parquet (what the pipelined mode "
                "replaces). Writes OUT/part-*.parquet and OUT/report.json.",
                "leanml features extract --graph movielens --log logs/impressions_000.tsv --out feats/\n"
                "  leanml features extract --out feats/ml   # MovieLens-100k train log"),
    "train": (TrainJob, "train a CTR model: pipelined from logs, from Parquet, or on Ray",
              "Train the graph's CTR model. With --log (or MovieLens by default) the logs stream through the "
              "graph into training (pipelined); with --features it reads the Parquet written by `features "
              "extract` (two-stage, stage 2).",
              "leanml features train\n  leanml features train --log logs/impressions_000.tsv --producer process\n"
              "  leanml features train --features feats/ml --epochs 2"),
    "generate": (GenerateJob, "write a synthetic log with the MovieLens schema at any scale",
                 "Seeded generator: Zipf-distributed users/items, long-tail histories, user/item tables, optional "
                 "corrupted lines.",
                 "leanml features generate --rows 10000000 --files 8 --out logs/10m\n"
                 "  leanml features generate --rows 10000 --malformed-rate 0.01 --out logs/dirty"),
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("features", help="FeatureBox: raw logs -> feature ops pipelined into CTR training",
                       description="FeatureBox: stream raw ad logs through an operator graph into CTR training.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    fs = p.add_subparsers(dest="features_command", metavar="SUBCOMMAND")
    for name, (job, short, description, examples) in COMMANDS.items():
        add_command(fs, name, job, RUN[name], help=short, description=description, epilog=f"examples:\n  {examples}")
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])


def cmd_plan(job: PlanJob) -> int:
    import torch

    from leanml.features.jobs import plan_job

    graph, plan = plan_job(job)
    if job.json:
        print(json.dumps(plan.as_dict(), indent=2))
    else:
        print(f"graph {graph.name} ({'with CUDA' if job.assume_cuda or torch.cuda.is_available() else 'CPU only'})")
        print(plan.table())
    return 0


def cmd_extract(job: ExtractJob) -> int:
    from leanml.features.jobs import extract_job, summary_lines

    report, out = extract_job(job)
    print("\n".join(summary_lines(report["extract"], report["rows"])))
    print(f"wrote {report['files']} file(s) to {out} (report: {out / 'report.json'})")
    return 0


def cmd_train(job: TrainJob) -> int:
    from leanml.features.jobs import summary_lines, train_job

    report, path = train_job(job)
    speed = f" ({report['samples_s']:.0f} samples/s)" if "samples_s" in report else ""
    print(f"{report['mode']}: {report['rows']} rows in {report['wall_s']:.2f} s{speed}, "
          f"train loss {report['loss']:.4f}")
    if "extract" in report:
        print("\n".join(summary_lines(report["extract"], report["rows"])))
    if "test" in report:
        t = report["test"]
        print(f"test: AUC {t['auc']:.4f}, logloss {t['logloss']:.4f} on {t['rows']} rows")
    print(f"report: {path}")
    return 0


def cmd_generate(job: GenerateJob) -> int:
    from leanml.features.jobs import generate_job

    print(f"wrote {job.rows} impressions and user/item tables to {generate_job(job)}")
    return 0


RUN = {"plan": cmd_plan, "extract": cmd_extract, "train": cmd_train, "generate": cmd_generate}
