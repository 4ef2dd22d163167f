"""The shared-memory slot ring: batches round-trip unchanged, a slot stays taken while any tensor of its
batch lives, discarded references are reclaimed, and batches that do not fit are refused."""

from __future__ import annotations

import gc

import torch

from leanml.features.run.batch import FeatureBatch
from leanml.features.run.shm import SlotRing
from leanml.features.train.lookup import build_plan


def _batch(n: int, seed: int, widths: tuple[int, ...] = (3, 2)) -> FeatureBatch:
    g = torch.Generator().manual_seed(seed)
    return FeatureBatch(torch.rand(n, generator=g), torch.randint(0, 1000, (n, 4), generator=g),
                        torch.rand(n, 2, generator=g),
                        [torch.randint(-1, 50, (n, w), generator=g) for w in widths]).packed()


def test_batches_round_trip_and_slots_free_when_their_tensors_die():
    a, b = _batch(7, 0), _batch(5, 1)
    ring = SlotRing.for_batch(a, slots=2, rows=8)
    sa, sb = ring.put(a), ring.put(b)
    assert {sa, sb} == {0, 1} and ring.free_slots() == 0
    assert ring.put(_batch(3, 2)) is None  # full: the caller sends this one the ordinary way
    ga, gb = ring.batch(sa, len(a)), ring.batch(sb, len(b))
    assert ga.equal(a) and gb.equal(b) and len(gb) == 5
    assert ga.ids().data_ptr() == ga.sparse.data_ptr()  # packed: ids are one view, no concatenation
    keep = ga.seqs[1][2:]  # a view of a view keeps the slot taken
    del ga
    gc.collect()
    assert ring.free_slots() == 0
    del keep
    gc.collect()
    assert ring.free_slots() == 1
    c = _batch(8, 3)
    assert ring.put(c) == sa and ring.batch(sa, 8).equal(c)  # reused slot, new contents
    assert gb.equal(b)  # the batch still held was not touched


def test_reclaim_frees_only_slots_never_turned_into_batches():
    a = _batch(4, 0)
    ring = SlotRing.for_batch(a, slots=3, rows=4)
    s0, s1 = ring.put(a), ring.put(a)
    held = ring.batch(s0, 4)
    assert ring.free_slots() == 1
    assert ring.reclaim() == 1  # s1 was sent but its reference was dropped
    assert ring.free_slots() == 2 and held.equal(a)
    assert ring.busy[s1] == 0 and ring.busy[s0] != 0


def test_batches_that_do_not_fit_are_refused():
    a = _batch(4, 0)
    ring = SlotRing.for_batch(a, slots=2, rows=4)
    assert ring.put(_batch(5, 1)) is None  # too many rows
    assert ring.put(_batch(4, 1, widths=(3, 3))) is None  # other sequence widths
    assert ring.free_slots() == 2


def test_lookup_plans_ride_in_the_ring():
    sizes = (1000, 1000, 1000, 1000, 50, 50)
    a, b = _batch(7, 0), _batch(4, 1)
    for x in (a, b):
        x.plan = build_plan(x.ids(), (4, 3, 2), sizes)
    ring = SlotRing.for_batch(a, slots=2, rows=8)
    assert ring.put(_batch(3, 2)) is None  # a plan ring takes batches with plans only
    sa, sb = ring.put(a), ring.put(b)
    ga, gb = ring.batch(sa, len(a), SlotRing.plan_counts(a)), ring.batch(sb, len(b), SlotRing.plan_counts(b))
    for got, want in ((ga, a), (gb, b)):
        assert got.equal(want) and got.plan.sizes == sizes and got.plan.layout == (4, 3, 2)
        assert all(torch.equal(x, y) for x, y in zip(got.plan.tensors(), want.plan.tensors(), strict=True))
    plan = ga.plan
    del ga
    gc.collect()
    assert ring.free_slots() == 0  # the plan's tensors keep the slot taken
    del plan
    gc.collect()
    assert ring.free_slots() == 1
    plain = SlotRing.for_batch(_batch(3, 2), slots=1, rows=8)
    assert plain.put(a) is None  # a ring without plan space refuses a batch with a plan
