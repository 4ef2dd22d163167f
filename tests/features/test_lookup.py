"""The lookup plan against a brute-force construction, its checks, and the model using a producer's plan."""

from __future__ import annotations

import pytest
import torch

from leanml.errors import LeanmlError
from leanml.features.run.batch import FeatureBatch
from leanml.features.train.lookup import bag_labels, build_plan
from leanml.features.train.model import FeatureDNN

SIZES = (7, 50, 3, 40, 9)  # three sparse fields, then two sequences
LAYOUT = (3, 6, 3)


def _ids(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    cols = [torch.randint(0, s, (n, 1), generator=g) for s in SIZES[:3]]
    for s, width in zip(SIZES[3:], LAYOUT[1:]):
        ids = torch.randint(0, s, (n, width), generator=g)
        cols.append(torch.where(torch.rand(n, width, generator=g) < 0.4, torch.full_like(ids, -1), ids))
    return torch.cat(cols, 1)


def test_plan_matches_a_brute_force_construction():
    ids = _ids(23, 0)
    p = build_plan(ids, LAYOUT, SIZES)
    fields = bag_labels(LAYOUT).tolist()
    offsets = [sum(SIZES[:f]) for f in range(len(SIZES))]
    slots = []  # (table row, bag) of every valid slot, row-major as the batch lays them out
    for r in range(len(ids)):
        for c, f in enumerate(fields):
            if ids[r, c] >= 0:
                slots.append((offsets[f] + int(ids[r, c]), r * len(SIZES) + f))
    count = {b: sum(1 for _, x in slots if x == b) for _, b in slots}
    assert p.gid.tolist() == [g for g, _ in slots]
    assert p.w.tolist() == pytest.approx([1 / count[b] for _, b in slots])
    assert p.boff.tolist() == [sum(1 for _, x in slots if x < b) for b in range(len(ids) * len(SIZES))]
    rows = sorted({g for g, _ in slots})
    assert p.uniq.tolist() == rows
    ends = [*p.goff.tolist()[1:], len(slots)]
    for k, (row, start, end) in enumerate(zip(rows, p.goff.tolist(), ends, strict=True)):
        got = sorted(zip(p.sbag[start:end].tolist(), p.sw[start:end].tolist()))
        want = sorted((b, 1 / count[b]) for g, b in slots if g == row)
        assert [b for b, _ in got] == [b for b, _ in want], k
        assert [w for _, w in got] == pytest.approx([w for _, w in want])


def test_plan_refuses_ids_beyond_their_field_and_a_wrong_layout():
    ids = _ids(5, 1)
    ids[2, 1] = 50  # field 1 has 50 ids
    with pytest.raises(LeanmlError, match="column 1 .* >= its 50 ids"):
        build_plan(ids, LAYOUT, SIZES)
    with pytest.raises(LeanmlError, match="does not match a table of 5 fields"):
        build_plan(_ids(5, 1), (3, 6, 2), SIZES)


def test_model_uses_a_producer_plan_and_rebuilds_one_made_for_another_table():
    torch.manual_seed(0)
    model = FeatureDNN(list(SIZES[:3]), list(SIZES[3:]), n_dense=2, dim=4, hidden=(8,))
    ids = _ids(17, 2)
    parts = [ids[:, :3], ids[:, 3:9], ids[:, 9:]]
    batch = FeatureBatch(torch.rand(17), parts[0], torch.rand(17, 2), parts[1:])

    def run(plan):
        model.zero_grad()
        batch.plan = plan
        out = model(batch)
        out.square().sum().backward()
        return out.detach(), model.emb.weight.grad.to_dense()

    ref_out, ref_grad = run(None)
    for plan in (build_plan(ids, LAYOUT, SIZES), build_plan(ids, LAYOUT, (7, 50, 3, 40, 10))):
        out, grad = run(plan)
        assert torch.equal(out, ref_out) and torch.equal(grad, ref_grad)
    # a plan that does not belong to the batch would give other numbers: the model must have used the first
    other = build_plan(_ids(17, 3), LAYOUT, SIZES)
    out, _ = run(other)
    assert not torch.equal(out, ref_out)
