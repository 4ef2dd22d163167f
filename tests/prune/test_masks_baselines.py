"""Masks and the baseline pruners against independent references on small sizes."""

from __future__ import annotations

import itertools

import pytest
import torch

from leanml.errors import LeanmlError
from leanml.prune.cores.magnitude import magnitude_prune
from leanml.prune.cores.sparsegpt import hinv_upper, sparsegpt_prune, sparsegpt_prune_many
from leanml.prune.cores.wanda import wanda_prune
from leanml.prune.masks import MaskSpec, keep_mask, parse_pattern, satisfies_nm, sparsity_of


@pytest.mark.parametrize("text,expected", [("2:4", (2, 4)), ("4:8", (4, 8)), (" 1 : 3 ", (1, 3)), (None, None)])
def test_parse_pattern_accepts(text, expected):
    assert parse_pattern(text) == expected


@pytest.mark.parametrize("text", ["2:3:4", "5:4", "a:b", "4:4", "0:4", "2-4"])
def test_parse_pattern_rejects(text):
    with pytest.raises(LeanmlError):
        parse_pattern(text)


@pytest.mark.parametrize("bad", [0.0, 1.0, -0.1, 1.5])
def test_sparsity_out_of_range(bad):
    with pytest.raises(LeanmlError):
        MaskSpec(sparsity=bad)


def test_row_and_layer_masks_are_exact_and_pick_the_smallest():
    torch.manual_seed(0)
    scores = torch.rand(7, 12)
    row = keep_mask(scores, MaskSpec(0.25, scope="row"))
    assert (row.sum(1) == 9).all()
    # brute force: per row the 3 dropped are the 3 smallest
    for r in range(7):
        dropped = set(torch.nonzero(~row[r]).flatten().tolist())
        assert dropped == set(scores[r].argsort()[:3].tolist())
    layer = keep_mask(scores, MaskSpec(0.25, scope="layer"))
    assert int((~layer).sum()) == 21
    assert scores[~layer].max() < scores[layer].min()


def test_nm_mask_matches_brute_force():
    torch.manual_seed(1)
    scores = torch.rand(5, 16)
    mask = keep_mask(scores, MaskSpec(pattern=(2, 4)))
    for r, b in itertools.product(range(5), range(4)):
        block = scores[r, 4 * b : 4 * b + 4]
        best = max(itertools.combinations(range(4), 2), key=lambda c: block[list(c)].sum())
        assert set(torch.nonzero(mask[r, 4 * b : 4 * b + 4]).flatten().tolist()) == set(best)


def test_magnitude_and_wanda_reference():
    torch.manual_seed(2)
    W = torch.randn(6, 8)
    x = torch.randn(100, 8) * torch.linspace(0.1, 3, 8)
    sq = (x**2).sum(0)
    out = wanda_prune(W, sq, MaskSpec(0.5))
    ref = W.clone()
    metric = W.abs() * x.norm(dim=0)
    for r in range(6):
        ref[r, metric[r].argsort()[:4]] = 0
    torch.testing.assert_close(out, ref)
    mag = magnitude_prune(W, MaskSpec(0.5, scope="layer"))
    assert sparsity_of(mag) == 0.5 and mag[mag != 0].abs().min() >= W.abs().median()


