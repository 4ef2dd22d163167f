"""The Python API and the command line make the same choices; dtypes, devices and the compressed
save format."""

from __future__ import annotations

import json

import pytest
import torch

from builders import tiny_family
from leanml.cli import main
from leanml.errors import LeanmlError
from leanml.models import check_dtype, count_parameters, decoder_linear_names, save_model
from leanml.models.compressed import is_compressed_dir, load_compressed
from leanml.prune.base import Pruner
from leanml.prune.engine import prune_model
from leanml.prune.masks import MaskSpec
from leanml.prune.methods import pruner_class
from leanml.prune.methods.baselines import SparseGPTPruner

CALIB = torch.randint(0, 256, (4, 24), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("method,scope", [("sparsegpt", "layer"), ("wanda", "row"), ("magnitude", "layer"),
                                          ("fista", "layer")])
def test_an_open_scope_is_the_methods_own(method, scope):
    pruner = pruner_class(method)()
    assert pruner.resolve_spec(MaskSpec(0.5)).scope == scope
    assert pruner.resolve_spec(MaskSpec(0.5, scope="row")).scope == "row"  # an explicit scope stays
    report = prune_model(tiny_family("llama", layers=1), CALIB, pruner, MaskSpec(0.5), progress=False,
                         layers=[0])
    assert report["mask"]["scope"] == scope


def test_python_api_and_cli_prune_with_the_same_scope_and_weights(tiny_model_dir, tmp_path):
    from leanml.data.text import calibration_windows
    from leanml.models import load_model

    out = tmp_path / "cli"
    assert main(["prune", "--model", str(tiny_model_dir), "--method", "sparsegpt", "--nsamples", "4",
                 "--seqlen", "32", "--no-eval", "--out", str(out)]) == 0
    cli_report = json.loads((out / "report.json").read_text())
    model, tok = load_model(str(tiny_model_dir))
    calib = calibration_windows(tok, "shakespeare", 4, 32, 0)
    report = prune_model(model, calib, SparseGPTPruner(), MaskSpec(0.5), batch_size=4, progress=False)
    assert report["mask"]["scope"] == cli_report["mask"]["scope"] == "layer"
    cli_model, _ = load_model(str(out))
    for (name, a), b in zip(model.state_dict().items(), cli_model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


class _Record(SparseGPTPruner):
    def prune_group(self, group, stats, spec):
        self.dtypes = getattr(self, "dtypes", set()) | {stats.H.dtype}
        return super().prune_group(group, stats, spec)


def test_bfloat16_weights_with_float32_statistics():
    model = tiny_family("llama").to(torch.bfloat16)
    pruner = _Record()
    prune_model(model, CALIB, pruner, MaskSpec(0.5), progress=False, batch_size=2)
    assert pruner.dtypes == {torch.float32}
    for name in decoder_linear_names(model):
        w = model.get_submodule(name).weight
        assert w.dtype == torch.bfloat16 and int((w == 0).sum()) == w.numel() // 2


def test_a_device_that_cannot_run_the_dtype_is_a_one_line_error():
    check_dtype(torch.bfloat16, "cpu")
    with pytest.raises(LeanmlError, match="dtype bfloat16 cannot run on meta"):
        check_dtype(torch.bfloat16, "meta")


def test_engine_leaves_the_weights_where_they_are():
    class Where(Pruner):
        name = "where"

        def prune_group(self, group, stats, spec):
            self.seen = next(iter(group.linears.values())).weight.device
            return {}

    model = tiny_family("opt")
    pruner = Where()
    prune_model(model, CALIB, pruner, MaskSpec(0.5), device="cpu", progress=False)
    assert pruner.seen.type == "cpu" and all(p.device.type == "cpu" for p in model.parameters())


def test_compressed_format_reloads_the_same_weights_and_is_smaller(tmp_path):
    model = tiny_family("gemma3_text")
    prune_model(model, CALIB, pruner_class("wanda")(), MaskSpec(0.5), progress=False)
    names = decoder_linear_names(model)
    sizes = save_model(model, None, tmp_path / "c", "compressed", names, 0.5)
    save_model(model, None, tmp_path / "d")
    assert is_compressed_dir(tmp_path / "c") and not is_compressed_dir(tmp_path / "d")
    loaded = load_compressed(tmp_path / "c")
    assert count_parameters(loaded) == count_parameters(model)
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    # values (half of the float32 weights) plus one bit per weight and row offsets
    assert 0.5 < sizes["compressed_bytes"] / sizes["dense_bytes"] < 0.56
    config = json.loads((tmp_path / "c" / "config.json").read_text())
    assert config["leanml_compressed"]["format"] == "sparse-bitmask"
    assert "model.embed_tokens" not in config["leanml_compressed"]["targets"]
