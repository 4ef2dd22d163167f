"""Raw ad logs for FeatureBox: MovieLens-100k written out as logs, and a seeded generator at any scale.

Both produce the same layout in a directory::

    impressions*.tsv[.gz]   ts, user_id, item_id, click, hist  (tab-separated, no header;
                            hist = the user's earlier item ids, "|"-joined, oldest first)
    users.jsonl             user_id, age, gender, occupation, zip_code
    items.jsonl             item_id, title, year, genres ("|"-joined genre names)

MovieLens ratings are impressions and a rating >= 4 is a click. The generator draws users, items and
history items from Zipf-like (power-law) distributions, history lengths from a long-tailed lognormal,
and clicks from a logistic model of user and item effects, so a model has something to learn.
"""

from __future__ import annotations

import gzip as gzip_mod
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np
import pandas as pd

from leanml.data.offline import widedeep_data_dir
from leanml.errors import LeanmlError
from leanml.features.read.logschema import Schema
from leanml.outputs import atomic_dir, atomic_file, cache_dir
from leanml.progress import EtaBar

LOG_SCHEMA = Schema((("ts", "int"), ("user_id", "int"), ("item_id", "int"), ("click", "int"), ("hist", "str")))
GENRES = ["unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Documentary", "Drama",
          "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller", "War", "Western"]
OCCUPATIONS = ["administrator", "artist", "doctor", "educator", "engineer", "entertainment", "executive",
               "healthcare", "homemaker", "lawyer", "librarian", "marketing", "none", "other", "programmer",
               "retired", "salesman", "scientist", "student", "technician", "writer"]
HIST_MAX = 50


def _open_text(path: Path, gz: bool) -> IO[str]:
    return gzip_mod.open(path, "wt", encoding="utf-8") if gz else open(path, "w", encoding="utf-8")  # noqa: SIM115


def _write_jsonl(path: Path, records: list[dict]) -> None:
    with atomic_file(path) as tmp, open(tmp, "w", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(r) + "\n")


def _log_lines(ts: np.ndarray, users: np.ndarray, items: np.ndarray, clicks: np.ndarray, hist: list[str]) -> str:
    return "".join(f"{a}\t{b}\t{c}\t{d}\t{e}\n" for a, b, c, d, e in
                   zip(ts.tolist(), users.tolist(), items.tolist(), clicks.tolist(), hist))


# ------------------------------------------------------------------------------------------- MovieLens
def movielens_logs(out_dir: str | Path | None = None, test_fraction: float = 0.1, gz: bool = False,
                   overwrite: bool = False) -> Path:
    """Write MovieLens-100k as raw logs (train/test split by time) plus user/item tables; returns the dir.

    Files: ``impressions_train.tsv``, ``impressions_test.tsv``, ``users.jsonl``, ``items.jsonl``.
    """
    out = Path(out_dir) if out_dir is not None else cache_dir() / "features" / "movielens"
    suffix = ".tsv.gz" if gz else ".tsv"
    done = out / f"impressions_test{suffix}"
    if done.exists() and not overwrite:
        return out
    out.mkdir(parents=True, exist_ok=True)
    src = widedeep_data_dir()
    ratings = pd.read_parquet(src / "MovieLens100k_data.parquet.brotli")
    items = pd.read_parquet(src / "MovieLens100k_items.parquet.brotli")
    users = pd.read_parquet(src / "MovieLens100k_users.parquet.brotli")
    ratings = ratings.sort_values(["timestamp", "user_id", "movie_id"], kind="stable").reset_index(drop=True)
    hist: list[str] = []
    seen: dict[int, list[int]] = {}
    for u, m in zip(ratings["user_id"].tolist(), ratings["movie_id"].tolist()):
        h = seen.setdefault(u, [])
        hist.append("|".join(map(str, h[-HIST_MAX:])))
        h.append(m)
    clicks = (ratings["rating"].to_numpy() >= 4).astype(np.int64)
    n_test = int(len(ratings) * test_fraction)
    cut = len(ratings) - n_test
    cols = (ratings["timestamp"].to_numpy(), ratings["user_id"].to_numpy(), ratings["movie_id"].to_numpy(), clicks)
    for name, sl in (("train", slice(0, cut)), ("test", slice(cut, None))):
        with atomic_file(out / f"impressions_{name}{suffix}") as tmp, _open_text(tmp, gz) as fh:
            fh.write(_log_lines(*(c[sl] for c in cols), hist[sl]))
    _write_jsonl(out / "users.jsonl", [
        {"user_id": int(r.user_id), "age": int(r.age), "gender": r.gender, "occupation": r.occupation,
         "zip_code": str(r.zip_code)} for r in users.itertuples()])
    flags = items[GENRES].to_numpy()
    recs = []
    for k, (mid, title, date) in enumerate(zip(items["movie_id"], items["movie_title"], items["release_date"])):
        m = re.search(r"(\d{4})$", str(date or ""))
        recs.append({"item_id": int(mid), "title": str(title), "year": int(m.group(1)) if m else 0,
                     "genres": "|".join(g for g, f in zip(GENRES, flags[k]) if f)})
    _write_jsonl(out / "items.jsonl", recs)
    return out


