"""``leanml prune`` and ``leanml eval``: flags generated from :class:`~leanml.prune.config.PruneJob` (with
each method's options) and :class:`~leanml.eval.config.EvalJob`; the work is :func:`leanml.prune.job.run_job`
and :func:`leanml.eval.job.evaluate_job`."""

from __future__ import annotations

import argparse
from typing import Any

from leanml.errors import LeanmlError
from leanml.flags import add_options, flags_of, from_args

PRUNE_EPILOG = """examples:
  leanml prune --model smollm2-135m --method sparsegpt --sparsity 0.5 --out out/sgpt50
  leanml prune --model smollm2-135m --method wanda --pattern 2:4 --out out/wanda24
  leanml prune --model ./my-llama --method fista --sparsity 0.5 --calib shakespeare --nsamples 64 --out out/f
  leanml prune --model smollm2-135m --method fasp --sparsity 0.2 --out out/fasp20
  leanml prune --model smollm2-135m --method wanda --sparsity 0.7 --sparsity-profile owl --out out/owl70
  leanml prune --model smollm2-135m --method fista --calib-samples 0.5 --out out/f-mix   # half self-generated
  leanml prune --model ./big-model --dtype bfloat16 --device cuda --save-format compressed --out out/big
  torchrun --nproc_per_node=2 -m leanml prune --method fista --mode dense --out out/fista-par
  leanml prune ... --resume        # continue an interrupted run from its last finished layer
  leanml prune --model ./llama-70b --dtype bfloat16 --stream --max-memory 8GB --out out/big   # bigger than memory
"""

EVAL_EPILOG = """examples:
  leanml eval --model smollm2-135m --data shakespeare --seqlen 512
  leanml eval --model out/sgpt50 --data shakespeare --seqlen 512 --max-windows 20 --json ppl.json
  leanml eval --model ./big-model --dtype bfloat16 --device cuda   # layer by layer: the model stays on the CPU
  leanml eval --model out/sgpt50 --tasks reviews-recommend,shakespeare-next-line --limit 200   # lm-eval accuracy

eval prints the perplexity and writes nothing unless --json FILE is given. With --tasks (needs
pip install 'leanml[eval]') perplexity runs only when --data is given; see docs/tasks.md.
"""


def method_option_classes() -> list[type]:
    """The options dataclass of every registered method, each once (shared ones: the first method's)."""
    from leanml.prune.methods import available, pruner_class

    return list(dict.fromkeys(pruner_class(name).Options for name in available()))


