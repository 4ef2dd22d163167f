"""Operator graphs: declared in Python or loaded from YAML, validated into a DAG.

A graph names the raw log ``schema`` (field -> int/float/str, in TSV column order), the ``tables``
its joins read (name -> path, relative paths resolve against the data directory), its ``ops``, and
which columns become model inputs (``outputs``: a 0/1 ``label``, categorical ``sparse`` ids,
``dense`` floats and ``sequence`` id matrices).

.. code-block:: yaml

    name: tiny
    schema: {user_id: int, item_id: int, click: int}
    ops:
      - {op: hash, input: user_id, output: user, buckets: 1000}
      - {op: cross, inputs: [user_id, item_id], output: user_x_item, buckets: 10000}
    outputs: {label: click, sparse: [user, user_x_item]}
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from leanml.errors import LeanmlError
from leanml.features.ops import Op, TruncatePad, op_from_spec
from leanml.features.read.logschema import Schema

GRAPHS_DIR = Path(__file__).parents[1] / "graphs"


@dataclass
class OutputSpec:
    """Which columns feed the model, in order."""

    label: str
    sparse: list[str] = field(default_factory=list)
    dense: list[str] = field(default_factory=list)
    sequence: list[str] = field(default_factory=list)

    def columns(self) -> list[str]:
        return [self.label, *self.sparse, *self.dense, *self.sequence]


@dataclass
class FeatureGraph:
    """A validated operator DAG over a log schema."""

    name: str
    schema: Schema
    ops: list[Op]
    outputs: OutputSpec
    tables: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ structure
    def producers(self) -> dict[str, Op]:
        """Column -> the op that produces it."""
        out: dict[str, Op] = {}
        for op in self.ops:
            for c in op.outputs:
                out[c] = op
        return out

    def validate(self) -> None:
        names = [op.name for op in self.ops]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise LeanmlError(f"graph {self.name}: op names {sorted(dup)} are used twice; give each op a unique name")
        produced: dict[str, str] = {}
        for op in self.ops:
            for c in op.outputs:
                if c in self.schema.names:
                    raise LeanmlError(f"graph {self.name}: op {op.name} writes {c!r}, a raw log field; "
                                      "rename the output")
                if c in produced:
                    raise LeanmlError(f"graph {self.name}: column {c!r} is written by both {produced[c]} and {op.name}")
                produced[c] = op.name
        known = set(self.schema.names) | set(produced)
        for op in self.ops:
            for c in op.inputs:
                if c not in known:
                    raise LeanmlError(f"graph {self.name}: op {op.name} reads {c!r}, which neither the schema nor any "
                                      "op provides; add it to the schema or fix the name")
        for c in self.outputs.columns():
            if c not in known:
                raise LeanmlError(f"graph {self.name}: output {c!r} is not produced; add an op or fix outputs")
        if not self.outputs.sparse and not self.outputs.dense and not self.outputs.sequence:
            raise LeanmlError(f"graph {self.name}: outputs list no features; add sparse, dense or sequence columns")
        self.levels()  # raises on cycles

    def levels(self) -> list[list[Op]]:
        """Topological levels: an op's level is one more than the deepest op producing one of its inputs."""
        prod = self.producers()
        level: dict[str, int] = {}
        visiting: set[str] = set()
        by_name = {op.name: op for op in self.ops}

        def depth(op: Op) -> int:
            if op.name in level:
                return level[op.name]
            if op.name in visiting:
                raise LeanmlError(f"graph {self.name}: the ops form a cycle through {op.name}; a graph must be a DAG")
            visiting.add(op.name)
            d = 0
            for c in op.inputs:
                if c in prod:
                    d = max(d, depth(prod[c]) + 1)
            visiting.discard(op.name)
            level[op.name] = d
            return d

        for op in self.ops:
            depth(op)
        n = max(level.values(), default=-1) + 1
        out: list[list[Op]] = [[] for _ in range(n)]
        for name in level:
            out[level[name]].append(by_name[name])
        return out

    def cardinality(self, column: str) -> int | None:
        """Distinct ids of a categorical column (follows truncate_pad back to the op making the ids)."""
        prod = self.producers()
        op = prod.get(column)
        while isinstance(op, TruncatePad):
            op = prod.get(op.input)
        return None if op is None else op.cardinality(column if op is prod.get(column) else op.outputs[0])

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        out = self.outputs
        return {
            "name": self.name,
            "schema": dict(self.schema.fields),
            "tables": dict(self.tables),
            "ops": [op.spec() for op in self.ops],
            "outputs": {"label": out.label, "sparse": out.sparse, "dense": out.dense, "sequence": out.sequence},
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FeatureGraph:
        if not isinstance(d, dict):
            raise LeanmlError("a graph must be a mapping with keys name, schema, ops, outputs")
        missing = [k for k in ("schema", "ops", "outputs") if k not in d]
        if missing:
            raise LeanmlError(f"graph lacks keys {missing}; see docs/features.md for the format")
        outs = d["outputs"]
        if not isinstance(outs, dict) or "label" not in outs:
            raise LeanmlError("graph outputs must be a mapping with a 'label' and sparse/dense/sequence lists")
        return cls(
            name=str(d.get("name", "graph")),
            schema=Schema.parse(d["schema"]),
            ops=[op_from_spec(s) for s in d["ops"]],
            outputs=OutputSpec(label=outs["label"], sparse=list(outs.get("sparse", [])),
                               dense=list(outs.get("dense", [])), sequence=list(outs.get("sequence", []))),
            tables={str(k): str(v) for k, v in (d.get("tables") or {}).items()},
        )

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None)

    @classmethod
    def from_yaml(cls, text: str) -> FeatureGraph:
        try:
            d = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise LeanmlError(f"graph YAML does not parse: {exc}".replace("\n", " ")) from exc
        return cls.from_dict(d)


def load_graph(spec: str | Path) -> FeatureGraph:
    """A graph from a YAML path or the name of a bundled graph (``movielens``)."""
    path = Path(spec)
    if not path.exists():
        bundled = GRAPHS_DIR / f"{spec}.yaml"
        if bundled.exists():
            path = bundled
        else:
            names = sorted(p.stem for p in GRAPHS_DIR.glob("*.yaml"))
            raise LeanmlError(f"graph {spec!r} is neither a YAML file nor a bundled graph ({', '.join(names)})")
    return FeatureGraph.from_yaml(path.read_text())


def graph(name: str, schema: Sequence[tuple[str, str]] | dict[str, str], ops: list[Op], *, label: str,
          sparse: Sequence[str] = (), dense: Sequence[str] = (), sequence: Sequence[str] = (),
          tables: dict[str, str] | None = None) -> FeatureGraph:
    """Declare a graph in Python."""
    return FeatureGraph(name, Schema.parse(schema), list(ops),
                        OutputSpec(label, list(sparse), list(dense), list(sequence)), dict(tables or {}))
