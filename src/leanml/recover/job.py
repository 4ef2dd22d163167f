"""``leanml recover`` as a library call: :class:`RecoverJob` (every option of the command, each declared
once) and :func:`run_recover_job`, which checks every input before a model is loaded, loads the pruned
model and its teacher, mixes in the teacher's samples, runs :func:`~leanml.recover.recover`, and writes
the model, ``report.json`` and ``losses.csv`` atomically."""

from __future__ import annotations

import csv
import json
import shutil
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from leanml.config import Form, default, given, option, require
from leanml.device import parse_device
from leanml.errors import LeanmlError
from leanml.eval.job import check_seqlen
from leanml.finite import NonFiniteError
from leanml.flags import flag_of
from leanml.recover.config import RecoverConfig, no_mask_flag
from leanml.recover.source import parse_nm

DType = Literal["float32", "bfloat16", "float16"]


@dataclass(frozen=True)
class RecoverJob:
    """``leanml recover``: fine-tune the pruned ``model`` keeping its zeros (``recover``: the training
    options), optionally distilling ``teacher``, and save it to ``out``."""

    model: str = option(help="the pruned model: a directory written by leanml prune (or any HF dir)")
    out: str = option(help="output directory (appears only when complete)")
    teacher: str | None = option(None, "dense teacher to distil: a model spec, or 'source' (the model pruned)")
    data: str = option("shakespeare", "training corpus; its train split is used (shakespeare: every play but Hamlet)")
    seqlen: int = option(256, "tokens per training window")
    recover: RecoverConfig = option(default_factory=RecoverConfig, form=Form(prefix=""))
    teacher_samples: float = option(0.0, "share of the training windows sampled from the teacher instead of read "
                                         "from the training corpus, in [0, 1] (needs a teacher)")
    teacher_samples_cache: str | None = option(
        None, "keep the teacher's samples in DIR and reuse them in later runs with the same teacher weights, window "
        "count, length, seed and start token (the report keeps the sampling time)", form=Form(metavar="DIR"))
    pattern: str | None = option(None, "N:M pattern the zeros must follow (checked; default: report.json's)")
    eval_data: str = option(default("shakespeare,reviews"), "comma-separated corpora whose test split gives "
                                                            "perplexity before/after")
    eval_seqlen: int = option(default(512), "tokens per evaluation window")
    eval_windows: int | None = option(None, "evaluate the first N test windows of each corpus")
    evaluate: bool = option(True, "measure the perplexities (off: skip them)", flag="--eval")
    resume: bool = option(False, "continue from the checkpoint of an interrupted run")
    device: str | None = option(None, "cpu or cuda (default: cuda when present)")
    save_format: Literal["safetensors", "compressed"] = option(
        "safetensors", "safetensors (plain from_pretrained loads it) or compressed (sparse-bitmask layout that "
        "leanml reloads: a 50% model is 0.63x the dense directory; python -m leanml.models.compressed writes the "
        "dense copy other tools read)")
    dtype: DType | None = option(None, "dtype of the saved model (default: the input's); training is float32")
    overwrite: bool = option(False, "replace an existing output directory")
    threads: int | None = option(None, "torch threads (default: the cores this process may use); lower it when "
                                       "other jobs share the machine", form=Form(metavar="N"))

    def __post_init__(self) -> None:
        require(self, self.seqlen >= 2, "seqlen", f"must be at least 2, got {self.seqlen}")
        require(self, self.eval_seqlen >= 2, "eval_seqlen", f"must be at least 2, got {self.eval_seqlen}")
        require(self, self.eval_windows is None or self.eval_windows >= 1, "eval_windows",
                f"must be at least 1, got {self.eval_windows}")
        if not self.evaluate and (self.eval_windows is not None or given(self.eval_data) or given(self.eval_seqlen)):
            no_eval = _no_eval()  # the flag that turned it off, looked up from a RecoverJob: only when refused
            require(self, self.eval_windows is None, ("eval_windows", "evaluate"),
                    f"eval_windows sets the perplexity's windows, which {no_eval} skips: drop one of them")
            for name in ("eval_data", "eval_seqlen"):
                require(self, not given(getattr(self, name)), (name, "evaluate"),
                        f"{name} sets the perplexity, which {no_eval} skips: drop one of them")
        require(self, self.threads is None or self.threads >= 1, "threads", f"must be at least 1, got {self.threads}")
        require(self, 0.0 <= self.teacher_samples <= 1.0, "teacher_samples",
                f"is a share of the training windows in [0, 1], got {self.teacher_samples}")
        require(self, not self.teacher_samples > 0 or self.teacher is not None, ("teacher_samples", "teacher"),
                "teacher_samples needs a model to sample from: pass teacher too")
        require(self, self.teacher_samples_cache is None or self.teacher_samples > 0,
                ("teacher_samples_cache", "teacher_samples"),
                "teacher_samples_cache keeps the samples of teacher_samples: pass teacher_samples too")
        distils = given(self.recover.kd_weight) or given(self.recover.temperature)
        require(self, self.teacher is not None or not distils, ("kd_weight", "temperature", "teacher"),
                "kd_weight and temperature set the distillation from a teacher: pass teacher too, or drop them")
        if not self.recover.keep_masks and self.pattern is not None:
            require(self, False, "pattern",
                    f"pattern cannot be kept while every weight trains (keep_masks=False, {no_mask_flag()}); drop "
                    "one of them")
        parse_nm(self.pattern)

    @property
    def eval_names(self) -> list[str]:
        """The corpora evaluated before and after (none with ``evaluate`` off)."""
        return [c.strip() for c in self.eval_data.split(",") if c.strip()] if self.evaluate else []


