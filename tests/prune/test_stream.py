"""Streamed pruning (:mod:`leanml.prune.stream`) against the in-memory engine: bit-identical weights on
every family and method, resume after a kill, spilled streams, and one-line errors on bad input."""

from __future__ import annotations

import errno
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from builders import FAMILIES, tiny_family
from leanml.errors import LeanmlError
from leanml.models.layout import get_adapter
from leanml.models.shards import INDEX_NAME, ShardIndex, ShardWriter, build_skeleton, read_header
from leanml.prune.engine import prune_model
from leanml.prune.engine.shard_store import DiskStream
from leanml.prune.masks import MaskSpec
from leanml.prune.methods import pruner_class
from leanml.prune.methods.fista import FistaPruner
from leanml.prune.stream import parse_memory, prune_streamed

CALIB = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))


def _pruner(method: str):
    if method == "fista":
        return FistaPruner(rounds=1, iters=4, refine=2)
    return pruner_class(method)()


def _save(model, path, shard_size: str | None = None):
    if shard_size is None:
        model.save_pretrained(path)
    else:
        model.save_pretrained(path, max_shard_size=shard_size)
    return path


def _out_tensors(path) -> dict[str, torch.Tensor]:
    index = ShardIndex(path)
    return index.read(index.names())


def _in_memory(src, method, spec, dtype=torch.float32, **kw):
    model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype).eval()
    model.config.use_cache = False
    report = prune_model(model, CALIB, _pruner(method), spec, progress=False, batch_size=2, device="cpu", **kw)
    return model, report


def _assert_same(model, out) -> None:
    got = _out_tensors(out)
    ref = model.state_dict()
    stored = {k: v for k, v in ref.items() if k in got}
    assert set(got) == set(stored)
    for k, v in stored.items():
        assert torch.equal(got[k], v), k


def test_shard_writer_and_index_round_trip(tmp_path):
    w = ShardWriter(tmp_path)
    w.write("a", {"x.weight": torch.arange(6.0).reshape(2, 3)})
    w.write("b", {"y.weight": torch.ones(4, dtype=torch.bfloat16)})
    w.finish()
    index = ShardIndex(tmp_path)
    assert sorted(index.names()) == ["x.weight", "y.weight"]
    assert index.shape("x.weight") == (2, 3) and index.nbytes("y.weight") == 8
    assert index.nbytes("y.weight", torch.float32) == 16
    t = index.read(["x.weight", "y.weight"], torch.float32)
    assert torch.equal(t["x.weight"], torch.arange(6.0).reshape(2, 3)) and t["y.weight"].dtype == torch.float32
    assert json.loads((tmp_path / INDEX_NAME).read_text())["weight_map"] == {"x.weight": "a.safetensors",
                                                                                "y.weight": "b.safetensors"}


def test_skeleton_has_no_weights(tmp_path):
    src = _save(tiny_family("llama"), tmp_path / "m")
    model = build_skeleton(src, torch.float32)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_disk_stream_reads_row_ranges_and_pickles_as_its_path(tmp_path):
    x = torch.randn(5, 3, 4, dtype=torch.bfloat16)
    d = DiskStream.write(x, tmp_path / "s.bin", rows=2)
    assert d.shape == x.shape and torch.equal(d[1:4], x[1:4]) and torch.equal(d[:2], x[:2])
    torch.save({"s": d}, tmp_path / "c.pt")
    back = torch.load(tmp_path / "c.pt", weights_only=False)["s"]
    assert torch.equal(back[:], x)


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_equals_in_memory_on_every_family(family, tmp_path, one_thread):
    src = _save(tiny_family(family), tmp_path / "src", shard_size="60KB")
    assert (src / INDEX_NAME).exists()  # several shards
    methods = [("sparsegpt", MaskSpec(0.5)), ("wanda", MaskSpec(pattern=(2, 4))), ("fista", MaskSpec(0.5))]
    if family in ("llama", "qwen2"):
        methods += [("magnitude", MaskSpec(0.5)), ("fasp", MaskSpec(0.25))]
    for method, spec in methods:
        model, _ = _in_memory(src, method, spec)
        out = tmp_path / f"out-{method}"
        prune_streamed(src, out, CALIB, _pruner(method), spec, progress=False, batch_size=2)
        _assert_same(model, out)
        loaded = AutoModelForCausalLM.from_pretrained(out).eval()  # plain transformers loads it
        with torch.no_grad():
            torch.testing.assert_close(loaded(CALIB[:1]).logits, model(CALIB[:1]).logits, rtol=0, atol=0)