def register(sub: argparse._SubParsersAction) -> None:
    from leanml.eval.config import EvalJob
    from leanml.prune.config import PruneJob

    p = sub.add_parser(
        "prune",
        help="prune an LLM post-training (magnitude, wanda, sparsegpt, fista, fasp, ...)",
        description="Prune a causal LM layer by layer on calibration text and save a model that "
        "AutoModelForCausalLM.from_pretrained loads, with report.json.",
        epilog=PRUNE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_options(p, PruneJob)
    added: set[str] = set()
    for cls in method_option_classes():  # a subclass's group shows only the flags its parent has not added
        flags = flags_of(cls, cls.prefix)
        if flags:
            skip = tuple(name for (_, name), flag in flags.items() if flag in added)
            made = add_options(p.add_argument_group((cls.__doc__ or cls.__name__).strip()), cls, cls.prefix, skip=skip)
            added.update(f.flag for f in made)
            record_given(p, [f.flag for f in made])
    p.set_defaults(func=run_prune)

    e = sub.add_parser(
        "eval",
        help="perplexity of a causal LM (SparseGPT protocol)",
        description="Perplexity over non-overlapping windows of the test split (SparseGPT's protocol).",
        epilog=EVAL_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_options(e, EvalJob)
    e.set_defaults(func=run_eval)


class _Given(argparse.Action):
    """Mixed into an option's action: records on the namespace that the flag was typed (``_leanml_given``)."""

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        super().__call__(parser, namespace, values, option_string)
        typed = (self.option_strings[0], option_string or self.option_strings[0])  # (its flag, as typed)
        namespace._leanml_given = (*getattr(namespace, "_leanml_given", ()), typed)


def record_given(parser: argparse.ArgumentParser, flags: list[str]) -> None:
    """Make the options ``flags`` of ``parser`` record when they are typed (read by :func:`method_readers`'
    check in :func:`prune_job`), whatever their value."""
    for action in parser._actions:
        if action.option_strings and action.option_strings[0] in flags and not isinstance(action, _Given):
            action.__class__ = type(f"Given{type(action).__name__}", (_Given, type(action)), {})


def method_readers() -> dict[str, list[str]]:
    """``{flag: methods whose options declare it}`` for every method option flag (from the declarations)."""
    from leanml.prune.methods import available, pruner_class

    readers: dict[str, list[str]] = {}
    for name in available():
        opts = pruner_class(name).Options
        for flag in flags_of(opts, opts.prefix).values():
            readers.setdefault(flag, []).append(name)
    return readers


def check_method_flags(args: argparse.Namespace) -> None:
    """Refuse a method option typed with a ``--method`` that does not read it (it would be ignored)."""
    readers = method_readers()
    for key, flag in getattr(args, "_leanml_given", ()):
        methods = readers.get(key, [])
        if methods and args.method not in methods:
            which = methods[0] if len(methods) == 1 else ", ".join(methods[:-1]) + " or " + methods[-1]
            raise LeanmlError(f"{flag} is read by --method {which} only; --method {args.method} ignores it: drop "
                              f"{flag} or use --method {which}")


def prune_job(args: argparse.Namespace) -> Any:
    """The :class:`~leanml.prune.config.PruneJob` a parsed ``leanml prune`` command line asks for (a method
    option typed with a method that does not read it is refused)."""
    from leanml.prune.config import PruneConfig, PruneJob
    from leanml.prune.methods import pruner_class

    check_method_flags(args)
    opts = pruner_class(args.method).Options
    config = from_args(PruneConfig, args, options=from_args(opts, args, opts.prefix))
    return from_args(PruneJob, args, config=config)


def run_prune(args: argparse.Namespace) -> int:
    from leanml.prune.job import run_job
    from leanml.prune.methods import pruner_class

    job = prune_job(args)
    report = run_job(job)
    if report is None:  # another rank of a torchrun run
        return 0
    c = job.config
    if job.streamed:
        from leanml.prune.stream import mb

        st = report["stream"]
        cap = f" (cap {mb(st['max_memory_bytes'])})" if st["max_memory_bytes"] else ""
        print(f"{c.method} streamed: peak RSS {mb(st['peak_rss_bytes'])}{cap} for {mb(st['weights_bytes'])} of "
              f"weights, {st['seconds']:.1f} s -> {report['out']}")
        return 0
    before, after = report["perplexity_before"], report["perplexity_after"]
    ppl_txt = f", ppl {before['ppl']:.2f} -> {after['ppl']:.2f}" if before and after else ""
    sparsity, model = report["measured_sparsity"], report["model"]
    if pruner_class(c.method).structured:  # the zeros left are only the pruned attention dimensions
        what = f"parameters {model['params_before']:,} -> {model['params_after']:,} (zeros left {sparsity:.3f})"
    else:
        what = f"sparsity {sparsity:.3f}"
    size_txt = f", {report['save']['weights_bytes'] / 2**20:.1f} MiB on disk ({job.save_format})"
    print(f"{c.method}: {what}{ppl_txt}, pruned in {report['prune_seconds']:.1f} s{size_txt} -> {report['out']}")
    return 0


def run_eval(args: argparse.Namespace) -> int:
    from leanml.eval.config import EvalJob
    from leanml.eval.job import evaluate_job
    from leanml.eval.sparsity import sparsity_line

    job = from_args(EvalJob, args)
    result = evaluate_job(job)
    if "ppl" in result:
        print(f"perplexity {result['ppl']:.3f}  ({job.corpus} test, {result['windows']} x {job.seqlen} tokens)")
    print(sparsity_line(result["sparsity"]))
    for name, rec in result.get("tasks", {}).items():
        score = "n/a" if rec["score"] is None else f"{rec['score']:.3f}"
        se = "" if rec["score_stderr"] is None else f" +- {rec['score_stderr']:.3f}"
        chance = "" if rec["chance"] is None else f", chance {rec['chance']:.2f}"
        print(f"{name}: {rec['metric']} {score}{se}  ({rec['n']} of {rec['size']} items{chance})")
    if job.json:
        print(f"-> {result['json']}")
    return 0