# ------------------------------------------------------------------------------------------- generator
def _powerlaw_sampler(rng: np.random.Generator, n: int, a: float) -> np.ndarray:
    """Cumulative probabilities of ranks 1..n with p(rank) ~ rank**-a, mapped to shuffled ids."""
    w = np.arange(1, n + 1, dtype=np.float64) ** (-a)
    return np.cumsum(w / w.sum())


def _draw(rng: np.random.Generator, cdf: np.ndarray, perm: np.ndarray, size: int) -> np.ndarray:
    ranks = np.minimum(np.searchsorted(cdf, rng.random(size)), len(cdf) - 1)
    return perm[ranks]


@dataclass(frozen=True)
class LogSpec:
    """What :func:`generate_logs` writes: ``rows`` impressions from generator ``seed``, ``n_users`` users
    and ``n_items`` items (default: from ``rows``), IDs drawn with ``p(rank) ~ rank**-zipf_a``, in
    ``files`` files (gzipped with ``gz``); ``unknown_item_rate`` of impressions name items absent from
    ``items.jsonl`` and ``malformed_rate`` of lines are corrupted; ``chunk_rows`` rows are drawn at a time."""

    rows: int
    seed: int = 0
    n_users: int | None = None
    n_items: int | None = None
    zipf_a: float = 1.1
    files: int = 1
    gz: bool = False
    unknown_item_rate: float = 0.002
    malformed_rate: float = 0.0
    chunk_rows: int = 500_000


def generate_logs(out_dir: str | Path, spec: LogSpec, *, progress: bool = True, overwrite: bool = False) -> Path:
    """Write a synthetic log of ``spec.rows`` impressions (same schema as the MovieLens logs, see
    :class:`LogSpec`); returns the dir.

    IDs are drawn with ``p(rank) ~ rank**-zipf_a``; history lengths are lognormal (median ~4, long tail,
    capped at 50); ``unknown_item_rate`` of impressions name items absent from ``items.jsonl`` (the
    graph's filter drops them); ``malformed_rate`` of lines are corrupted (for quarantine tests).

    The files are written into a temporary folder beside ``out_dir`` that is renamed to ``out_dir`` at
    the end, so a set of files under ``out_dir`` is always complete. An existing ``out_dir`` that is not
    empty is refused unless ``overwrite`` (then it is replaced as a whole, older files included).
    """
    if spec.rows < 1 or spec.files < 1:
        raise LeanmlError("rows and files must be >= 1")
    out = check_generate_target(out_dir, overwrite)
    with atomic_dir(out, overwrite=True) as tmp:
        _generate_into(tmp, spec, progress)
    return out