def _no_eval() -> str:
    """The flag that skips the perplexities (``evaluate`` off)."""
    return flag_of(RecoverJob, "evaluate", negative=True)


def input_dtype(spec: str) -> str:
    """The dtype a model directory was saved in (its config.json), else float32."""
    from leanml.models import DTYPES

    config = Path(spec).expanduser() / "config.json"
    if config.is_file():
        raw = json.loads(config.read_text())
        name = str(raw.get("dtype") or raw.get("torch_dtype") or "float32").replace("torch.", "")
        if name in DTYPES:
            return name
    return "float32"


def run_recover_job(job: RecoverJob) -> dict[str, Any]:
    """Run ``leanml recover``: every input is checked before a model is loaded; a run refused after that
    (a budget below the smallest plan) removes the checkpoint folder it made. Returns the report
    written to ``job.out``/report.json."""
    from leanml.machine import apply_threads
    from leanml.models.compressed import require_compressed
    from leanml.outputs import check_output_dir, check_writable, clean_stale_in
    from leanml.prune.engine.checkpoint import check_checkpoint

    cache = job.teacher_samples_cache
    if cache is not None and Path(cache).is_file():
        raise LeanmlError(f"teacher_samples_cache {cache} is a file; it must be a directory",
                          fields=("teacher_samples_cache",))
    if cache is not None:
        check_writable(cache, "teacher_samples_cache")
    if job.save_format == "compressed":
        require_compressed()
    out = check_output_dir(job.out, job.overwrite)
    ckpt = out.with_name(out.name + ".ckpt")
    clean_stale_in(ckpt)
    threads = apply_threads(job.threads)
    device = parse_device(job.device)
    _check_inputs(job)
    # last: only a run whose inputs pass clears a checkpoint (--overwrite); teacher samples alone resume
    check_checkpoint(ckpt, job.resume, job.overwrite, partial=("teacher_samples.pt",))
    # from here on a refused run removes the checkpoint folder it made (teacher samples) before training began
    fresh_ckpt = not ckpt.exists()
    try:
        return _run(job, out, ckpt, device, threads)
    except LeanmlError as exc:
        # a diverged run's checkpoint would only diverge again on --resume, and blocks a rerun with other options
        if isinstance(exc, NonFiniteError) or (fresh_ckpt and ckpt.is_dir() and not (ckpt / "state.pt").exists()):
            shutil.rmtree(ckpt, ignore_errors=True)
        raise


def _check_inputs(job: RecoverJob) -> None:
    """Everything checkable before a model is loaded: the model's and teacher's files, window lengths,
    the corpora."""
    from leanml.data.text import check_corpus
    from leanml.models.check import check_model_input, check_model_spec
    from leanml.recover.source import declaration, read_report

    check_model_input(job.model, job.seqlen)
    if job.eval_names:
        check_model_input(job.model, job.eval_seqlen, "eval_seqlen")
    report = read_report(job.model)  # a report.json of the wrong shape is refused before any loading
    teacher = job.teacher
    if teacher == "source":
        teacher = declaration(report).source_model  # none: refused after loading, as before
    if teacher:
        check_model_spec(teacher, flag="teacher")
    check_corpus(job.data, "train", "data")
    for name in job.eval_names:
        check_corpus(name, "test", "eval_data")


