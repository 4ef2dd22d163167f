"""The ``leanml ctr`` jobs: one options dataclass per command (its fields are the command's flags) and the
function that runs it. Every option and input is checked before any data is loaded or content IDs are
fitted; the functions return reports (the command line prints them)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from leanml.config import ConfigError, Form, default, given, option, require
from leanml.ctr.content_ids.config import ContentIDConfig
from leanml.ctr.options import CTRConfig
from leanml.device import default_device
from leanml.errors import LeanmlError
from leanml.flags import flag_of
from leanml.machine import apply_threads
from leanml.outputs import check_output_dir, check_writable, write_json
from leanml.progress import Timer

DATASETS = ("fashion", "movielens")
Dataset = Literal["fashion", "movielens"]
OnBad = Literal["skip", "error"]


@dataclass(frozen=True)
class Threads:
    """Torch CPU threads of a command."""

    threads: int = option(1, "torch CPU threads (default 1: these models are small, and extra threads slow down "
                             "a shared machine)", form=Form(show_default=False))

    def __post_init__(self) -> None:
        require(self, self.threads >= 1, "threads", f"must be >= 1, got {self.threads}")

    def apply(self) -> None:
        apply_threads(self.threads)


@dataclass(frozen=True, kw_only=True)
class FitJob:
    """``leanml ctr content-ids fit``: a content-ID model on a built-in dataset's old ads or a folder of images."""

    data: Dataset | None = option(None, "built-in dataset (fits on its old ads)")
    images: Path | None = option(None, "folder of <ad_id>.<png|jpg|npy> images", parse=Path)
    captions: Path | None = option(None, "CSV ad_id,caption (required with an images folder)", parse=Path)
    on_bad: OnBad = option("skip", "unreadable image / missing caption: skip and report (default) or fail",
                           form=Form(show_default=False))
    content: ContentIDConfig = option(default_factory=ContentIDConfig, form=Form(prefix=""))
    seed: int = option(0, "seed of the dataset and of the fit")
    out: Path = option(help="output folder (config.json, model.safetensors, report.json)", parse=Path)
    overwrite: bool = option(False, "replace an existing output folder", form=Form(show_default=False))
    cpu: Threads = option(default_factory=Threads, form=Form(prefix=""))

    def __post_init__(self) -> None:
        require(self, (self.data is None) != (self.images is None), ("data", "images"), "give data or images")
        require(self, self.images is None or self.captions is not None, ("images", "captions"),
                "images needs captions CSV (ad_id,caption): text supervises the quantizer")
        require(self, self.captions is None or self.images is not None, ("captions", "images", "data"),
                "captions label the ads of images; data brings its own: drop captions or use images")


@dataclass(frozen=True, kw_only=True)
class AssignJob:
    """``leanml ctr content-ids assign``: the Parquet serving table of every ad's content IDs."""

    data: Dataset | None = option(None, "all ads (old and new) of a built-in dataset")
    images: Path | None = option(None, "folder of <ad_id>.<png|jpg|npy> images", parse=Path)
    model: Path = option(help="folder written by `content-ids fit`", parse=Path)
    on_bad: OnBad = option("skip", "unreadable image: skip and report (default) or fail",
                           form=Form(show_default=False))
    seed: int = option(default(0), "dataset seed (with a built-in dataset)")
    out: Path = option(help="the Parquet file to write", parse=Path)
    cpu: Threads = option(default_factory=Threads, form=Form(prefix=""))

    def __post_init__(self) -> None:
        require(self, (self.data is None) != (self.images is None), ("data", "images"), "give data or images")
        require(self, self.data is not None or not given(self.seed), ("seed", "images", "data"),
                "seed draws a built-in dataset's ads; images are read as they are: drop seed or use data")


