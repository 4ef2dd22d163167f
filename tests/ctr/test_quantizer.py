"""Soft product quantizer: soft -> hard as tau -> 0, gradients, k-means, usage statistics."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.cluster import KMeans

from leanml.ctr.content_ids.encoders import ContentEncoder, SmallCNN
from leanml.ctr.content_ids.quantizer import (
    SoftProductQuantizer,
    SoftResidualQuantizer,
    anneal_tau,
    hard_assign,
    kmeans,
    reconstruct,
    reseed_dead_codes,
    residual_quantize,
    soft_assign,
    usage_stats,
)
from leanml.ctr.content_ids.schema import global_ids
from leanml.ctr.content_ids.trainer import ContentIDConfig, ContentIDModel, info_nce
from leanml.errors import LeanmlError

# single-threaded torch: faster and fairer on a shared 2-core machine
pytestmark = pytest.mark.usefixtures("one_thread")


def test_soft_assignment_converges_to_hard_as_tau_goes_to_zero() -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 12, dtype=torch.float64)
    cb = torch.randn(3, 8, 4, dtype=torch.float64)
    codes = hard_assign(x, cb)
    # brute-force nearest codeword per sub-space
    sub = x.reshape(64, 3, 4)
    brute = torch.stack([((sub[:, m, None, :] - cb[m][None]) ** 2).sum(-1).argmin(1) for m in range(3)], 1)
    assert torch.equal(codes, brute)
    gaps = []
    for tau in (1.0, 0.1, 1e-3, 1e-5):
        p = soft_assign(x, cb, tau)
        assert torch.allclose(p.sum(-1), torch.ones(64, 3, dtype=torch.float64))
        gaps.append((reconstruct(p, cb) - reconstruct(codes, cb)).abs().max().item())
    assert gaps[-1] < 1e-6
    assert gaps[0] > gaps[-1]
    assert torch.equal(soft_assign(x, cb, 1e-5).argmax(-1), codes)


def test_gradients_reach_image_encoder_through_soft_quantizer() -> None:
    torch.manual_seed(0)
    cfg = ContentIDConfig(kind="cnn", dim=16, m=4, k=8, width=4)
    model = ContentIDModel(cfg).train()
    images = torch.rand(6, 28, 28)
    _, q, _ = model(images, tau=0.5)
    info_nce(model.img_proj(q), model.txt_proj(torch.randn(6, 384)), torch.arange(6), 0.1).backward()
    first_conv = model.encoder.backbone.net[0].weight
    assert first_conv.grad is not None and first_conv.grad.abs().sum() > 0
    assert model.quantizer.codebooks.grad is not None and model.quantizer.codebooks.grad.abs().sum() > 0


def test_straight_through_forward_is_hard_backward_is_soft() -> None:
    torch.manual_seed(1)
    q = SoftProductQuantizer(8, 2, 4, straight_through=True).train()
    x = torch.randn(10, 8, requires_grad=True)
    z, probs = q(x, tau=0.5)
    assert torch.allclose(z, reconstruct(probs.argmax(-1), q.codebooks))
    z.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    q.eval()
    z_eval, _ = q(x, tau=0.5)
    assert torch.equal(q.codes(x), hard_assign(x, q.codebooks))
    assert torch.allclose(z_eval, reconstruct(q.codes(x), q.codebooks))


def test_kmeans_matches_sklearn_inertia() -> None:
    rng = np.random.default_rng(0)
    centers = rng.normal(0, 5, (6, 3))
    x = np.concatenate([c + rng.normal(0, 0.3, (50, 3)) for c in centers]).astype(np.float32)
    c = kmeans(torch.from_numpy(x), 6, iters=30, seed=0).numpy()
    ours = ((x[:, None] - c[None]) ** 2).sum(-1).min(1).sum()
    ref = KMeans(6, n_init=10, random_state=0).fit(x).inertia_
    assert ours <= ref * 1.05


def test_kmeans_init_sets_codebooks() -> None:
    torch.manual_seed(0)
    q = SoftProductQuantizer(8, 2, 4)
    x = torch.randn(200, 8)
    q.init_kmeans(x)
    sub = x.reshape(200, 2, 4)
    for m in range(2):
        assert torch.allclose(q.codebooks[m], kmeans(sub[:, m], 4, seed=m), atol=1e-5)


def test_usage_stats_bruteforce() -> None:
    codes = np.array([[0, 1], [0, 1], [1, 2], [3, 2]])
    s = usage_stats(codes, 4)
    # sub-space 0 uses {0,1,3}, sub-space 1 uses {1,2}: 1 + 2 dead codes
    assert s.dead_codes == 3
    assert s.unique_tuples == 3
    assert s.collision_rate == pytest.approx(0.5)
    ent0 = -(0.5 * np.log2(0.5) + 2 * 0.25 * np.log2(0.25))
    ent1 = 1.0
    assert s.entropy_bits == pytest.approx((ent0 + ent1) / 2)


def test_global_ids_and_validation() -> None:
    assert global_ids(np.array([[1, 0, 3]]), 4).tolist() == [[1, 4, 11]]
    with pytest.raises(LeanmlError, match="codebook"):
        ContentIDConfig(codebook="vq")
    ContentIDConfig(codebook="rq", dim=10, m=3)  # rq levels need not divide D
    with pytest.raises(LeanmlError, match="K=1"):
        SoftProductQuantizer(8, 2, 1)
    with pytest.raises(LeanmlError, match="divide"):
        SoftProductQuantizer(10, 3, 4)
    with pytest.raises(LeanmlError, match="K >= 2"):
        ContentIDConfig(k=1)
    assert anneal_tau(0, 10, 1.0, 0.01) == pytest.approx(1.0)
    assert anneal_tau(9, 10, 1.0, 0.01) == pytest.approx(0.01)


def test_content_encoder_takes_any_backbone() -> None:
    backbone = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(28 * 28, 20))
    enc = ContentEncoder(backbone, dim=12, backbone_dim=20)
    assert enc(torch.rand(3, 28, 28)).shape == (3, 12)
    with pytest.raises(LeanmlError, match="backbone_dim"):
        ContentEncoder(torch.nn.Identity(), dim=4)
    assert ContentEncoder(SmallCNN(width=4), 8)(torch.rand(2, 1, 28, 28)).shape == (2, 8)


def test_residual_quantizer_matches_greedy_brute_force() -> None:
    torch.manual_seed(0)
    x = torch.randn(50, 6, dtype=torch.float64)
    cb = torch.randn(3, 5, 6, dtype=torch.float64)
    # brute force: level by level, the nearest codeword to what is left
    left, brute = x.clone(), []
    for lvl in range(3):
        c = ((left[:, None, :] - cb[lvl][None]) ** 2).sum(-1).argmin(1)
        brute.append(c)
        left = left - cb[lvl][c]
    brute = torch.stack(brute, 1)
    q, probs, inputs = residual_quantize(x, cb)
    assert torch.equal(probs.argmax(-1), brute)
    assert torch.allclose(q, x - left) and torch.allclose(inputs[:, 0], x)
    # soft assignment at a tiny temperature gives the same codes and reconstruction
    q_soft, p_soft, _ = residual_quantize(x, cb, tau=1e-6)
    assert torch.equal(p_soft.argmax(-1), brute) and torch.allclose(q_soft, q, atol=1e-6)
    rq = SoftResidualQuantizer(6, 3, 5)
    rq.codebooks.data = cb.float()
    assert torch.equal(rq.codes(x.float()), brute)
    assert torch.allclose(rq.decode(brute), q.float(), atol=1e-5)


def test_residual_kmeans_init_lowers_error_each_level_and_gets_gradients() -> None:
    torch.manual_seed(0)
    x = torch.nn.functional.normalize(torch.randn(300, 8), dim=-1)
    rq = SoftResidualQuantizer(8, 3, 8)
    rq.init_kmeans(x)
    assert rq.scale[0] == pytest.approx(1.0, rel=1e-4) and rq.scale[0] > rq.scale[1] > rq.scale[2]
    codes = rq.codes(x)
    errs = [((x - rq.codebooks[torch.arange(j + 1), codes[:, : j + 1]].sum(1)) ** 2).sum(1).mean() for j in range(3)]
    assert errs[0] > errs[1] > errs[2]
    rq.train()
    z = x.clone().requires_grad_(True)
    q, p = rq(z, tau=0.5)
    assert p.shape == (300, 3, 8)
    q.sum().backward()
    assert z.grad is not None and rq.codebooks.grad is not None and rq.codebooks.grad.abs().sum() > 0


def test_reseed_moves_only_dead_codewords_onto_data() -> None:
    g = torch.Generator().manual_seed(0)
    cb = torch.zeros(2, 4, 3)
    counts = torch.tensor([[5, 0, 1, 0], [1, 1, 1, 1]])
    inputs = torch.randn(20, 2, 3) + 10.0
    assert reseed_dead_codes(cb, counts, inputs, g, noise=0.0) == 2
    assert (cb[0, [0, 2]] == 0).all() and (cb[1] == 0).all()
    for j in (1, 3):  # each re-seeded codeword is one of the inputs of its sub-space
        assert ((inputs[:, 0] - cb[0, j]).abs().sum(1) < 1e-6).any()
