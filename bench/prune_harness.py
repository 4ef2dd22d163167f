"""Record logic of the pruning benchmark (``bench/prune.py``): settings, keys, merging, measured
sparsity per module kind, flags, seed statistics, ratios, the targets of issue 12, and the
generated Markdown. Pure functions of records and files; nothing here runs a model.

A record is one (method, pattern, profile, seed, corpus): a perplexity on the whole test split of
``corpus`` plus what was measured about the pruned model (sparsity per module kind read from the
saved weights, prune seconds and CPU-seconds, machine and load). Dense rows have ``seed`` None.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _common

#: pattern name -> (requested sparsity, N:M or None)
PATTERNS: dict[str, tuple[float, tuple[int, int] | None]] = {
    "50%": (0.5, None),
    "60%": (0.6, None),
    "70%": (0.7, None),
    "2:4": (0.5, (2, 4)),
    "4:8": (0.5, (4, 8)),
}
#: llm-compressor rows: our row name -> the runner's --method
PEERS = {"llmc-sparsegpt": "sparsegpt", "llmc-wanda": "wanda"}
OURS = ["magnitude", "wanda", "sparsegpt", "fista"]
SPARSEGPTS = ("sparsegpt", "llmc-sparsegpt")
PROFILES = ("uniform", "owl")
CORPUS_NAMES = {"shakespeare": "Hamlet", "reviews": "reviews"}
#: module kinds our engine never prunes: sparser than in the dense model by more than this -> flagged
UNTOUCHED_KINDS = ("embeddings", "lm_head")
FLAG_TOLERANCE = 0.02
KEY_FIELDS = ("method", "pattern", "profile", "seed", "corpus")
KIND_ORDER = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head", "embeddings"]


def parse_pattern(name: str) -> tuple[float, tuple[int, int] | None]:
    """``"50%"`` -> ``(0.5, None)``; ``"2:4"`` -> ``(0.5, (2, 4))``. Raises ``ValueError`` otherwise."""
    if name in PATTERNS:
        return PATTERNS[name]
    m = re.fullmatch(r"(\d+(?:\.\d+)?)%", name)
    if m and 0 < float(m.group(1)) < 100:
        return float(m.group(1)) / 100, None
    m = re.fullmatch(r"(\d+):(\d+)", name)
    if m and 0 < int(m.group(1)) < int(m.group(2)):
        n, mm = int(m.group(1)), int(m.group(2))
        return 1 - n / mm, (n, mm)
    raise ValueError(f"pattern {name!r} is neither a percentage (50%) nor N:M (2:4)")


def pattern_order(name: str) -> tuple[int, float]:
    if name == "dense":
        return (0, 0.0)
    sparsity, nm = parse_pattern(name)
    return (2, nm[1]) if nm else (1, sparsity)


# ---------------------------------------------------------------- keys and merging


def record_key(r: dict[str, Any]) -> tuple:
    """(method, pattern, profile, seed, corpus): one record per key in ``prune.json``."""
    return tuple(r.get(f) for f in KEY_FIELDS)


def is_current(r: dict[str, Any]) -> bool:
    """A record of this benchmark's protocol (older records have no corpus / profile / seed fields)."""
    return all(f in r for f in KEY_FIELDS)


