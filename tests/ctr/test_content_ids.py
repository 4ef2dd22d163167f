"""Content-ID fitting (both supervisions), stable visual IDs, and the Parquet serving table."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from leanml.ctr.content_ids.assign import assign_visual_ids, read_visual_ids, write_visual_ids
from leanml.ctr.content_ids.encoders import embed_texts
from leanml.ctr.content_ids.trainer import (
    ContentIDConfig,
    build_vocab,
    fit_content_ids,
    load_content_model,
    save_content_model,
    token_targets,
)
from leanml.ctr.data import fashion_ads
from leanml.errors import LeanmlError

# single-threaded torch: faster and fairer on a shared 2-core machine
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def fitted():
    torch.set_num_threads(1)
    data = fashion_ads(n_ads=320, n_users=20, per_day=200, seed=1)
    cfg = ContentIDConfig(kind="cnn", dim=16, m=4, k=8, width=4, epochs=2, warmup_epochs=1, batch_size=64)
    text = embed_texts(data.captions)
    model, report = fit_content_ids(data.content, data.captions, cfg, text_emb=text, progress=False)
    return data, model, report


def test_fit_reports_usage_and_learns(fitted) -> None:
    data, model, report = fitted
    assert len(report["history"]) == 3 and report["history"][0]["quantized"] is False
    usage = report["usage"]
    assert usage["n_items"] == data.n_items
    assert 0 <= usage["dead_codes"] < 4 * 8
    assert 0 < usage["norm_entropy"] <= 1
    # the hard-quantized image retrieves its own caption more often than chance
    n_captions = len(set(data.captions))
    assert report["caption_top1"] > 2.0 / n_captions


def test_ids_are_stable_for_the_same_image(fitted, tmp_path) -> None:
    data, model, _ = fitted
    ids = assign_visual_ids(model, data.content)
    assert ids.shape == (data.n_items, 4)
    assert np.array_equal(ids, assign_visual_ids(model, data.content.clone()))
    # batch composition does not matter (eval mode, no batch statistics)
    assert np.array_equal(ids[5:9], assign_visual_ids(model, data.content[5:9]))
    # local codes: every position lies in [0, K)
    assert ids.min() >= 0 and ids.max() < 8
    save_content_model(model, tmp_path / "cid", {"note": "test"})
    reloaded = load_content_model(tmp_path / "cid")
    assert np.array_equal(ids, assign_visual_ids(reloaded, data.content))


def test_parquet_table_schema_and_round_trip(fitted, tmp_path) -> None:
    data, model, _ = fitted
    ids = assign_visual_ids(model, data.content)
    path = write_visual_ids(tmp_path / "ids.parquet", data.item_ids, ids, 8)
    table = pq.read_table(path)
    assert table.schema.field("ad_id").type == pa.int64()
    assert table.schema.field("visual_ids").type == pa.list_(pa.int64())
    meta = table.schema.metadata
    assert meta[b"M"] == b"4" and meta[b"K"] == b"8" and meta[b"codebook"] == b"pq"
    assert meta[b"schema"] == b"leanml.content_ids/2"
    assert all(len(v) == 4 for v in table.column("visual_ids").to_pylist())
    t = read_visual_ids(path)
    assert (t.m, t.k) == (4, 8) and np.array_equal(t.ad_ids, data.item_ids) and np.array_equal(t.codes, ids)
    assert not list(tmp_path.glob(".*tmp*"))  # atomic write leaves no temp file
    got, missing = t.lookup(np.array([t.ad_ids[3], -5, t.ad_ids[0]]))
    assert missing.tolist() == [False, True, False]
    assert np.array_equal(got[0], ids[3]) and (got[1] == 8).all()
    with pytest.raises(LeanmlError, match=r"outside \[0, K=8\)"):
        write_visual_ids(tmp_path / "bad.parquet", np.array([1]), np.array([[40, 0, 0, 0]]), 8)
    with pytest.raises(LeanmlError, match="does not exist"):
        read_visual_ids(tmp_path / "missing.parquet")


def test_residual_codes_fit_and_refine(fitted) -> None:
    """RQ content IDs: levels refine the vector (reconstruction error falls level by level)."""
    data, _, _ = fitted
    cfg = ContentIDConfig(kind="cnn", dim=16, m=3, k=8, width=4, epochs=2, warmup_epochs=1, batch_size=64,
                          codebook="rq")
    model, report = fit_content_ids(data.content, data.captions, cfg, text_emb=embed_texts(data.captions),
                                    progress=False)
    assert any(h.get("reseeded") is not None for h in report["history"])
    with torch.no_grad():
        z = model.embed(data.content)
        codes = model.quantizer.codes(z)
        cb = model.quantizer.codebooks
        partial = [cb[torch.arange(j + 1), codes[:, : j + 1]].sum(1) for j in range(3)]
        errs = [((z - p) ** 2).sum(1).mean().item() for p in partial]
        assert torch.allclose(partial[-1], model.quantizer.decode(codes))
    assert errs[0] > errs[1] > errs[2]
    assert assign_visual_ids(model, data.content).shape == (data.n_items, 3)


def test_token_supervision_fits_and_targets_are_multi_hot() -> None:
    captions = ["dark slim plain coat", "light bulky plain coat", "dark slim textured bag", "grey slim plain bag"]
    vocab = build_vocab(captions)
    assert set(vocab) == {"dark", "slim", "plain", "coat", "bag"}
    t = token_targets(captions, vocab)
    assert t.sum(1).tolist() == [4, 2, 3, 3]
    data = fashion_ads(n_ads=160, n_users=10, per_day=100, seed=2)
    cfg = ContentIDConfig(kind="cnn", dim=8, m=2, k=4, width=4, epochs=1, warmup_epochs=1, loss="tokens", batch_size=64)
    model, report = fit_content_ids(data.content, data.captions, cfg, progress=False)
    assert report["history"][-1]["loss"] < report["history"][0]["loss"] * 1.5
    assert model.config.vocab and assign_visual_ids(model, data.content).shape == (160, 2)


def test_bad_inputs_raise_clear_errors() -> None:
    with pytest.raises(LeanmlError, match="captions"):
        fit_content_ids(torch.rand(10, 28, 28), ["a"] * 9, ContentIDConfig(k=2, m=2, dim=8))
    with pytest.raises(LeanmlError, match="empty or missing"):
        embed_texts(["fine", ""])
    with pytest.raises(LeanmlError, match="K >= 2"):
        fit_content_ids(torch.rand(10, 28, 28), ["a"] * 10, ContentIDConfig(k=1))


def test_fit_cache_is_keyed_by_the_fitting_code(tmp_path, monkeypatch) -> None:
    import hashlib
    from pathlib import Path

    import leanml.ctr.content as content_mod
    import leanml.ctr.content_ids as cid_pkg

    # the hash covers the three files that fit content IDs (computed here independently)
    root = Path(cid_pkg.__file__).parent
    ref = hashlib.sha256(b"".join((root / n).read_bytes() for n in ("encoders.py", "quantizer.py", "trainer.py")))
    assert content_mod.content_code_hash() == ref.hexdigest()[:16]
    # a second call with the same code is served from the cache; changed code fits again
    monkeypatch.setenv("LEANML_CACHE", str(tmp_path))
    data = fashion_ads(n_ads=160, n_users=10, per_day=100, seed=3)
    cfg = ContentIDConfig(kind="cnn", dim=8, m=2, k=4, width=4, epochs=1, warmup_epochs=1, loss="tokens", batch_size=64)
    calls = []
    real_fit = content_mod.fit_content_ids
    monkeypatch.setattr(content_mod, "fit_content_ids", lambda *a, **k: calls.append(1) or real_fit(*a, **k))
    model, _ = content_mod.fit_dataset_content_ids(data, cfg, progress=False)
    assert model.config.vocab and not cfg.vocab  # the fit keeps its vocabulary; the caller's config is unchanged
    content_mod.fit_dataset_content_ids(data, cfg, progress=False)
    assert len(calls) == 1
    monkeypatch.setattr(content_mod, "content_code_hash", lambda: "another-version")
    content_mod.fit_dataset_content_ids(data, cfg, progress=False)
    assert len(calls) == 2 and len(list((tmp_path / "content_ids").iterdir())) == 2


def test_reseeding_zeroes_the_optimizer_moments_of_reseeded_codewords_only() -> None:
    from leanml.ctr.content_ids.trainer import ContentIDModel, embed_all, reseed_dead

    torch.manual_seed(0)
    cfg = ContentIDConfig(kind="mlp", in_dim=6, dim=8, m=2, k=4, width=2)
    model = ContentIDModel(cfg)
    x = torch.randn(40, 6)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(3):  # give every parameter Adam moments
        z, v, probs = model(x, 1.0)
        loss = (v**2).sum() + (probs * torch.arange(4.0)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    q = model.quantizer
    with torch.no_grad():
        q.codebooks[0, 3] = 1e3  # far from every input: dead
    _, codes = embed_all(model, x)
    dead = torch.stack([torch.bincount(torch.as_tensor(codes[:, j]), minlength=4) for j in range(2)]) == 0
    assert dead[0, 3]
    before = {k: v.clone() for k, v in opt.state[q.codebooks].items() if torch.is_tensor(v) and v.dim() == 3}
    assert reseed_dead(model, x, torch.Generator().manual_seed(0), opt) == int(dead.sum())
    for key, old in before.items():
        new = opt.state[q.codebooks][key]
        assert torch.all(new[dead] == 0) and torch.equal(new[~dead], old[~dead]) and old[dead].abs().sum() > 0


def test_post_hoc_designs_of_one_seed_share_one_continuous_vector(tmp_path) -> None:
    """Post-hoc designs differ only in their codes: the encoder of one seed yields the same vector for
    every M, K and codebook kind (whole-vector norm; the quantizer is created after encoder and heads)."""
    import json

    data = fashion_ads(n_ads=160, n_users=10, per_day=100, seed=3)
    text = embed_texts(data.captions)
    vectors, models = [], []
    for codebook, m in (("pq", 8), ("pq", 2), ("rq", 3)):
        cfg = ContentIDConfig(kind="cnn", dim=16, m=m, k=8, width=4, epochs=1, warmup_epochs=1, batch_size=64,
                              codebook=codebook, joint=False)
        model, _ = fit_content_ids(data.content, data.captions, cfg, text_emb=text, progress=False)
        with torch.no_grad():
            vectors.append(model.embed(data.content))
        models.append(model)
    assert torch.equal(vectors[0], vectors[1]) and torch.equal(vectors[0], vectors[2])
    assert torch.allclose(vectors[0].norm(dim=1), torch.ones(len(vectors[0])))
    # jointly trained pq keeps one unit vector per sub-space
    joint = ContentIDConfig(kind="cnn", dim=16, m=4, k=8, width=4, epochs=1, warmup_epochs=1, batch_size=64)
    model, _ = fit_content_ids(data.content, data.captions, joint, text_emb=text, progress=False)
    with torch.no_grad():
        sub = model.embed(data.content).reshape(-1, 4, 4)
    assert torch.allclose(sub.norm(dim=-1), torch.ones(sub.shape[:2]))
    # norm_groups G: G unit vectors of D/G dims, whatever the codebook
    cfg = ContentIDConfig(kind="cnn", dim=16, m=2, k=8, width=4, epochs=1, warmup_epochs=1, batch_size=64,
                          codebook="rq", joint=False, norm_groups=4)
    model, _ = fit_content_ids(data.content, data.captions, cfg, text_emb=text, progress=False)
    with torch.no_grad():
        sub = model.embed(data.content).reshape(-1, 4, 4)
    assert torch.allclose(sub.norm(dim=-1), torch.ones(sub.shape[:2]))
    with pytest.raises(LeanmlError, match="norm_groups=3 must divide"):
        ContentIDConfig(dim=16, norm_groups=3)
    # a folder written before the option existed keeps its per-sub-vector normalization on load
    save_content_model(models[0], tmp_path / "old", {})
    cfg_path = tmp_path / "old" / "config.json"
    fields = json.loads(cfg_path.read_text())
    del fields["norm_groups"]
    cfg_path.write_text(json.dumps(fields))
    old = load_content_model(tmp_path / "old")
    assert old.norm_groups == 8
    with torch.no_grad():
        sub = old.embed(data.content).reshape(-1, 8, 2)
    assert torch.allclose(sub.norm(dim=-1), torch.ones(sub.shape[:2]))