def test_fasp_streamed_shrinks_and_writes_the_config(tmp_path, one_thread):
    src = _save(tiny_family("qwen2"), tmp_path / "src")
    model, ref = _in_memory(src, "fasp", MaskSpec(0.25))
    info = ref["finalize"]
    out = tmp_path / "out"
    report = prune_streamed(src, out, CALIB, _pruner("fasp"), MaskSpec(0.25), progress=False, batch_size=2)
    assert report["finalize"]["intermediate_size"] == info["intermediate_size"] < 128
    assert json.loads((out / "config.json").read_text())["intermediate_size"] == info["intermediate_size"]
    _assert_same(model, out)


def test_bfloat16_streamed_equals_in_memory_and_reports_memory(tmp_path, one_thread):
    src = _save(tiny_family("llama"), tmp_path / "src")
    model, _ = _in_memory(src, "sparsegpt", MaskSpec(0.5), dtype=torch.bfloat16)
    out = tmp_path / "out"
    report = prune_streamed(src, out, CALIB, _pruner("sparsegpt"), MaskSpec(0.5), dtype=torch.bfloat16,
                            progress=False, batch_size=2)
    _assert_same(model, out)
    st = report["stream"]
    assert st["peak_rss_bytes"] > 0 and st["weights_bytes"] == sum(
        p.numel() * 2 for p in model.parameters())
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.fixture
def no_process(monkeypatch):
    """The cap counted for the run's own tensors only (the test process's resident set set aside), so a
    cap just above the layer floor spills every stream."""
    monkeypatch.setattr("leanml.prune.stream.resident_bytes", lambda: 0)


def test_spilled_streams_give_the_same_result(tmp_path, one_thread, no_process):
    src = _save(tiny_family("llama", layers=3), tmp_path / "src")
    model, _ = _in_memory(src, "sparsegpt", MaskSpec(0.5))
    index = ShardIndex(src)
    from leanml.prune.engine.shard_store import memory_floor

    skel = build_skeleton(src, torch.float32)
    floor = memory_floor(index, skel, get_adapter(skel), torch.float32)["floor_bytes"]
    out = tmp_path / "out"
    report = prune_streamed(src, out, CALIB, _pruner("sparsegpt"), MaskSpec(0.5), max_memory=floor + 1,
                            progress=False, batch_size=2, checkpoint_dir=tmp_path / "ckpt")
    assert report["stream"]["spilled_layers"] == [0, 1, 2]
    _assert_same(model, out)


class _Kill(Exception):
    pass


@pytest.mark.parametrize("method,spec", [("sparsegpt", MaskSpec(0.5)), ("fasp", MaskSpec(0.25))])
def test_resume_after_a_kill_gives_the_same_result(method, spec, tmp_path, monkeypatch, one_thread):
    src = _save(tiny_family("llama", layers=3), tmp_path / "src")
    model, _ = _in_memory(src, method, spec)
    import leanml.prune.engine.shard_store as shard_store

    real = shard_store.ShardStore.load

    def dying(self, idx, layer):
        if idx == 2 and self.writer.has("layer-00001"):  # the walk (not a pre-pass) reaches layer 2
            raise _Kill
        return real(self, idx, layer)

    monkeypatch.setattr(shard_store.ShardStore, "load", dying)
    ckpt = tmp_path / "ckpt"
    out = tmp_path / "out"
    with pytest.raises(_Kill):
        prune_streamed(src, out, CALIB, _pruner(method), spec, progress=False, batch_size=2, checkpoint_dir=ckpt,
                       fingerprint={"m": 1}, sequential=True)
    assert sorted(p.name for p in (ckpt / "shards").glob("*.safetensors")) == ["layer-00000.safetensors",
                                                                               "layer-00001.safetensors"]
    monkeypatch.setattr(shard_store.ShardStore, "load", real)
    report = prune_streamed(src, out, CALIB, _pruner(method), spec, progress=False, batch_size=2,
                            checkpoint_dir=ckpt, fingerprint={"m": 1}, sequential=True)
    assert report["engine"]["resumed_from_layer"] == 2
    _assert_same(model, out)


