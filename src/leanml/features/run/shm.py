"""A ring of shared-memory batch slots between a producer worker process and the trainer.

Handing a :class:`FeatureBatch` to a ``DataLoader`` worker's parent the ordinary way moves every tensor
storage into a fresh shared-memory segment and passes its file descriptor over a socket; the parent
maps the segment and unmaps it when the batch dies. Per batch that costs a few milliseconds of the
trainer's own CPU (receiving, mapping, first-touch page faults), which is on the critical path.

A :class:`SlotRing` is allocated once per worker (shared memory, sized from the first batch): the
worker copies each batch into a free slot and sends only a small :class:`SlotRef` (slot number, row
count). The ring itself travels once per epoch. The trainer builds the batch as views of the slot;
the slot becomes free again when every tensor of that batch has been garbage-collected, so a caller
that keeps batches (``list(prefetcher)``) never sees them overwritten: while no slot is free the
worker sends batches the ordinary way.

Slot states: free -> *sent* (the worker filled it and sent its :class:`SlotRef`) -> *held* (the trainer
made the batch) -> free (the batch's tensors are gone). A slot still *sent* when the worker starts its
next epoch belongs to a reference the loader threw away (an epoch left early with persistent workers),
and :meth:`SlotRing.reclaim` frees it.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from leanml.features.run.batch import FeatureBatch, split_ids
from leanml.features.train.lookup import LookupPlan

_FREE, _SENT, _HELD = 0, 1, 2


class SlotRing:
    """``slots`` batches of at most ``rows`` rows with ``n_sparse`` sparse ids, sequences of ``widths``
    and ``n_dense`` dense floats, in shared memory. ``busy[s]`` is non-zero from the moment the worker
    takes slot ``s`` until the trainer has dropped every tensor of the batch in it."""

    def __init__(self, slots: int, rows: int, n_sparse: int, widths: list[int], n_dense: int,
                 plan: LookupPlan | None = None) -> None:
        self.rows, self.n_sparse, self.widths, self.n_dense = rows, n_sparse, list(widths), n_dense
        n_ids = n_sparse + sum(widths)
        self.label = torch.empty(slots, rows, dtype=torch.float32).share_memory_()
        self.ids = torch.empty(slots, rows, n_ids, dtype=torch.int64).share_memory_()
        self.dense = torch.empty(slots, rows, n_dense, dtype=torch.float32).share_memory_()
        self.busy = torch.zeros(slots, dtype=torch.uint8).share_memory_()
        self._next = 0
        # lookup plans (when the batches carry one, all built for one table): at most rows * n_ids valid slots,
        # as [gid | sbag | goff | boff] in the plan's index dtype, [uniq] int64 and [w | sw] floats
        self.plan_key = None if plan is None else (plan.sizes, plan.layout, plan.gid.dtype, plan.w.dtype)
        if plan is not None:
            cap, n_bags = rows * n_ids, rows * len(plan.sizes)
            self.p_idx = torch.empty(slots, 3 * cap + n_bags, dtype=plan.gid.dtype).share_memory_()
            self.p_uniq = torch.empty(slots, cap, dtype=torch.int64).share_memory_()
            self.p_w = torch.empty(slots, 2 * cap, dtype=plan.w.dtype).share_memory_()

    @classmethod
    def for_batch(cls, batch: FeatureBatch, slots: int, rows: int) -> SlotRing:
        """A ring whose slots hold batches shaped like ``batch`` with up to ``max(rows, len(batch))`` rows
        (and their lookup plans, if ``batch`` has one)."""
        return cls(slots, max(rows, len(batch)), batch.sparse.shape[1], [s.shape[1] for s in batch.seqs],
                   batch.dense.shape[1], batch.plan)

    @property
    def slots(self) -> int:
        return int(self.busy.shape[0])

    def fits(self, batch: FeatureBatch) -> bool:
        p = batch.plan
        plan_ok = (p is None if self.plan_key is None
                   else p is not None and (p.sizes, p.layout, p.gid.dtype, p.w.dtype) == self.plan_key)
        return (plan_ok and len(batch) <= self.rows and batch.sparse.shape[1] == self.n_sparse
                and [s.shape[1] for s in batch.seqs] == self.widths and batch.dense.shape[1] == self.n_dense
                and batch.sparse.dtype in (torch.int64, torch.int32)
                and all(s.dtype in (torch.int64, torch.int32) for s in batch.seqs))

    def put(self, batch: FeatureBatch) -> int | None:
        """Worker side: copy ``batch`` into a free slot and return its number (None: no slot free or it does
        not fit; send the batch the ordinary way)."""
        if not self.fits(batch):
            return None
        busy = self.busy.numpy()
        for k in range(self.slots):
            s = (self._next + k) % self.slots
            if busy[s] == _FREE:
                break
        else:
            return None
        busy[s] = _SENT
        self._next = s + 1
        n = len(batch)
        self.label[s, :n].copy_(batch.label)
        self.ids[s, :n].copy_(batch.ids())
        self.dense[s, :n].copy_(batch.dense)
        p = batch.plan
        if p is not None:
            v, u, nb = len(p.gid), len(p.uniq), len(p.boff)
            self.p_idx[s, :v].copy_(p.gid)
            self.p_idx[s, v : 2 * v].copy_(p.sbag)
            self.p_idx[s, 2 * v : 2 * v + u].copy_(p.goff)
            self.p_idx[s, 2 * v + u : 2 * v + u + nb].copy_(p.boff)
            self.p_uniq[s, :u].copy_(p.uniq)
            self.p_w[s, :v].copy_(p.w)
            self.p_w[s, v : 2 * v].copy_(p.sw)
        return s

    @staticmethod
    def plan_counts(batch: FeatureBatch) -> tuple[int, int] | None:
        """What a :class:`SlotRef` carries to rebuild the batch's plan: valid slots and distinct rows."""
        return None if batch.plan is None else (len(batch.plan.gid), len(batch.plan.uniq))

    def reclaim(self) -> int:
        """Worker side, at the start of an epoch: free the slots whose references were never turned into
        batches (the loader discarded them); returns how many."""
        busy = self.busy.numpy()
        lost = busy == _SENT
        busy[lost] = _FREE
        return int(lost.sum())

    def free_slots(self) -> int:
        return int((self.busy == _FREE).sum())

    def batch(self, slot: int, n: int, plan: tuple[int, int] | None = None) -> FeatureBatch:
        """Trainer side: the batch in ``slot`` (``n`` rows; ``plan``: its plan's valid slots and distinct rows)
        as views of the ring, packed as collate makes it; the slot is released when all its tensors are gone."""
        self.busy[slot] = _HELD
        parts = [self.label.numpy()[slot, :n], self.ids.numpy()[slot, :n], self.dense.numpy()[slot, :n]]
        if plan is not None and self.plan_key is not None:
            v, u = plan
            nb = n * len(self.plan_key[0])
            parts += [self.p_idx.numpy()[slot, : 2 * v + u + nb], self.p_uniq.numpy()[slot, :u],
                      self.p_w.numpy()[slot, : 2 * v]]
        lease = _Lease(self.busy, slot, len(parts))
        for a in parts:  # torch.from_numpy keeps exactly these arrays alive until its tensor storage dies
            weakref.finalize(a, lease.release)
        t = [torch.from_numpy(a) for a in parts]
        b = split_ids(t[0], t[1], t[2], self.widths)
        if len(t) > 3:
            sizes, layout = self.plan_key[0], self.plan_key[1]  # type: ignore[index]
            pi, uniq, pw = t[3], t[4], t[5]
            b.plan = LookupPlan(sizes, layout, n, pi[:v], pw[:v], pi[2 * v + u :], uniq, pi[2 * v : 2 * v + u],
                                pi[v : 2 * v], pw[v:])
        return b


class _Lease:
    """Counts the arrays of one slot's batch still alive; marks the slot free when the last one dies."""

    def __init__(self, busy: torch.Tensor, slot: int, parts: int) -> None:
        self.busy, self.slot, self.left = busy, slot, parts
        self.lock = threading.Lock()

    def release(self) -> None:
        with self.lock:
            self.left -= 1
            if self.left == 0:
                self.busy[self.slot] = _FREE


class SlotRef:
    """What travels instead of a batch: worker, slot, row count, the plan's counts (valid slots, distinct
    rows; None without a plan) and the ring itself the first time."""

    __slots__ = ("worker", "slot", "n", "ring", "plan")

    def __init__(self, worker: int, slot: int, n: int, ring: SlotRing | None,
                 plan: tuple[int, int] | None = None) -> None:
        self.worker, self.slot, self.n, self.ring, self.plan = worker, slot, n, ring, plan

    def __getstate__(self) -> tuple[Any, ...]:
        return self.worker, self.slot, self.n, self.ring, self.plan

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self.worker, self.slot, self.n, self.ring, self.plan = state
