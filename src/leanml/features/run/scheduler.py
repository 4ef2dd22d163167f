"""Layer-wise scheduling of an operator graph.

The DAG is cut into topological levels (``FeatureGraph.levels``). Within a level no op depends on
another, so the CPU ops of a level run together in a thread pool, while GPU-placed ops are queued on
one CUDA stream. Columns cross devices only at level boundaries: before a level starts, every input an
op needs on the other device is copied once (and the copy is kept for later levels); at the end the
model inputs are brought back to the CPU for collation. Filter masks are applied to every live column
at the end of the level that computes them.

Per-entity features. The outputs of a ``dict_join`` depend only on the joined entity (a user, an
item), and so does every row-wise op whose inputs all come from one join (title words, genre ids,
a user's age bucket...). :func:`entity_scopes` finds those ops from their inputs; the executor runs
them once over the whole table (plus the default row for unknown keys) when the table is loaded,
and per batch only looks up each row's entity position, so their outputs reach the row level as
:class:`~leanml.features.ops.columns.Gathered` columns (per-entity values + row positions) that are
gathered where a row-level op or the collate step reads them. Filters on entity columns gather
their per-entity mask. Results are identical to running every op per row (tested); ``entity=False``
runs everything per row.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from leanml.features.ops import DictJoin, Op, OpContext
from leanml.features.ops.columns import (
    Column,
    EntityColumn,
    Gathered,
    as_tensor,
    column_nbytes,
    materialize,
    select_rows,
    to_device,
)
from leanml.features.run.arena import Arena, NoArena
from leanml.features.run.batch import FeatureBatch, collate
from leanml.features.run.graph import FeatureGraph


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
    scope: dict[str, str] = field(default_factory=dict)  # op name -> the join it runs once per entity of

    def table(self) -> str:
        """A human-readable listing (what ``leanml features plan`` prints)."""
        lines = []
        for i, level in enumerate(self.levels):
            moves = [t for t in self.transfers if t.level == i]
            row_ops = [op for op in level if op.name not in self.scope]
            lines.append(f"level {i}: {len(row_ops)} op(s) per row" + (f", {len(moves)} transfer(s) before it"
                                                                       if moves else ""))
            for t in moves:
                lines.append(f"    transfer {t.column}: {t.src} -> {t.dst}")
            for op in level:
                if op.name in self.scope and not op.is_filter:
                    continue
                where = f"gathered from {self.scope[op.name]}" if op.name in self.scope else self.device[op.name]
                lines.append(f"  {op.name:22s} {op.kind:13s} {where:5s} "
                             f"{','.join(op.inputs)} -> {','.join(op.outputs)}")
        tail = [t for t in self.transfers if t.level == len(self.levels)]
        if tail:
            lines.append("before collate:")
            for t in tail:
                lines.append(f"    transfer {t.column}: {t.src} -> {t.dst}")
        joins = sorted(set(self.scope.values()))
        for j in joins:
            ops = [op for lv in self.levels for op in lv if self.scope.get(op.name) == j]
            lines.append(f"once per entity of {j} (when its table is loaded, then gathered per row): {len(ops)} op(s)")
            for op in ops:
                lines.append(f"  {op.name:22s} {op.kind:13s} cpu   {','.join(op.inputs)} -> {','.join(op.outputs)}")
        n_ops = sum(map(len, self.levels))
        lines.append(f"total: {n_ops} ops in {len(self.levels)} levels ({n_ops - len(self.scope)} per row, "
                     f"{len(self.scope)} per entity), {len(self.transfers)} transfers per batch")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {
            "levels": [[{"name": op.name, "kind": op.kind, "device": self.device[op.name],
                         "per_entity_of": self.scope.get(op.name),
                         "inputs": op.inputs, "outputs": op.outputs} for op in lv] for lv in self.levels],
            "transfers": [vars(t) for t in self.transfers],
        }


def entity_scopes(graph: FeatureGraph) -> dict[str, str]:
    """Op name -> the ``dict_join`` it can run once per entity of: row-wise ops whose inputs all come
    (directly or through other such ops) from that one join."""
    col_scope: dict[str, str | None] = dict.fromkeys(graph.schema.names)
    scope: dict[str, str] = {}
    for level in graph.levels():
        for op in level:
            if isinstance(op, DictJoin):
                for c in op.outputs:
                    col_scope[c] = op.name
                continue
            scopes = {col_scope.get(c) for c in op.inputs}
            s = scopes.pop() if len(scopes) == 1 else None
            if op.rowwise and s is not None:
                scope[op.name] = s
            for c in op.outputs:
                col_scope[c] = s if op.name in scope else None
    return scope


def make_plan(graph: FeatureGraph, cuda: bool | None = None, entity: bool = True) -> Plan:
    """Plan the graph for a machine with (``cuda=True``) or without CUDA (default: this machine).

    ``entity``: run the ops that depend on one joined entity only once per entity (see the module doc)."""
    if cuda is None:
        cuda = torch.cuda.is_available()
    levels = graph.levels()
    scope = entity_scopes(graph) if entity else {}
    device = {op.name: ("cuda" if cuda and op.placement == "gpu" and op.name not in scope else "cpu")
              for lv in levels for op in lv}
    where: dict[str, set[str]] = {c: {"cpu"} for c in graph.schema.names}
    transfers: list[Transfer] = []
    for i, level in enumerate(levels):
        for op in level:
            if op.name in scope:
                continue
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
    return Plan(levels, device, transfers, scope)


_ENTITY_CACHE: dict[Any, dict[str, EntityColumn]] = {}
_ENTITY_LOCK = threading.Lock()


def clear_caches() -> None:
    """Forget loaded tables, join indexes and per-entity columns (the next extractor loads them again)."""
    from leanml.features.ops import join as join_mod

    with _ENTITY_LOCK:
        _ENTITY_CACHE.clear()
    with join_mod._TABLES_LOCK:
        join_mod._TABLES.clear()
        join_mod._PREPARED.clear()


def entity_columns(join: DictJoin, ops: list[Op], ctx: OpContext, counters: Counter | None = None
                   ) -> tuple[dict[str, EntityColumn], float]:
    """The join's table columns and the outputs of ``ops`` (its per-entity ops, in level order), one row per
    entity plus the default row; computed once per process and table version (forked workers inherit it).
    Returns the columns and the seconds spent computing them here (0 when cached)."""
    path = ctx.resolve_table(join.table)
    key = (str(path), path.stat().st_mtime, json.dumps(join.spec(), sort_keys=True, default=str),
           json.dumps([op.spec() for op in ops], sort_keys=True, default=str))
    with _ENTITY_LOCK:
        hit = _ENTITY_CACHE.get(key)
        if hit is not None:
            return hit, 0.0
        t0 = time.perf_counter()
        _, base = join.prepare(ctx)
        cols: dict[str, Column] = dict(base)
        octx = OpContext(arena=NoArena(), tables=ctx.tables, data_dir=ctx.data_dir)
        for op in ops:
            outs = op.forward([cols[c] for c in op.inputs], octx)
            cols.update(zip(op.outputs, outs))
        if counters is not None:
            counters.update(octx.counters)
        out = {c: EntityColumn(v) for c, v in cols.items()}
        _ENTITY_CACHE[key] = out
        return out, time.perf_counter() - t0


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
    ``entity``: run per-entity ops once per table row and gather them (``False``: every op per log row).
    """

    def __init__(self, graph: FeatureGraph, *, device: torch.device | str | None = None, threads: int = 1,
                 arena: Arena | NoArena | bool | None = None, force_torch: bool = False,
                 data_dir: str | Path | None = None, tables: dict[str, str] | None = None,
                 entity: bool = True) -> None:
        self.graph = graph
        self.gpu = torch.device(device) if device is not None else (
            torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
        self.entity = entity
        self.plan = make_plan(graph, cuda=self.gpu.type == "cuda", entity=entity)
        levels = self.plan.levels
        self._entity_ops = {j: [op for lv in levels for op in lv if self.plan.scope.get(op.name) == j]
                            for j in set(self.plan.scope.values())}
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

    def _ctx(self, device: torch.device | None = None) -> OpContext:
        return OpContext(arena=self.arena, device=device or torch.device("cpu"), tables=self.tables,
                         data_dir=self.data_dir)

    def entities(self, join: DictJoin) -> dict[str, EntityColumn]:
        """The entity columns of one join (its table columns and its per-entity ops' outputs)."""
        cols, secs = entity_columns(join, self._entity_ops.get(join.name, []), self._ctx(), self.stats.counters)
        if secs:
            self.stats.op_seconds[f"<per-entity {join.name}>"] += secs
            self.stats.op_rows[f"<per-entity {join.name}>"] += len(next(iter(cols.values())).values)
        return cols

    def _run_join(self, op: DictJoin, keys: Column) -> tuple[dict[str, Column], float, Counter]:
        """Entity mode: only the entity row of every log row; every entity column becomes a gathered column."""
        ctx = self._ctx()
        t0 = time.perf_counter()
        ents = self.entities(op)
        pos = op.positions(materialize(keys), ctx)
        return {c: Gathered(e, pos) for c, e in ents.items()}, time.perf_counter() - t0, ctx.counters

    def _run_op(self, op: Op, inputs: list[Column], device: torch.device) -> tuple[list[Column], float, Counter]:
        ctx = self._ctx(device)
        t0 = time.perf_counter()
        if not op.accepts_gathered:
            inputs = [materialize(c) for c in inputs]
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
        scope = self.plan.scope
        for level in self.plan.levels:
            masks = []
            for op in level:
                if self.entity and isinstance(op, DictJoin):
                    gathered, secs, counters = self._run_join(op, cols[op.input]["cpu"])
                    for c, g in gathered.items():
                        cols[c] = {"cpu": g}
                    st.op_seconds[op.name] += secs
                    st.op_rows[op.name] += n
                    st.counters.update(counters)
                elif op.name in scope and op.is_filter:
                    t0 = time.perf_counter()
                    masks.append(np.asarray(materialize(cols[op.outputs[0]]["cpu"]), dtype=bool))
                    st.op_seconds[op.name] += time.perf_counter() - t0
                    st.op_rows[op.name] += n
            level = [op for op in level if op.name not in scope and not (self.entity and isinstance(op, DictJoin))]
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
    from leanml.features.ops.columns import Ragged

    if isinstance(col, Ragged):
        return Ragged(_as_torch_cpu(col.values), _as_torch_cpu(col.offsets))
    if isinstance(col, np.ndarray) and col.dtype != object:
        return as_tensor(col)
    return col


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