def _obs_reference(W: torch.Tensor, H: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Sequential OBS with explicit inverses: for each column j left to right, the inverse Hessian of the
    columns not yet fixed decides which rows of column j to prune (smallest w^2 / [H_F^-1]_jj over the
    column), the pruned weights are zeroed and the remaining columns compensate optimally."""
    W = W.clone().double()
    H = H.double()
    n = W.shape[1]
    for j in range(n):
        Hinv = torch.linalg.inv(H[j:, j:])
        sal = W[:, j] ** 2 / Hinv[0, 0]
        k = int(round(sparsity * W.shape[0]))
        rows = sal.argsort()[:k]
        for r in rows.tolist():
            W[r, j:] -= W[r, j] / Hinv[0, 0] * Hinv[:, 0]
            W[r, j] = 0.0
    return W.float()


def test_sparsegpt_blocksize1_equals_direct_obs():
    torch.manual_seed(3)
    X = torch.randn(200, 10) @ torch.randn(10, 10)
    H = X.T @ X / 200
    W = torch.randn(8, 10)
    damp = 0.01
    Hd = H + damp * torch.diagonal(H).mean() * torch.eye(10)
    out = sparsegpt_prune(W, H, MaskSpec(0.5, scope="layer"), damp=damp, blocksize=1)
    ref = _obs_reference(W, Hd, 0.5)
    torch.testing.assert_close(out, ref, atol=2e-4, rtol=1e-3)
    assert sparsity_of(out) == 0.5


def test_sparsegpt_beats_magnitude_in_output_error_and_meets_patterns():
    torch.manual_seed(4)
    # correlated inputs, as real activations are: this is where OBS compensation pays
    X = (torch.randn(512, 64) @ torch.randn(64, 64)) * torch.rand(64) * 3
    H = X.T @ X / 512
    W = torch.randn(32, 64)

    def err(Wn):
        return float(((Wn - W) @ X.T).pow(2).sum())

    for spec in [MaskSpec(0.5, scope="row"), MaskSpec(0.5, scope="layer"), MaskSpec(pattern=(2, 4))]:
        sg = sparsegpt_prune(W, H, spec, blocksize=32)
        wa = wanda_prune(W, torch.diagonal(H), spec)
        assert err(sg) < err(wa) < err(magnitude_prune(W, spec))
        assert abs(sparsity_of(sg) - 0.5) < 1e-9
        if spec.pattern:
            assert satisfies_nm(sg, 2, 4)
        elif spec.scope == "row":
            assert ((sg == 0).sum(1) == 32).all()
    sg48 = sparsegpt_prune(W, H, MaskSpec(pattern=(4, 8)), blocksize=16)
    assert satisfies_nm(sg48, 4, 8) and sparsity_of(sg48) == 0.5
    # exact sparsity even when blocks are narrower than the rounding unit: 0.3 * 32 * 64 = 614.4 -> 614
    # weights, 19 or 20 per row (the row quotas of keep_mask)
    quotas = (~keep_mask(torch.rand(32, 64), MaskSpec(0.3, scope="row"))).sum(1)
    assert int(quotas.sum()) == 614 and set(quotas.tolist()) == {19, 20}
    for bs in (1, 3, 7, 128):
        assert torch.equal((sparsegpt_prune(W, H, MaskSpec(0.3, scope="row"), blocksize=bs) == 0).sum(1), quotas)


def test_hinv_upper_factor_and_dead_inputs():
    H = torch.tensor([[2.0, 0.5, 0.0], [0.5, 1.0, 0.0], [0.0, 0.0, 0.0]])
    U, dead = hinv_upper(H, damp=0.0)
    assert dead.tolist() == [False, False, True]
    Hf = H.clone()
    Hf[2, 2] = 1
    torch.testing.assert_close(U.T @ U, torch.linalg.inv(Hf))
    with pytest.raises(LeanmlError):
        hinv_upper(H, damp=-1)


@pytest.mark.parametrize("specs", [[MaskSpec(0.5, scope="layer"), MaskSpec(0.3, scope="layer"),
                                    MaskSpec(0.6, scope="row")],
                                   [MaskSpec(pattern=(2, 4))] * 3])
def test_one_sweep_over_a_group_equals_separate_sweeps(specs):
    torch.manual_seed(5)
    X = (torch.randn(400, 32) @ torch.randn(32, 32)) * torch.rand(32) * 3
    H = X.T @ X / 400
    Ws = [torch.randn(r, 32) for r in (7, 12, 5)]
    together = sparsegpt_prune_many(Ws, H, specs, blocksize=8)
    for W, spec, got in zip(Ws, specs, together):
        torch.testing.assert_close(got, sparsegpt_prune(W, H, spec, blocksize=8), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype,k", [(torch.float32, 0), (torch.float32, 1), (torch.float32, 500),
                                     (torch.float64, 999), (torch.float32, 1000), (torch.float16, 300)])
def test_lowest_indices_are_exactly_the_k_smallest(dtype, k):
    from leanml.prune.masks import lowest_indices

    v = torch.randn(1000, generator=torch.Generator().manual_seed(k)).to(dtype)
    idx = lowest_indices(v, k)
    assert idx.dtype == torch.long and idx.numel() == k and idx.unique().numel() == k
    assert torch.equal(torch.sort(v[idx]).values, torch.sort(v).values[:k])
