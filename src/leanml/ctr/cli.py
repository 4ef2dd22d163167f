"""``leanml ctr ...``: content IDs (fit, assign), CTR training and evaluation.

Every flag is a field of the command's options dataclass (:mod:`leanml.ctr.jobs`); each command builds it,
calls one job function and prints its report."""

from __future__ import annotations

import argparse
from typing import Any

from leanml.ctr.jobs import AssignJob, EvalJob, FitJob, TrainJob, assign_job, eval_job, fit_job, train_job
from leanml.flags import add_options, from_args, iter_flags

SOURCE = ("data", "images")  # one of them, on fit and assign


def print_metrics(metrics: dict[str, Any]) -> None:
    """A small table: rows overall / new / old, columns n, AUC, gAUC, logloss."""
    print(f"{'split':<8}{'rows':>8}{'AUC':>9}{'gAUC':>9}{'logloss':>9}")
    for split, sfx in (("all", ""), ("new ads", "_new"), ("old ads", "_old")):
        n = metrics.get(f"n{sfx}", metrics.get("n"))
        print(f"{split:<8}{n:>8}{metrics[f'auc{sfx}']:>9.4f}{metrics[f'gauc{sfx}']:>9.4f}{metrics[f'logloss{sfx}']:>9.4f}")


def _command(sub: argparse._SubParsersAction, name: str, cls: type, func: Any, help: str, description: str,
             examples: list[str], source: bool = False) -> None:
    """A subcommand whose flags are the fields of ``cls`` (``--data``/``--images``: exactly one, with ``source``)."""
    p = sub.add_parser(name, help=help, description=description, epilog="examples:\n  " + "\n  ".join(examples),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    if source:
        others = tuple(f.name for f, *_ in iter_flags(cls) if f.name not in SOURCE)
        add_options(p.add_mutually_exclusive_group(required=True), cls, skip=others)
    add_options(p, cls, skip=SOURCE if source else ())
    p.set_defaults(func=lambda args: func(from_args(cls, args)))


def _group(sub: argparse._SubParsersAction, name: str, dest: str, metavar: str, **kwargs: Any
           ) -> argparse._SubParsersAction:
    p = sub.add_parser(name, formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])
    return p.add_subparsers(dest=dest, metavar=metavar)


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``ctr`` with ``content-ids fit|assign``, ``train`` and ``eval``."""
    ctr = _group(sub, "ctr", "ctr_command", "SUBCOMMAND", help="visual content IDs and CTR models (new-ad cold start)",
                 description="Text-supervised visual IDs for ads and CTR models that use them.",
                 epilog="examples:\n  leanml ctr content-ids fit --data fashion --out out/cid\n"
                        "  leanml ctr content-ids assign --model out/cid --data fashion --out out/ids.parquet\n"
                        "  leanml ctr train --data fashion --model deepfm --features id,visual --out out/run\n"
                        "  leanml ctr eval --run out/run")
    cid = _group(ctr, "content-ids", "cid_command", "ACTION", help="fit a content-ID model or assign visual IDs",
                 description="Train the image extractor + soft product quantizer under text supervision, "
                             "or export visual IDs for serving.",
                 epilog="examples:\n  leanml ctr content-ids fit --data fashion --M 4 --K 16 --out out/cid\n"
                        "  leanml ctr content-ids assign --model out/cid --images ads/ --out ids.parquet")
    _command(cid, "fit", FitJob, cmd_fit, "train extractor + quantizer on images and captions",
             "Fit on the old ads of a built-in dataset (--data) or on a folder of images named <ad_id>.png with a "
             "captions CSV (ad_id,caption). Writes config.json, model.safetensors and report.json into --out.",
             ["leanml ctr content-ids fit --data fashion --out out/cid",
              "leanml ctr content-ids fit --data movielens --loss tokens --out out/cid-ml",
              "leanml ctr content-ids fit --images ads/ --captions captions.csv --out out/cid"], source=True)
    _command(cid, "assign", AssignJob, cmd_assign, "export ad -> content IDs as the Parquet serving table",
             "The serving table (schema leanml.content_ids/2, module leanml.ctr.content_ids.schema): columns ad_id "
             "(int64) and visual_ids (list<int64>, length M, codes in [0, K)); metadata M, K, codebook, schema. "
             "FeatureBox's content_ids op reads it as is. A JSON report is written next to it (<out>.report.json).",
             ["leanml ctr content-ids assign --model out/cid --data fashion --out out/ids.parquet",
              "leanml ctr content-ids assign --model out/cid --images ads/ --out ids.parquet --on-bad error"],
             source=True)
    _command(ctr, "train", TrainJob, cmd_train, "train a CTR model and evaluate it on new and old ads",
             "Fields: user, context, and per --features: id (ad ID), raw (continuous content vector through an "
             "MLP), visual (the M content IDs; --visual-fields says how). Content IDs are fitted on the old ads "
             "unless --content-ids or --visual-ids is given.",
             ["leanml ctr train --data fashion --model deepfm --features id,visual --out out/run",
              "leanml ctr train --data movielens --model dcnv2 --features id --out out/ml-id",
              "leanml ctr train --data fashion --codebook rq --K 64 --visual-fields prefix --out out/rq",
              "leanml ctr train --data fashion --features visual --visual-ids out/ids.parquet --out out/v"])
    _command(ctr, "eval", EvalJob, cmd_eval, "evaluate a trained CTR run on its dataset's test logs",
             "Reloads a run folder from `ctr train`, rebuilds its dataset (same seed) and prints AUC / gAUC / "
             "logloss overall, on new ads and on old ads; writes eval.json.", ["leanml ctr eval --run out/run"])


def cmd_fit(job: FitJob) -> int:
    report = fit_job(job)
    u, c = report["usage"], report["config"]
    print(f"fitted {report['n_items']} items in {report['seconds']:.1f}s; loss {report['final_loss']:.4f}; "
          f"dead codes {u['dead_codes']}/{c['m'] * c['k']}; entropy {u['entropy_bits']:.2f} bits; "
          f"collisions {u['collision_rate']:.3f}; skipped {len(report['skipped'])}")
    print(f"wrote {job.out}")
    return 0


def cmd_assign(job: AssignJob) -> int:
    r = assign_job(job)
    print(f"assigned {r['n_ads']} ads (M={r['M']}, K={r['K']}, {r['codebook']}); skipped {r['n_skipped']}"
          + (f" (see {job.out}.report.json)" if r["n_skipped"] else ""))
    print(f"wrote {job.out}")
    return 0


def cmd_train(job: TrainJob) -> int:
    report = train_job(job)
    info = report.get("visual_table")
    if info:
        print(f"visual IDs from {job.visual_ids}: {info['ads_missing']} ads missing, "
              f"{info['rows_dropped_train']} train / {info['rows_dropped_test']} test rows dropped")
    print(f"{job.ctr.model} with features {report['config']['features']} on {job.data} ({report['seconds']:.1f}s)")
    print_metrics(report["metrics"])
    print(f"wrote {job.out}")
    return 0


def cmd_eval(job: EvalJob) -> int:
    r = eval_job(job)
    print(f"{r['config']['model']} with features {r['config']['features']} on {r['data_args']['name']}")
    print_metrics(r["metrics"])
    print(f"wrote {job.run / 'eval.json'}")
    return 0
