"""A trained CTR run on disk: ``model.safetensors``, ``fields.npz`` and ``report.json``, written and read back."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from leanml.ctr.content import ItemFeatures
from leanml.ctr.data import CTRData
from leanml.ctr.fields import FieldBuilder
from leanml.ctr.models import CTRModel, ResidualID
from leanml.ctr.options import CTRConfig
from leanml.ctr.train import build_ctr_model
from leanml.errors import LeanmlError
from leanml.faults import check_space
from leanml.finite import check_finite_tensors
from leanml.outputs import atomic_dir, write_json


def save_ctr_run(out: str | Path, model: CTRModel | ResidualID, builder: FieldBuilder, report: dict[str, Any],
                 overwrite: bool = False, *, out_flag: str | None = None) -> Path:
    """Write ``model.safetensors``, ``fields.npz`` (per-item field ids and content vectors) and
    ``report.json`` atomically. ``out_flag``: the option that set ``out``, named when the disk is too full
    (default: "output folder")."""
    from safetensors.torch import save_file

    state = builder.state()
    check_finite_tensors(model.state_dict().items(), "the CTR model")
    arrays = {f"sparse__{k}": v for k, v in state["item_sparse"].items()}
    arrays.update({f"dense__{k}": v for k, v in builder.dense.items()})
    # before the save: the weights and the field arrays, about their bytes in memory
    need = (sum(t.numel() * t.element_size() for t in model.state_dict().values())
            + sum(np.asarray(a).nbytes for a in (state["user_index"], *arrays.values())))
    check_space(Path(out).expanduser().absolute().parent, need, "the CTR run",
                f"free space there or choose another {out_flag or 'output folder'}")
    with atomic_dir(out, overwrite=overwrite) as tmp:
        save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()},
                  str(tmp / "model.safetensors"))
        np.savez(tmp / "fields.npz", user_index=state["user_index"], **arrays)
        write_json(tmp / "report.json", {**report, "fields": state["specs"]})
    return Path(out)


def load_ctr_run(path: str | Path, data: CTRData, report: dict[str, Any] | None = None
                 ) -> tuple[CTRModel | ResidualID, FieldBuilder, dict[str, Any]]:
    """Load a run written by :func:`save_ctr_run` for evaluation on ``data`` (same dataset and seed).
    ``report``: the run's report as :func:`read_run_report` returned it, passed by a caller that has also
    checked that the folder holds ``model.safetensors`` and ``fields.npz``; the report is then not read, nor
    the files checked, again."""
    from safetensors.torch import load_file

    path = Path(path)
    if report is None:
        if not (path / "report.json").exists() or not (path / "model.safetensors").exists() \
                or not (path / "fields.npz").exists():
            raise LeanmlError(f"{path} is not a CTR run folder; create one with `leanml ctr train`")
        report = read_run_report(path)
    cfg = run_config(report, path)
    try:
        npz = np.load(path / "fields.npz")
        item_sparse = {k[len("sparse__"):]: npz[k] for k in npz.files if k.startswith("sparse__")}
        npz["user_index"]
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError) as exc:
        raise LeanmlError(f"{path / 'fields.npz'} is damaged ({exc}); train the run again") from None
    if any(len(v) != data.n_items for v in item_sparse.values()) or len(npz["user_index"]) != data.n_users:
        raise LeanmlError(f"run {path} was trained on other items or users than this data; evaluate with the "
                          "dataset and seed it was trained on")
    dense = {k[len("dense__"):]: npz[k] for k in npz.files if k.startswith("dense__")}
    items = ItemFeatures(np.zeros((data.n_items, 0), np.int64), dense.get("raw"), 0, 0, decoded=dense.get("codeword"))
    state = {"user_index": npz["user_index"], "item_sparse": item_sparse, "specs": report["fields"]}
    builder = FieldBuilder(None, items, cfg, state=state)
    model = build_ctr_model(cfg, builder)
    try:
        model.load_state_dict(load_file(str(path / "model.safetensors")))
    except Exception as exc:  # safetensors' own error types, a truncated file, shapes that do not match
        raise LeanmlError(f"{path / 'model.safetensors'} cannot be loaded ({str(exc).splitlines()[0]}); "
                          "train the run again") from None
    return model.eval(), builder, report


def read_run_report(path: str | Path) -> dict[str, Any]:
    """``report.json`` of a run folder, checked: valid JSON with the keys evaluation needs."""
    path = Path(path)
    file = path / "report.json"
    if not file.is_file():
        raise LeanmlError(f"{path} has no report.json; pass a run folder written by `leanml ctr train`")
    try:
        report = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LeanmlError(f"{file} is not valid JSON ({exc}); the run folder is damaged: train it again") from None
    if not isinstance(report, dict) or not isinstance(report.get("config"), dict) or "fields" not in report:
        raise LeanmlError(f"{file} lacks the run's config or fields; the run folder is damaged: train it again")
    return report


def run_config(report: dict[str, Any], path: str | Path) -> CTRConfig:
    """The :class:`CTRConfig` a run report records (a damaged one is a one-line error)."""
    try:
        return CTRConfig(**report["config"])
    except (TypeError, AttributeError) as exc:
        raise LeanmlError(f"{Path(path) / 'report.json'} has a config this version cannot read ({exc}); "
                          "train the run again") from None
