"""Nothing non-finite goes unnoticed: training loops stop at the first NaN or infinite loss or gradient
(one line naming the step and the likely option, exit 2, nothing saved), every saver refuses a NaN
tensor before writing, and solvers that fail numerically name the option that caused it and leave no
checkpoint behind. The command-line cases run the real CLI on a tiny random LLaMA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cli.conftest import SAMPLE_TEXT, assert_user_error, run_cli, save_tiny_llama, save_zeroed_copy
from leanml.finite import (
    NonFiniteError,
    check_finite_step,
    check_finite_tensors,
    first_non_finite,
    lr_hint,
    solver_error,
)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """``model/`` (tiny LLaMA), ``pruned/`` (half its decoder weights zero), ``nan/`` (the model with one
    NaN in a norm weight, which no pruner touches) and ``text.txt``."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("finite")
    save_tiny_llama(root / "model")
    save_zeroed_copy(root / "model", root / "pruned")
    save_tiny_llama(root / "nan")
    weights = root / "nan" / "model.safetensors"
    state = load_file(str(weights))
    state["model.layers.1.post_attention_layernorm.weight"][3] = float("nan")
    save_file(state, str(weights), metadata={"format": "pt"})
    (root / "text.txt").write_text(SAMPLE_TEXT, encoding="utf-8")
    return root


def leftovers(folder: Path, name: str) -> list[str]:
    """Everything in ``folder`` whose name starts with ``name`` or ``.name`` (output, checkpoint, temporaries)."""
    return sorted(p.name for p in folder.iterdir() if p.name.lstrip(".").startswith(name))


# ---------------------------------------------------------------------------------------------------
# the checks themselves


def test_a_nan_gradient_is_named_with_its_parameter_and_step() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    loss = model(torch.randn(5, 3)).sum()
    loss.backward()
    check_finite_step(loss, model.named_parameters(), 1, lr_hint(1e-3))  # finite: passes
    model[1].bias.grad[0] = float("inf")
    with pytest.raises(NonFiniteError, match=r"gradient of 1\.bias is not finite at step 7.*\(lr 0\.5\)"):
        check_finite_step(loss, model.named_parameters(), 7, lr_hint(0.5))
    with pytest.raises(NonFiniteError, match=r"loss is nan at step 2 of recover.*--weight-decay 3"):
        check_finite_step(torch.tensor(float("nan")), model.named_parameters(), 2,
                          lr_hint(1e-3, "--weight-decay 3"), "recover")


def test_the_first_bad_tensor_is_named_with_its_count() -> None:
    state = {"a": torch.zeros(4), "ids": torch.arange(3), "b": torch.tensor([1.0, float("nan"), float("-inf")]),
             "c": torch.tensor([float("nan")])}
    assert first_non_finite(state.items()) == ("b", 2, 3)
    with pytest.raises(NonFiniteError, match="refusing to save the model: tensor b has 2 of 3 values"):
        check_finite_tensors(state.items(), "the model")
    check_finite_tensors({"a": torch.zeros(2), "ids": torch.arange(2)}.items(), "the model")


def test_solver_errors_name_the_statistics_when_they_are_not_finite() -> None:
    H = torch.eye(3)
    assert "--fasp-damp 1e+39" in str(solver_error("FASP", "--fasp-damp", 1e39, H))
    H[1, 1] = float("nan")
    message = str(solver_error("FASP", "--fasp-damp", 0.01, H))
    assert "input statistics" in message and "--fasp-damp" not in message


def test_save_model_refuses_a_nan_model_and_writes_nothing(tmp_path) -> None:
    from builders import tiny_llama
    from leanml.models import save_model
    from leanml.outputs import atomic_dir

    model = tiny_llama()
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[2, 5] = float("inf")
    for fmt in ("safetensors", "compressed"):
        with pytest.raises(NonFiniteError, match=r"tensor model\.layers\.0\.mlp\.up_proj\.weight has 1 of 8192"):
            with atomic_dir(tmp_path / fmt) as tmp:
                save_model(model, None, tmp, fmt, ["model.layers.0.mlp.up_proj"])
    assert list(tmp_path.iterdir()) == []


def test_a_shard_with_a_nan_is_not_written(tmp_path) -> None:
    from leanml.models.shards import ShardWriter

    writer = ShardWriter(tmp_path / "out")
    with pytest.raises(NonFiniteError, match="shard layer-00001.safetensors: tensor w"):
        writer.write("layer-00001", {"w": torch.full((2, 2), float("nan"))})
    assert list((tmp_path / "out").iterdir()) == []


