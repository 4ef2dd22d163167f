"""The planning problem as a MILP for ``scipy.optimize.milp`` (HiGHS).

One binary per (group, option), one per whole-layer option, one continuous ``T_l`` per layer (the
layer's transient); the memory rows are the model of :mod:`leanml.memory.plan_types`. :func:`solve_milp`
minimises the added time under a budget; :func:`min_peak_choice` / :func:`min_peak` minimise the peak.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, OptimizeResult, milp
from scipy.sparse import coo_array

from leanml.memory.plan_types import Problem, evaluate, smallest_keep_choice


@contextlib.contextmanager
def _quiet_fd1() -> Iterator[None]:
    """Silence C-level prints to stdout (the solver library writes some diagnostics there)."""
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError):
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def _milp(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
    with _quiet_fd1():
        return milp(*args, **kwargs)


class MilpBuilder:
    """Variable indexing and sparse rows for the MILP."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        self.n = 0
        self.x: list[list[list[int]]] = []
        self.z: list[list[int]] = []  # one binary per whole-layer option
        self.t: list[int] = []
        for spec in problem.layers:
            self.x.append([[self._new() for _ in g] for g in spec.groups])
            self.z.append([self._new() for _ in spec.whole])
            self.t.append(self._new())
        self.post = [self._new() for _ in problem.post]
        self.rows: list[dict[int, float]] = []
        self.lo: list[float] = []
        self.hi: list[float] = []

    def _new(self) -> int:
        self.n += 1
        return self.n - 1

    def add(self, coefs: dict[int, float], lo: float, hi: float) -> None:
        self.rows.append(coefs)
        self.lo.append(lo)
        self.hi.append(hi)

    def keep_terms(self, layer: int) -> dict[int, float]:
        spec = self.problem.layers[layer]
        terms: dict[int, float] = {}
        for g, xs in zip(spec.groups, self.x[layer]):
            for o, v in zip(g, xs):
                terms[v] = o.keep
        for o, z in zip(spec.whole, self.z[layer]):
            terms[z] = o.keep
        return terms

    def build(self, budget: float | None, peak_var: int | None = None) -> None:
        """Assignment, transient and memory rows; ``budget=None`` with ``peak_var`` minimises the peak."""
        pr = self.problem
        for layer, spec in enumerate(pr.layers):
            zs = self.z[layer]
            for g, xs in zip(spec.groups, self.x[layer]):
                row = {v: 1.0 for v in xs}
                for z in zs:
                    row[z] = 1.0
                self.add(row, 1.0, 1.0)
                # T_l >= transient of the chosen option of this group
                row = {v: o.transient for o, v in zip(g, xs) if o.transient}
                row[self.t[layer]] = -1.0
                self.add(row, -np.inf, 0.0)
            if zs and not spec.groups:  # nothing but whole-layer options: exactly one of them
                self.add({z: 1.0 for z in zs}, 1.0, 1.0)
            elif len(zs) > 1:
                self.add({z: 1.0 for z in zs}, 0.0, 1.0)
            for o, z in zip(spec.whole, zs):
                if o.transient:
                    self.add({z: o.transient, self.t[layer]: -1.0}, -np.inf, 0.0)
        if self.post:
            self.add({v: 1.0 for v in self.post}, 1.0, 1.0)
        prefix: dict[int, float] = {}
        for layer in range(len(pr.layers)):
            for k, v in self.keep_terms(layer).items():
                prefix[k] = prefix.get(k, 0.0) + v
            row = dict(prefix)
            row[self.t[layer]] = 1.0
            self._memory_row(row, budget, peak_var)
        if self.post:
            row = dict(prefix)
            for o, v in zip(pr.post, self.post):
                row[v] = o.keep + o.transient
            self._memory_row(row, budget, peak_var)

    def _memory_row(self, row: dict[int, float], budget: float | None, peak_var: int | None) -> None:
        pre = self.problem.pre_bytes
        if budget is not None:
            self.add(row, -np.inf, budget - pre)
        else:
            assert peak_var is not None
            row = dict(row)
            row[peak_var] = -1.0
            self.add(row, -np.inf, -pre)

    def matrix(self, n: int) -> LinearConstraint:
        r, c, d = [], [], []
        for i, row in enumerate(self.rows):
            for j, v in row.items():
                r.append(i)
                c.append(j)
                d.append(v)
        a = coo_array((d, (r, c)), shape=(len(self.rows), n)).tocsr()
        return LinearConstraint(a, np.array(self.lo), np.array(self.hi))

    def integrality(self, n: int) -> np.ndarray:
        integ = np.ones(n)
        for t in self.t:
            integ[t] = 0
        if n > self.n:
            integ[self.n:] = 0
        return integ

    def bounds(self, n: int) -> Bounds:
        hi = np.ones(n)
        for t in self.t:
            hi[t] = np.inf
        if n > self.n:
            hi[self.n:] = np.inf
        return Bounds(np.zeros(n), hi)

    def decode(self, xv: np.ndarray) -> tuple[list[int], list[list[int]], int]:
        whole, choices = [], []
        for layer in range(len(self.problem.layers)):
            zs = self.z[layer]
            picked = [i for i, z in enumerate(zs) if xv[z] > 0.5]
            whole.append(picked[0] if picked else -1)
            choices.append([int(np.argmax([xv[v] for v in xs])) if xs else 0 for xs in self.x[layer]])
        post = int(np.argmax([xv[v] for v in self.post])) if self.post else 0
        return whole, choices, post