def test_layer_checkpointed_but_not_written_is_recovered_on_resume(tmp_path, monkeypatch, one_thread):
    src = _save(tiny_family("llama", layers=2), tmp_path / "src")
    model, _ = _in_memory(src, "wanda", MaskSpec(0.5))
    import leanml.prune.engine.shard_store as shard_store

    real = shard_store.ShardStore.release

    def dying(self, idx, layer):
        if idx == 1:
            raise _Kill  # killed after layer 1's checkpoint, before its shard
        return real(self, idx, layer)

    monkeypatch.setattr(shard_store.ShardStore, "release", dying)
    ckpt = tmp_path / "ckpt"
    with pytest.raises(_Kill):
        prune_streamed(src, tmp_path / "out", CALIB, _pruner("wanda"), MaskSpec(0.5), progress=False, batch_size=2,
                       checkpoint_dir=ckpt)
    assert not (ckpt / "shards" / "layer-00001.safetensors").exists()
    monkeypatch.setattr(shard_store.ShardStore, "release", real)
    report = prune_streamed(src, tmp_path / "out", CALIB, _pruner("wanda"), MaskSpec(0.5), progress=False,
                            batch_size=2, checkpoint_dir=ckpt)
    assert report["engine"]["resumed_from_layer"] == 2
    _assert_same(model, tmp_path / "out")


# --------------------------------------------------------------------------------------------------
# bad input


def test_cap_below_one_layer_names_the_smallest_cap(tmp_path):
    src = _save(tiny_family("llama"), tmp_path / "src")
    with pytest.raises(LeanmlError, match=r"smallest cap that works is \d+MiB") as err:
        prune_streamed(src, tmp_path / "out", CALIB, _pruner("wanda"), MaskSpec(0.5), max_memory=1000,
                       progress=False)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()


def test_missing_shard_names_a_tensor(tmp_path):
    src = _save(tiny_family("llama"), tmp_path / "src", shard_size="60KB")
    index = json.loads((src / INDEX_NAME).read_text())["weight_map"]
    victim = sorted(set(index.values()))[1]
    (src / victim).unlink()
    with pytest.raises(LeanmlError, match=rf"shard {victim} is missing .* holds model\."):
        prune_streamed(src, tmp_path / "out", CALIB, _pruner("wanda"), MaskSpec(0.5), progress=False)


def test_truncated_shard_names_the_cut_tensor(tmp_path):
    src = _save(tiny_family("llama"), tmp_path / "src", shard_size="60KB")
    index = json.loads((src / INDEX_NAME).read_text())["weight_map"]
    victim = src / sorted(set(index.values()))[1]
    header = read_header(victim)
    last = max(header, key=lambda k: header[k]["data_offsets"][1])
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) - 10])
    with pytest.raises(LeanmlError, match=rf"truncated: tensor {last} is cut off"):
        prune_streamed(src, tmp_path / "out", CALIB, _pruner("wanda"), MaskSpec(0.5), progress=False)


def test_shard_truncated_while_the_run_reads_it_names_the_tensor(tmp_path, monkeypatch):
    src = _save(tiny_family("llama"), tmp_path / "src")
    index = ShardIndex(src)
    path = src / "model.safetensors"
    header = read_header(path)
    last = max(header, key=lambda k: header[k]["data_offsets"][1])
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(LeanmlError, match=rf"tensor {last} is cut off"):
        index.read([last])


