"""Nothing silently wrong: an option that another option would silently override is refused in one line
before any work (through the real CLI, and at the Python boundary); the Trainer callbacks stop a diverged
run at its step before anything non-finite is saved; a fake or cut ``.gguf`` under ``--stream`` is refused
in one line and leaves no folder in the cache."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from cli import conftest as cli_conftest
from cli.conftest import assert_unchanged, assert_user_error, run_cli, snapshot

llm_inputs = cli_conftest.llm_inputs  # the session fixture of tests/cli: a tiny LLaMA, its pruned copy, text

# ----------------------------------------------------------------------------------------------------
# options silently overridden by another option: refused, naming both


def _prune(inputs: Path, out: Path, *extra: str) -> list[str]:
    return ["prune", "--model", str(inputs / "model"), "--calib", str(inputs / "text.txt"), "--seqlen", "32",
            "--nsamples", "2", "--out", str(out), *extra]


def _recover(inputs: Path, out: Path, *extra: str) -> list[str]:
    return ["recover", "--model", str(inputs / "pruned"), "--data", str(inputs / "text.txt"), "--seqlen", "32",
            "--steps", "2", "--out", str(out), *extra]


PRUNE_CONFLICTS = [
    (("--method", "fasp", "--fasp-alloc", "uniform", "--fasp-plan-samples", "4"),
     ("--fasp-plan-samples sets the windows of --fasp-alloc score's pre-pass", "--fasp-alloc uniform")),
    (("--method", "sparsegpt", "--fasp-damp", "0.1"),
     ("--fasp-damp is read by --method fasp only; --method sparsegpt ignores it",)),
    (("--method", "wanda-sp", "--fasp-target", "dense"), ("--fasp-target is read by --method fasp only",)),
    (("--method", "fasp", "--fista-iters", "5"), ("--fista-iters is read by --method fista only",)),
    (("--method", "magnitude", "--sparsegpt-damp", "0.01"), ("--sparsegpt-damp", "--method magnitude ignores it")),
    # the flag is refused when typed, even at its default value
    (("--method", "sparsegpt", "--fasp-plan-samples", "8"),
     ("--fasp-plan-samples is read by --method fasp, magnitude-sp, wanda-sp or flap only",)),
    (("--method", "wanda", "--fista-no-precondition"), ("--fista-no-precondition is read by --method fista only",)),
    (("--no-eval", "--eval-data", "shakespeare"), ("--eval-data sets the perplexity's corpus", "without --eval")),
    (("--stream", "--no-eval", "--eval-data", "shakespeare"), ("--eval-data", "--stream")),
]


@pytest.mark.parametrize("extra,needles", PRUNE_CONFLICTS, ids=[" ".join(c[0]) for c in PRUNE_CONFLICTS])
def test_prune_refuses_an_option_another_one_overrides(llm_inputs, tmp_path, extra, needles) -> None:
    before = snapshot(tmp_path, llm_inputs)
    result = run_cli(_prune(llm_inputs, tmp_path / "out", *extra))
    assert_user_error(result, *needles)
    assert_unchanged(before, tmp_path, llm_inputs)


def test_the_method_options_given_to_their_method_still_run(llm_inputs, tmp_path) -> None:
    result = run_cli(_prune(llm_inputs, tmp_path / "out", "--method", "sparsegpt", "--sparsegpt-damp", "0.02",
                            "--no-eval", "--threads", "1"))
    assert result.code == 0, str(result)


@pytest.mark.parametrize("extra,flag", [(("--eval-data", "shakespeare"), "--eval-data"),
                                        (("--eval-seqlen", "64"), "--eval-seqlen")])
def test_recover_refuses_evaluation_options_with_no_eval(llm_inputs, tmp_path, extra, flag) -> None:
    before = snapshot(tmp_path, llm_inputs)
    result = run_cli(_recover(llm_inputs, tmp_path / "out", "--no-eval", *extra))
    assert_user_error(result, f"{flag} sets the perplexity, which --no-eval skips")
    assert_unchanged(before, tmp_path, llm_inputs)


def test_ctr_assign_refuses_a_seed_with_images_and_fit_refuses_captions_with_data(tmp_path) -> None:
    (tmp_path / "imgs").mkdir()
    (tmp_path / "caps.csv").write_text("ad_id,caption\n1,a red dress\n")
    before = snapshot(tmp_path)
    assign = run_cli(["ctr", "content-ids", "assign", "--model", str(tmp_path / "cid"), "--images",
                      str(tmp_path / "imgs"), "--seed", "3", "--out", str(tmp_path / "ids.parquet")])
    assert_user_error(assign, "--seed draws a built-in dataset's ads", "--images")
    fit = run_cli(["ctr", "content-ids", "fit", "--data", "fashion", "--captions", str(tmp_path / "caps.csv"),
                   "--out", str(tmp_path / "cid")])
    assert_user_error(fit, "--captions label the ads of --images", "--data")
    assert_unchanged(before, tmp_path)


def test_python_recover_with_distillation_and_no_teacher_is_a_value_error() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from leanml.recover import recover
    from leanml.recover.config import RecoverConfig

    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    windows = torch.randint(0, 32, (2, 8))
    weights = {n: p.clone() for n, p in model.named_parameters()}
    for cfg, needle in ((RecoverConfig(kd_weight=0.7), "config.kd_weight=0.7"),
                        (RecoverConfig(temperature=2.0), "config.temperature=2.0")):
        with pytest.raises(ValueError, match=r"^teacher is None, but " + needle.replace(".", r"\.")) as exc:
            recover(model, windows, cfg, progress=False)
        assert "\n" not in str(exc.value)
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())  # nothing trained


def test_python_prune_refuses_options_of_another_method() -> None:
    from leanml.config import ConfigError
    from leanml.prune.config import PruneConfig
    from leanml.prune.methods.fasp import FaspOptions, StructuredOptions

    with pytest.raises(ConfigError, match="wanda-sp takes StructuredOptions, got FaspOptions .whose damp, target"):
        PruneConfig(method="wanda-sp", sparsity=0.2, options=FaspOptions(damp=0.1))
    PruneConfig(method="wanda-sp", sparsity=0.2, options=StructuredOptions())
    with pytest.raises(ConfigError, match="plan_samples sets the windows of alloc score's pre-pass"):
        FaspOptions(alloc="uniform", plan_samples=8)
    assert FaspOptions(alloc="uniform").plan_samples == 8


def test_the_docs_list_every_refused_pair() -> None:
    root = Path(__file__).resolve().parents[1]
    text = "\n".join(p.read_text() for p in (root / "docs").glob("*.md"))
    for pair in ("`--fasp-plan-samples` with `--fasp-alloc uniform`", "`--eval-data` with `--no-eval`",
                 "--eval-seqlen` with `--no-eval`", "a method option with a `--method` that does not read it",
                 "`--seed` with `--images`", "`--captions` with `--data`", "`kd_weight` or `temperature`"):
        assert pair in text, pair


# ----------------------------------------------------------------------------------------------------
# the Trainer callbacks stop a diverged run at its step


def _trainer(tmp_path: Path, callback, lr: float = 1e-3, model=None):
    from torch.utils.data import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    torch.manual_seed(0)
    if model is None:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
        with torch.no_grad():  # a pruned model: half of every decoder linear's weights are zero
            for name, p in model.named_parameters():
                if "layers." in name and p.dim() == 2:
                    p[:, ::2] = 0

    class Windows(Dataset):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            ids = torch.randint(0, 32, (8,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    args = TrainingArguments(output_dir=str(tmp_path / "run"), learning_rate=lr, max_steps=3, save_steps=1,
                             per_device_train_batch_size=2, report_to=[], use_cpu=True, logging_steps=1,
                             save_strategy="steps", dataloader_num_workers=0, disable_tqdm=True,
                             remove_unused_columns=False)
    return Trainer(model=model, args=args, train_dataset=Windows(), callbacks=[callback]), model


def _saved_checkpoints(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "run").glob("checkpoint-*"))


def test_keep_masks_callback_stops_an_infinite_learning_rate_at_step_1(tmp_path) -> None:
    from leanml.finite import NonFiniteError
    from leanml.recover import KeepMasksCallback

    trainer, model = _trainer(tmp_path, KeepMasksCallback(), lr=math.inf)
    with pytest.raises(NonFiniteError, match=r"^KeepMasksCallback: the optimizer step 1 made .* NaN or infinite: "
                                             r"lower the learning rate \(TrainingArguments learning_rate=inf\)"):
        trainer.train()
    assert _saved_checkpoints(tmp_path) == []  # the diverged weights were never saved


def test_keep_masks_callback_stops_an_infinite_loss_before_the_optimizer_step(tmp_path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from leanml.finite import NonFiniteError
    from leanml.recover import KeepMasksCallback

    class InfiniteLoss(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.loss = out.loss * math.inf
            return out

    model = InfiniteLoss(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layers." in name and p.dim() == 2:
                p[:, ::2] = 0
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer, _ = _trainer(tmp_path, KeepMasksCallback(), model=model)
    with pytest.raises(NonFiniteError, match=r"^KeepMasksCallback: the gradient of .* is not finite at step 1 "):
        trainer.train()
    assert _saved_checkpoints(tmp_path) == []
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())  # no step was taken


def test_adacc_callback_stops_an_infinite_learning_rate_and_checks_its_arguments(tmp_path) -> None:
    from leanml.finite import NonFiniteError
    from leanml.memory import AdaccCallback

    for bad, err in (({"budget": [0.5]}, TypeError), ({"report_name": 3}, TypeError),
                     ({"report_name": "../x.json"}, ValueError), ({"check_finite": "yes"}, TypeError)):
        with pytest.raises(err, match=next(iter(bad))):
            AdaccCallback(**bad)
    trainer, _ = _trainer(tmp_path, AdaccCallback(budget=0.9), lr=math.inf)
    with pytest.raises(NonFiniteError, match=r"^AdaccCallback: the optimizer step 1 made"):
        trainer.train()
    assert _saved_checkpoints(tmp_path) == []


def test_a_finite_run_with_both_callbacks_trains_and_saves(tmp_path) -> None:
    from leanml.recover import KeepMasksCallback

    trainer, model = _trainer(tmp_path, KeepMasksCallback())
    trainer.train()
    assert len(_saved_checkpoints(tmp_path)) == 3
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


# ----------------------------------------------------------------------------------------------------
# a fake or cut .gguf under --stream


def _gguf_source() -> Path:
    from leanml.data.offline import smollm2_gguf

    return smollm2_gguf()


@pytest.mark.parametrize("kind", ["fake", "cut", "header-only"])
def test_stream_refuses_a_bad_gguf_and_leaves_no_folder_in_the_cache(llm_inputs, tmp_path, kind) -> None:
    path = tmp_path / f"{kind}.gguf"
    if kind == "fake":
        path.write_bytes(b"GGUF\x03\x00\x00\x00 not a model")
    else:
        with open(_gguf_source(), "rb") as f:
            path.write_bytes(f.read(30_000_000 if kind == "cut" else 4096))
    cache = tmp_path / "cache"
    before = snapshot(tmp_path)
    result = run_cli(["prune", "--model", str(path), "--stream", "--no-eval", "--calib", str(llm_inputs / "text.txt"),
                      "--out", str(tmp_path / "out")], env={"LEANML_CACHE": str(cache)})
    assert_user_error(result, path.name)
    assert not cache.exists()
    assert_unchanged(before, tmp_path)


def test_stream_of_a_gguf_into_a_read_only_cache_names_leanml_cache(llm_inputs, tmp_path) -> None:
    from cli.parallel import readonly_dir

    cache = readonly_dir(tmp_path / "ro-cache")
    result = run_cli(["prune", "--model", str(_gguf_source()), "--stream", "--no-eval", "--calib",
                      str(llm_inputs / "text.txt"), "--out", str(tmp_path / "out")], env={"LEANML_CACHE": str(cache)})
    assert_user_error(result, "LEANML_CACHE", str(cache))
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------------------------------
# the bytes a save needs, estimated before the work


def test_stream_with_too_little_space_is_refused_before_the_work(llm_inputs, tmp_path, monkeypatch, capsys) -> None:
    from leanml import faults
    from leanml.cli import main

    monkeypatch.setattr(faults, "free_bytes", lambda path: 999)
    out = tmp_path / "out"
    assert main(["prune", "--model", str(llm_inputs / "model"), "--stream", "--no-eval", "--calib",
                 str(llm_inputs / "text.txt"), "--seqlen", "32", "--nsamples", "2", "--threads", "1",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("leanml: error:")]
    assert len(lines) == 1 and "streamed" not in err, err
    assert f"not enough disk space for the pruned model in {tmp_path}: it needs about " in lines[0], lines
    assert "999 bytes free" in lines[0] and "unknown" not in lines[0], lines
    assert not out.exists() and not (tmp_path / "out.ckpt").exists() and not list(tmp_path.glob(".out*"))


def test_a_ctr_run_with_too_little_space_is_refused_before_its_save(tmp_path, monkeypatch) -> None:
    import numpy as np

    from leanml import faults
    from leanml.ctr.content import ItemFeatures
    from leanml.ctr.data import fashion_ads
    from leanml.ctr.options import CTRConfig
    from leanml.ctr.runs import save_ctr_run
    from leanml.ctr.train import run_ctr
    from leanml.errors import LeanmlError

    data = fashion_ads(n_ads=200, n_users=20, per_day=500, seed=5)
    rng = np.random.default_rng(2)
    items = ItemFeatures(rng.integers(0, 8, (200, 2)), rng.normal(size=(200, 16)).astype(np.float32), 2, 8)
    model, builder, rep = run_ctr(data, items, CTRConfig(model="deepfm", features="visual", epochs=1), progress=False)
    monkeypatch.setattr(faults, "free_bytes", lambda path: 999)
    with pytest.raises(LeanmlError, match=rf"^not enough disk space for the CTR run in {tmp_path}: it needs about "
                                          r"[\d.,]+ kB, 999 bytes free; "
                                          r"free space there or choose another output folder$"):
        save_ctr_run(tmp_path / "run", model, builder, rep)
    assert list(tmp_path.iterdir()) == []


def test_a_content_id_model_with_too_little_space_is_refused_before_its_save(tmp_path, monkeypatch) -> None:
    from leanml import faults
    from leanml.ctr.content_ids.config import ContentIDConfig
    from leanml.ctr.content_ids.trainer import ContentIDModel, save_content_model
    from leanml.errors import LeanmlError

    model = ContentIDModel(ContentIDConfig(kind="cnn", dim=16, m=4, k=8, width=4))
    monkeypatch.setattr(faults, "free_bytes", lambda path: 999)
    with pytest.raises(LeanmlError, match=rf"^not enough disk space for the content-ID model in {tmp_path}: it needs "
                                          r"about [\d.,]+ kB, 999 bytes free; "
                                          r"free space there or choose another output folder$"):
        save_content_model(model, tmp_path / "cid", {"note": "test"})
    assert list(tmp_path.iterdir()) == []


def test_recover_with_too_little_space_is_refused_before_training(llm_inputs, tmp_path, monkeypatch, capsys) -> None:
    from leanml import faults
    from leanml.cli import main

    monkeypatch.setattr(faults, "free_bytes", lambda path: 999)
    out = tmp_path / "out"
    assert main(_recover(llm_inputs, out, "--no-eval", "--threads", "1")) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("leanml: error:")]
    assert len(lines) == 1 and "step" not in err, err
    assert f"not enough disk space for the recovered model in {tmp_path}: it needs about " in lines[0], lines
    assert "999 bytes free" in lines[0], lines
    assert not out.exists() and not list(tmp_path.glob(".out*"))
