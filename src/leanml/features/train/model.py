"""A small CTR model over FeatureBox batches: one fused embedding table, mean-pooled sequences, an MLP.

Every sparse field and every sequence has its own block of rows in ONE embedding table (field ``f``'s
id ``i`` is row ``offsets[f] + i``), so a batch needs one lookup for all fields instead of one per field.
The lookup is one ``embedding_bag`` call that pools every field's slots into its bag (a sparse field
is a bag of one id, a sequence a bag of up to ``L`` ids, padding ``< 0`` skipped, mean over the rest,
an empty bag is zeros); its backward sorts the batch's ids once, sums the gradient per distinct row
with the same bag kernel and hands the optimizer a sparse, already coalesced gradient of those rows. The
table is trained by :class:`RowSparseAdam` (lazy Adam, as ``SparseAdam``: only the touched rows move),
the MLP by ``Adam``; a dense Adam step over every hashed bucket would dominate the step time.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from leanml.errors import LeanmlError
from leanml.features.run.batch import FeatureBatch
from leanml.features.run.graph import FeatureGraph
from leanml.features.train.lookup import LookupPlan, build_plan


class _BagLookup(torch.autograd.Function):
    """``out[b] = sum_j w_j * weight[gid_j]`` over the slots ``j`` of bag ``b`` (the tensors of a
    :class:`~leanml.features.train.lookup.LookupPlan`). Backward sums each distinct row's gradient with the same bag
    kernel over the plan's slots sorted by row and returns a coalesced sparse gradient of those rows (dense
    if not ``sparse``)."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, plan: LookupPlan, sparse: bool) -> torch.Tensor:
        ctx.save_for_backward(plan.uniq, plan.goff, plan.sbag, plan.sw)
        ctx.shape, ctx.sparse = weight.shape, sparse
        return nn.functional.embedding_bag(plan.gid, weight, plan.boff, mode="sum", per_sample_weights=plan.w)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        uniq, goff, sbag, sw = ctx.saved_tensors
        g_rows = nn.functional.embedding_bag(sbag, grad.contiguous(), goff, mode="sum", per_sample_weights=sw)
        if ctx.sparse:
            gw = torch.sparse_coo_tensor(uniq.unsqueeze(0), g_rows, ctx.shape, is_coalesced=True,
                                         check_invariants=False)
        else:
            gw = torch.zeros(ctx.shape, dtype=grad.dtype, device=grad.device).index_add_(0, uniq, g_rows)
        return gw, None, None


