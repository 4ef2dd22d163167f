"""Demo part for pruning: SparseGPT 50 % on SmolLM2 (perplexity before/after and time), FISTA next to
SparseGPT on the first layers, and FASP structured pruning."""

from __future__ import annotations

import copy
import time

DEMO_CALIB = 16
DEMO_SEQLEN = 256
DEMO_EVAL_WINDOWS = 8
FISTA_LAYERS = 2


def run_demo() -> None:
    from leanml.data.text import calibration_windows, load_text, token_windows
    from leanml.eval.perplexity import perplexity
    from leanml.models import count_parameters, load_model
    from leanml.prune.engine import prune_model
    from leanml.prune.masks import MaskSpec
    from leanml.prune.methods import available, pruner_class

    print(f"\n== pruning: SmolLM2-135M, calibration {DEMO_CALIB} x {DEMO_SEQLEN} Shakespeare tokens, "
          f"perplexity on {DEMO_EVAL_WINDOWS} x {DEMO_SEQLEN} Hamlet tokens ==")
    model, tok = load_model("smollm2-135m")
    calib = calibration_windows(tok, "shakespeare", DEMO_CALIB, DEMO_SEQLEN, seed=0)
    test = token_windows(tok, load_text("shakespeare", "test"), DEMO_SEQLEN)[:DEMO_EVAL_WINDOWS]
    dense_state = copy.deepcopy(model.state_dict())
    params = count_parameters(model)
    dense_ppl = perplexity(model, test, progress=False)
    rows = [("dense", "-", dense_ppl, 0.0, params)]

    def run(model, method: str, spec: MaskSpec, layers=None, label: str | None = None) -> None:
        model.load_state_dict(dense_state)
        cls = pruner_class(method)
        t0 = time.perf_counter()
        prune_model(model, calib, cls(), spec, layers=layers, batch_size=4)
        seconds = time.perf_counter() - t0
        ppl = perplexity(model, test, progress=False)
        rows.append((label or method, spec.describe() if not cls.structured else f"{spec.sparsity:.0%} struct",
                     ppl, seconds, count_parameters(model)))

    run(model, "sparsegpt", MaskSpec(0.5))
    names = available()
    if "fista" in names:
        first = list(range(FISTA_LAYERS))
        run(model, "sparsegpt", MaskSpec(0.5), layers=first, label=f"sparsegpt (layers 0-{FISTA_LAYERS - 1})")
        run(model, "fista", MaskSpec(0.5), layers=first, label=f"fista (layers 0-{FISTA_LAYERS - 1})")
    if "fasp" in names:
        run(model, "fasp", MaskSpec(0.2))  # shrinks the model: keep it last
    print(f"{'method':28s} {'pattern':14s} {'ppl':>9s} {'seconds':>8s} {'params':>12s}")
    for name, pattern, ppl, seconds, n in rows:
        print(f"{name:28s} {pattern:14s} {ppl:9.2f} {seconds:8.1f} {n:12,d}")
