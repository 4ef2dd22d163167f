"""The fused embedding table against per-field ``nn.Embedding`` tables (the model before fusion)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from leanml.errors import LeanmlError
from leanml.features.run.batch import FeatureBatch
from leanml.features.train.model import CTROptimizer, FeatureDNN, FusedEmbedding

SPARSE, SEQ, DIM = [7, 50, 3], [40, 9], 4


class Reference(nn.Module):
    """One ``nn.Embedding`` per field, sequences mean-pooled over ids >= 0 (an empty list is zeros)."""

    def __init__(self, fused: FusedEmbedding) -> None:
        super().__init__()
        self.tables = nn.ModuleList(nn.Embedding(n, DIM, sparse=True) for n in SPARSE + SEQ)
        with torch.no_grad():
            for f, t in enumerate(self.tables):
                t.weight.copy_(fused.field_rows(f))

    def forward(self, b: FeatureBatch) -> torch.Tensor:
        parts = [self.tables[j](b.sparse[:, j]) for j in range(len(SPARSE))]
        for k, ids in enumerate(b.seqs):
            mask = (ids >= 0).unsqueeze(-1).float()
            emb = self.tables[len(SPARSE) + k](ids.clamp_min(0))
            parts.append((emb * mask).sum(1) / mask.sum(1).clamp_min(1.0))
        return torch.stack(parts, 1)


def _batch(n: int, seed: int) -> FeatureBatch:
    g = torch.Generator().manual_seed(seed)
    sparse = torch.stack([torch.randint(0, s, (n,), generator=g) for s in SPARSE], 1)
    seqs = []
    for s, L in zip(SEQ, (6, 3)):
        ids = torch.randint(0, s, (n, L), generator=g)
        lengths = torch.randint(0, L + 1, (n, 1), generator=g)
        seqs.append(torch.where(torch.arange(L) < lengths, ids, torch.full_like(ids, -1)))
    return FeatureBatch(torch.randint(0, 2, (n,), generator=g).float(), sparse, torch.zeros(n, 0), seqs)


def _fused_forward(fe: FusedEmbedding, b: FeatureBatch) -> torch.Tensor:
    ids = torch.cat([b.sparse, *b.seqs], 1)
    return fe(ids, (len(SPARSE), 6, 3))


def test_fused_lookup_gradients_and_sparse_adam_match_per_field_tables():
    torch.manual_seed(0)
    fe = FusedEmbedding(SPARSE + SEQ, DIM)
    ref = Reference(fe)
    opt_f = CTROptimizer(fe, lr=0.05)
    opt_r = torch.optim.SparseAdam(list(ref.parameters()), lr=0.05)
    for step in range(4):
        b = _batch(64, step)
        target = torch.randn(64, len(SPARSE + SEQ), DIM, generator=torch.Generator().manual_seed(99 + step))
        out_f, out_r = _fused_forward(fe, b), ref(b)
        torch.testing.assert_close(out_f, out_r, rtol=1e-5, atol=1e-6)
        for opt, out in ((opt_f, out_f), (opt_r, out_r)):
            opt.zero_grad()
            ((out - target) ** 2).sum().backward()
        g = fe.weight.grad
        assert g.is_sparse and bool((g._indices()[0, 1:] > g._indices()[0, :-1]).all())  # sorted, unique rows
        dense = g.to_dense()
        for f, t in enumerate(ref.tables):
            o = int(fe.offsets[f])
            torch.testing.assert_close(dense[o : o + SPARSE_SEQ[f]], t.weight.grad.to_dense(), rtol=1e-5, atol=1e-6)
        opt_f.step()
        opt_r.step()
        for f, t in enumerate(ref.tables):  # the same lazy Adam updates on the same rows
            torch.testing.assert_close(fe.field_rows(f).detach(), t.weight.detach(), rtol=1e-5, atol=1e-6)


SPARSE_SEQ = SPARSE + SEQ


def test_dense_gradient_mode_and_empty_bags():
    torch.manual_seed(1)
    a, b = FusedEmbedding(SPARSE_SEQ, DIM), FusedEmbedding(SPARSE_SEQ, DIM, sparse=False)
    with torch.no_grad():
        b.weight.copy_(a.weight)
    batch = _batch(32, 5)
    batch.seqs[0][:5] = -1  # empty lists pool to zeros
    oa, ob = _fused_forward(a, batch), _fused_forward(b, batch)
    assert torch.equal(oa[:5, 3], torch.zeros(5, DIM))
    oa.sum().backward()
    ob.sum().backward()
    assert not b.weight.grad.is_sparse
    torch.testing.assert_close(a.weight.grad.to_dense(), b.weight.grad)


def test_feature_dnn_trains_and_rejects_bad_ids():
    torch.manual_seed(2)
    model = FeatureDNN(SPARSE, SEQ, n_dense=0, dim=DIM, hidden=(8,))
    opt = CTROptimizer(model, lr=0.05)
    batch = _batch(256, 3)
    batch.label = (batch.sparse[:, 0] % 2).float()  # learnable from field 0
    loss_fn = nn.BCEWithLogitsLoss()
    losses = []
    for _ in range(30):
        loss = loss_fn(model(batch), batch.label)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0]
    bad = _batch(4, 0)
    bad.sparse[2, 1] = 50  # field 1 has ids 0..49
    with pytest.raises(LeanmlError, match="column 1 .* >= its 50 ids"):
        model(bad)
    with pytest.raises(LeanmlError, match="expects 3 sparse fields"):
        model(FeatureBatch(bad.label, bad.sparse[:, :2], bad.dense, bad.seqs))


def test_packed_batches_need_no_concatenation():
    torch.manual_seed(3)
    model = FeatureDNN(SPARSE, SEQ, n_dense=0, dim=DIM, hidden=(8,))
    b = _batch(16, 4)
    p = b.packed()
    assert p.equal(b) and p.ids().data_ptr() == p.sparse.data_ptr() and p.ids()._base is not None
    assert torch.equal(p.ids(), b.ids()) and b.ids().data_ptr() != b.sparse.data_ptr()  # unpacked: a copy
    assert torch.equal(model(p), model(b))


@pytest.mark.parametrize("hidden", [(8, 6), ()])
def test_split_first_layer_is_one_linear_over_the_concatenation(hidden):
    """The first layer (embeddings' part + dense part) against ``nn.Linear`` on ``cat(pooled, dense)``,
    forward and every gradient, and its initialisation is that of the one linear under the same seed."""
    torch.manual_seed(4)
    model = FeatureDNN(SPARSE, SEQ, n_dense=3, dim=DIM, hidden=hidden)
    torch.manual_seed(4)
    FusedEmbedding(SPARSE_SEQ, DIM)  # consume the table's draws, then the one linear's
    widths = [DIM * len(SPARSE_SEQ) + 3, *hidden, 1]
    one = nn.Linear(widths[0], widths[1])
    w = torch.cat([model.emb_in.weight, model.dense_in.weight], 1)
    assert torch.equal(w, one.weight) and torch.equal(model.emb_in.bias, one.bias)
    b = _batch(32, 6)
    b.dense = torch.randn(32, 3)
    out = model(b)
    out.square().sum().backward()
    ref_w = w.detach().clone().requires_grad_(True)
    ref_b = model.emb_in.bias.detach().clone().requires_grad_(True)
    pooled = model.emb(b.ids(), (len(SPARSE), 6, 3)).detach()
    h = nn.functional.linear(torch.cat([pooled.reshape(32, -1), b.dense], 1), ref_w, ref_b)
    ref = model.mlp(h).squeeze(-1)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    model.zero_grad()
    grads = torch.autograd.grad(ref.square().sum(), [ref_w, ref_b])
    out = model(b)
    out.square().sum().backward()
    torch.testing.assert_close(torch.cat([model.emb_in.weight.grad, model.dense_in.weight.grad], 1), grads[0],
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.emb_in.bias.grad, grads[1], rtol=1e-5, atol=1e-5)


def test_narrow_linear_matches_autograd_in_double():
    """The first layer's dense part (``h + x @ W.T`` with its own backward) against torch's gradcheck."""
    from leanml.features.train.model import _AddNarrowLinear

    torch.manual_seed(0)
    h = torch.randn(9, 5, dtype=torch.float64, requires_grad=True)
    x = torch.randn(9, 2, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(_AddNarrowLinear.apply, (h, x, w))
    torch.testing.assert_close(_AddNarrowLinear.apply(h, x, w), h + x @ w.T)
