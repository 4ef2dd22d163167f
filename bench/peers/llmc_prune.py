"""Prune a model with llm-compressor's ``oneshot`` on CPU, on calibration windows given as token ids.

Runs in the peer's own environment (``make peers`` builds ``.venv-peers``), never in the project's:

    .venv-peers/bin/python bench/peers/llmc_prune.py --model DIR --calib calib.pt \\
        --method sparsegpt --sparsity 0.5 --out OUT
    .venv-peers/bin/python bench/peers/llmc_prune.py --model DIR --calib calib.pt \\
        --method wanda --mask 2:4 --out OUT

``--calib``: a ``torch.save`` file holding one ``(nsamples, seqlen)`` long tensor of token ids
(``bench/prune.py`` writes it and feeds the same file to every method). Every window is used, in
order, one per batch, without shuffling or truncation.

``OUT`` receives the pruned model as plain safetensors (``model.safetensors``, ``config.json``,
tokenizer files; a tied head is stored once, as the embedding table) and ``run.json``: wall seconds
and CPU-seconds (this process and its children) of the ``oneshot`` call and of the whole run, torch
threads, package versions, the modifier's settings and the SHA-256 of the calibration ids.

The head is excluded with ``ignore=["re:.*lm_head"]``: a bare ``"lm_head"`` does not match the
module's qualified name, and with ``targets=["Linear"]`` the head (and the embedding table tied to it)
would then be pruned without a warning. ``--ignore`` overrides the list (``--ignore ''``: none).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

MODIFIERS = {"sparsegpt": "SparseGPTModifier", "wanda": "WandaPruningModifier"}
DEFAULT_IGNORE = ["re:.*lm_head"]


def cpu_seconds() -> float:
    """User + system CPU time of this process and of its waited-for children."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def parse_mask(text: str) -> tuple[int, int]:
    """``"2:4"`` -> ``(2, 4)`` (N kept of every M; llm-compressor's N:M names the same pattern)."""
    try:
        n, m = (int(x) for x in text.split(":"))
    except ValueError:
        raise SystemExit(f"llmc_prune: error: malformed --mask {text!r}; use N:M such as 2:4") from None
    if not 0 < n < m:
        raise SystemExit(f"llmc_prune: error: malformed --mask {text!r}; need 0 < N < M")
    return n, m


def make_modifier(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """The llm-compressor modifier for ``args`` and the settings it was given (for the report)."""
    from llmcompressor.modifiers.pruning import SparseGPTModifier, WandaPruningModifier

    cls = {"sparsegpt": SparseGPTModifier, "wanda": WandaPruningModifier}[args.method]
    if args.mask:
        n, m = parse_mask(args.mask)
        settings: dict[str, Any] = {"sparsity": 1.0 - n / m, "mask_structure": f"{n}:{m}"}
    else:
        settings = {"sparsity": args.sparsity}
    settings.update(targets=["Linear"], ignore=args.ignore)
    if args.profile == "owl":
        settings.update(sparsity_profile="owl", owl_m=args.owl_m, owl_lmbda=args.owl_lmbda)
    return cls(**settings), settings


def save_plain(model: Any, tokenizer: Any, out: Path) -> dict[str, Any]:
    """Write ``model`` as one plain safetensors file (tied tensors stored once) with config and tokenizer."""
    from safetensors.torch import save_file

    state = model.state_dict()
    seen: dict[int, str] = {}
    tensors = {}
    tied = []
    for name, tensor in state.items():
        ptr = tensor.data_ptr()
        if ptr in seen:  # a tied weight: transformers re-ties it from the config on load
            tied.append([name, seen[ptr]])
            continue
        seen[ptr] = name
        tensors[name] = tensor.detach().contiguous().cpu()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    for attr in ("quantization_config", "sparsity_config"):
        if hasattr(config, attr):
            delattr(config, attr)
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"tied": tied, "tensors": len(tensors)}


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("llmcompressor", "compressed-tensors", "transformers", "torch"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "absent"
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="Hugging Face model directory (config, weights, tokenizer)")
    ap.add_argument("--calib", required=True, help="torch.save file of a (nsamples, seqlen) tensor of token ids")
    ap.add_argument("--method", required=True, choices=sorted(MODIFIERS))
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--sparsity", type=float, help="unstructured sparsity in (0, 1), e.g. 0.5")
    group.add_argument("--mask", help="N:M pattern, e.g. 2:4 or 4:8")
    ap.add_argument("--profile", choices=["uniform", "owl"], default="uniform",
                    help="layer sparsity profile (owl: llm-compressor's OWL with --owl-m / --owl-lmbda)")
    ap.add_argument("--owl-m", type=int, default=5, help="OWL outlier threshold M (default 5)")
    ap.add_argument("--owl-lmbda", type=float, default=0.08, help="OWL lambda (default 0.08)")
    ap.add_argument("--ignore", type=lambda s: [x for x in s.split(",") if x], default=DEFAULT_IGNORE,
                    help="comma list of modules to leave alone (default re:.*lm_head)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                    help="weights' dtype (default float32); on a GPU machine the sequential pipeline moves "
                         "each layer to the GPU while the model stays on the CPU")
    ap.add_argument("--out", required=True, help="output directory (created; must not exist)")
    args = ap.parse_args(argv)
    if args.sparsity is not None and not 0.0 < args.sparsity < 1.0:
        raise SystemExit(f"llmc_prune: error: --sparsity must be in (0, 1), got {args.sparsity}")
    if args.profile == "owl" and args.mask:
        raise SystemExit("llmc_prune: error: --profile owl takes unstructured --sparsity, not --mask")
    out = Path(args.out)
    if out.exists():
        raise SystemExit(f"llmc_prune: error: {out} exists; pass a new --out")

    wall0, cpu0 = time.perf_counter(), cpu_seconds()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    ids = torch.load(args.calib, weights_only=True)
    if ids.dim() != 2:
        raise SystemExit(f"llmc_prune: error: {args.calib} holds shape {tuple(ids.shape)}; need (nsamples, seqlen)")
    ids = ids.long()
    nsamples, seqlen = ids.shape
    calib_sha = hashlib.sha256(ids.numpy().tobytes()).hexdigest()
    dataset = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    modifier, settings = make_modifier(args)

    t0, c0 = time.perf_counter(), cpu_seconds()
    model = oneshot(
        model=model,
        tokenizer=tokenizer,
        dataset=dataset,
        recipe=modifier,
        num_calibration_samples=nsamples,
        max_seq_length=seqlen,
        shuffle_calibration_samples=False,
        batch_size=1,
    )
    seconds, cpu = time.perf_counter() - t0, cpu_seconds() - c0

    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True)
    saved = save_plain(model, tokenizer, tmp)
    report = {
        "method": args.method,
        "modifier": MODIFIERS[args.method],
        "settings": settings,
        "profile": args.profile,
        "nsamples": nsamples,
        "seqlen": seqlen,
        "calib_sha256": calib_sha,
        "seconds": seconds,
        "cpu_seconds": cpu,
        "total_seconds": time.perf_counter() - wall0,
        "total_cpu_seconds": cpu_seconds() - cpu0,
        "torch_threads": torch.get_num_threads(),
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "dtype": args.dtype,
        "versions": versions(),
        "saved": saved,
        "argv": sys.argv,
    }
    (tmp / "run.json").write_text(json.dumps(report, indent=2) + "\n")
    tmp.rename(out)
    print(json.dumps({k: report[k] for k in ("method", "settings", "seconds", "cpu_seconds")}))


if __name__ == "__main__":
    main()
