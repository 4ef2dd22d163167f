"""What planning needs from the devices and the process group: the device allocator's out-of-memory
errors as one-line errors naming a fix, and agreement across ``torch.distributed`` ranks (the largest
value over ranks, rank 0's plan on every rank)."""

from __future__ import annotations

import torch

from leanml.errors import LeanmlError
from leanml.memory.plan_types import Solution

# the device allocator's out-of-memory errors (torch.OutOfMemoryError is newer than torch.cuda's)
OOM_ERRORS: tuple[type[BaseException], ...] = tuple(
    {e for e in (getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None))
     if isinstance(e, type)})


def out_of_memory(what: str, exc: BaseException, fix: str, fields: tuple[str, ...] = ()) -> LeanmlError:
    """One-line error for a device out-of-memory ``exc`` raised while doing ``what``, naming ``fix``
    (``fields``: the options it names, shown as their flags on the command line)."""
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    first = ". ".join(first.split(". ")[:2])[:160]
    return LeanmlError(f"the device ran out of memory {what} ({first}); {fix}", fields=fields)


def max_over_ranks(value: float) -> float:
    """Under torch.distributed, the largest ``value`` over all ranks; else ``value``."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        nccl = torch.distributed.get_backend() == "nccl"  # NCCL reduces CUDA tensors only
        t = torch.tensor([float(value)], dtype=torch.float64, device="cuda" if nccl else "cpu")
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return float(t.item())
    return value


def broadcast_plan(sol: Solution) -> Solution:
    """Under torch.distributed, every rank takes rank 0's plan."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        box = [sol]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]
    return sol
