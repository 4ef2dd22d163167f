"""The pruning options declared once: :class:`PruneConfig` checks itself once and names fields, the library
entry ``leanml.prune`` gives the engine's result, and every flag of ``leanml prune``/``eval`` is a field."""

from __future__ import annotations

import argparse
import copy
import dataclasses

import pytest
import torch

import leanml
from builders import tiny_llama
from leanml.config import ConfigError
from leanml.flags import cli_message, parser_flags
from leanml.prune.config import PruneConfig, PruneJob
from leanml.prune.engine import prune_model
from leanml.prune.masks import MaskSpec
from leanml.prune.methods.baselines import WandaPruner
from leanml.prune.methods.fista import FistaOptions, FistaPruner


def _ids(n: int = 4, seqlen: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n, seqlen), generator=torch.Generator().manual_seed(seed))


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.mark.parametrize("config,pruner,spec", [
    (PruneConfig(method="wanda", batch_size=2, device="cpu"), WandaPruner(), MaskSpec(0.5, scope="row")),
    (PruneConfig(method="fista", pattern="2:4", batch_size=2, device="cpu", options=FistaOptions(iters=3, refine=2)),
     FistaPruner(iters=3, refine=2), MaskSpec(0.5, (2, 4), "layer")),
], ids=["wanda", "fista-2:4"])
def test_the_library_entry_gives_the_engines_weights(config, pruner, spec) -> None:
    model = tiny_llama()
    ours, ref = copy.deepcopy(model), copy.deepcopy(model)
    report = leanml.prune(ours, _ids(), config, progress=False)
    prune_model(ref, _ids(), pruner, spec, batch_size=2, device="cpu", progress=False)
    assert _same_weights(ours, ref) and not _same_weights(ours, model)
    assert report["method"] == config.method and report["mask"]["scope"] == spec.scope


def test_refusals_name_fields() -> None:
    cases = [
        (dict(sparsity=1.5), ("sparsity",), "sparsity must be in (0, 1), got 1.5"),
        (dict(method="fasp", pattern="2:4"), ("pattern",), "fasp removes whole units and takes no N:M mask"),
        (dict(method="wanda", pattern="2:4", sparsity_profile="owl"), ("sparsity_profile",), "the 2:4 pattern"),
        (dict(method="wanda", sparsity_profile=(0.5, 1.2)), ("sparsity_profile",), "one sparsity in (0, 1)"),
        (dict(method="wanda", options=FistaOptions()), ("options",), "wanda takes NoOptions, got FistaOptions"),
        (dict(nsamples=0), ("nsamples",), "nsamples must be at least 1"),
        (dict(batch_size=0), ("batch_size",), "batch_size must be at least 1"),
    ]
    for kwargs, fields, text in cases:
        with pytest.raises(ConfigError) as exc:
            PruneConfig(**kwargs)
        assert exc.value.fields == fields and text in str(exc.value), str(exc.value)
    with pytest.raises(ConfigError, match="malformed pattern '2-4'"):
        PruneConfig(pattern="2-4")
    with pytest.raises(ConfigError, match="calib_samples samples from the whole model, which stream never holds"):
        PruneJob(out="o", stream=True, config=PruneConfig(calib_samples=0.5))
    with pytest.raises(ConfigError, match="sparsity_profile owl is not streamed"):  # refused before any reading
        PruneJob(out="o", stream=True, config=PruneConfig(method="wanda", sparsity_profile="owl"))
    for settings in (dict(stream_device="cpu"), dict(checkpoint_interval=30.0)):  # not silently ignored
        with pytest.raises(ConfigError, match="drop stream_device and checkpoint_interval"):
            PruneJob(out="o", max_memory="1GB", config=PruneConfig(**settings))
    with pytest.raises(ConfigError, match="mode must be sequential or dense, got 'sequental'"):
        PruneConfig(mode="sequental")


def test_the_config_resolves_without_changing_what_was_asked() -> None:
    config = PruneConfig(method="wanda")
    assert config.spec == MaskSpec(0.5, None, "row") and config.scope is None  # resolved, never written back
    assert PruneConfig(method="sparsegpt").spec.scope == "layer" and not config.intra_layer_on
    assert PruneConfig(method="wanda", scope="layer").spec.scope == "layer"
    assert PruneConfig(method="fista").method_options() == FistaOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.sparsity = 0.7  # type: ignore[misc]


def _parsers() -> dict[str, argparse.ArgumentParser]:
    from leanml.prune.cli import register

    sub = argparse.ArgumentParser().add_subparsers()
    register(sub)
    return dict(sub.choices)


def test_every_flag_is_generated_from_one_field() -> None:
    for name, parser in _parsers().items():
        made = parser_flags(parser)
        generated = {f.flag for f in made}
        actions = {s for a in parser._actions if a.dest not in ("help",) for s in a.option_strings
                   if not s.startswith("--no-") and not s.endswith("-no-precondition") and not s.endswith("-no-shrink")}
        assert actions == generated, (name, actions ^ generated)
        assert len(made) == len({(f.owner, f.field) for f in made}) == len(generated)


def test_the_command_line_shows_flags_for_a_refused_field() -> None:
    from leanml.prune.cli import prune_job

    parser = _parsers()["prune"]
    args = parser.parse_args(["--out", "o", "--method", "fista", "--fista-lambda", "0", "--fista-rounds", "3"])
    with pytest.raises(ConfigError) as exc:
        prune_job(args)
    assert cli_message(exc.value, parser_flags(parser)) == (
        "--fista-lambda 0 cannot be tuned by bisection; give a positive value or --fista-rounds 1")


def test_the_docs_list_every_flag_with_its_field_and_default() -> None:
    """docs/prune.md and docs/fasp.md carry one table row per generated flag: flag, field, default."""
    import re
    from pathlib import Path

    docs = Path(__file__).resolve().parents[2] / "docs"
    rows = {}
    for page in ("prune.md", "fasp.md"):
        for line in (docs / page).read_text().splitlines():
            m = re.match(r"\| `(--[\w-]+)`(?: / `--[\w-]+`)? \| `([\w.]+)` \| (.*?) \|", line)
            if m:
                rows[m.group(1)] = (m.group(2).split(".")[-1], m.group(3))
    for name, parser in _parsers().items():
        for f in parser_flags(parser):
            assert f.flag in rows, f"{name}: {f.flag} has no row in the docs' option tables"
            field = next(x for x in dataclasses.fields(f.owner) if x.name == f.field)
            shown = "required" if field.default is dataclasses.MISSING else f"`{field.default}`"
            assert rows[f.flag] == (f.field, shown), (f.flag, rows[f.flag])
