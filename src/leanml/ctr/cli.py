"""``leanml ctr ...``: content IDs (fit, assign), CTR training and evaluation."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from leanml.utils import LeanmlError, Timer, default_device, write_json

DATASETS = ("fashion", "movielens")


def _fmt(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def print_metrics(metrics: dict[str, Any]) -> None:
    """A small table: rows overall / new / old, columns n, AUC, gAUC, logloss."""
    print(f"{'split':<8}{'rows':>8}{'AUC':>9}{'gAUC':>9}{'logloss':>9}")
    for split, sfx in (("all", ""), ("new ads", "_new"), ("old ads", "_old")):
        n = metrics.get(f"n{sfx}", metrics.get("n"))
        print(f"{split:<8}{n:>8}{metrics[f'auc{sfx}']:>9.4f}{metrics[f'gauc{sfx}']:>9.4f}{metrics[f'logloss{sfx}']:>9.4f}")


def _add_threads(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: these models are small, and extra threads slow down "
                        "a shared machine)")


def _set_threads(args: argparse.Namespace) -> None:
    import torch

    if args.threads < 1:
        raise LeanmlError(f"--threads {args.threads}: use a positive number of threads")
    torch.set_num_threads(args.threads)


def _add_content_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--M", dest="m", type=int, default=4, help="IDs per ad: sub-spaces (pq) or levels (rq), default 4")
    p.add_argument("--K", dest="k", type=int, default=16, help="codewords per sub-space / level (>= 2), default 16")
    p.add_argument("--codebook", choices=["pq", "rq"], default="pq",
                   help="product quantization (independent sub-spaces) or residual (coarse-to-fine levels)")
    p.add_argument("--no-reseed", action="store_true", help="keep dead codewords (default: re-seed them each epoch)")
    p.add_argument("--posthoc", action="store_true",
                   help="train the encoder alone, then fit the codebooks by k-means (default: jointly)")
    p.add_argument("--dim", type=int, default=32, help="quantized vector length D (divisible by M for pq), default 32")
    p.add_argument("--norm-groups", type=int, default=0,
                   help="L2-normalize the content vector in G equal groups (1: as a whole; default 0: M for "
                        "jointly trained pq, else 1)")
    p.add_argument("--loss", choices=["infonce", "tokens"], default="infonce", help="text supervision")
    p.add_argument("--content-epochs", type=int, default=None, help="quantized training epochs")
    p.add_argument("--straight-through", action="store_true", help="hard forward, soft backward")


def _content_overrides(args: argparse.Namespace) -> dict[str, Any]:
    ov: dict[str, Any] = {"m": args.m, "k": args.k, "dim": args.dim, "loss": args.loss, "codebook": args.codebook,
                          "reseed_dead": not args.no_reseed, "straight_through": args.straight_through,
                          "joint": not args.posthoc, "norm_groups": args.norm_groups}
    seed_content = getattr(args, "seed_content", None)
    ov["seed"] = args.seed if seed_content is None else seed_content
    if args.content_epochs is not None:
        ov["epochs"] = args.content_epochs
    return ov


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``ctr`` with ``content-ids fit|assign``, ``train`` and ``eval``."""
    ctr = sub.add_parser(
        "ctr", help="visual content IDs and CTR models (new-ad cold start)",
        description="Text-supervised visual IDs for ads and CTR models that use them.",
        epilog="examples:\n  leanml ctr content-ids fit --data fashion --out out/cid\n"
               "  leanml ctr content-ids assign --model out/cid --data fashion --out out/ids.parquet\n"
               "  leanml ctr train --data fashion --model deepfm --features id,visual --out out/run\n"
               "  leanml ctr eval --run out/run",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ctr_sub = ctr.add_subparsers(dest="ctr_command", metavar="SUBCOMMAND")
    ctr.set_defaults(func=lambda a: (ctr.print_help(), 2)[1])

    cid = ctr_sub.add_parser(
        "content-ids", help="fit a content-ID model or assign visual IDs",
        description="Train the image extractor + soft product quantizer under text supervision, "
                    "or export visual IDs for serving.",
        epilog="examples:\n  leanml ctr content-ids fit --data fashion --M 4 --K 16 --out out/cid\n"
               "  leanml ctr content-ids assign --model out/cid --images ads/ --out ids.parquet",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cid_sub = cid.add_subparsers(dest="cid_command", metavar="ACTION")
    cid.set_defaults(func=lambda a: (cid.print_help(), 2)[1])

    fit = cid_sub.add_parser(
        "fit", help="train extractor + quantizer on images and captions",
        description="Fit on the old ads of a built-in dataset (--data) or on a folder of images named "
                    "<ad_id>.png with a captions CSV (ad_id,caption). Writes config.json, "
                    "model.safetensors and report.json into --out.",
        epilog="examples:\n  leanml ctr content-ids fit --data fashion --out out/cid\n"
               "  leanml ctr content-ids fit --data movielens --loss tokens --out out/cid-ml\n"
               "  leanml ctr content-ids fit --images ads/ --captions captions.csv --out out/cid",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = fit.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", choices=DATASETS, help="built-in dataset (fits on its old ads)")
    src.add_argument("--images", type=Path, help="folder of <ad_id>.<png|jpg|npy> images")
    fit.add_argument("--captions", type=Path, help="CSV ad_id,caption (required with --images)")
    fit.add_argument("--on-bad", choices=["skip", "error"], default="skip",
                     help="unreadable image / missing caption: skip and report (default) or fail")
    _add_content_args(fit)
    fit.add_argument("--seed", type=int, default=0)
    fit.add_argument("--out", type=Path, required=True)
    fit.add_argument("--overwrite", action="store_true")
    _add_threads(fit)
    fit.set_defaults(func=cmd_fit)

    assign = cid_sub.add_parser(
        "assign", help="export ad -> content IDs as the Parquet serving table",
        description="The serving table (schema leanml.content_ids/2, module leanml.ctr.content_ids.schema): "
                    "columns ad_id (int64) and visual_ids (list<int64>, length M, codes in [0, K)); metadata "
                    "M, K, codebook, schema. FeatureBox's content_ids op reads it as is. A JSON report is "
                    "written next to it (<out>.report.json).",
        epilog="examples:\n  leanml ctr content-ids assign --model out/cid --data fashion --out out/ids.parquet\n"
               "  leanml ctr content-ids assign --model out/cid --images ads/ --out ids.parquet --on-bad error",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    asrc = assign.add_mutually_exclusive_group(required=True)
    asrc.add_argument("--data", choices=DATASETS, help="all ads (old and new) of a built-in dataset")
    asrc.add_argument("--images", type=Path, help="folder of <ad_id>.<png|jpg|npy> images")
    assign.add_argument("--model", type=Path, required=True, help="folder written by `content-ids fit`")
    assign.add_argument("--on-bad", choices=["skip", "error"], default="skip")
    assign.add_argument("--seed", type=int, default=0, help="dataset seed (with --data)")
    assign.add_argument("--out", type=Path, required=True)
    _add_threads(assign)
    assign.set_defaults(func=cmd_assign)

    train = ctr_sub.add_parser(
        "train", help="train a CTR model and evaluate it on new and old ads",
        description="Fields: user, context, and per --features: id (ad ID), raw (continuous content "
                    "vector through an MLP), visual (the M content IDs; --visual-fields says how). Content "
                    "IDs are fitted on the old ads unless --content-ids or --visual-ids is given.",
        epilog="examples:\n  leanml ctr train --data fashion --model deepfm --features id,visual --out out/run\n"
               "  leanml ctr train --data movielens --model dcnv2 --features id --out out/ml-id\n"
               "  leanml ctr train --data fashion --codebook rq --K 64 --visual-fields prefix --out out/rq\n"
               "  leanml ctr train --data fashion --features visual --visual-ids out/ids.parquet --out out/v",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("--data", choices=DATASETS, default="fashion")
    train.add_argument("--model", default="deepfm", help="lr, dnn, deepfm or dcnv2")
    train.add_argument("--features", default="id,visual", help="any of id, raw, visual (comma-separated)")
    train.add_argument("--content-ids", type=Path, help="content-ID model folder (default: fit one, cached)")
    train.add_argument("--visual-ids", type=Path, help="Parquet table from `assign` (visual features only)")
    train.add_argument("--on-missing", choices=["error", "skip"], default="error",
                       help="log ads absent from --visual-ids: fail (default) or drop their rows and report")
    _add_content_args(train)
    train.add_argument("--epochs", type=int, default=3)
    train.add_argument("--lr", type=float, default=None, help="default 5e-3 (1e-2 for dcnv2)")
    train.add_argument("--id-dropout", type=float, default=0.1,
                       help="share of training rows whose ad ID is replaced by the unseen-ad row, so the new-ad "
                            "path is trained (DropoutNet-style; default 0.1)")
    train.add_argument("--id-mode", choices=["dropout", "residual"], default="dropout",
                       help="the ad ID as one field trained with --id-dropout, or as a correction learned on a "
                            "frozen model without it (a new ad's prediction is then exactly that model's)")
    train.add_argument("--visual-fields", choices=["codes", "prefix", "codes+prefix", "bag", "none"], default="codes",
                       help="each code its own field (codes), prefix n-grams (prefix, for --codebook rq), both, "
                            "or one pooled bag")
    train.add_argument("--codeword-vector", action="store_true",
                       help="also feed the codes' codeword vector (a codebook lookup) through an MLP; needs the "
                            "content-ID model, not only a --visual-ids table")
    train.add_argument("--content-tower", action="store_true",
                       help="with raw and --codeword-vector: one MLP over both vectors as one field, instead of "
                            "one field each (which would interact with each other)")
    train.add_argument("--seed-content", type=int, default=None,
                       help="seed of the content-ID fit (default: --seed)")
    train.add_argument("--embed-dim", type=int, default=16)
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--out", type=Path, required=True)
    train.add_argument("--overwrite", action="store_true")
    _add_threads(train)
    train.set_defaults(func=cmd_train)

    ev = ctr_sub.add_parser(
        "eval", help="evaluate a trained CTR run on its dataset's test logs",
        description="Reloads a run folder from `ctr train`, rebuilds its dataset (same seed) and prints "
                    "AUC / gAUC / logloss overall, on new ads and on old ads; writes eval.json.",
        epilog="examples:\n  leanml ctr eval --run out/run",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ev.add_argument("--run", type=Path, required=True)
    _add_threads(ev)
    ev.set_defaults(func=cmd_eval)


def _check_visual_ids(path: Path, on_missing: str) -> None:
    """A --visual-ids table is read (and its format checked) before any data is loaded."""
    from leanml.ctr.content_ids.schema import read_table

    if not path.is_file():
        raise LeanmlError(f"--visual-ids {path} does not exist; write it with `leanml ctr content-ids assign`")
    try:
        read_table(path, on_empty=on_missing)
    except LeanmlError:
        raise
    except Exception as exc:  # pyarrow's errors for a file that is not Parquet
        raise LeanmlError(f"--visual-ids {path} is not a readable Parquet table ({str(exc).splitlines()[0]}); "
                          "write it again with `leanml ctr content-ids assign`") from None


def _check_content_args(args: argparse.Namespace) -> None:
    """The content-ID options are checked before the (long) fit: the same checks as the fit's config."""
    from leanml.ctr.content_ids.trainer import ContentIDConfig

    if args.content_epochs is not None and args.content_epochs < 1:
        raise LeanmlError(f"--content-epochs {args.content_epochs}: use at least 1")
    if args.m < 1 or args.dim < 1 or args.norm_groups < 0:
        raise LeanmlError(f"--M {args.m}, --dim {args.dim}: use numbers >= 1 (and --norm-groups >= 0)")
    cfg = ContentIDConfig(kind="cnn")
    for key, value in _content_overrides(args).items():
        setattr(cfg, key, value)
    cfg.validate()


def _load_data(name: str, seed: int):  # noqa: ANN202 - CTRData, imported lazily
    from leanml.ctr.data import load_dataset

    return load_dataset(name, seed=seed)


def cmd_fit(args: argparse.Namespace) -> int:
    _set_threads(args)

    from leanml.ctr.content_ids.encoders import embed_texts
    from leanml.ctr.content_ids.trainer import ContentIDConfig, fit_content_ids, save_content_model
    from leanml.ctr.data import load_ad_folder
    from leanml.ctr.train import content_config_for, fit_dataset_content_ids
    from leanml.utils import check_output_dir

    check_output_dir(args.out, args.overwrite)
    _check_content_args(args)
    with Timer() as t:
        if args.data:
            data = _load_data(args.data, args.seed)
            cfg = content_config_for(data, **_content_overrides(args))
            model, report = fit_dataset_content_ids(data, cfg, use_cache=False)
            report["skipped"] = []
        else:
            if args.captions is None:
                raise LeanmlError("--images needs --captions CSV (ad_id,caption): text supervises the quantizer")
            ad_ids, images, captions, skipped = load_ad_folder(args.images, args.captions, args.on_bad)
            assert captions is not None
            cfg = ContentIDConfig(kind="cnn")
            for key, value in _content_overrides(args).items():
                setattr(cfg, key, value)
            text = embed_texts(captions) if cfg.loss == "infonce" else None
            model, report = fit_content_ids(images, captions, cfg, text_emb=text, device=default_device())
            report["skipped"] = skipped
            report["n_ads"] = len(ad_ids)
    report["seconds"] = t.seconds
    save_content_model(model, args.out, report, overwrite=args.overwrite)
    u = report["usage"]
    print(f"fitted {report['n_items']} items in {t.seconds:.1f}s; loss {report['final_loss']:.4f}; "
          f"dead codes {u['dead_codes']}/{cfg.m * cfg.k}; entropy {u['entropy_bits']:.2f} bits; "
          f"collisions {u['collision_rate']:.3f}; skipped {len(report['skipped'])}")
    print(f"wrote {args.out}")
    return 0


def cmd_assign(args: argparse.Namespace) -> int:
    _set_threads(args)
    from leanml.ctr.content_ids.assign import assign_visual_ids, write_visual_ids
    from leanml.ctr.content_ids.quantizer import usage_stats
    from leanml.ctr.content_ids.schema import SCHEMA_VERSION
    from leanml.ctr.content_ids.trainer import load_content_model
    from leanml.ctr.data import load_ad_folder
    from leanml.utils import check_writable

    if args.out.is_dir():
        raise LeanmlError(f"--out {args.out} is a folder; give the Parquet file to write, e.g. ids.parquet")
    check_writable(args.out.parent, "--out")
    model = load_content_model(args.model)
    skipped: list[dict[str, str]] = []
    if args.data:
        data = _load_data(args.data, args.seed)
        if data.content_kind != model.config.kind:
            raise LeanmlError(f"model {args.model} encodes {model.config.kind!r} content but {args.data} has "
                              f"{data.content_kind!r} content; fit a model on --data {args.data}")
        ad_ids, inputs = data.item_ids, data.content
    else:
        if model.config.kind != "cnn":
            raise LeanmlError(f"model {args.model} is not an image model; --images needs one fitted on images")
        ad_ids, inputs, _, skipped = load_ad_folder(args.images, None, args.on_bad)
    with Timer() as t:
        codes = assign_visual_ids(model, inputs)
    cfg = model.config
    write_visual_ids(args.out, ad_ids, codes, cfg.k, cfg.codebook)
    usage = usage_stats(codes, cfg.k).as_dict()
    report = {"model": str(args.model), "out": str(args.out), "n_ads": len(ad_ids), "M": cfg.m, "K": cfg.k,
              "codebook": cfg.codebook, "schema": SCHEMA_VERSION, "skipped": skipped, "n_skipped": len(skipped),
              "usage": usage, "seconds": t.seconds}
    write_json(Path(str(args.out) + ".report.json"), report)
    print(f"assigned {len(ad_ids)} ads (M={cfg.m}, K={cfg.k}, {cfg.codebook}); skipped {len(skipped)}"
          + (f" (see {args.out}.report.json)" if skipped else ""))
    print(f"wrote {args.out}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    _set_threads(args)
    from leanml.ctr.content_ids.trainer import load_content_model
    from leanml.ctr.train import (
        CTRConfig,
        content_config_for,
        content_items,
        fit_dataset_content_ids,
        items_from_table,
        parse_features,
        run_ctr,
        save_ctr_run,
    )
    from leanml.utils import check_output_dir

    # every option and input is checked before any data is loaded or content IDs are fitted
    check_output_dir(args.out, args.overwrite)
    features = parse_features(args.features)
    cfg = CTRConfig(model=args.model, features=features, embed_dim=args.embed_dim, epochs=args.epochs,
                    lr=args.lr, id_dropout=args.id_dropout, visual_fields=args.visual_fields,
                    codeword_vector=args.codeword_vector, content_tower=args.content_tower,
                    id_mode=args.id_mode, seed=args.seed)
    content_model = None
    if args.visual_ids is not None:
        if "raw" in features:
            raise LeanmlError("--visual-ids carries IDs only; drop 'raw' from --features or use --content-ids")
        _check_visual_ids(args.visual_ids, args.on_missing)
    elif features != "id":
        if args.content_ids is not None:
            content_model = load_content_model(args.content_ids)
        else:
            _check_content_args(args)
    data = _load_data(args.data, args.seed)
    items, extra = None, {}
    with Timer() as t:
        if args.visual_ids is not None:
            items, data, info = items_from_table(data, args.visual_ids, on_missing=args.on_missing)
            extra["visual_table"] = info
            print(f"visual IDs from {args.visual_ids}: {info['ads_missing']} ads missing, "
                  f"{info['rows_dropped_train']} train / {info['rows_dropped_test']} test rows dropped")
        elif features != "id":
            if content_model is not None:
                model = content_model
                extra["content_ids"] = str(args.content_ids)
            else:
                model, cid_report = fit_dataset_content_ids(data, content_config_for(data, **_content_overrides(args)))
                extra["content_ids"] = {"fitted": True, "usage": cid_report["usage"]}
            items = content_items(data, model)
        model_ctr, builder, report = run_ctr(data, items, cfg)
    report.update(extra, seconds=t.seconds, data_args={"name": args.data, "seed": args.seed,
                                                       "on_missing": args.on_missing})
    save_ctr_run(args.out, model_ctr, builder, report, overwrite=args.overwrite)
    print(f"{cfg.model} with features {features} on {args.data} ({t.seconds:.1f}s)")
    print_metrics(report["metrics"])
    print(f"wrote {args.out}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    _set_threads(args)
    from leanml.ctr.train import evaluate_run, items_from_table, load_ctr_run, read_run_report, run_config
    from leanml.utils import check_writable

    if not args.run.is_dir():
        raise LeanmlError(f"--run {args.run} is not a folder; pass a folder written by `leanml ctr train --out`")
    saved = read_run_report(args.run)
    run_config(saved, args.run)
    for name in ("model.safetensors", "fields.npz"):
        if not (args.run / name).is_file():
            raise LeanmlError(f"{args.run} has no {name}; pass a complete folder written by `leanml ctr train --out`")
    data_args = saved.get("data_args", {"name": "fashion", "seed": 0})
    if not isinstance(data_args, dict) or data_args.get("name") not in DATASETS \
            or not isinstance(data_args.get("seed", 0), int):
        raise LeanmlError(f"{args.run / 'report.json'} names no known dataset (data_args {data_args!r}); "
                          "the run folder is damaged: train it again")
    check_writable(args.run, "--run")
    data = _load_data(data_args["name"], data_args.get("seed", 0))
    if "visual_table" in saved:
        _, data, _ = items_from_table(data, saved["visual_table"]["table"], on_missing=data_args.get("on_missing", "error"))
    model, builder, _ = load_ctr_run(args.run, data)
    metrics = evaluate_run(model, builder, data)
    write_json(args.run / "eval.json", {"run": str(args.run), "metrics": metrics, "data_args": data_args})
    print(f"{saved['config']['model']} with features {saved['config']['features']} on {data_args['name']}")
    print_metrics(metrics)
    print(f"wrote {args.run / 'eval.json'}")
    return 0