def test_pickle_only_directory_is_refused(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    torch.save({"w": torch.ones(2)}, src / "pytorch_model.bin")
    (src / "config.json").write_text("{}")
    with pytest.raises(LeanmlError, match="pytorch_model.bin.*save_pretrained"):
        ShardIndex(src)


def test_disk_full_while_spilling_is_one_line_and_keeps_written_layers(tmp_path, monkeypatch, one_thread,
                                                                       no_process):
    src = _save(tiny_family("llama", layers=3), tmp_path / "src")
    ckpt = tmp_path / "ckpt"
    import leanml.prune.engine.shard_store as shard_store

    skel = build_skeleton(src, torch.float32)
    floor = shard_store.memory_floor(ShardIndex(src), skel, get_adapter(skel), torch.float32)["floor_bytes"]
    orig_open = open

    def no_space_open(file, mode="r", *a, **k):
        if str(file).endswith(".bin.tmp") and "stream-00001" in str(file):
            raise OSError(errno.ENOSPC, "No space left on device")
        return orig_open(file, mode, *a, **k)

    monkeypatch.setattr("builtins.open", no_space_open)
    with pytest.raises(LeanmlError, match="disk full while spilling") as err:
        prune_streamed(src, tmp_path / "out", CALIB, _pruner("wanda"), MaskSpec(0.5), max_memory=floor + 1,
                       progress=False, batch_size=2, checkpoint_dir=ckpt)
    assert "\n" not in str(err.value)
    assert (ckpt / "shards" / "layer-00000.safetensors").exists()
    assert not list((ckpt / "streams").glob("*.tmp"))
    monkeypatch.setattr("builtins.open", orig_open)
    model, _ = _in_memory(src, "wanda", MaskSpec(0.5))
    prune_streamed(src, tmp_path / "out", CALIB, _pruner("wanda"), MaskSpec(0.5), max_memory=floor + 1,
                   progress=False, batch_size=2, checkpoint_dir=ckpt)
    _assert_same(model, tmp_path / "out")


def test_parse_memory():
    assert parse_memory("1.2GB") == 1_200_000_000 and parse_memory("512MiB") == 512 * 2**20
    assert parse_memory(None) is None and parse_memory("100") == 100
    with pytest.raises(LeanmlError, match="not a size"):
        parse_memory("lots")


# --------------------------------------------------------------------------------------------------
# command line


def test_cli_stream_equals_the_in_memory_cli(tiny_model_dir, tmp_path, capsys):
    from leanml.cli import main

    common = ["prune", "--model", str(tiny_model_dir), "--method", "sparsegpt", "--nsamples", "4", "--seqlen", "32",
              "--no-eval", "--threads", "1"]
    assert main([*common, "--out", str(tmp_path / "mem")]) == 0
    assert main([*common, "--stream", "--max-memory", "2GB", "--out", str(tmp_path / "st")]) == 0
    assert "streamed: peak RSS" in capsys.readouterr().out
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "mem")
    _assert_same(ref, tmp_path / "st")
    report = json.loads((tmp_path / "st" / "report.json").read_text())
    assert report["stream"]["max_memory_bytes"] == 2 * 10**9 and report["stream"]["peak_rss_bytes"] > 0
    assert not (tmp_path / "st.ckpt").exists()


def test_cli_cap_below_a_layer_is_one_line(tiny_model_dir, tmp_path, capsys):
    from leanml.cli import main

    assert main(["prune", "--model", str(tiny_model_dir), "--method", "wanda", "--nsamples", "2", "--seqlen", "16",
                 "--no-eval", "--max-memory", "10kB", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "smallest cap that works" in err[0]
    assert not (tmp_path / "o").exists()


# --------------------------------------------------------------------------------------------------
# the real model (slow)


@pytest.mark.slow
def test_smollm2_streamed_equals_in_memory(smollm2_dir, tmp_path):
    from transformers import AutoTokenizer

    from leanml.data.text import calibration_windows

    calib = calibration_windows(AutoTokenizer.from_pretrained(smollm2_dir), "shakespeare", 4, 128, 0)
    for method in ("wanda", "sparsegpt"):
        model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
        model.config.use_cache = False
        prune_model(model, calib, _pruner(method), MaskSpec(0.5), progress=False, batch_size=4, device="cpu")
        out = tmp_path / method
        prune_streamed(smollm2_dir, out, calib, _pruner(method), MaskSpec(0.5), progress=False, batch_size=4)
        _assert_same(model, out)
        del model


@pytest.mark.slow
def test_gguf_converts_tensor_by_tensor_to_what_transformers_loads(smollm2_dir, tmp_path):
    from leanml.data.offline import smollm2_gguf
    from leanml.models.shards import gguf_to_safetensors

    out = gguf_to_safetensors(smollm2_gguf(), tmp_path / "conv", shard_bytes=100 * 2**20, progress=False)
    assert len(list(out.glob("*.safetensors"))) > 1  # several shards
    got, ref = ShardIndex(out), ShardIndex(smollm2_dir)
    assert sorted(got.names()) == sorted(ref.names())
    for name in ref.names():
        assert torch.equal(got.read([name])[name], ref.read([name])[name]), name


def test_the_named_cap_has_headroom_over_the_floor():
    from leanml.prune.stream import CAP_HEADROOM_MIB, suggested_cap_mib

    mib = 2**20
    for floor in (1, mib, 1155 * mib - 5, 1155 * mib, 610 * mib + 1):
        cap = suggested_cap_mib(floor)
        assert cap % CAP_HEADROOM_MIB == 0
        assert cap * mib >= floor + CAP_HEADROOM_MIB * mib  # a rerun a few MiB heavier still passes
        assert cap * mib < floor + 2 * CAP_HEADROOM_MIB * mib + mib