def merge_records(new: Iterable[dict[str, Any]], old: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """``old`` with every record of ``new`` replacing the one of the same key; records of an older
    protocol (without the key fields) are dropped. Order: old order, new keys appended in order."""
    new = list(new)
    for r in new:
        if not is_current(r):
            raise ValueError(f"record lacks one of {KEY_FIELDS}: {sorted(r)}")
    return _common.merge_records([r for r in old if is_current(r)], new, record_key, keep_place=True)


def load_records(path: Path) -> list[dict[str, Any]]:
    return _common.load_json(path, [])


# ---------------------------------------------------------------- measured sparsity


def module_kind(name: str) -> str | None:
    """The kind of a weight from its qualified name: ``"embeddings"`` for embedding tables,
    ``"lm_head"``, else the linear's own name (``q_proj``, ``down_proj``, ...). ``None`` for what is
    not a ``.weight``."""
    if not name.endswith(".weight"):
        return None
    parts = name[: -len(".weight")].split(".")
    if "lm_head" in parts:
        return "lm_head"
    if any("embed" in p for p in parts):
        return "embeddings"
    return parts[-1]


def sparsity_by_kind(model_dir: str | Path) -> dict[str, Any]:
    """Fraction of exact zeros per module kind, read from the ``*.safetensors`` files of a saved model.

    Only 2-D weights count (norm scales and biases are never pruned). Returns
    ``{"by_kind": {kind: fraction}, "decoder_linears": fraction over every 2-D weight that is
    neither an embedding nor the head, "tied_head": bool}``; with a tied head (no ``lm_head``
    tensor in the files) ``by_kind["lm_head"]`` is the embedding table's value.
    """
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {model_dir}")
    zeros: dict[str, int] = defaultdict(int)
    total: dict[str, int] = defaultdict(int)
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                kind = module_kind(name)
                if kind is None:
                    continue
                t = f.get_tensor(name)
                if t.dim() != 2:
                    continue
                zeros[kind] += int((t == 0).sum())
                total[kind] += t.numel()
    by_kind = {k: zeros[k] / total[k] for k in total}
    tied = "lm_head" not in by_kind and "embeddings" in by_kind
    if tied:
        by_kind["lm_head"] = by_kind["embeddings"]
    lin = [k for k in total if k not in UNTOUCHED_KINDS]
    n = sum(total[k] for k in lin)
    return {"by_kind": by_kind, "decoder_linears": sum(zeros[k] for k in lin) / n if n else 0.0, "tied_head": tied}


def untouched_flags(by_kind: dict[str, float], dense_by_kind: dict[str, float],
                    tol: float = FLAG_TOLERANCE) -> list[str]:
    """Kinds our engine never prunes (embeddings, head) that are sparser than in the dense model by more
    than ``tol``: a model pruned there is not comparable with ours, and the benchmark says so."""
    flags = []
    for kind in UNTOUCHED_KINDS:
        if kind in by_kind and by_kind[kind] > dense_by_kind.get(kind, 0.0) + tol:
            flags.append(f"{kind} pruned ({100 * by_kind[kind]:.1f} % zeros, "
                         f"dense {100 * dense_by_kind.get(kind, 0.0):.1f} %)")
    return flags


# ---------------------------------------------------------------- statistics, ratios, targets


@dataclass
class Stats:
    mean: float
    std: float
    n: int
    seeds: list[Any]

    def text(self, digits: int = 2) -> str:
        s = f"{self.mean:.{digits}f}"
        return s + (f" ± {self.std:.{digits}f} (n={self.n})" if self.n > 1 else "")


def usable(r: dict[str, Any]) -> bool:
    """A record whose numbers may be compared: it ran and nothing outside the pruned linears was pruned."""
    return not r.get("error") and not r.get("flags") and r.get("ppl") is not None


def stats(records: Iterable[dict[str, Any]], field: str = "ppl", **where: Any) -> Stats | None:
    """Mean ± sample std of ``field`` over usable records matching ``where`` (one per seed)."""
    rows = [r for r in records if usable(r) and all(r.get(k) == v for k, v in where.items())]
    vals = [float(r[field]) for r in rows if r.get(field) is not None]
    if not vals:
        return None
    return Stats(statistics.fmean(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0, len(vals),
                 [r.get("seed") for r in rows])


def timing_records(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per run (the timing is shared by the corpora of a run): the first corpus seen."""
    seen: dict[tuple, dict[str, Any]] = {}
    for r in records:
        seen.setdefault(record_key(r)[:4], r)
    return list(seen.values())


def best_sparsegpt(records: list[dict[str, Any]], pattern: str, corpus: str) -> tuple[str, Stats] | None:
    """The better of our SparseGPT and llm-compressor's (seed-mean perplexity, uniform profile)."""
    cands = [(m, s) for m in SPARSEGPTS
             if (s := stats(records, method=m, pattern=pattern, profile="uniform", corpus=corpus))]
    return min(cands, key=lambda c: c[1].mean) if cands else None


def paired_stats(runs: list[dict[str, Any]], field: str, a: str, b: str,
                 **where: Any) -> tuple[Stats | None, Stats | None, str]:
    """``field`` of methods ``a`` and ``b`` over the calibration seeds both have usable runs of (a ratio
    of the two means then compares the same calibration sets), and what is missing when there is no
    common seed (``(None, None, "needs ...")``)."""
    rows = {m: {r.get("seed"): r for r in runs if usable(r) and r["method"] == m
                and all(r.get(k) == v for k, v in where.items())} for m in (a, b)}
    common = set(rows[a]) & set(rows[b])
    if not common:
        lacking = [m for m in (a, b) if not rows[m]] or [a, b]
        return None, None, ("needs " + " and ".join(lacking)
                            + (" on a common calibration seed" if len(lacking) == 2 and rows[a] else ""))
    pick = {m: [r for seed, r in rows[m].items() if seed in common] for m in (a, b)}
    return stats(pick[a], field), stats(pick[b], field), ""


def _target(name: str, corpus: str | None, value: float | None, limit: str, ok: bool | None,
            detail: str) -> dict[str, Any]:
    status = "pending" if ok is None else ("met" if ok else "missed")
    return {"target": name, "corpus": corpus or "-", "value": value, "limit": limit, "status": status, "detail": detail}


def targets(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The targets of issue 12 computed from the records: met / missed / pending, with the numbers."""
    out: list[dict[str, Any]] = []
    corpora = sorted({r["corpus"] for r in records if r.get("corpus")}, key=lambda c: (c != "shakespeare", c))
    for pattern, limits in (("50%", {"shakespeare": 0.88, "reviews": 0.95}), ("2:4", {})):
        for corpus in corpora:
            limit = limits.get(corpus, 0.90 if pattern == "2:4" else None)
            if limit is None:
                continue
            name = f"FISTA {pattern} <= {limit:.2f} x better SparseGPT"
            fista = stats(records, method="fista", pattern=pattern, profile="uniform", corpus=corpus)
            best = best_sparsegpt(records, pattern, corpus)
            if not fista or not best:
                out.append(_target(name, corpus, None, f"{limit:.2f}", None,
                                   "needs " + " and ".join(w for w, s in (("fista", fista), ("a SparseGPT", best))
                                                           if not s)))
                continue
            ratio = fista.mean / best[1].mean
            out.append(_target(name, corpus, ratio, f"{limit:.2f}", ratio <= limit,
                               f"fista {fista.text()} / {best[0]} {best[1].text()}"))
    for corpus in corpora:
        name = "70% owl: best of ours <= 0.75 x llmc-sparsegpt uniform"
        peer = stats(records, method="llmc-sparsegpt", pattern="70%", profile="uniform", corpus=corpus)
        ours = [(m, s) for m in OURS if (s := stats(records, method=m, pattern="70%", profile="owl", corpus=corpus))]
        if not peer or not ours:
            out.append(_target(name, corpus, None, "0.75", None,
                               "needs " + " and ".join(w for w, s in (("llmc-sparsegpt 70%", peer),
                                                                       ("our owl rows", ours)) if not s)))
            continue
        m, s = min(ours, key=lambda c: c[1].mean)
        ratio = s.mean / peer.mean
        out.append(_target(name, corpus, ratio, "0.75", ratio <= 0.75,
                           f"{m} owl {s.text()} / llmc-sparsegpt {peer.text()}"))
    runs = timing_records(records)
    for a, b, limit in (("fista", "sparsegpt", 2.0), ("sparsegpt", "llmc-sparsegpt", 1.0)):
        for field, what in (("seconds", "wall s"), ("cpu_seconds", "CPU-s")):
            name = f"{a} prune {what} <= {limit:g} x {b} (50%)"
            sa, sb, missing = paired_stats(runs, field, a, b, pattern="50%", profile="uniform")
            if not sa or not sb:
                out.append(_target(name, None, None, f"{limit:g}", None, missing))
                continue
            ratio = sa.mean / sb.mean
            out.append(_target(name, None, ratio, f"{limit:g}", ratio <= limit,
                               f"{a} {sa.text(0)} / {b} {sb.text(0)} (seeds {', '.join(map(str, sa.seeds))})"))
    for corpus in corpora:
        name = "our SparseGPT within ±3 % of llmc-sparsegpt (same windows)"
        ours = {r["seed"]: r for r in records if usable(r) and r["method"] == "sparsegpt" and r["pattern"] == "50%"
                and r["profile"] == "uniform" and r["corpus"] == corpus}
        peer = {r["seed"]: r for r in records if usable(r) and r["method"] == "llmc-sparsegpt" and r["pattern"] == "50%"
                and r["profile"] == "uniform" and r["corpus"] == corpus}
        seeds = sorted(set(ours) & set(peer), key=str)
        same = [s for s in seeds if ours[s].get("calib_sha256") == peer[s].get("calib_sha256")]
        if not same:
            out.append(_target(name, corpus, None, "±3 %", None,
                               "needs sparsegpt and llmc-sparsegpt 50% on the same calibration seed"))
            continue
        diffs = [ours[s]["ppl"] / peer[s]["ppl"] - 1 for s in same]
        mean = statistics.fmean(diffs)
        per = ", ".join(f"seed {s}: {ours[s]['ppl']:.2f} vs {peer[s]['ppl']:.2f}" for s in same)
        out.append(_target(name, corpus, mean, "±3 %", abs(mean) <= 0.03, f"{100 * mean:+.2f} % ({per})"))
    return out


# ---------------------------------------------------------------- Markdown


def _fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _distinct(values: Iterable[Any]) -> list[Any]:
    return list(dict.fromkeys(json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else v for v in values))


def settings_text(r: dict[str, Any]) -> str:
    """The settings a run used, from its record: the peer's modifier arguments, or our method options
    and engine settings (sparsity and N:M, given by the pattern column, left out)."""
    if peer := r.get("peer"):
        args = {k: v for k, v in (peer.get("settings") or {}).items() if k not in ("sparsity", "mask_structure")}
        return (f"{peer.get('modifier')}({', '.join(f'{k}={v!r}' for k, v in args.items())}), oneshot batch 1, "
                f"llmcompressor {(peer.get('versions') or {}).get('llmcompressor')}")
    if r.get("error") and not r.get("method_config") and not r.get("engine"):
        return "- (the run failed before pruning)"
    engine = r.get("engine") or {}
    config = r.get("method_config") or {}
    parts = [r.get("settings") or "engine API",
             ", ".join(f"{k}={v}" for k, v in config.items()) or "no method options",
             f"mask scope {r.get('mask_scope')}", f"intra-layer {engine.get('intra_layer')}",
             "sequential" if engine.get("sequential", True) else "dense inputs",
             f"batch {engine.get('batch_size')}"]
    if r.get("profile") == "owl" and engine.get("owl"):
        parts.append(f"owl M={engine['owl'].get('m')} lambda={engine['owl'].get('lam')}")
    return "; ".join(str(x) for x in parts)


def render_markdown(records: list[dict[str, Any]]) -> str:
    """The whole ``prune.md``, headers included, from the records alone."""
    records = [r for r in records if is_current(r)]
    if not records:
        return "# Pruning benchmark\n\nNo records yet: run `python bench/prune.py --help`.\n"
    corpora = sorted({r["corpus"] for r in records}, key=lambda c: (c != "shakespeare", c))
    lines = ["# Pruning benchmark: leanml and llm-compressor side by side", ""]
    machines = _distinct(
        f"{m.get('cpu')}, {m.get('cores')} cores ({m.get('cores_available')} available), "
        f"{m.get('torch_threads')} torch threads, torch {m.get('torch')}, "
        + (f"GPU {m['gpu']}" if m.get("gpu") else "no GPU")
        for r in records if isinstance(m := r.get("machine"), dict))
    lines.append("Machine: " + "; ".join(machines) + ".  ")
    loads = [r["load"][k][0] for r in records if isinstance(r.get("load"), dict)
             for k in ("before", "after") if r["load"].get(k)]
    if loads:
        lines.append(f"Load average (1 min) around the runs: {min(loads):.2f} to {max(loads):.2f}.  ")
    models = _distinct(r.get("model") for r in records)
    lines.append(f"Model: {', '.join(map(str, models))}.  ")
    cal = [r for r in records if r["method"] != "dense"]
    if cal:
        desc = _distinct(f"{r.get('nsamples')} x {r.get('seqlen')} tokens from {r.get('calib_text')}" for r in cal)
        seeds = sorted({r["seed"] for r in cal if r.get("seed") is not None})
        lines.append(f"Calibration: {'; '.join(desc)}; seeds {', '.join(map(str, seeds))}; the same token-id file "
                     "for every method of a seed (SHA-256 in the records).  ")
        sampling = {r["seed"]: r["calib_sampling_seconds"] for r in cal if r.get("calib_sampling_seconds") is not None}
        if sampling:
            lines.append("Sampling the calibration windows from the dense model (once per seed, shared by every row, "
                         "not in prune s): " + ", ".join(f"seed {k} {v:.0f} s" for k, v in sorted(sampling.items()))
                         + ".  ")
    for corpus in corpora:
        wins = _distinct((r.get("eval_text"), r.get("eval_windows"), r.get("seqlen"))
                         for r in records if r["corpus"] == corpus)
        lines.append(f"Evaluation {CORPUS_NAMES.get(corpus, corpus)}: "
                     + "; ".join(f"{t}, {w} windows x {s} tokens" for t, w, s in wins)
                     + (" (MIXED window counts)" if len(wins) > 1 else "") + ".  ")
    lines += [
        "Perplexity: SparseGPT's protocol, our evaluator, on the saved model reloaded from disk (peer rows: "
        "llm-compressor's `oneshot` in its own venv on the same calibration file).  ",
        "`sparsity` is measured from the saved weights over the decoder linears; `/ best SGPT` is the ratio to the "
        "better of our SparseGPT and llm-compressor's (seed mean, uniform) at the same pattern on the same corpus.  ",
        "Prune s / CPU-s: the pruning call only, timed alike for both (model already loaded, saving after, "
        "calibration forwards and any OWL pass included): our `prune_model` with `leanml prune`'s default "
        "settings (without the per-layer checkpoint files the CLI writes for `--resume`), llm-compressor's "
        "`oneshot`; CPU-s is user + system time of the process and its children.",
        "",
    ]
    header = "| pattern | method | profile | seeds | sparsity | " + " | ".join(
        f"{CORPUS_NAMES.get(c, c)} ppl | / best SGPT" for c in corpora) + " | prune s | prune CPU-s | notes |"
    lines += ["## Perplexity (seed mean ± std)", "", header, "|" + "---|" * (header.count("|") - 1)]
    groups = sorted({record_key(r)[:3] for r in records},
                    key=lambda k: (pattern_order(k[1]), k[2] != "uniform", k[0] not in ("dense",), str(k[0])))
    runs = timing_records(records)
    for method, pattern, profile in groups:
        rs = [r for r in records if record_key(r)[:3] == (method, pattern, profile)]
        notes = sorted({f for r in rs for f in r.get("flags") or []}
                       | {f"error: {r['error']}" for r in rs if r.get("error")})
        seeds = sorted({r["seed"] for r in rs}, key=str)
        sp = stats(rs, "sparsity_measured")
        cells = [pattern, method, profile, ", ".join("-" if s is None else str(s) for s in seeds),
                 _fmt(sp.mean if sp else None, 3)]
        for c in corpora:
            s = stats(rs, corpus=c)
            best = best_sparsegpt(records, pattern, c) if pattern != "dense" else None
            cells += [s.text() if s else "-", _fmt(s.mean / best[1].mean, 3) if s and best else "-"]
        t = stats([r for r in runs if record_key(r)[:3] == (method, pattern, profile)], "seconds")
        cpu = stats([r for r in runs if record_key(r)[:3] == (method, pattern, profile)], "cpu_seconds")
        cells += [t.text(0) if t else "-", cpu.text(0) if cpu else "-", "; ".join(notes) or ""]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Targets (computed from the records)", "",
              "| target | corpus | value | limit | status | numbers |", "|---|---|---|---|---|---|"]
    for t in targets(records):
        value = "-" if t["value"] is None else (f"{100 * t['value']:+.2f} %" if "%" in t["limit"]
                                                else f"{t['value']:.3f}")
        lines.append(f"| {t['target']} | {CORPUS_NAMES.get(t['corpus'], t['corpus'])} | {value} | {t['limit']} | "
                     f"**{t['status']}** | {t['detail']} |")
    lines += ["", "## Settings (from the records)", "", "| method | profile | settings |", "|---|---|---|"]
    for method, profile in sorted({(r["method"], r["profile"]) for r in runs if r["method"] != "dense"},
                                  key=lambda k: (k[0] in PEERS, str(k[0]), k[1])):
        texts = _distinct(settings_text(r) for r in runs if (r["method"], r["profile"]) == (method, profile))
        lines.append(f"| {method} | {profile} | {'<br>'.join(texts)} |")
    lines += ["", "## Measured sparsity by module kind (fraction of zeros in the saved weights)", "",
              "| method | pattern | profile | seed | " + " | ".join(KIND_ORDER) + " | flags |",
              "|" + "---|" * (5 + len(KIND_ORDER))]
    for r in sorted(runs, key=lambda r: (pattern_order(r["pattern"]), r["profile"], str(r["method"]), str(r["seed"]))):
        kinds = r.get("sparsity_by_kind") or {}
        lines.append(f"| {r['method']} | {r['pattern']} | {r['profile']} | "
                     f"{r['seed'] if r['seed'] is not None else '-'} | "
                     + " | ".join(_fmt(kinds.get(k), 3) for k in KIND_ORDER)
                     + f" | {'; '.join(r.get('flags') or []) or ''} |")
    lines += ["", "## Every run", "", "| method | pattern | profile | seed | corpus | ppl | prune s | prune CPU-s | "
              "load before / after | peer | calib SHA-256 |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(records, key=lambda r: (pattern_order(r["pattern"]), r["profile"], str(r["method"]), str(r["seed"]),
                                            corpora.index(r["corpus"]))):
        load = r.get("load") or {}
        peer = r.get("peer") or {}
        peer_txt = f"llmcompressor {peer.get('versions', {}).get('llmcompressor')}" if peer else ""
        lines.append(f"| {r['method']} | {r['pattern']} | {r['profile']} | "
                     f"{r['seed'] if r['seed'] is not None else '-'} | "
                     f"{CORPUS_NAMES.get(r['corpus'], r['corpus'])} | {_fmt(r.get('ppl'))} | "
                     f"{_fmt(r.get('seconds'), 1)} | "
                     f"{_fmt(r.get('cpu_seconds'), 1)} | {_fmt((load.get('before') or [None])[0])} / "
                     f"{_fmt((load.get('after') or [None])[0])} | {peer_txt} | {(r.get('calib_sha256') or '-')[:12]} |")
    commands = _distinct(r.get("command") for r in records if r.get("command"))
    locked = sum(1 for r in runs if r.get("cpu_lock_held"))
    lines += ["", f"Commands ({locked} of {len(runs)} runs held the exclusive CPU lock, "
                  "`flock /tmp/leanml-cpu.lock`):", ""]
    lines += [f"- `{c}`" for c in commands]
    return "\n".join(lines) + "\n"


def plot(records: list[dict[str, Any]], path: Path) -> None:
    """Perplexity per pattern and method (seed mean, std as error bar), one panel per corpus."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in records if is_current(r)]
    corpora = sorted({r["corpus"] for r in records}, key=lambda c: (c != "shakespeare", c))
    patterns = sorted({r["pattern"] for r in records if r["pattern"] != "dense"}, key=pattern_order)
    series = sorted({(r["method"], r["profile"]) for r in records if r["method"] != "dense"}, key=str)
    fig, axes = plt.subplots(1, max(1, len(corpora)), figsize=(7 * max(1, len(corpora)), 5), squeeze=False)
    width = 0.8 / max(1, len(series))
    for ax, corpus in zip(axes[0], corpora):
        for i, (method, profile) in enumerate(series):
            xs, ys, es = [], [], []
            for j, p in enumerate(patterns):
                s = stats(records, method=method, pattern=p, profile=profile, corpus=corpus)
                if s:
                    xs.append(j + (i - (len(series) - 1) / 2) * width)
                    ys.append(s.mean)
                    es.append(s.std)
            label = method + ("" if profile == "uniform" else f" ({profile})")
            ax.bar(xs, ys, width, yerr=es, label=label, hatch="//" if method in PEERS else None)
            for x, y in zip(xs, ys):
                ax.text(x, y, f"{y:.0f}", ha="center", va="bottom", fontsize=6)
        dense = stats(records, method="dense", corpus=corpus)
        if dense:
            ax.axhline(dense.mean, color="k", ls="--", lw=1, label=f"dense {dense.mean:.1f}")
        ax.set_xticks(range(len(patterns)), patterns)
        ax.set_yscale("log")
        ax.set_ylabel("perplexity (log)")
        ax.set_title(f"{CORPUS_NAMES.get(corpus, corpus)} (lower is better)")
        ax.legend(fontsize=7)
    models = ", ".join(str(m) for m in _distinct(r.get("model") for r in records))
    fig.suptitle(f"{models}: perplexity after pruning, whole test splits "
                 "(bars: seed mean, whiskers: std; hatched: llm-compressor)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
