"""Demo part for pruning: SparseGPT and FISTA at 50 % on the whole of SmolLM2 (small calibration), the
SparseGPT model recovered by a short fine-tune that keeps its zeros, and FASP structured pruning; each
step with its perplexity and its time."""

from __future__ import annotations

import copy
import time

import torch

DEMO_CALIB = 16
DEMO_SEQLEN = 256
DEMO_EVAL_WINDOWS = 8
RECOVER_STEPS = 10
RECOVER_BATCH = 4
RECOVER_SEQLEN = 128
RECOVER_LR = 1e-4


def run_demo() -> None:
    from leanml.data.text import calibration_windows, load_text, token_windows
    from leanml.eval.perplexity import perplexity
    from leanml.models import count_parameters, load_model
    from leanml.prune.engine import prune_model
    from leanml.prune.masks import MaskSpec
    from leanml.prune.methods import available, pruner_class
    from leanml.recover import RecoverConfig, recover, recover_training

    print(f"\n== pruning: SmolLM2-135M, calibration {DEMO_CALIB} x {DEMO_SEQLEN} Shakespeare tokens, "
          f"perplexity on {DEMO_EVAL_WINDOWS} x {DEMO_SEQLEN} Hamlet tokens, {torch.get_num_threads()} threads ==")
    t0 = time.perf_counter()
    model, tok = load_model("smollm2-135m")
    calib = calibration_windows(tok, "shakespeare", DEMO_CALIB, DEMO_SEQLEN, seed=0)
    test = token_windows(tok, load_text("shakespeare", "test"), DEMO_SEQLEN)[:DEMO_EVAL_WINDOWS]
    dense_state = copy.deepcopy(model.state_dict())
    params = count_parameters(model)
    dense_ppl = perplexity(model, test, progress=False)
    print(f"loaded and evaluated the dense model in {time.perf_counter() - t0:.0f} s")
    rows = [("dense", "-", dense_ppl, 0.0, params)]
    states: dict[str, dict[str, torch.Tensor]] = {}

    def run(method: str, spec: MaskSpec, label: str | None = None, **options: object) -> None:
        model.load_state_dict(dense_state)
        cls = pruner_class(method)
        t = time.perf_counter()
        prune_model(model, calib, cls(**options), spec, batch_size=4, progress=False)
        seconds = time.perf_counter() - t
        ppl = perplexity(model, test, progress=False)
        rows.append((label or method, spec.describe() if not cls.structured else f"{spec.sparsity:.0%} struct",
                     ppl, seconds, count_parameters(model)))
        print(f"  {label or method}: ppl {ppl:.2f} in {seconds:.0f} s")
        if not cls.structured:
            states[method] = copy.deepcopy(model.state_dict())

    names = available()
    run("sparsegpt", MaskSpec(0.5))
    if "fista" in names:
        # 10 FISTA and 10 refit iterations instead of the defaults' 20 + 20 keep the tour within 4 minutes
        # (measured on this calibration: ppl 59.61 in 79 s against 58.98 in 111 s)
        run("fista", MaskSpec(0.5), iters=10, refine=10)
    # prune, then recover: a short fine-tune of the SparseGPT model that keeps its zeros exactly
    model.load_state_dict(states["sparsegpt"])
    train = token_windows(tok, load_text("shakespeare", "train")[:400_000], RECOVER_SEQLEN)
    cfg = RecoverConfig(train=recover_training(steps=RECOVER_STEPS, batch_size=RECOVER_BATCH, lr=RECOVER_LR,
                                               strategy="none"), warmup=2, checkpoint_every=RECOVER_STEPS + 1)
    t = time.perf_counter()
    result = recover(model, train, cfg, progress=False)
    seconds = time.perf_counter() - t
    model.to("cpu")
    ppl = perplexity(model, test, progress=False)
    label = f"sparsegpt + recover {RECOVER_STEPS} steps"
    rows.append((label, "50% (kept)" if result["sparsity"]["kept_exactly"] else "50% (LOST)", ppl, seconds,
                 count_parameters(model)))
    print(f"  {label}: ppl {ppl:.2f} in {seconds:.0f} s")
    if "fasp" in names:
        model.load_state_dict(dense_state)
        run("fasp", MaskSpec(0.2))  # shrinks the model: keep it last
    print(f"{'method':32s} {'pattern':14s} {'ppl':>9s} {'seconds':>8s} {'params':>12s}")
    for name, pattern, ppl, secs, n in rows:
        print(f"{name:32s} {pattern:14s} {ppl:9.2f} {secs:8.1f} {n:12,d}")
    by = {r[0].split(" (")[0]: r[2] for r in rows}
    if "fista" in by:
        gap = (by["sparsegpt"] - by["fista"]) / by["sparsegpt"]
        print(f"FISTA vs SparseGPT at 50 % on the whole model: perplexity {by['fista']:.2f} vs {by['sparsegpt']:.2f} "
              f"({abs(gap):.1%} {'lower' if gap >= 0 else 'higher'} with FISTA); recovery takes SparseGPT's "
              f"{by['sparsegpt']:.2f} to {by[label]:.2f} (dense {dense_ppl:.2f}). Small calibration and "
              f"evaluation: see bench/results/prune_fista.md and recover.md for the full runs.")