class _AddNarrowLinear(torch.autograd.Function):
    """``h + x @ weight.T`` for a narrow ``x`` (``[n, k]``, ``k`` a few dense floats) in one ``addmm``.

    Autograd's own weight gradient for ``nn.Linear`` is ``grad.T @ x``, a ``[out, n] @ [n, k]`` product that
    BLAS runs about ten times slower than the same numbers as ``(x.T @ grad).T`` when ``k`` is tiny and ``n``
    a whole batch (measured 3.5 ms against 0.3 ms for 8,192 x 2 into 128 on one core), so the backward
    computes it that way round."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return torch.addmm(h, x, weight.t())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        gx = grad.mm(weight) if ctx.needs_input_grad[1] else None
        gw = x.t().mm(grad).t() if ctx.needs_input_grad[2] else None
        return grad, gx, gw


class FusedEmbedding(nn.Module):
    """One embedding table for several fields, looked up and mean-pooled per bag in one call.

    ``sizes[f]`` is field ``f``'s number of ids. :meth:`forward` takes ``ids`` ``[n, S]`` (``S`` slots
    per row, ids ``< 0`` are padding) and their ``layout`` (the number of sparse fields, one column each,
    then the width of every sequence) and returns ``[n, F, dim]``: per row and field the mean of its valid
    slots' vectors.

    >>> e = FusedEmbedding([10, 5], dim=4)
    >>> ids = torch.tensor([[3, 0, 4, -1], [9, -1, -1, -1]])  # one sparse field, a sequence of 3
    >>> e(ids, (1, 3)).shape
    torch.Size([2, 2, 4])
    """

    def __init__(self, sizes: list[int], dim: int, sparse: bool = True, init_std: float = 0.05) -> None:
        super().__init__()
        if not sizes or min(sizes) < 1:
            raise LeanmlError(f"every embedded field needs at least one id (sizes {sizes})")
        self.sizes, self.dim, self.sparse = list(sizes), dim, sparse
        self.weight = nn.Parameter(torch.empty(sum(sizes), dim))
        nn.init.normal_(self.weight, std=init_std)
        off = torch.zeros(len(sizes), dtype=torch.int64)
        off[1:] = torch.cumsum(torch.tensor(sizes[:-1], dtype=torch.int64), 0)
        self.register_buffer("offsets", off, persistent=False)
        self.register_buffer("limits", torch.tensor(sizes, dtype=torch.int64), persistent=False)

    def field_rows(self, field: int) -> torch.Tensor:
        """The block of the table that holds field ``field``'s vectors."""
        o = int(self.offsets[field])
        return self.weight[o : o + self.sizes[field]]

    def plan(self, ids: torch.Tensor, layout: tuple[int, ...]) -> LookupPlan:
        """The lookup plan of ``ids`` laid out as ``layout`` (sparse fields, *sequence widths) for this table."""
        return build_plan(ids, layout, self.sizes, self.offsets, self.limits, self.weight.dtype)

    def forward(self, ids: torch.Tensor, layout: tuple[int, ...] | list[int],
                plan: LookupPlan | None = None) -> torch.Tensor:
        """Pooled vectors ``[n, fields, dim]`` of ``ids`` ``[n, S]`` laid out as ``layout = (sparse fields,
        *sequence widths)``; ``plan``: the batch's lookup plan when a producer built it (used when it was
        built for this table, layout, row count and device; otherwise built here)."""
        layout = tuple(layout)
        n = len(ids)
        if plan is None or not plan.fits(tuple(self.sizes), layout, n, ids.device, self.weight.dtype):
            plan = self.plan(ids, layout)
        out = _BagLookup.apply(self.weight, plan, self.sparse)
        return out.view(n, len(self.sizes), self.dim)


class FeatureDNN(nn.Module):
    """Embeds each sparse field and mean-pools each sequence (ids < 0 are padding) from one fused table,
    concatenates the dense floats and runs an MLP to one logit.

    >>> m = FeatureDNN([10, 5], [100], n_dense=2, dim=4, hidden=(8,))
    >>> b = FeatureBatch(torch.zeros(3), torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 2),
    ...                  [torch.full((3, 4), -1)])
    >>> m(b).shape
    torch.Size([3])
    """

    def __init__(self, sparse_sizes: list[int], seq_sizes: list[int], n_dense: int, dim: int = 16,
                 hidden: tuple[int, ...] = (128, 64), sparse_grad: bool = True) -> None:
        super().__init__()
        self.n_sparse, self.n_seq = len(sparse_sizes), len(seq_sizes)
        self.emb = FusedEmbedding([*sparse_sizes, *seq_sizes], dim, sparse=sparse_grad)
        emb_width = dim * (len(sparse_sizes) + len(seq_sizes))
        widths = [emb_width + n_dense, *hidden, 1]
        # The first layer as two: the pooled embeddings' part and the dense floats' part, initialised as one
        # nn.Linear over their concatenation would be. Same function, but no concatenation, no gradient for
        # the dense inputs, and the embeddings' gradient is a product with a width of dim * fields (a multiple
        # of 8 for the usual dims) instead of that plus a few dense columns, which BLAS runs much slower.
        first = nn.Linear(widths[0], widths[1])
        self.emb_in = nn.Linear(emb_width, widths[1])
        self.dense_in = nn.Linear(n_dense, widths[1], bias=False) if n_dense else None
        with torch.no_grad():
            self.emb_in.weight.copy_(first.weight[:, :emb_width])
            self.emb_in.bias.copy_(first.bias)
            if self.dense_in is not None:
                self.dense_in.weight.copy_(first.weight[:, emb_width:])
        layers: list[nn.Module] = []
        for w_in, w_out in zip(widths[1:-1], widths[2:], strict=True):
            layers += [nn.ReLU(inplace=True), nn.Linear(w_in, w_out)]
        self.mlp = nn.Sequential(*layers)

    def forward(self, batch: FeatureBatch) -> torch.Tensor:
        if batch.sparse.shape[1] != self.n_sparse or len(batch.seqs) != self.n_seq:
            raise LeanmlError(f"model expects {self.n_sparse} sparse fields and {self.n_seq} sequences, the batch "
                              f"has {batch.sparse.shape[1]} and {len(batch.seqs)}")
        ids = batch.ids()
        pooled = self.emb(ids, batch.layout(), batch.plan)
        h = self.emb_in(pooled.reshape(len(ids), -1))
        if self.dense_in is not None:
            h = _AddNarrowLinear.apply(h, batch.dense.to(h.dtype), self.dense_in.weight)
        return self.mlp(h).squeeze(-1)


