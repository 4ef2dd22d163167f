"""Training-memory benchmark: no optimization, full checkpointing, selective checkpointing, torch.compile
with an activation memory budget, and Adacc at 25/50/75% of the unoptimized activation peak.

    .venv/bin/python bench/memory.py            # full run (small LLaMA config + SmolLM2-135M)
    .venv/bin/python bench/memory.py --quick    # small config only, fewer steps

All strategies of a section train side by side, interleaved step by step, so that load from other
processes on the machine affects them alike. Peak = saved-activation bytes (saved-tensors hook,
storages de-duplicated, parameters skipped) plus the transient recompute/decompression workspace.
Writes bench/results/memory.{md,json,png}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from leanml.data.text import load_text, token_windows
from leanml.memory.train import StrategyRunner, TrainConfig, batches, measure_peak, remap_vocab
from leanml.utils import machine_info, machine_line, write_json

RESULTS = Path(__file__).resolve().parent / "results"
MIB = 2**20

SMALL = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=512, tie_word_embeddings=True, use_cache=False)


def small_model(vocab: int, seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, **SMALL))


def strategies(budgets: list[float], compile_budgets: list[float]) -> list[tuple[str, float]]:
    out: list[tuple[str, float]] = [("none", 1.0), ("checkpoint", 1.0), ("sac", 1.0)]
    out += [("compile", b) for b in compile_budgets]
    out += [("adacc", b) for b in budgets]
    return out


def run_section(name: str, make_model, data: list[torch.Tensor], plan: list[tuple[str, float]], lr: float,  # noqa: ANN001
                warmup: int) -> list[dict[str, Any]]:
    """Train one model per strategy, interleaving their steps; returns one record per strategy."""
    base_peak = measure_peak(make_model().train(), data[0])
    runners: list[tuple[str, float, StrategyRunner]] = []
    notes: dict[str, str] = {}
    for strategy, frac in plan:
        cfg = TrainConfig(strategy=strategy, budget=frac, batch_size=data[0].shape[0], steps=len(data), lr=lr,
                          warmup=warmup, progress=False)
        runner = StrategyRunner(make_model(), cfg, unoptimized_peak=base_peak)
        t0 = time.perf_counter()
        try:
            runner.setup(data[0])
        except Exception as exc:  # noqa: BLE001 - report strategies that do not run here
            runner.close()
            notes[f"{strategy}@{frac}"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            print(f"[{name}] {strategy}@{frac}: did not run ({notes[f'{strategy}@{frac}']})", file=sys.stderr)
            continue
        print(f"[{name}] {strategy}@{frac}: set up in {time.perf_counter() - t0:.1f}s, "
              f"peak {runner.peak / MIB:.1f} MiB", file=sys.stderr)
        runners.append((strategy, frac, runner))
    for x in tqdm(data, desc=f"{name}: interleaved steps"):
        for _, _, runner in runners:
            runner.step(x)
    records = []
    for strategy, _frac, runner in runners:
        runner.close()
        r = runner.result()
        r["section"] = name
        if strategy not in ("adacc", "compile"):
            r["budget_fraction"] = None
        records.append(r)
    for key, msg in notes.items():
        strategy, frac = key.split("@")
        records.append({"section": name, "strategy": strategy, "budget_fraction": float(frac), "error": msg,
                        "peak_bytes": None, "budget_bytes": frac and float(frac) * base_peak, "step_s": None,
                        "tokens_s": None, "final_loss": None, "steps": 0})
    return records


def fmt_table(records: list[dict[str, Any]], base: dict[str, Any] | None) -> list[str]:
    ck = next((r for r in records if r["strategy"] == "checkpoint" and r.get("step_s")), None)
    sac = next((r for r in records if r["strategy"] == "sac" and r.get("step_s")), None)
    rows = ["| strategy | budget | peak MiB | peak / unopt. | within budget | median step s | tokens/s | "
            "vs checkpoint | vs sac | final loss | plan |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        budget = f"{r['budget_fraction']:.0%}" if r.get("budget_fraction") else "-"
        if r.get("error"):
            rows.append(f"| {r['strategy']} | {budget} | did not run: {r['error']} | | | | | | | | |")
            continue
        unopt = r["unoptimized_peak_bytes"]
        within = "-" if r.get("budget_bytes") is None else ("yes" if r["peak_bytes"] <= r["budget_bytes"] else "**no**")
        vs_ck = f"{r['tokens_s'] / ck['tokens_s']:.2f}x" if ck else "-"
        vs_sac = f"{r['tokens_s'] / sac['tokens_s']:.2f}x" if sac else "-"
        plan = ""
        if r.get("plan"):
            plan = ", ".join(f"{k} {v}" for k, v in r["plan"]["summary"].items() if v)
        rows.append(
            f"| {r['strategy']} | {budget} | {r['peak_bytes'] / MIB:.1f} | {r['peak_bytes'] / unopt:.0%} | {within} | "
            f"{r['step_s']:.3f} | {r['tokens_s']:.0f} | {vs_ck} | {vs_sac} | {r['final_loss']:.4f} | {plan} |"
        )
    return rows


def plot(records: list[dict[str, Any]], loss_records: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    ax = axes[0]
    small = [r for r in records if r["section"] == "small" and not r.get("error")]
    for r in small:
        label = r["strategy"] + (f"@{r['budget_fraction']:.0%}" if r.get("budget_fraction") else "")
        ax.scatter(r["peak_bytes"] / MIB, r["tokens_s"], s=40)
        ax.annotate(label, (r["peak_bytes"] / MIB, r["tokens_s"]), fontsize=8, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("peak saved activations (MiB)")
    ax.set_ylabel("tokens / s")
    ax.set_title("small LLaMA config: memory vs throughput")
    ax.grid(alpha=0.3)
    ax = axes[1]
    for r in loss_records:
        if r.get("error"):
            continue
        label = r["strategy"] + (f"@{r['budget_fraction']:.0%}" if r.get("budget_fraction") else "")
        losses = r["losses"]
        k = 10
        smooth = [statistics.fmean(losses[max(0, i - k + 1) : i + 1]) for i in range(len(losses))]
        ax.plot(smooth, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (moving mean of 10)")
    ax.set_title("loss curves on Shakespeare")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small config only, fewer steps")
    ap.add_argument("--timing-steps", type=int, default=None, help="steps per strategy in the timing table")
    ap.add_argument("--loss-steps", type=int, default=None, help="fine-tuning steps of the loss comparison")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=2048, help="small config: keep this many most frequent tokens")
    ap.add_argument("--smollm2", action=argparse.BooleanOptionalAction, default=None, help="include SmolLM2-135M")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--render", action="store_true", help="only rewrite memory.md/.png from memory.json")
    args = ap.parse_args()
    if args.render:
        render(json.loads((Path(args.out) / "memory.json").read_text()), Path(args.out))
        return 0
    torch.set_num_threads(args.threads)
    timing_steps = args.timing_steps or (6 if args.quick else 12)
    loss_steps = args.loss_steps or (30 if args.quick else 200)
    with_smollm2 = (not args.quick) if args.smollm2 is None else args.smollm2
    budgets = [0.25, 0.5, 0.75]
    command = "python bench/memory.py " + " ".join(sys.argv[1:])
    t_start = time.perf_counter()

    from transformers import AutoTokenizer

    from leanml.models import bundled_dir

    tokenizer = AutoTokenizer.from_pretrained(bundled_dir("smollm2-135m"))
    text = load_text("shakespeare", "train")[:1_500_000]
    windows = token_windows(tokenizer, text, args.seqlen)
    small_windows = remap_vocab(windows, args.vocab)

    # 1. timing and peak table on the small config
    data = batches(small_windows, args.batch_size, timing_steps, seed=0)
    plan = strategies(budgets, [0.5])
    records = run_section("small", lambda: small_model(args.vocab), data, plan, lr=1e-3, warmup=2)

    # 2. loss after N steps: unoptimized vs Adacc at 50% (same batches, same init); windows cut in half
    #    to keep 200 steps within the time budget
    loss_windows = small_windows[:, : (args.seqlen // 2) * 2].reshape(-1, args.seqlen // 2)
    loss_data = batches(loss_windows, args.batch_size, loss_steps, seed=1)
    loss_records = run_section("loss", lambda: small_model(args.vocab), loss_data,
                               [("none", 1.0), ("adacc", 0.5)], lr=1e-3, warmup=2)

    # 3. SmolLM2-135M (30 layers, 49k vocabulary), a modest batch
    smol_records: list[dict[str, Any]] = []
    if with_smollm2:
        from leanml.models import load_model

        model0, _ = load_model("smollm2-135m")
        state = {k: v.clone() for k, v in model0.state_dict().items()}

        def smol() -> torch.nn.Module:
            model0.load_state_dict(state)
            return model0

        smol_bs, smol_len = 1, 128
        smol_windows = token_windows(tokenizer, text[:400_000], smol_len)
        smol_data = batches(smol_windows, smol_bs, 3, seed=0)
        # one model object is reused, so the strategies run one after another here
        for strategy, frac in strategies(budgets, []):
            smol_records += run_section("smollm2", smol, smol_data, [(strategy, frac)], lr=1e-5, warmup=1)

    all_records = records + loss_records + smol_records
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    keys = ("section", "strategy", "budget_fraction", "peak_bytes", "budget_bytes", "unoptimized_peak_bytes",
            "step_s", "tokens_s", "final_loss", "steps", "setup_s", "error", "plan", "history", "losses", "step_times")
    payload = {
        "command": command, "machine": machine_info(), "machine_line": machine_line(),
        "settings": {"threads": args.threads, "timing_steps": timing_steps, "loss_steps": loss_steps,
                     "batch_size": args.batch_size, "seqlen": args.seqlen, "vocab": args.vocab,
                     "smollm2_batch_size": 1, "smollm2_seqlen": 128},
        "small_config": SMALL | {"vocab_size": args.vocab},
        "records": [{k: r.get(k) for k in keys if k in r} for r in all_records],
        "seconds": time.perf_counter() - t_start,
    }
    write_json(out / "memory.json", payload)
    render(payload, out)
    return 0


def targets(records: list[dict[str, Any]], loss_records: list[dict[str, Any]],
            other: list[dict[str, Any]]) -> list[str]:
    """The issue's targets, checked against the measured records."""
    def find(strategy: str, frac: float | None = None) -> dict[str, Any] | None:
        for r in records:
            if r["strategy"] == strategy and not r.get("error") and (frac is None or r.get("budget_fraction") == frac):
                return r
        return None

    lines = ["## Targets", ""]
    a50, ck, sac = find("adacc", 0.5), find("checkpoint"), find("sac")
    if a50 and ck and sac:
        r_ck = a50["tokens_s"] / ck["tokens_s"]
        r_sac = a50["tokens_s"] / sac["tokens_s"]
        lines.append(f"- Adacc@50% throughput vs full checkpointing: {r_ck:.3f}x (target >= 1.2x: "
                     f"{'met' if r_ck >= 1.2 else '**missed**'}); vs selective checkpointing: {r_sac:.2f}x "
                     f"(target >= 1.0x: {'met' if r_sac >= 1.0 else '**missed**'}; SAC itself keeps "
                     f"{sac['peak_bytes'] / sac['unoptimized_peak_bytes']:.0%} of the unoptimized peak, above the 50% budget).")
    budgeted = [r for r in records + loss_records + other if r.get("budget_bytes") and not r.get("error")]
    over = [r for r in budgeted if r["peak_bytes"] > r["budget_bytes"]]
    lines.append(f"- Measured peak within budget: {len(budgeted) - len(over)}/{len(budgeted)} budgeted runs"
                 + ("" if not over else " (over: " + ", ".join(f"{r['strategy']}@{r['budget_fraction']:.0%}" for r in over) + ")")
                 + ".")
    ok = [r for r in loss_records if not r.get("error")]
    if len(ok) == 2:
        rel = ok[1]["final_loss"] / ok[0]["final_loss"] - 1
        lines.append(f"- Loss after {ok[0]['steps']} steps, Adacc@50% vs unoptimized: {rel:+.2%} "
                     f"(target within 1%: {'met' if abs(rel) <= 0.01 else '**missed**'}).")
    none = find("none")
    if none and ck and a50 and a50["tokens_s"] < 1.2 * ck["tokens_s"]:
        allowed = none["tokens_s"] / ck["tokens_s"] / 1.2 - 1
        added = none["tokens_s"] / a50["tokens_s"] - 1
        predicted = a50["plan"]["predicted_time_s"] / none["step_s"]
        model_note = ("its planner predicted {:+.0%}; the time model prices each option with kernel timings taken in "
                      "isolation during the profile, which under-predicts memory-bound casts and quantization inside "
                      "the running step (see the Adacc section of README.md)" if added > predicted else
                      "its planner predicted {:+.0%}").format(predicted)
        lines.append(f"- Why: on this CPU full checkpointing costs {none['tokens_s'] / ck['tokens_s'] - 1:+.0%} over no "
                     f"optimization, so 1.2x over it allows a half-memory plan at most {allowed:+.1%} over the "
                     f"unoptimized step; Adacc@50% measured {added:+.1%} ({model_note}). On CPU, compression is not "
                     "much cheaper than the recomputation it replaces, and step times on this shared machine vary "
                     "by several percent between runs.")
    lines.append("- `compile`: its peak counts what the compiled graph saves; recomputation inside the compiled "
                 "backward runs in fused kernels that the saved-tensors hook cannot see, so its transient workspace "
                 "is not included. It ran at the 50% budget only (each compilation takes from seconds to minutes on "
                 "this shared machine).")
    return lines + [""]