@dataclass
class _Loaded:
    """What a recovery job loaded and checked: the pruned model and its tokenizer, the report it came with
    and its mask declaration, the mask to keep (None with ``--no-mask``) and the teacher."""

    model: Any
    tokenizer: Any
    report_in: dict[str, Any] | None
    decl: Any
    mask_info: dict[str, Any]
    keeper: Any = None
    teacher: Any = None
    teacher_spec: str | None = None


def _run(job: RecoverJob, out: Path, ckpt: Path, device: Any, threads: int) -> dict[str, Any]:
    from leanml.models import count_parameters
    from leanml.recover.api import recover

    cfg = job.recover
    save_dtype = job.dtype or input_dtype(job.model)
    loaded = _load(job)
    if job.save_format == "safetensors":  # before the work: the save needs about the weights at the save dtype
        _check_save_space(loaded.model, save_dtype, out)
    windows, samples_info, eval_sets = _training_data(job, loaded, ckpt, device)
    params = count_parameters(loaded.model)
    result = recover(loaded.model, windows, cfg, teacher=loaded.teacher, masks=loaded.keeper, eval_sets=eval_sets,
                     checkpoint_dir=ckpt, device=device, on_step=_eta_printer(cfg.train.steps))
    report = _job_report(job, loaded, result, samples_info, params, threads)
    _save(job, out, loaded, result, report, save_dtype)
    shutil.rmtree(ckpt, ignore_errors=True)
    return report


def _check_save_space(model: Any, save_dtype: str, out: Path) -> None:
    """Refuse before training when ``out``'s file system cannot hold the model at ``save_dtype``."""
    from leanml.faults import check_space
    from leanml.models import parse_dtype
    from leanml.models.save import saved_bytes

    need = saved_bytes(model, parse_dtype(save_dtype))
    check_space(out.parent, need, "the recovered model", "free space there or choose another output folder")


def _load(job: RecoverJob) -> _Loaded:
    """The pruned model (float32: training keeps float32 weights and optimizer state), its mask checked
    against what its report declares, and the teacher (``source``: the model it was pruned from)."""
    from leanml.models import load_model
    from leanml.recover.masks import MaskKeeper
    from leanml.recover.source import check_masks, check_teacher, declaration, read_report

    model, tokenizer = load_model(job.model)
    report_in = read_report(job.model)
    decl = declaration(report_in, job.pattern, flag_of(RecoverJob, "pattern"))
    loaded = _Loaded(model, tokenizer, report_in, decl, {"source": None, **decl.to_json()})
    if job.recover.keep_masks:
        loaded.keeper = MaskKeeper.from_zeros(model)
        loaded.mask_info = check_masks(loaded.keeper, decl, job.model)
    check_seqlen(model, job.seqlen, job)
    if job.eval_names:
        check_seqlen(model, job.eval_seqlen, job, "eval_seqlen")
    teacher_spec = job.teacher
    if teacher_spec == "source":
        if not decl.source_model:
            raise LeanmlError(f"teacher source: {job.model} has no report.json naming the model it was pruned "
                              f"from; pass the dense model itself as teacher", fields=("teacher",))
        teacher_spec = decl.source_model
    if teacher_spec is not None:
        teacher, teacher_tok = load_model(teacher_spec)
        check_teacher(model, tokenizer, teacher, teacher_tok, where=f"teacher {teacher_spec}")
        loaded.teacher, loaded.teacher_spec = teacher, teacher_spec
    return loaded