def check_generate_target(out_dir: str | Path, overwrite: bool) -> Path:
    """Refuse to write generated logs over a file, or over a folder with files in it unless ``overwrite``."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise LeanmlError(f"out {out} is a file; give a folder for the generated logs", fields=("out",))
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise LeanmlError(f"out {out} already has files; choose an empty or new folder, or pass overwrite "
                          "to replace it as a whole", fields=("out", "overwrite"))
    return out


def _generate_into(out: Path, spec: LogSpec, progress: bool) -> None:
    rows, zipf_a, files, gz, chunk_rows = spec.rows, spec.zipf_a, spec.files, spec.gz, spec.chunk_rows
    unknown_item_rate, malformed_rate = spec.unknown_item_rate, spec.malformed_rate
    rng = np.random.default_rng(spec.seed)
    n_users = spec.n_users or max(1000, rows // 40)
    n_items = spec.n_items or max(500, rows // 200)
    user_cdf, item_cdf = _powerlaw_sampler(rng, n_users, zipf_a), _powerlaw_sampler(rng, n_items, zipf_a)
    user_perm = rng.permutation(n_users) + 1
    item_perm = rng.permutation(n_items) + 1
    user_bias = rng.normal(0, 0.8, n_users + 2)
    item_bias = rng.normal(0, 0.8, n_items + 2)
    # tables
    words = [f"w{i}" for i in range(5000)]
    word_cdf = _powerlaw_sampler(rng, len(words), 1.0)
    word_perm = np.arange(len(words))
    _write_jsonl(out / "users.jsonl", [
        {"user_id": u, "age": int(rng.integers(16, 75)), "gender": "MF"[int(rng.integers(0, 2))],
         "occupation": OCCUPATIONS[int(rng.integers(0, len(OCCUPATIONS)))],
         "zip_code": f"{int(rng.integers(0, 100000)):05d}"} for u in range(1, n_users + 1)])
    item_recs = []
    for i in range(1, n_items + 1):
        nw = int(rng.integers(1, 6))
        year = int(rng.integers(1930, 2000))
        title = " ".join(words[j] for j in _draw(rng, word_cdf, word_perm, nw)) + f" ({year})"
        g = rng.choice(len(GENRES), size=int(rng.integers(1, 4)), replace=False)
        item_recs.append({"item_id": i, "title": title, "year": year, "genres": "|".join(GENRES[k] for k in sorted(g))})
    _write_jsonl(out / "items.jsonl", item_recs)
    # impressions
    suffix = ".tsv.gz" if gz else ".tsv"
    per_file = -(-rows // files)
    ts0 = 1_600_000_000
    written = 0
    bar = EtaBar(total=rows, desc="generate logs", unit="row", disable=not progress)
    for f in range(files):
        path = out / f"impressions_{f:03d}{suffix}"
        with atomic_file(path) as tmp, _open_text(tmp, gz) as fh:
            left = min(per_file, rows - written)
            while left > 0:
                n = min(chunk_rows, left)
                users = _draw(rng, user_cdf, user_perm, n)
                items = _draw(rng, item_cdf, item_perm, n)
                unknown = rng.random(n) < unknown_item_rate
                items = np.where(unknown, n_items + 1 + rng.integers(0, 1000, n), items)
                logit = -0.8 + user_bias[users] + item_bias[np.minimum(items, n_items + 1)]
                clicks = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.int64)
                ts = ts0 + written + np.arange(n)
                lengths = np.minimum(np.exp(rng.normal(1.4, 1.1, n)).astype(np.int64), HIST_MAX)
                flat = _draw(rng, item_cdf, item_perm, int(lengths.sum())).tolist()
                offs = np.concatenate([[0], np.cumsum(lengths)]).tolist()
                hist = ["|".join(map(str, flat[offs[k]:offs[k + 1]])) for k in range(n)]
                text = _log_lines(ts, users, items, clicks, hist)
                if malformed_rate > 0:
                    text = _corrupt(text, malformed_rate, rng)
                fh.write(text)
                written += n
                left -= n
                bar.update(n)
    bar.close()


def _corrupt(text: str, rate: float, rng: np.random.Generator) -> str:
    lines = text.split("\n")[:-1]
    bad = np.flatnonzero(rng.random(len(lines)) < rate)
    for k, i in enumerate(bad.tolist()):
        f = lines[i].split("\t")
        kind = k % 3
        if kind == 0:
            lines[i] = "\t".join(f[:3])  # truncated row
        elif kind == 1:
            lines[i] = "\t".join([f[0], "user" + f[1], *f[2:]])  # non-integer user id
        else:
            lines[i] = "\t".join([f[0], f[1], f[2], "yes", f[4]])  # non-integer click
    return "\n".join(lines) + "\n"