def render(payload: dict[str, Any], out: Path) -> None:
    """Write memory.md and memory.png from the measured records."""
    st = payload["settings"]
    recs = payload["records"]
    records = [r for r in recs if r["section"] == "small"]
    loss_records = [r for r in recs if r["section"] == "loss"]
    smol_records = [r for r in recs if r["section"] == "smollm2"]
    plot(records, loss_records, out / "memory.png")
    cfg = payload["small_config"]
    lines = ["# Training memory: Adacc vs checkpointing", "", f"Machine: {payload['machine_line']} "
             f"({st['threads']} torch thread(s); cores shared with other jobs, so absolute times are noisy; "
             "the strategies of a section run interleaved step by step).", "", f"Command: `{payload['command']}`", "",
             "Peak = saved-activation bytes (saved-tensors hook, storages de-duplicated, parameters skipped) plus the "
             "transient recompute and decompression workspace. Budgets are fractions of the unoptimized peak.", ""]
    lines += [f"## Small LLaMA config ({cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, MLP "
              f"{cfg['intermediate_size']}, vocabulary = {st['vocab']} most frequent SmolLM2 tokens), batch "
              f"{st['batch_size']} x seqlen {st['seqlen']}, {st['timing_steps']} steps (median after 2 warm-up)", ""]
    lines += fmt_table(records, None) + [""]
    if loss_records:
        lines += [f"## Loss after {st['loss_steps']} steps (small config, batch {st['batch_size']} x seqlen "
                  f"{st['seqlen'] // 2}, Shakespeare train split, AdamW lr 1e-3, same init and batches; final loss = "
                  "mean of the last 10 step losses)", ""]
        lines += fmt_table(loss_records, None) + [""]
    if smol_records:
        n = max(r.get("steps", 0) for r in smol_records)
        lines += [f"## SmolLM2-135M, batch {st['smollm2_batch_size']} x seqlen {st['smollm2_seqlen']}, {n} steps "
                  "(median of the steps after 1 warm-up: fewer than the 10 the protocol asks, to fit the "
                  "time budget on shared cores, so treat its times as rough)", ""]
        lines += fmt_table(smol_records, None) + [""]
    lines += targets(records, loss_records, smol_records)
    lines += [f"Total benchmark time: {payload['seconds']:.0f} s.", ""]
    (out / "memory.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
