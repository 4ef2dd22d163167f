"""Feature operators: small, uniform, each with a numpy (CPU) implementation and, where the work is
arithmetic, a torch implementation that runs on ``cuda`` when the scheduler places it there.

Every op declares ``inputs``, ``outputs`` and ``placement`` (``cpu`` or ``gpu``; ``gpu`` means "torch
on CUDA when present, else the CPU path"). Columns are 1-D numpy arrays (ints, floats or objects for
strings), 1-D/2-D torch tensors, or :class:`Ragged` lists (flat values plus row offsets).
Ops write their outputs into the per-batch :class:`~leanml.features.run.arena.Arena` where the size
is known, so intermediates reuse one buffer batch after batch.
"""

from leanml.features.ops.base import (
    OPS,
    Op,
    OpContext,
    default_seed,
    describe_ops,
    dumps_spec,
    op_from_spec,
    register_op,
)
from leanml.features.ops.columns import (
    Column,
    Ragged,
    column_nbytes,
    copy_out,
    is_torch,
    num_rows,
    select_rows,
    to_device,
)
from leanml.features.ops.content_ids import ContentIdLookup, read_content_id_table, write_content_id_table
from leanml.features.ops.filter import Filter
from leanml.features.ops.hash import Cross, Hash
from leanml.features.ops.join import DictJoin, load_table
from leanml.features.ops.numeric import Bucketize, LogTransform, Normalize
from leanml.features.ops.sequence import TruncatePad
from leanml.features.ops.text import Split

__all__ = [
    "OPS", "Bucketize", "Column", "ContentIdLookup", "Cross", "DictJoin", "Filter", "Hash", "LogTransform",
    "Normalize", "Op", "OpContext", "Ragged", "Split", "TruncatePad", "column_nbytes", "copy_out", "default_seed",
    "describe_ops", "dumps_spec", "is_torch", "load_table", "num_rows", "op_from_spec", "read_content_id_table",
    "register_op", "select_rows", "to_device", "write_content_id_table",
]