@dataclass(frozen=True, kw_only=True)
class TrainJob:
    """``leanml ctr train``: one CTR model on a built-in dataset, evaluated on its new and old ads."""

    data: Dataset = option("fashion", "built-in dataset")
    ctr: CTRConfig = option(default_factory=CTRConfig, form=Form(prefix=""))
    content_ids: Path | None = option(None, "content-ID model folder (default: fit one, cached)", parse=Path)
    visual_ids: Path | None = option(None, "Parquet table from `assign` (visual features only)", parse=Path)
    on_missing: Literal["error", "skip"] = option(
        "error", "log ads absent from the visual-ID table: fail (default) or drop their rows and report",
                                                  form=Form(show_default=False))
    content: ContentIDConfig = option(default_factory=ContentIDConfig, form=Form(prefix=""))
    seed_content: int | None = option(None, "seed of the content-ID fit (default: the CTR seed)")
    out: Path = option(help="output folder (model.safetensors, fields.npz, report.json)", parse=Path)
    overwrite: bool = option(False, "replace an existing output folder", form=Form(show_default=False))
    cpu: Threads = option(default_factory=Threads, form=Form(prefix=""))

    def __post_init__(self) -> None:
        require(self, self.visual_ids is None or "raw" not in self.ctr.feature_set.split("+"),
                ("visual_ids", "features", "content_ids"),
                "visual_ids carries IDs only; drop 'raw' from features or use content_ids")
        require(self, self.visual_ids is None or self.content_ids is None, ("visual_ids", "content_ids"),
                "visual_ids already holds the IDs, so content_ids would be unused: give one of them")
        require(self, self.seed_content is None or (self.visual_ids is None and self.content_ids is None),
                ("seed_content", "content_ids", "visual_ids"),
                "seed_content seeds a content-ID fit, which content_ids and visual_ids skip: drop one of them")

    @property
    def content_config(self) -> ContentIDConfig:
        """The content-ID options with their seed (``seed_content``, else the CTR seed)."""
        return replace(self.content, seed=self.ctr.seed if self.seed_content is None else self.seed_content)


@dataclass(frozen=True, kw_only=True)
class EvalJob:
    """``leanml ctr eval``: a trained run on its dataset's test logs."""

    run: Path = option(help="run folder written by `leanml ctr train`", parse=Path)
    cpu: Threads = option(default_factory=Threads, form=Form(prefix=""))


def fit_job(job: FitJob) -> dict[str, Any]:
    """Fit and save a content-ID model; returns its report."""
    from leanml.ctr.content import content_config_for, fit_dataset_content_ids
    from leanml.ctr.content_ids.encoders import embed_texts
    from leanml.ctr.content_ids.trainer import fit_content_ids, save_content_model
    from leanml.ctr.data import load_ad_folder, load_dataset

    job.cpu.apply()
    check_output_dir(job.out, job.overwrite)
    config = replace(job.content, seed=job.seed)
    with Timer() as t:
        if job.data:
            data = load_dataset(job.data, seed=job.seed)
            model, report = fit_dataset_content_ids(data, content_config_for(data, config), use_cache=False)
            report["skipped"] = []
        else:
            assert job.images is not None and job.captions is not None
            ad_ids, images, captions, skipped = load_ad_folder(job.images, job.captions, job.on_bad)
            assert captions is not None
            text = embed_texts(captions) if config.loss == "infonce" else None
            model, report = fit_content_ids(images, captions, config, text_emb=text, device=default_device())
            report["skipped"] = skipped
            report["n_ads"] = len(ad_ids)
    report["seconds"] = t.seconds
    save_content_model(model, job.out, report, overwrite=job.overwrite, out_flag=flag_of(FitJob, "out"))
    return report


def assign_job(job: AssignJob) -> dict[str, Any]:
    """Write the serving table of every ad's content IDs (and ``<out>.report.json``); returns the report."""
    from leanml.ctr.content_ids.assign import assign_visual_ids, write_visual_ids
    from leanml.ctr.content_ids.quantizer import usage_stats
    from leanml.ctr.content_ids.schema import SCHEMA_VERSION
    from leanml.ctr.content_ids.trainer import load_content_model
    from leanml.ctr.data import load_ad_folder, load_dataset

    job.cpu.apply()
    require(job, not job.out.is_dir(), "out",
            f"{job.out} is a folder; give the Parquet file to write, e.g. ids.parquet")
    check_writable(job.out.parent, "out")
    model = load_content_model(job.model)
    cfg = model.config
    skipped: list[dict[str, str]] = []
    if job.data:
        data = load_dataset(job.data, seed=job.seed)
        if data.content_kind != cfg.kind:
            raise LeanmlError(f"model {job.model} encodes {cfg.kind!r} content but {job.data} has "
                              f"{data.content_kind!r} content; fit a model on data {job.data}",
                              owner=AssignJob, fields=("data",))
        ad_ids, inputs = data.item_ids, data.content
    else:
        assert job.images is not None
        if cfg.kind != "cnn":
            raise LeanmlError(f"model {job.model} is not an image model; images needs one fitted on image files",
                              owner=AssignJob, fields=("images",))
        ad_ids, inputs, _, skipped = load_ad_folder(job.images, None, job.on_bad)
    with Timer() as t:
        codes = assign_visual_ids(model, inputs)
    write_visual_ids(job.out, ad_ids, codes, cfg.k, cfg.codebook)
    report = {"model": str(job.model), "out": str(job.out), "n_ads": len(ad_ids), "M": cfg.m, "K": cfg.k,
              "codebook": cfg.codebook, "schema": SCHEMA_VERSION, "skipped": skipped, "n_skipped": len(skipped),
              "usage": usage_stats(codes, cfg.k).as_dict(), "seconds": t.seconds}
    write_json(Path(str(job.out) + ".report.json"), report)
    return report