class RowSparseAdam(torch.optim.Optimizer):
    """Lazy Adam for parameters with row-sparse gradients: the update rule of ``torch.optim.SparseAdam``
    (only the rows in the gradient move; their moments decay only when they are touched), done as one
    gather of the touched rows of both moments (kept side by side in ``state["moments"]``, ``[rows, 2, ...]``:
    first then second moment), in-place updates and one scatter back, instead of a chain of sparse-tensor
    ops. Same numbers as ``SparseAdam`` to float rounding (tested)."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                if not g.is_sparse:
                    raise LeanmlError("RowSparseAdam takes sparse gradients (an embedding with sparse=True)")
                idx = g._indices()[0]
                if not (g.is_coalesced() or idx.numel() < 2 or bool((idx[1:] > idx[:-1]).all())):
                    g = g.coalesce()  # accumulated over several backward passes: rows repeat
                    idx = g._indices()[0]
                values = g._values()
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["moments"] = torch.zeros(len(p), 2, *p.shape[1:], dtype=p.dtype, device=p.device)
                st["step"] += 1
                mv = st["moments"].index_select(0, idx)  # both moments of the touched rows in one gather
                m, v = mv[:, 0], mv[:, 1]
                m.lerp_(values, 1 - b1)
                v.mul_(b2).addcmul_(values, values, value=1 - b2)
                st["moments"].index_copy_(0, idx, mv)
                step_size = group["lr"] * math.sqrt(1 - b2 ** st["step"]) / (1 - b1 ** st["step"])
                rows = p.index_select(0, idx)  # gather + copy back: much cheaper than index_add_ on CPU
                rows.sub_(m.div_(v.sqrt_().add_(group["eps"])), alpha=step_size)
                p.index_copy_(0, idx, rows)


class CTROptimizer:
    """:class:`RowSparseAdam` for the fused embedding table (``SparseAdam`` for plain sparse ``nn.Embedding``
    tables), ``Adam`` for the MLP, driven as one optimizer."""

    def __init__(self, model: nn.Module, lr: float = 1e-3) -> None:
        self.lr = lr
        fused = [m.weight for m in model.modules() if isinstance(m, FusedEmbedding) and m.sparse]
        sparse = [p for m in model.modules() if isinstance(m, nn.Embedding) and m.sparse for p in m.parameters()]
        ids = {id(p) for p in fused + sparse}
        dense = [p for p in model.parameters() if id(p) not in ids]
        self.opts: list[torch.optim.Optimizer] = []
        if fused:
            self.opts.append(RowSparseAdam(fused, lr=lr))
        if sparse:
            self.opts.append(torch.optim.SparseAdam(sparse, lr=lr))
        if dense:
            self.opts.append(torch.optim.Adam(dense, lr=lr))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.opts:
            o.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for o in self.opts:
            o.step()


def model_for_graph(graph: FeatureGraph, dim: int = 16, hidden: tuple[int, ...] = (128, 64),
                    cardinalities: dict[str, int] | None = None, sparse_grad: bool = True) -> FeatureDNN:
    """A :class:`FeatureDNN` sized from the graph's output cardinalities (hash buckets, bucket counts)."""
    cards = dict(cardinalities or {})

    def size(col: str) -> int:
        n = cards.get(col) or graph.cardinality(col)
        if not n:
            raise LeanmlError(f"output {col!r} has no known number of ids; give its hash op `buckets:` "
                              "(or pass cardinalities)")
        return int(n)

    o = graph.outputs
    return FeatureDNN([size(c) for c in o.sparse], [size(c) for c in o.sequence], len(o.dense), dim, hidden,
                      sparse_grad=sparse_grad)