def test_ctr_training_stops_at_the_first_non_finite_step() -> None:
    from ctr.test_train import tiny_data
    from leanml.ctr.fields import FieldBuilder
    from leanml.ctr.models import build_model
    from leanml.ctr.options import CTRConfig
    from leanml.ctr.train import train_ctr_model

    data = tiny_data()
    cfg = CTRConfig(model="dnn", features="id", epochs=50, batch_size=4, lr=1e30)
    b = FieldBuilder(data, None, cfg)
    model = build_model("dnn", b.specs, b.dense_dims)
    with pytest.raises(NonFiniteError, match=r"at step \d+ of CTR training.*\(lr 1e\+30\)"):
        train_ctr_model(model, *b.tensors(data.train), cfg, device=torch.device("cpu"), progress=False)


# ---------------------------------------------------------------------------------------------------
# through the CLI


def test_train_stops_at_a_diverging_step_and_saves_nothing(inputs, tmp_path) -> None:
    result = run_cli(["train", "--model", inputs / "model", "--data", inputs / "text.txt", "--seqlen", "32",
                      "--batch-size", "2", "--steps", "4", "--lr", "1e30", "--out", tmp_path / "out"])
    assert_user_error(result, "not finite at step", "--lr 1e+30", "nothing was saved", before_work=False)
    assert leftovers(tmp_path, "out") == []


def test_recover_stops_at_a_diverging_step_and_leaves_no_checkpoint(inputs, tmp_path) -> None:
    result = run_cli(["recover", "--model", inputs / "pruned", "--data", inputs / "text.txt", "--no-eval",
                      "--seqlen", "32", "--steps", "6", "--checkpoint-every", "1", "--batch-size", "2",
                      "--lr", "1e30", "--weight-decay", "0.1", "--out", tmp_path / "out"])
    assert_user_error(result, "at step", "--lr 1e+30", "--weight-decay 0.1", before_work=False)
    assert leftovers(tmp_path, "out") == []  # neither the output nor the checkpoint of the steps before


def test_a_model_with_nan_weights_is_refused_when_loaded(inputs, tmp_path) -> None:
    result = run_cli(["prune", "--model", inputs / "nan", "--calib", inputs / "text.txt", "--method", "magnitude",
                      "--seqlen", "32", "--nsamples", "4", "--no-eval", "--out", tmp_path / "out"])
    assert_user_error(result, "NaN or infinite", "model.layers.1.post_attention_layernorm.weight: 1 of 64",
                      before_work=False)  # after the loading bar, before any work
    assert leftovers(tmp_path, "out") == []


def test_a_streamed_read_refuses_nan_weights(inputs) -> None:
    from leanml.models.shards import ShardIndex

    index = ShardIndex(inputs / "nan")
    assert index.read(["model.layers.0.mlp.up_proj.weight"])  # finite tensors read as before
    with pytest.raises(NonFiniteError, match="post_attention_layernorm.weight: 1 of 64"):
        index.read(["model.layers.1.post_attention_layernorm.weight"])


@pytest.mark.parametrize("every, saver", [("2", "the recovery checkpoint"), ("10", "the model")])
def test_the_saver_refuses_the_nan_model_a_diverged_run_would_save(inputs, tmp_path, monkeypatch, capsys,
                                                                   one_thread, every, saver) -> None:
    """With the training loop's check switched off, the NaN weights reach the saver (the checkpoint's
    after 2 steps, else the model's), which refuses them: exit 2, one line naming the first bad tensor,
    no output and no checkpoint."""
    import leanml.train.runner
    from leanml.cli import main

    monkeypatch.setattr(leanml.train.runner, "check_finite_step", lambda *args, **kwargs: None)
    code = main(["recover", "--model", str(inputs / "pruned"), "--data", str(inputs / "text.txt"), "--no-eval",
                 "--seqlen", "32", "--steps", "4", "--checkpoint-every", every, "--batch-size", "2", "--lr", "1e30",
                 "--memory", "none", "--threads", "1", "--out", str(tmp_path / "out")])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("leanml: error:")]
    assert code == 2 and len(errors) == 1, errors
    assert f"refusing to save {saver}" in errors[0] and "tensor model." in errors[0], errors
    assert "NaN or infinite" in errors[0]
    assert leftovers(tmp_path, "out") == []


@pytest.mark.parametrize("method, flag", [("sparsegpt", "--sparsegpt-damp"), ("fasp", "--fasp-damp")])
def test_a_damping_that_breaks_the_solver_is_named_and_leaves_no_checkpoint(inputs, tmp_path, method, flag) -> None:
    # finite, but the damped matrix overflows float32: the factorisation fails
    args = ["prune", "--model", inputs / "model", "--calib", inputs / "text.txt", "--method", method, flag, "1e39",
            "--seqlen", "32", "--nsamples", "4", "--no-eval", "--out", tmp_path / "out"]
    for _ in range(2):  # the rerun is not blocked by a checkpoint of the first
        result = run_cli(args)
        assert_user_error(result, f"{flag} 1e+39", "positive definite", before_work=False)
        assert "interrupted" not in result.stderr
        assert leftovers(tmp_path, "out") == []
