"""The lookup plan of a batch: everything the fused embedding's forward and backward derive from the ids alone.

For one batch the fused table (:class:`leanml.features.train.model.FusedEmbedding`) needs, besides the table
itself: the table row of every valid slot, the bag every slot pools into, its mean weight, the first
slot of every bag, and for the backward the slots sorted by row (the distinct rows, where each starts,
the bags and weights in that order). None of it depends on the model's weights, only on the ids and on
the table layout (the number of ids per field), so a producer can build it beside extraction, off the
trainer's critical path: a pipelined run hands it over with the batch (``ExtractConfig.lookup_sizes``),
and a batch without one gets it built by the model as before.

>>> ids = torch.tensor([[3, 0, 4, -1], [9, -1, -1, -1]])  # one sparse field, then a sequence of 3
>>> p = build_plan(ids, (1, 3), (10, 5))
>>> p.gid.tolist(), p.w.tolist(), p.sbag.tolist()
([3, 10, 14, 9], [1.0, 0.5, 0.5, 1.0], [0, 2, 1, 1])
>>> p.uniq.tolist(), p.goff.tolist(), p.boff.tolist()
([3, 9, 10, 14], [0, 1, 2, 3], [0, 1, 3, 4])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from leanml.errors import LeanmlError


@dataclass
class LookupPlan:
    """Slots in bag order: ``gid`` (table row), ``w`` (1 / valid slots of the bag); ``boff`` (first slot of
    every bag, ``[n * fields]``; bag ``row * fields + field``). Slots sorted by row: ``uniq`` (the distinct
    rows, int64), ``goff`` (first sorted slot of each), ``sbag`` and ``sw`` (bag number and weight in that
    order). ``sizes``: the table layout it was built for; ``layout``: the batch's ``(sparse fields,
    *sequence widths)``; ``n``: batch rows."""

    sizes: tuple[int, ...]
    layout: tuple[int, ...]
    n: int
    gid: torch.Tensor
    w: torch.Tensor
    boff: torch.Tensor
    uniq: torch.Tensor
    goff: torch.Tensor
    sbag: torch.Tensor
    sw: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        return [self.gid, self.w, self.boff, self.uniq, self.goff, self.sbag, self.sw]

    def to(self, device: torch.device | str) -> LookupPlan:
        return LookupPlan(self.sizes, self.layout, self.n, *(t.to(device, non_blocking=True) for t in self.tensors()))

    def pin_memory(self) -> LookupPlan:
        return LookupPlan(self.sizes, self.layout, self.n, *(t.pin_memory() for t in self.tensors()))

    def fits(self, sizes: tuple[int, ...], layout: tuple[int, ...], n: int, device: torch.device,
             dtype: torch.dtype) -> bool:
        """Built for this table layout, this batch layout and row count, on this device, weights of ``dtype``."""
        return (self.sizes == sizes and self.layout == layout and self.n == n and self.gid.device == device
                and self.w.dtype == dtype)


_BAGS: dict[tuple[Any, ...], torch.Tensor] = {}


def bag_labels(layout: tuple[int, ...], device: torch.device | str = "cpu") -> torch.Tensor:
    """The field of every id column of a batch with ``layout = (sparse fields, *sequence widths)``: the sparse
    fields one column each, then sequence ``j`` (field ``sparse + j``) over its width (cached)."""
    key = (*layout, str(device))
    if key not in _BAGS:
        labels = list(range(layout[0]))
        for j, width in enumerate(layout[1:]):
            labels += [layout[0] + j] * width
        _BAGS[key] = torch.tensor(labels, dtype=torch.int64, device=device)
    return _BAGS[key]


def index_dtype(table_rows: int, n: int, fields: int) -> torch.dtype:
    """int32 slot ids and bag numbers when they fit (the backward sort runs about twice as fast), else int64."""
    return torch.int32 if max(table_rows, n * fields) < 2**31 else torch.int64


def check_ids(ids: torch.Tensor, bags: torch.Tensor, sizes: tuple[int, ...], limits: torch.Tensor) -> None:
    """Raise when a column holds an id beyond its field's number of ids."""
    if not len(ids):
        return
    over = ids.amax(0) >= limits.index_select(0, bags)
    if bool(over.any()):
        col = int(over.nonzero()[0])
        raise LeanmlError(f"fused embedding: column {col} (field {int(bags[col])}) has id "
                          f"{int(ids[:, col].max())} >= its {sizes[int(bags[col])]} ids; "
                          "the graph's buckets and the model's table sizes disagree")


def build_plan(ids: torch.Tensor, layout: tuple[int, ...] | list[int], sizes: tuple[int, ...] | list[int],
               offsets: torch.Tensor | None = None, limits: torch.Tensor | None = None,
               w_dtype: torch.dtype = torch.float32) -> LookupPlan:
    """The :class:`LookupPlan` of ``ids`` ``[n, S]`` (``< 0``: padding) laid out as ``layout = (sparse fields,
    *sequence widths)`` for a fused table with ``sizes[f]`` ids per field (``offsets``/``limits``: the
    table's own tensors, when at hand). Checks every id against its field."""
    sizes, layout = tuple(int(s) for s in sizes), tuple(int(x) for x in layout)
    n, s = ids.shape
    nf = len(sizes)
    if layout[0] + sum(layout[1:]) != s or layout[0] + len(layout) - 1 != nf:
        raise LeanmlError(f"fused embedding: a batch of {s} id columns as {layout[0]} sparse fields and "
                          f"sequences {list(layout[1:])} does not match a table of {nf} fields")
    dev = ids.device
    bags = bag_labels(layout, dev)
    if limits is None:
        limits = torch.tensor(sizes, dtype=torch.int64, device=dev)
    if offsets is None:
        offsets = torch.zeros(nf, dtype=torch.int64, device=dev)
        offsets[1:] = torch.cumsum(limits[:-1], 0)
    check_ids(ids, bags, sizes, limits)
    idx = index_dtype(sum(sizes), n, nf)
    valid = (ids >= 0).reshape(-1).nonzero().squeeze(1)
    gid = (ids + offsets[bags]).reshape(-1).index_select(0, valid).to(idx)
    bag = (torch.arange(n, device=dev).unsqueeze(1) * nf + bags).reshape(-1).index_select(0, valid)
    counts = torch.bincount(bag, minlength=n * nf)
    w = counts.index_select(0, bag).to(w_dtype).reciprocal_()
    boff = torch.zeros(n * nf, dtype=idx, device=dev)
    boff[1:] = torch.cumsum(counts, 0)[:-1]
    bag = bag.to(idx)
    sorted_gid, perm = torch.sort(gid)
    first = torch.ones(len(sorted_gid), dtype=torch.bool, device=dev)
    torch.ne(sorted_gid[1:], sorted_gid[:-1], out=first[1:])
    goff = first.nonzero().squeeze(1)
    uniq = sorted_gid.index_select(0, goff).long()
    return LookupPlan(sizes, layout, n, gid, w, boff, uniq, goff.to(idx), bag.index_select(0, perm),
                      w.index_select(0, perm))