def _costs(b: MilpBuilder, n: int) -> np.ndarray:
    c = np.zeros(n)
    for layer, spec in enumerate(b.problem.layers):
        for g, xs in zip(spec.groups, b.x[layer]):
            for o, v in zip(g, xs):
                c[v] = o.time
        for o, z in zip(spec.whole, b.z[layer]):
            c[z] = o.time
    for o, v in zip(b.problem.post, b.post):
        c[v] = o.time
    return c


def min_peak_choice(problem: Problem, time_limit: float) -> tuple[float, list[int], list[list[int]], int, bool]:
    """The plan of smallest peak as ``(peak, whole, choices, post, proven)``: a MILP minimising the peak;
    on a time limit its best plan (or the greedy smallest-keep plan), then ``proven`` is False."""
    b = MilpBuilder(problem)
    peak_var = b.n
    n = b.n + 1
    b.build(None, peak_var)
    c = np.zeros(n)
    c[peak_var] = 1.0
    res = _milp(c, constraints=b.matrix(n), integrality=b.integrality(n), bounds=b.bounds(n),
               options={"time_limit": time_limit})
    if res.x is None:
        wh, ch, post = smallest_keep_choice(problem)
        return evaluate(problem, wh, ch, post)[0], wh, ch, post, False
    wh, ch, post = b.decode(res.x)
    return evaluate(problem, wh, ch, post)[0], wh, ch, post, res.status == 0


def min_peak(problem: Problem, time_limit: float = 10.0) -> float:
    """The smallest peak any plan reaches (a MILP minimising the peak)."""
    return min_peak_choice(problem, time_limit)[0]


def solve_milp(problem: Problem, budget: float, time_limit: float,
               relax: bool = False) -> tuple[MilpBuilder, OptimizeResult]:
    """The least-added-time MILP under ``budget`` (its LP relaxation when ``relax``): the builder (to
    decode the answer) and ``scipy``'s result."""
    b = MilpBuilder(problem)
    b.build(budget)
    n = b.n
    integ = np.zeros(n) if relax else b.integrality(n)
    res = _milp(_costs(b, n), constraints=b.matrix(n), integrality=integ, bounds=b.bounds(n),
               options={"time_limit": time_limit})
    return b, res
