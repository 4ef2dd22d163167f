"""Pruning benchmark: our methods and llm-compressor's side by side, on two corpora, over seeds.

Every row prunes SmolLM2-135M (or ``--model``) with the SAME calibration windows (``--nsamples`` x
``--seqlen`` tokens from the calib split of ``--calib``, one token-id file per seed, fed to every
method), saves the pruned model, reloads it from disk, measures its sparsity per module kind from
the saved weights, and evaluates it with our evaluator on the WHOLE test split of each corpus
(Hamlet and the clothing reviews). Rows:

- ``dense``: the unpruned model;
- ``magnitude``, ``wanda``, ``sparsegpt``, ``fista`` (any registered method; ``fista:dense`` sets a
  warm start): through the engine API (``prune_model``);
- ``llmc-sparsegpt``, ``llmc-wanda``: llm-compressor's ``SparseGPTModifier`` / ``WandaPruningModifier``
  run by ``bench/peers/llmc_prune.py`` in ``.venv-peers`` (built by ``make peers`` when absent). A
  peer that cannot be built or run gives a record with the error; the other rows go on.

Patterns: ``50%``, ``60%``, ``70%`` (any ``NN%``) unstructured, ``2:4``, ``4:8``; profiles ``uniform``
and ``owl`` (unstructured only). One record per (method, pattern, profile, seed, corpus) in
``bench/results/prune.json``, merged by that key, so chunks run separately; after each row the JSON,
``prune.md`` (tables, headers and the targets of issue 12, all generated from the records) and
``prune.png`` are rewritten. Run each chunk under the CPU lock:

    flock /tmp/leanml-cpu.lock python bench/prune.py --methods dense
    flock /tmp/leanml-cpu.lock python bench/prune.py --methods llmc-sparsegpt --patterns 50%,2:4 --seeds 0
    flock /tmp/leanml-cpu.lock python bench/prune.py --methods sparsegpt,fista --patterns 50% --seeds 0,1,2
    python bench/prune.py --render-only
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import resource
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import prune_harness as H  # noqa: E402
from leanml.data.text import (  # noqa: E402
    REVIEWS_TEST,
    SHAKESPEARE_CALIB,
    SHAKESPEARE_TEST,
    SHAKESPEARE_VAL,
    calibration_windows,
    load_text,
    token_windows,
)
from leanml.errors import LeanmlError  # noqa: E402
from leanml.machine import machine_info  # noqa: E402
from leanml.outputs import atomic_file, cache_dir, write_json  # noqa: E402
from leanml.processes import exit_on_sigterm, run_child  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PEERS_PYTHON = ROOT / ".venv-peers" / "bin" / "python"
PEER_SCRIPT = Path(__file__).resolve().parent / "peers" / "llmc_prune.py"
DEFAULT_MODEL = "smollm2-135m"
DEFAULT_CALIB = "shakespeare"
DEFAULT_NSAMPLES = 64
DEFAULT_SEQLEN = 512
DEFAULT_SEED = 0
DEFAULT_THREADS = 2
CORPORA = ("shakespeare", "reviews")
CPU_LOCK = "/tmp/leanml-cpu.lock"


def merge_records(new: list[dict[str, Any]], path: Path = RESULTS / "prune.json") -> list[dict[str, Any]]:
    """Records of ``path`` with those of ``new`` replacing the ones of the same key (see ``prune_harness``).

    Records without the key fields (an older protocol) are not of this benchmark and are left out.
    """
    current = [r for r in new if H.is_current(r)]
    if len(current) < len(new):
        print(f"prune.json: {len(new) - len(current)} record(s) without corpus/profile/seed left out", file=sys.stderr)
    return H.merge_records(current, H.load_records(path))


def write_outputs(records: list[dict[str, Any]], results: Path) -> None:
    """``prune.json``, ``prune.md`` and ``prune.png`` next to each other, all from ``records``."""
    write_json(results, records)
    with atomic_file(results.with_suffix(".md")) as tmp:
        tmp.write_text(H.render_markdown(records))
    with atomic_file(results.with_suffix(".png"), suffix=".png") as tmp:
        H.plot(records, tmp)


def cpu_seconds() -> float:
    """User + system CPU time of this process and its waited-for children."""
    return sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                  resource.getrusage(resource.RUSAGE_CHILDREN)))


def cpu_lock_held(path: str = CPU_LOCK) -> bool | None:
    """Whether someone (this run's ``flock``, when run as documented) holds the exclusive CPU lock:
    a non-blocking shared lock fails exactly then. None when the lock file does not exist."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def machine() -> dict[str, Any]:
    info = machine_info()
    info["cores_available"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return info


def calib_text(name: str, sampling: dict[str, Any] | None = None) -> str:
    """What the calibration windows are; ``sampling``: what ``calibration_with_samples`` reported, if used."""
    if name == "shakespeare":
        text = (f"the shakespeare calib split ({len(SHAKESPEARE_CALIB)} plays, "
                f"none of {SHAKESPEARE_TEST + SHAKESPEARE_VAL})")
    else:
        text = f"the {name} calib split"
    if not sampling:
        return text
    n = sampling["sampled_windows"]
    return (f"{n} of {n + sampling['corpus_windows']} windows sampled from the dense model itself (temperature 1, "
            f"from its BOS token), the rest from {text}")


def check_calibration_kind(path: Path, calib_samples: float) -> None:
    """Refuse to merge rows of another calibration kind into ``path``: records are keyed by method, pattern,
    profile, seed and corpus, so a ``--calib-samples`` run would silently replace corpus-only rows."""
    kinds = {r.get("calib_samples", 0.0) for r in H.load_records(path) if r["method"] != "dense"}
    if kinds - {calib_samples}:
        raise LeanmlError(f"{path} holds rows calibrated with --calib-samples "
                          f"{', '.join(f'{k:g}' for k in sorted(kinds))}, "
                          f"this run uses {calib_samples:g}; pass another --results file")


def eval_text(name: str) -> str:
    if name == "shakespeare":
        return f"the whole shakespeare test split ({', '.join(SHAKESPEARE_TEST)})"
    if name == "reviews":
        return f"the whole reviews test split (last {REVIEWS_TEST} Women's Clothing review texts)"
    return f"the whole {name} test split"


def ids_sha256(ids: torch.Tensor) -> str:
    return hashlib.sha256(ids.long().numpy().tobytes()).hexdigest()


@dataclass
class Context:
    """What every row of one invocation shares."""

    args: argparse.Namespace
    model_dir: Path
    tokenizer: Any
    tests: dict[str, torch.Tensor]
    dense_kinds: dict[str, float]
    work: Path
    command: str
    calib: dict[int, tuple[Path, torch.Tensor]] = field(default_factory=dict)
    sampling: dict[int, dict[str, Any]] = field(default_factory=dict)

    def calibration(self, seed: int) -> tuple[Path, torch.Tensor]:
        """The calibration windows of ``seed``, written once to a token-id file every method reads."""
        if seed not in self.calib:
            a = self.args
            tag = f"-samples{a.calib_samples:g}" if a.calib_samples else ""
            path = self.work / f"calib-{a.calib}{tag}-{a.nsamples}x{a.seqlen}-seed{seed}.pt"
            if a.calib_samples:
                ids = self._sampled(seed, path.with_suffix(".sampled.pt"))
            else:
                ids = calibration_windows(self.tokenizer, a.calib, a.nsamples, a.seqlen, seed=seed)
            with atomic_file(path) as tmp:
                torch.save(ids, tmp)
            self.calib[seed] = (path, torch.load(path, weights_only=True))
        return self.calib[seed]

    def _sampled(self, seed: int, path: Path) -> torch.Tensor:
        """Windows partly sampled from the dense model, drawn once into ``path`` (sampling is the costly
        part; every row and rerun reads the file) with the measured sampling time kept beside them."""
        if not path.exists():
            from leanml.data.sampling import CalibrationSet, calibration_with_samples
            from leanml.models import load_model

            a = self.args
            model, _ = load_model(str(self.model_dir))
            calib = CalibrationSet(a.calib, a.nsamples, a.seqlen, a.calib_samples, seed=seed)
            ids, info = calibration_with_samples(model, self.tokenizer, calib)
            with atomic_file(path) as tmp:
                torch.save({"ids": ids, "info": info}, tmp)
        saved = torch.load(path, weights_only=True)
        self.sampling[seed] = saved["info"]
        return saved["ids"]


# ---------------------------------------------------------------- rows


def our_config(label: str, pattern: str, profile: str, batch_size: int | None) -> Any:
    """The :class:`~leanml.prune.config.PruneConfig` of a row of ours: ``leanml prune --method METHOD``'s
    settings (the config's defaults: method options, mask scope, sequential mode, intra-layer correction,
    batch size, OWL's M and lambda) at the row's pattern and profile; ``label`` is a method name, or
    ``method:warm`` for a warm start (``fista:dense``); ``batch_size`` None keeps the default."""
    from leanml.config import replace
    from leanml.prune.config import PruneConfig
    from leanml.prune.methods import pruner_class

    method, _, warm = label.partition(":")
    options = pruner_class(method).Options()  # an unknown name: a one-line LeanmlError
    if warm:
        if not hasattr(options, "warm_start"):
            raise LeanmlError(f"method {method!r} takes no warm start; drop ':{warm}' from {label!r}")
        options = replace(options, warm_start=warm)
    sparsity, nm = H.parse_pattern(pattern)
    extra = {} if batch_size is None else {"batch_size": batch_size}
    return PruneConfig(method=method, sparsity=sparsity, pattern=f"{nm[0]}:{nm[1]}" if nm else None,
                       sparsity_profile=profile, options=options, **extra)


def prune_ours(ctx: Context, label: str, pattern: str, profile: str, seed: int, out: Path) -> dict[str, Any]:
    """Prune with our engine (:func:`leanml.prune`, the CLI's default settings), save to ``out``; return
    timing and the settings the engine reports it used.

    Timed like the peer's ``oneshot``: the pruning call only, model already loaded, saving after;
    no per-layer checkpoint files (the CLI writes them for ``--resume``)."""
    import leanml.prune
    from leanml.models import load_model, save_model

    config = our_config(label, pattern, profile, ctx.args.batch_size)
    _, ids = ctx.calibration(seed)
    model, tok = load_model(str(ctx.model_dir))
    t0, c0 = time.perf_counter(), cpu_seconds()
    report = leanml.prune(model, ids, config)
    seconds, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    save_model(model, tok, out)
    profile_info = report["mask"]["profile"]
    return {"seconds": seconds, "cpu_seconds": cpu, "method_config": report["method_config"],
            "mask_scope": report["mask"]["scope"],
            "engine": {**report["engine"], "owl": {"m": config.owl.m, "lam": config.owl.lam}},
            "settings": f"leanml prune --method {config.method} defaults",
            "profile_info": {k: v for k, v in profile_info.items() if k != "name"} or None,
            "engine_prune_seconds": report["prune_seconds"],
            # the method's own work (statistics passes, solves, the pruned layer's forward) and the rest
            "solver_seconds": report["solver_seconds"], "engine_seconds": report["engine_seconds"]}


def ensure_peers(python: Path) -> None:
    """Build ``.venv-peers`` with ``make peers`` when absent; raise with the reason when that fails."""
    if python.exists():
        return
    if python != PEERS_PYTHON:
        raise LeanmlError(f"peer python {python} does not exist; pass the python of an env with llmcompressor")
    print(f"{python} absent: running `make peers`", flush=True)
    proc = subprocess.run(["make", "-C", str(ROOT), "peers"], capture_output=True, text=True)
    if proc.returncode or not python.exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise LeanmlError(f"`make peers` failed (exit {proc.returncode}): {tail[0]}")


def prune_peer(ctx: Context, label: str, pattern: str, profile: str, seed: int, out: Path) -> dict[str, Any]:
    """Run llm-compressor in its own venv on our calibration file; return its report."""
    python = Path(ctx.args.peers_python)
    ensure_peers(python)
    sparsity, nm = H.parse_pattern(pattern)
    calib_path, ids = ctx.calibration(seed)
    cmd = [str(python), str(PEER_SCRIPT), "--model", str(ctx.model_dir), "--calib", str(calib_path),
           "--method", H.PEERS[label], "--out", str(out), "--threads", str(ctx.args.threads), "--profile", profile]
    cmd += ["--mask", f"{nm[0]}:{nm[1]}"] if nm else ["--sparsity", f"{sparsity:g}"]
    log = ctx.work / "logs" / f"{out.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    t0, c0 = time.perf_counter(), cpu_seconds()
    with log.open("w") as fh:
        returncode = run_child(cmd, check=False, stdout=fh, stderr=subprocess.STDOUT,
                               env={**os.environ, "HF_HUB_OFFLINE": "1"})
    process_seconds, process_cpu = time.perf_counter() - t0, cpu_seconds() - c0
    if returncode:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
        errs = [ln for ln in lines if "Error" in ln or "error:" in ln] or lines
        raise LeanmlError(f"llm-compressor run failed (exit {returncode}): "
                          f"{(errs[-1] if errs else 'no output')[:300]} (log {log})")
    report = json.loads((out / "run.json").read_text())
    if report["calib_sha256"] != ids_sha256(ids):
        raise LeanmlError("the peer read different calibration ids than ours")
    return {"seconds": report["seconds"], "cpu_seconds": report["cpu_seconds"], "process_seconds": process_seconds,
            "process_cpu_seconds": process_cpu, "peer": {k: report[k] for k in ("modifier", "settings", "versions",
                                                                               "torch_threads", "total_seconds",
                                                                               "total_cpu_seconds")}}


def run_row(ctx: Context, method: str, pattern: str, profile: str, seed: int | None) -> list[dict[str, Any]]:
    """One pruned (or dense) model evaluated on every corpus: one record per corpus."""
    from leanml.eval.perplexity import perplexity
    from leanml.models import load_model

    a = ctx.args
    name = f"{method.replace(':', '-')}-{pattern.replace('%', 'pct').replace(':', 'of')}-{profile}-seed{seed}"
    out = ctx.work / "models" / name
    shutil.rmtree(out, ignore_errors=True)
    base: dict[str, Any] = {"method": method, "pattern": pattern, "profile": profile, "seed": seed,
                            "model": a.model, "seqlen": a.seqlen, "command": ctx.command, "machine": machine(),
                            "load": {"before": list(os.getloadavg())},
                            "cpu_lock_held": cpu_lock_held(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    if method != "dense":
        sparsity, _ = H.parse_pattern(pattern)
        calib_path, ids = ctx.calibration(seed)
        base.update(sparsity=sparsity, nsamples=a.nsamples, calib=a.calib,
                    calib_text=calib_text(a.calib, ctx.sampling.get(seed)), calib_sha256=ids_sha256(ids),
                    calib_samples=a.calib_samples)
        if seed in ctx.sampling:  # measured once per seed, when the file was first written; shared by every row
            base["calib_sampling_seconds"] = ctx.sampling[seed]["sampling_seconds"]
    else:
        base.update(sparsity=0.0, nsamples=None)
    try:
        if method == "dense":
            info, model_dir = {"seconds": 0.0, "cpu_seconds": 0.0}, ctx.model_dir
        else:
            prune = prune_peer if method in H.PEERS else prune_ours
            info, model_dir = prune(ctx, method, pattern, profile, seed, out), out
        base.update(info)
        kinds = H.sparsity_by_kind(model_dir)
        base.update(sparsity_measured=kinds["decoder_linears"], sparsity_by_kind=kinds["by_kind"],
                    tied_head=kinds["tied_head"], flags=H.untouched_flags(kinds["by_kind"], ctx.dense_kinds))
        model, _ = load_model(str(model_dir))
        records = []
        for corpus, windows in ctx.tests.items():
            t0 = time.perf_counter()
            ppl = perplexity(model, windows, batch_size=a.eval_batch_size, progress=True)
            records.append({**base, "corpus": corpus, "eval_text": eval_text(corpus),
                            "eval_windows": int(windows.shape[0]), "ppl": ppl,
                            "eval_seconds": time.perf_counter() - t0})
    except (LeanmlError, subprocess.SubprocessError, OSError, RuntimeError, ValueError) as exc:
        msg = f"{type(exc).__name__}: {exc}".splitlines()[0]
        print(f"{method} {pattern} {profile} seed {seed}: {msg}", flush=True)
        records = [{**base, "corpus": c, "eval_text": eval_text(c), "eval_windows": int(w.shape[0]), "ppl": None,
                    "error": msg} for c, w in ctx.tests.items()]
    finally:
        if not a.keep_models:
            shutil.rmtree(out, ignore_errors=True)
    for r in records:
        r["load"]["after"] = list(os.getloadavg())
    return records


def plan(methods: list[str], patterns: list[str], profiles: list[str], seeds: list[int]) -> list[tuple]:
    """The rows to run, in order: dense once, then per seed, pattern, profile, method."""
    rows: list[tuple] = [("dense", "dense", "uniform", None)] if "dense" in methods else []
    for seed in seeds:
        for pattern in patterns:
            nm = H.parse_pattern(pattern)[1]
            for profile in profiles:
                if profile != "uniform" and nm:
                    print(f"skipping {profile} x {pattern}: a sparsity profile takes unstructured patterns",
                          file=sys.stderr)
                    continue
                rows += [(m, pattern, profile, seed) for m in methods if m != "dense"]
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="bundled name or model directory (default smollm2-135m)")
    ap.add_argument("--methods", default="dense,llmc-sparsegpt,llmc-wanda",
                    help="comma list of: dense, llmc-sparsegpt, llmc-wanda, and our methods (magnitude, wanda, "
                         "sparsegpt, fista, fista:<warm start>)")
    ap.add_argument("--patterns", default="50%",
                    help="comma list of NN%% (unstructured) and N:M, e.g. 50%%,60%%,70%%,2:4,4:8")
    ap.add_argument("--profiles", default="uniform", help="comma list of: uniform, owl (owl: unstructured only)")
    ap.add_argument("--seeds", default=str(DEFAULT_SEED), help="comma list of calibration seeds, e.g. 0,1,2")
    ap.add_argument("--nsamples", type=int, default=DEFAULT_NSAMPLES, help="calibration windows (default 64)")
    ap.add_argument("--seqlen", type=int, default=DEFAULT_SEQLEN, help="tokens per window (default 512)")
    ap.add_argument("--calib", default=DEFAULT_CALIB, help="corpus whose calib split calibrates (default shakespeare)")
    ap.add_argument("--calib-samples", type=float, default=0.0,
                    help="share of the calibration windows sampled from the dense model itself, the same file for "
                         "every method, ours and the peer's (default 0; use its own --results file)")
    ap.add_argument("--corpora", default=",".join(CORPORA), help="evaluation corpora, whole test splits")
    ap.add_argument("--threads", type=int, default=DEFAULT_THREADS,
                    help="torch threads, ours and the peer's (default 2)")
    ap.add_argument("--batch-size", type=int, default=None,
                    help="engine calibration batch size of our rows (default: leanml prune's)")
    ap.add_argument("--eval-batch-size", type=int, default=4)
    ap.add_argument("--peers-python", default=str(PEERS_PYTHON), help="python of the peer venv (default .venv-peers)")
    ap.add_argument("--work-dir", default=None,
                    help="calibration files, saved models, peer logs (default <cache>/bench-prune)")
    ap.add_argument("--keep-models", action="store_true", help="keep the saved pruned models in the work dir")
    ap.add_argument("--results", default=str(RESULTS / "prune.json"), help="records file (md and png beside it)")
    ap.add_argument("--render-only", action="store_true", help="rewrite prune.md and prune.png from the records")
    args = ap.parse_args(argv)
    exit_on_sigterm()  # a killed run takes its children (the peer, `leanml recover`) with it
    results = Path(args.results)
    if args.render_only:
        write_outputs(merge_records([], results), results)
        print(results.with_suffix(".md").read_text())
        return
    try:
        check_calibration_kind(results, args.calib_samples)
    except LeanmlError as exc:
        ap.error(str(exc))
    methods = [m for m in args.methods.split(",") if m]
    patterns = [p for p in args.patterns.split(",") if p]
    profiles = [p for p in args.profiles.split(",") if p]
    try:
        for p in patterns:
            H.parse_pattern(p)
        seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError as exc:
        ap.error(str(exc))
    if bad := [p for p in profiles if p not in H.PROFILES]:
        ap.error(f"unknown profile(s) {bad}; use uniform, owl")
    for m in methods:
        if m not in ("dense", *H.PEERS):
            try:
                our_config(m, "50%", "uniform", args.batch_size)
            except LeanmlError as exc:
                ap.error(str(exc))
    torch.set_num_threads(args.threads)
    from leanml.models import BUNDLED, bundled_dir, load_model

    model_dir = bundled_dir(args.model) if args.model in BUNDLED else Path(args.model).resolve()
    _, tok = load_model(str(model_dir))
    tests = {c: token_windows(tok, load_text(c, "test"), args.seqlen) for c in args.corpora.split(",") if c}
    work = Path(args.work_dir) if args.work_dir else cache_dir() / "bench-prune"
    work.mkdir(parents=True, exist_ok=True)
    ctx = Context(args, model_dir, tok, tests, H.sparsity_by_kind(model_dir)["by_kind"], work,
                  shlex.join(["python", "bench/prune.py", *(sys.argv[1:] if argv is None else argv)]))
    print(", ".join(f"{c}: {w.shape[0]} windows x {w.shape[1]}" for c, w in tests.items()), flush=True)
    for row in tqdm(plan(methods, patterns, profiles, seeds), desc="rows", unit="row"):
        records = run_row(ctx, *row)
        all_records = merge_records(records, results)
        write_outputs(all_records, results)
        for r in records:
            ppl = "error" if r["ppl"] is None else f"{r['ppl']:.2f}"
            print(f"{r['method']:15s} {r['pattern']:4s} {r['profile']:7s} seed {r['seed']} {r['corpus']:11s} "
                  f"ppl {ppl:>8s}  "
                  f"sparsity {r.get('sparsity_measured', float('nan')):.3f}  prune {r.get('seconds', 0):.0f} s / "
                  f"{r.get('cpu_seconds', 0):.0f} CPU-s", flush=True)
    print(results.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