def _training_data(job: RecoverJob, loaded: _Loaded, ckpt: Path,
                   device: Any) -> tuple[Any, dict[str, Any] | None, dict[str, Any]]:
    """The training windows (with the teacher's samples mixed in), what the samples were, and the
    evaluation windows of each corpus."""
    from leanml.data.text import load_text, token_windows
    from leanml.recover.teacher import TeacherSampling, mix_teacher_samples

    tokenizer = loaded.tokenizer
    windows = token_windows(tokenizer, load_text(job.data, "train"), job.seqlen)
    samples_info = None
    if job.teacher_samples > 0:
        assert loaded.teacher is not None and loaded.teacher_spec is not None
        sampling = TeacherSampling(job.teacher_samples, ckpt, cache_dir=job.teacher_samples_cache)
        windows, samples_info = mix_teacher_samples(windows, loaded.teacher, loaded.teacher_spec, tokenizer,
                                                    job.recover, sampling, device)
    eval_sets = {}
    for name in job.eval_names:
        w = token_windows(tokenizer, load_text(name, "test"), job.eval_seqlen)
        eval_sets[name] = w[: job.eval_windows] if job.eval_windows else w
    return windows, samples_info, eval_sets


def _eta_printer(steps: int) -> Callable[[int, dict[str, Any]], None]:
    """An ``on_step`` that prints one plain line with the estimated time of the rest after the first step."""
    from leanml.progress import announce_eta

    first: dict[str, Any] = {}

    def say_eta(done: int, entry: dict[str, Any]) -> None:
        if not first:
            first["done"] = done
            line = announce_eta("recover", 1, steps - done + 1, entry["step_s"], "step")
            if line:
                print(line, file=sys.stderr, flush=True)

    return say_eta


def _job_report(job: RecoverJob, loaded: _Loaded, result: dict[str, Any], samples_info: dict[str, Any] | None,
                params: int, threads: int) -> dict[str, Any]:
    """``report.json`` of the run, but for where it was saved: the job, the mask, the models, the data and
    :func:`~leanml.recover.recover`'s report."""
    from leanml.machine import machine_info

    decl, kept, report_in = loaded.decl, job.recover.keep_masks, loaded.report_in
    pattern = loaded.mask_info.get("pattern") or ("structured" if decl.structured else "unstructured")
    return {
        "command": "recover",
        "config": asdict(job),
        "method": decl.method,
        "mask": {"pattern": pattern if kept else "dense", "sparsity": result["sparsity"]["out"],
                 "structured": decl.structured, "kept": kept},
        "mask_check": loaded.mask_info,
        "model": {"source": decl.source_model or job.model, "recovered_from": job.model, "params": params},
        "teacher_model": loaded.teacher_spec,
        "data": {"corpus": job.data, "split": "train", **result["data"],
                 "note": "shakespeare train = every play except Hamlet (the test split)"
                 if job.data == "shakespeare" else "", "teacher_samples": samples_info},
        "eval": {"corpora": job.eval_names, "split": "test", "seqlen": job.eval_seqlen},
        "input_report": {k: report_in.get(k) for k in ("method", "mask", "measured_sparsity", "finalize")}
        if report_in else None,
        **{k: v for k, v in result.items() if k not in ("data", "config")},
        "recover_config": result["config"],
        "threads": threads,
        "machine": machine_info(),
    }


def _save(job: RecoverJob, out: Path, loaded: _Loaded, result: dict[str, Any], report: dict[str, Any],
          save_dtype: str) -> None:
    """Cast to the saved dtype keeping every zero, then the one save path of pruned models, with
    ``losses.csv`` beside the report."""
    from leanml.models import parse_dtype
    from leanml.models.saving import SaveSpec, save_pruned
    from leanml.recover.masks import cast_keeping_zeros

    model = loaded.model
    dtype = parse_dtype(save_dtype)
    if dtype != next(model.parameters()).dtype:
        underflow = cast_keeping_zeros(model, dtype)
        report["save_cast"] = {"dtype": save_dtype, "kept_weights_raised_from_underflow": underflow}
    pattern = loaded.mask_info.get("pattern") if job.recover.keep_masks else None
    spec = SaveSpec(job.save_format, pattern, save_dtype, job.overwrite, what="the recovered model")
    save_pruned(model, loaded.tokenizer, out, report, spec,
                write_more=lambda tmp: write_losses(tmp / "losses.csv", result["losses"]))


def write_losses(path: Path, log: dict[str, list]) -> None:
    """The per-step log as CSV: step (1-based), then one column per logged quantity."""
    keys = list(log)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", *keys])
        for i, row in enumerate(zip(*(log[k] for k in keys))):
            w.writerow([i + 1, *("" if v is None else f"{v:.6g}" for v in row)])
