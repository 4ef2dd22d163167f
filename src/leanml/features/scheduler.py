"""Layer-wise scheduling of an operator graph.

The DAG is cut into topological levels (``FeatureGraph.levels``). Within a level no op depends on
another, so the CPU ops of a level run together in a thread pool, while GPU-placed ops are queued on
one CUDA stream. Columns cross devices only at level boundaries: before a level starts, every input an
op needs on the other device is copied once (and the copy is kept for later levels); at the end the
model inputs are brought back to the CPU for collation. Filter masks are applied to every live column
at the end of the level that computes them.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from leanml.features.arena import Arena, NoArena
from leanml.features.batch import FeatureBatch, collate
from leanml.features.columns import Column, column_nbytes, select_rows, to_device
from leanml.features.graph import FeatureGraph
from leanml.features.ops import Op, OpContext


@dataclass
class Transfer:
    """A column copied between devices before ``level`` starts (``level == len(levels)``: before collate)."""

    level: int
    column: str
    src: str
    dst: str


@dataclass
class Plan:
    """Levels, the device of each op and the transfers they imply."""

    levels: list[list[Op]]
    device: dict[str, str]
    transfers: list[Transfer]

    def table(self) -> str:
        """A human-readable listing (what ``leanml features plan`` prints)."""
        lines = []
        for i, level in enumerate(self.levels):
            moves = [t for t in self.transfers if t.level == i]
            lines.append(f"level {i}: {len(level)} op(s)" + (f", {len(moves)} transfer(s) before it" if moves else ""))
            for t in moves:
                lines.append(f"    transfer {t.column}: {t.src} -> {t.dst}")
            for op in level:
                lines.append(f"  {op.name:22s} {op.kind:13s} {self.device[op.name]:5s} "
                             f"{','.join(op.inputs)} -> {','.join(op.outputs)}")
        tail = [t for t in self.transfers if t.level == len(self.levels)]
        if tail:
            lines.append("before collate:")
            for t in tail:
                lines.append(f"    transfer {t.column}: {t.src} -> {t.dst}")
        lines.append(f"total: {sum(map(len, self.levels))} ops in {len(self.levels)} levels, "
                     f"{len(self.transfers)} transfers per batch")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {
            "levels": [[{"name": op.name, "kind": op.kind, "device": self.device[op.name],
                         "inputs": op.inputs, "outputs": op.outputs} for op in lv] for lv in self.levels],
            "transfers": [vars(t) for t in self.transfers],
        }


def make_plan(graph: FeatureGraph, cuda: bool | None = None) -> Plan:
    """Plan the graph for a machine with (``cuda=True``) or without CUDA (default: this machine)."""
    if cuda is None:
        cuda = torch.cuda.is_available()
    levels = graph.levels()
    device = {op.name: ("cuda" if cuda and op.placement == "gpu" else "cpu") for lv in levels for op in lv}
    where: dict[str, set[str]] = {c: {"cpu"} for c in graph.schema.names}
    transfers: list[Transfer] = []
    for i, level in enumerate(levels):
        for op in level:
            dev = device[op.name]
            for c in op.inputs:
                if dev not in where[c]:
                    transfers.append(Transfer(i, c, next(iter(where[c])), dev))
                    where[c].add(dev)
        for op in level:
            for c in op.outputs:
                where[c] = {device[op.name]}
        filters = [op for op in level if op.is_filter]
        if filters and any("cuda" in devs for devs in where.values()):  # masks also apply to GPU columns
            transfers.append(Transfer(i + 1, "<mask of " + ",".join(f.name for f in filters) + ">", "cpu", "cuda"))
    for c in graph.outputs.columns():
        if "cpu" not in where[c]:
            transfers.append(Transfer(len(levels), c, "cuda", "cpu"))
    return Plan(levels, device, transfers)


@dataclass
class ExecStats:
    """Per-op seconds and rows, transfer counts, filter drops."""

    op_seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    op_rows: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    transfers: int = 0
    transfer_bytes: int = 0
    rows_in: int = 0
    rows_out: int = 0
    batches: int = 0
    counters: Counter = field(default_factory=Counter)

    def merge(self, other: ExecStats) -> None:
        for k, v in other.op_seconds.items():
            self.op_seconds[k] += v
        for k, v in other.op_rows.items():
            self.op_rows[k] += v
        self.transfers += other.transfers
        self.transfer_bytes += other.transfer_bytes
        self.rows_in += other.rows_in
        self.rows_out += other.rows_out
        self.batches += other.batches
        self.counters.update(other.counters)

    def as_dict(self) -> dict[str, Any]:
        return {
            "op_seconds": {k: round(v, 6) for k, v in self.op_seconds.items()},
            "op_rows_per_s": {k: round(self.op_rows[k] / v, 1) for k, v in self.op_seconds.items() if v > 0},
            "transfers": self.transfers, "transfer_bytes": self.transfer_bytes,
            "rows_in": self.rows_in, "rows_out": self.rows_out, "batches": self.batches,
            "counters": dict(self.counters),
        }


class LayerwiseExecutor:
    """Runs a graph on chunks of raw columns, level by level, and collates the model inputs.

    ``threads``: CPU ops of one level run concurrently on this many threads (1 = sequential).
    ``device``: where GPU-placed ops run (``cuda`` when present by default). ``force_torch`` runs the
    torch implementations even on the CPU (used to check them against the numpy ones).
    ``arena``: per-batch buffer for op outputs (``None``: a fresh :class:`Arena`; ``False``: plain allocation).
    """

    def __init__(self, graph: FeatureGraph, *, device: torch.device | str | None = None, threads: int = 1,
                 arena: Arena | NoArena | bool | None = None, force_torch: bool = False,
                 data_dir: str | Path | None = None, tables: dict[str, str] | None = None) -> None:
        self.graph = graph
        self.gpu = torch.device(device) if device is not None else (
            torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
        self.plan = make_plan(graph, cuda=self.gpu.type == "cuda")
        self.threads = max(1, threads)
        self.force_torch = force_torch
        if arena is None or arena is True:
            arena = Arena()
        elif arena is False:
            arena = NoArena()
        self.arena = arena
        self.tables = {**graph.tables, **(tables or {})}
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self.stats = ExecStats()
        self._pool = ThreadPoolExecutor(self.threads) if self.threads > 1 else None
        self._stream = torch.cuda.Stream() if self.gpu.type == "cuda" else None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()

    def _device_of(self, op: Op) -> torch.device:
        return self.gpu if self.plan.device[op.name] == "cuda" else torch.device("cpu")

    def _run_op(self, op: Op, inputs: list[Column], device: torch.device) -> tuple[list[Column], float, Counter]:
        ctx = OpContext(arena=self.arena, device=device, tables=self.tables, data_dir=self.data_dir)
        t0 = time.perf_counter()
        use_torch = op.has_torch and (device.type == "cuda" or self.force_torch)
        if use_torch:
            if device.type == "cpu":
                inputs = [_as_torch_cpu(c) for c in inputs]
            outs = op.forward_torch(inputs, ctx)
            if device.type == "cpu":
                outs = [to_device(o, device) for o in outs]
        else:
            outs = op.forward(inputs, ctx)
        if len(outs) != len(op.outputs):
            raise RuntimeError(f"op {op.name} returned {len(outs)} columns for outputs {op.outputs}")
        return outs, time.perf_counter() - t0, ctx.counters

    def _run_levels(self, cols: dict[str, dict[str, Column]], n: int) -> int:
        st = self.stats
        for level in self.plan.levels:
            # transfers at the level boundary
            for op in level:
                dev = self.plan.device[op.name]
                for c in op.inputs:
                    if dev not in cols[c]:
                        src = next(iter(cols[c].values()))
                        moved = to_device(src, self._device_of(op))
                        cols[c][dev] = moved
                        st.transfers += 1
                        st.transfer_bytes += column_nbytes(src)
            gpu_ops = [op for op in level if self.plan.device[op.name] == "cuda"]
            cpu_ops = [op for op in level if self.plan.device[op.name] == "cpu"]
            results: list[tuple[Op, Any]] = []
            if self._pool is not None and len(cpu_ops) > 1:
                futs = [(op, self._pool.submit(self._run_op, op, [cols[c]["cpu"] for c in op.inputs],
                                               torch.device("cpu"))) for op in cpu_ops]
            else:
                futs = []
                for op in cpu_ops:
                    results.append((op, self._run_op(op, [cols[c]["cpu"] for c in op.inputs], torch.device("cpu"))))
            for op in gpu_ops:
                results.append((op, self._run_op(op, [cols[c]["cuda"] for c in op.inputs], self.gpu)))
            results += [(op, f.result()) for op, f in futs]
            masks = []
            for op, (outs, secs, counters) in results:
                dev = self.plan.device[op.name]
                st.op_seconds[op.name] += secs
                st.op_rows[op.name] += n
                st.counters.update(counters)
                for c, o in zip(op.outputs, outs):
                    cols[c] = {dev: o}
                if op.is_filter:
                    masks.append(np.asarray(outs[0], dtype=bool))
            if masks:
                keep = np.logical_and.reduce(masks)
                if not keep.all():
                    st.counters["filtered_rows"] += int((~keep).sum())
                    for c in cols:
                        cols[c] = {d: select_rows(v, keep) for d, v in cols[c].items()}
                    n = int(keep.sum())
        return n

    def run_columns(self, chunk: dict[str, np.ndarray]) -> dict[str, Column]:
        """All columns of one chunk after the graph ran (numpy/torch/ragged, filters applied)."""
        st = self.stats
        cols: dict[str, dict[str, Column]] = {c: {"cpu": chunk[c]} for c in self.graph.schema.names}
        n = len(chunk[self.graph.schema.names[0]]) if chunk else 0
        st.rows_in += n
        # every CUDA copy and kernel of the batch is issued on one stream, so they stay ordered
        with torch.cuda.stream(self._stream) if self._stream is not None else _null():
            n = self._run_levels(cols, n)
        if self._stream is not None:
            self._stream.synchronize()
        out: dict[str, Column] = {}
        for c, copies in cols.items():
            if "cpu" in copies:
                out[c] = copies["cpu"]
            else:
                src = copies["cuda"]
                if c in self.graph.outputs.columns():
                    st.transfers += 1
                    st.transfer_bytes += column_nbytes(src)
                out[c] = src
        st.rows_out += n
        st.batches += 1
        return out

    def run(self, chunk: dict[str, np.ndarray]) -> FeatureBatch:
        """One chunk of raw columns -> one :class:`FeatureBatch`; the arena is reset afterwards."""
        cols = self.run_columns(chunk)
        o = self.graph.outputs
        t0 = time.perf_counter()
        batch = collate(cols, o.label, o.sparse, o.dense, o.sequence)
        self.stats.op_seconds["<collate>"] += time.perf_counter() - t0
        self.stats.op_rows["<collate>"] += len(batch)
        self.arena.reset()
        return batch


def _as_torch_cpu(col: Column) -> Column:
    from leanml.features.columns import Ragged

    if isinstance(col, Ragged):
        return Ragged(_as_torch_cpu(col.values), _as_torch_cpu(col.offsets))
    if isinstance(col, np.ndarray) and col.dtype != object:
        return torch.from_numpy(col)
    return col


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
