"""``leanml demo`` part: training memory strategies side by side on a small LLaMA config and real text."""

from __future__ import annotations

import time

import torch

MIB = 2**20


def run_demo() -> None:
    """Train a small LLaMA config on Shakespeare for a few steps with each memory strategy (interleaved)
    and print peak saved-activation memory, median step time and loss."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from leanml.data.text import load_text, token_windows
    from leanml.memory import Budget
    from leanml.models import bundled_dir
    from leanml.train import StrategyRunner, TrainConfig, batches, lm_unoptimized_peak, remap_vocab

    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tokenizer = AutoTokenizer.from_pretrained(bundled_dir("smollm2-135m"))
        windows = remap_vocab(token_windows(tokenizer, load_text("shakespeare", "train")[:200_000], 128), 1024)
        cfg = LlamaConfig(hidden_size=192, intermediate_size=512, num_hidden_layers=6, num_attention_heads=6,
                          num_key_value_heads=3, vocab_size=1024, max_position_embeddings=256, use_cache=False)

        def model() -> torch.nn.Module:
            torch.manual_seed(0)
            return LlamaForCausalLM(cfg)

        data = batches(windows, 4, 8, seed=0)
        base = lm_unoptimized_peak(model().train(), data[0])
        runners = []
        for strategy, budget in [("none", 1.0), ("checkpoint", 1.0), ("sac", 1.0), ("adacc", 0.5)]:
            r = StrategyRunner(model(), TrainConfig(strategy=strategy, budget=Budget.parse(budget), steps=len(data),
                                                    lr=1e-3, warmup=2, progress=False), unoptimized_peak=base)
            r.setup(data[0])
            runners.append(r)
        for x in data:
            for r in runners:
                r.step(x)
        print(f"\nmemory: small LLaMA (6 layers, hidden 192) on Shakespeare, batch 4 x 128 tokens, {len(data)} steps")
        print(f"{'strategy':<14}{'peak MiB':>10}{'of none':>9}{'step s':>9}{'tokens/s':>10}{'loss':>8}")
        for r in runners:
            r.close()
            res = r.result()
            name = res["label"]
            print(f"{name:<14}{res['peak_bytes'] / MIB:>10.1f}{res['peak_bytes'] / base:>9.0%}"
                  f"{res['step_s']:>9.3f}{res['tokens_s']:>10.0f}{res['final_loss']:>8.3f}")
        print(f"({time.perf_counter() - t0:.0f} s)")
    finally:
        torch.set_num_threads(threads)