def _check_visual_ids(job: TrainJob) -> None:
    """A visual-ID table is read (and its format checked) before any data is loaded."""
    from leanml.ctr.content_ids.schema import read_table

    path = job.visual_ids
    assert path is not None
    require(job, path.is_file(), "visual_ids",
            f"{path} does not exist; write it with `leanml ctr content-ids assign`")
    try:
        read_table(path, on_empty=job.on_missing)
    except LeanmlError:
        raise
    except Exception as exc:  # pyarrow's errors for a file that is not Parquet
        raise ConfigError(f"visual_ids {path} is not a readable Parquet table ({str(exc).splitlines()[0]}); "
                          "write it again with `leanml ctr content-ids assign`", TrainJob, ("visual_ids",)) from None


def train_job(job: TrainJob) -> dict[str, Any]:
    """Train, evaluate and save one CTR run; returns its report."""
    from leanml.ctr import content
    from leanml.ctr.content_ids.trainer import load_content_model
    from leanml.ctr.data import load_dataset
    from leanml.ctr.runs import save_ctr_run
    from leanml.ctr.train import run_ctr

    job.cpu.apply()
    check_output_dir(job.out, job.overwrite)
    features = job.ctr.feature_set
    content_model = None
    if job.visual_ids is not None:
        _check_visual_ids(job)
    elif features != "id" and job.content_ids is not None:
        content_model = load_content_model(job.content_ids)
    data = load_dataset(job.data, seed=job.ctr.seed)
    items, extra = None, {}
    with Timer() as t:
        if job.visual_ids is not None:
            items, data, info = content.items_from_table(data, job.visual_ids, on_missing=job.on_missing)
            extra["visual_table"] = info
        elif features != "id":
            if content_model is not None:
                extra["content_ids"] = str(job.content_ids)
            else:
                cfg = content.content_config_for(data, job.content_config)
                content_model, cid_report = content.fit_dataset_content_ids(data, cfg)
                extra["content_ids"] = {"fitted": True, "usage": cid_report["usage"]}
            items = content.content_items(data, content_model)
        model, builder, report = run_ctr(data, items, job.ctr)
    report.update(extra, seconds=t.seconds, data_args={"name": job.data, "seed": job.ctr.seed,
                                                       "on_missing": job.on_missing})
    save_ctr_run(job.out, model, builder, report, overwrite=job.overwrite, out_flag=flag_of(TrainJob, "out"))
    return report


def eval_job(job: EvalJob) -> dict[str, Any]:
    """Evaluate a saved run on its dataset's test logs and write ``eval.json``; returns its record and the run's
    config."""
    from leanml.ctr.content import items_from_table
    from leanml.ctr.data import load_dataset
    from leanml.ctr.runs import load_ctr_run, read_run_report, run_config
    from leanml.ctr.train import evaluate_run

    job.cpu.apply()
    require(job, job.run.is_dir(), "run", f"{job.run} is not a folder; pass a folder written by `leanml ctr train`")
    saved = read_run_report(job.run)
    run_config(saved, job.run)
    for name in ("model.safetensors", "fields.npz"):
        if not (job.run / name).is_file():
            raise LeanmlError(f"{job.run} has no {name}; pass a complete run folder written by `leanml ctr train`")
    data_args = saved.get("data_args", {"name": "fashion", "seed": 0})
    if not isinstance(data_args, dict) or data_args.get("name") not in DATASETS \
            or not isinstance(data_args.get("seed", 0), int):
        raise LeanmlError(f"{job.run / 'report.json'} names no known dataset (data_args {data_args!r}); "
                          "the run folder is damaged: train it again")
    check_writable(job.run, "run")
    data = load_dataset(data_args["name"], seed=data_args.get("seed", 0))
    if "visual_table" in saved:
        _, data, _ = items_from_table(data, saved["visual_table"]["table"],
                                      on_missing=data_args.get("on_missing", "error"))
    model, builder, _ = load_ctr_run(job.run, data, report=saved)
    metrics = evaluate_run(model, builder, data)
    result = {"run": str(job.run), "metrics": metrics, "data_args": data_args}
    write_json(job.run / "eval.json", result)
    return {**result, "config": saved["config"]}
