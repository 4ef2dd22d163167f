"""The memory planner: choose, per activation group, retain / recompute / compress-with-X.

Pure numeric core: a :class:`Problem` holds, for every layer, the options of each of its groups (bytes
kept until the layer's backward, transient bytes while the group's backward runs, seconds added per
step, relative error) and its whole-layer options (a checkpoint of the layer; the layer run by compiled
kernels with the compiler's own budgeted recomputation, possibly with its saved tensors compressed),
each replacing all of the layer's group choices; plus bytes retained before the layers (``pre_bytes``)
and the options of the group after them (``post``: head and loss). Times may be negative (a compiled
layer can be faster than the eager one it replaces).

Memory model of one training step (layers run 0..L-1 forward, then L-1..0 backward):

* the head's backward runs first: ``pre + sum_l R_l + R_post + T_post <= budget``;
* while layer ``l`` runs backward, layers ``< l`` still hold what they kept and layer ``l`` adds a
  transient (recomputed or decompressed tensors): ``pre + sum_{l' <= l} R_l' + T_l <= budget`` with
  ``T_l = max`` over the layer's groups of the chosen option's transient (or the whole-layer option's).

:func:`solve_plan` writes this as a MILP for ``scipy.optimize.milp`` (HiGHS): one binary per
(group, option), one per whole-layer option, one continuous ``T_l`` per layer; minimise added time.
On a time limit without a solution it falls back to :func:`greedy_plan`. :func:`evaluate` is the
plain definition of the model above, used for checking and brute force.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

log = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class Option:
    """One way to treat a group of activations."""

    name: str
    keep: float  # bytes held from forward until this layer's backward
    transient: float = 0.0  # extra bytes alive while this group's backward runs
    time: float = 0.0  # seconds added per step
    error: float = 0.0  # relative error of the reconstructed activations


@dataclass
class LayerSpec:
    """The groups of one layer (each a list of options) and its whole-layer options: ``checkpoint``
    (recompute the layer) and ``alternatives`` (e.g. compiled kernels at a recomputation budget)."""

    groups: list[list[Option]]
    checkpoint: Option | None = None
    alternatives: list[Option] = field(default_factory=list)

    @property
    def whole(self) -> list[Option]:
        """The whole-layer options: the checkpoint (if any) first, then the alternatives."""
        return ([self.checkpoint] if self.checkpoint is not None else []) + list(self.alternatives)

    def signature(self) -> tuple:
        opts = tuple(tuple((o.name, o.keep, o.transient, o.time) for o in g) for g in self.groups)
        return (opts, tuple((o.name, o.keep, o.transient, o.time) for o in self.whole))


@dataclass
class Problem:
    """A planning instance. ``post`` may be empty (nothing after the layers)."""

    layers: list[LayerSpec]
    pre_bytes: float = 0.0
    post: list[Option] = field(default_factory=list)


@dataclass
class Solution:
    """A plan: per layer a whole-layer option or one option index per group; and the post option."""

    checkpoint: list[bool]  # the layer is recomputed as a whole (whole[l] is its checkpoint option)
    choices: list[list[int]]  # option index per group (ignored where whole[l] >= 0)
    post: int
    peak: float
    time: float
    status: str  # "optimal", "uniform" (one layer plan reused, proven optimal), "greedy"
    solve_s: float = 0.0
    whole: list[int] = field(default_factory=list)  # index into LayerSpec.whole, -1 = per-group choices

    def __post_init__(self) -> None:
        if not self.whole:
            self.whole = [0 if ck else -1 for ck in self.checkpoint]


def _whole_index(spec: LayerSpec, w: bool | int) -> int:
    """``True``/``False`` (checkpoint or not) or an index into ``spec.whole`` (-1: per-group)."""
    if isinstance(w, bool):
        if w and spec.checkpoint is None:
            raise ValueError("layer has no checkpoint option")
        return 0 if w else -1
    return int(w)


def layer_cost(spec: LayerSpec, w: bool | int, ch: list[int]) -> tuple[float, float, float]:
    """(keep, transient, time) of one layer under a choice (``w`` as in :func:`evaluate`)."""
    idx = _whole_index(spec, w)
    if idx >= 0:
        o = spec.whole[idx]
        return o.keep, o.transient, o.time
    chosen = [g[i] for g, i in zip(spec.groups, ch)]
    return (sum(o.keep for o in chosen), max((o.transient for o in chosen), default=0.0),
            sum(o.time for o in chosen))


def evaluate(problem: Problem, whole: list[bool] | list[int], choices: list[list[int]], post: int) -> tuple[float, float]:
    """Peak bytes and added seconds of a plan under the memory model (the definition, no solver).

    ``whole[l]``: ``True``/``False`` (layer checkpointed or not) or an index into the layer's
    :attr:`LayerSpec.whole` options (-1: the per-group ``choices[l]``)."""
    pre = problem.pre_bytes
    prefix = pre
    peak = pre
    total_time = 0.0
    for spec, w, ch in zip(problem.layers, whole, choices):
        keep, trans, tm = layer_cost(spec, w, ch)
        prefix += keep
        peak = max(peak, prefix + trans)
        total_time += tm
    if problem.post:
        p = problem.post[post]
        peak = max(peak, prefix + p.keep + p.transient)
        total_time += p.time
    return peak, total_time


class _Builder:
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


def _costs(b: _Builder, n: int) -> np.ndarray:
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


class PlanInfeasible(ValueError):
    """No plan was found within ``budget`` bytes. ``floor``: the smallest peak a plan reaches (proven by
    the solver when ``proven``, else the smallest peak of a plan found, an upper bound); ``reason``: why
    this budget got no plan. The message names all three."""

    def __init__(self, budget: float, floor: float, reason: str, proven: bool = True) -> None:
        self.budget, self.floor, self.reason, self.proven = float(budget), float(floor), reason, proven
        smallest = "the smallest feasible peak is" if proven else "the smallest peak of a plan found is"
        super().__init__(f"no plan fits {budget:.0f} bytes: {reason}; {smallest} {floor:.0f} bytes")


def _min_peak_choice(problem: Problem, time_limit: float) -> tuple[float, list[int], list[list[int]], int, bool]:
    """The plan of smallest peak as ``(peak, whole, choices, post, proven)``: a MILP minimising the peak;
    on a time limit its best plan (or the greedy smallest-keep plan), then ``proven`` is False."""
    b = _Builder(problem)
    peak_var = b.n
    n = b.n + 1
    b.build(None, peak_var)
    c = np.zeros(n)
    c[peak_var] = 1.0
    res = _milp(c, constraints=b.matrix(n), integrality=b.integrality(n), bounds=b.bounds(n),
               options={"time_limit": time_limit})
    if res.x is None:
        wh, ch, post = _smallest_keep_choice(problem)
        return evaluate(problem, wh, ch, post)[0], wh, ch, post, False
    wh, ch, post = b.decode(res.x)
    return evaluate(problem, wh, ch, post)[0], wh, ch, post, res.status == 0


def min_peak(problem: Problem, time_limit: float = 10.0) -> float:
    """The smallest peak any plan reaches (a MILP minimising the peak)."""
    return _min_peak_choice(problem, time_limit)[0]


def min_peak_plan(problem: Problem, time_limit: float = 10.0) -> Solution:
    """A plan reaching the smallest peak (ties broken towards less added time)."""
    floor = min_peak(problem, time_limit)
    return solve_plan(problem, floor * (1 + 1e-9) + 1e-6, time_limit, reuse=False)


def _floor_plan(problem: Problem, budget: float, time_limit: float, why: str) -> Solution:
    """When the cheapest-plan search fails (``why``): the smallest-peak plan if it fits ``budget``, else
    :class:`PlanInfeasible` naming the budget, the smallest peak and why."""
    peak, wh, ch, post, proven = _min_peak_choice(problem, time_limit)
    if peak <= budget * (1 + 1e-9):
        log.warning("planner: %s; using the plan of smallest peak (%.0f bytes) instead of the cheapest", why, peak)
        return _solution(problem, wh, ch, post, peak, evaluate(problem, wh, ch, post)[1], "smallest")
    if proven:
        raise PlanInfeasible(budget, peak, f"the budget is {peak - budget:.0f} bytes below the smallest feasible peak")
    raise PlanInfeasible(budget, peak, f"{why}, and the smallest peak found ({time_limit:g} s solver limit) is "
                         f"{peak - budget:.0f} bytes above the budget", proven=False)


def _smallest_keep_choice(problem: Problem) -> tuple[list[int], list[list[int]], int]:
    wh, ch = [], []
    for spec in problem.layers:
        per_group = [min(range(len(g)), key=lambda i, g=g: (g[i].keep, g[i].transient)) for g in spec.groups]
        options = [(layer_cost(spec, -1, per_group)[:2], -1)]
        options += [((o.keep, o.transient), i) for i, o in enumerate(spec.whole)]
        wh.append(min(options)[1] if spec.groups else min(options[1:])[1])
        ch.append(per_group)
    post = min(range(len(problem.post)), key=lambda i: problem.post[i].keep) if problem.post else 0
    return wh, ch, post


def greedy_min_peak(problem: Problem) -> float:
    """Peak of the plan that takes the smallest-keep option everywhere (an upper bound on the minimum)."""
    return evaluate(problem, *_smallest_keep_choice(problem))[0]


def _solve_milp(problem: Problem, budget: float, time_limit: float, relax: bool = False):  # noqa: ANN202
    b = _Builder(problem)
    b.build(budget)
    n = b.n
    integ = np.zeros(n) if relax else b.integrality(n)
    res = _milp(_costs(b, n), constraints=b.matrix(n), integrality=integ, bounds=b.bounds(n),
               options={"time_limit": time_limit})
    return b, res


def _uniform(problem: Problem, budget: float, time_limit: float) -> Solution | None:
    """Solve for one plan shared by all (identical) layers; None when infeasible."""
    n_layers = len(problem.layers)
    spec = problem.layers[0]
    scaled_groups = [[Option(o.name, o.keep * n_layers, o.transient, o.time * n_layers, o.error) for o in g]
                     for g in spec.groups]
    def scaled(o: Option) -> Option:
        return Option(o.name, o.keep * n_layers, o.transient, o.time * n_layers, o.error)

    ck = None if spec.checkpoint is None else scaled(spec.checkpoint)
    single = Problem([LayerSpec(scaled_groups, ck, [scaled(o) for o in spec.alternatives])], problem.pre_bytes,
                     problem.post)
    b, res = _solve_milp(single, budget, time_limit)
    if res.x is None or res.status != 0:
        return None
    wh, ch, post = b.decode(res.x)
    sol_wh, sol_ch = wh * n_layers, [list(ch[0]) for _ in range(n_layers)]
    peak, tm = evaluate(problem, sol_wh, sol_ch, post)
    if peak > budget * (1 + 1e-9):
        return None
    return _solution(problem, sol_wh, sol_ch, post, peak, tm, "uniform")


def _solution(problem: Problem, whole: list[int], choices: list[list[int]], post: int, peak: float, tm: float,
              status: str, solve_s: float = 0.0) -> Solution:
    ck = [w == 0 and spec.checkpoint is not None for spec, w in zip(problem.layers, whole)]
    return Solution(ck, choices, post, peak, tm, status, solve_s, list(whole))


def prune_dominated(problem: Problem) -> tuple[Problem, list[list[list[int]]]]:
    """Drop options another option of the same group beats or ties on keep, transient and time (an
    optimal plan never needs them). Returns the smaller problem and, per layer and group, the original
    index of each kept option."""
    layers, maps = [], []
    for spec in problem.layers:
        groups, gmaps = [], []
        for g in spec.groups:
            keep_idx = []
            for i, o in enumerate(g):
                dominated = False
                for j, p in enumerate(g):
                    if j == i:
                        continue
                    if p.keep <= o.keep and p.transient <= o.transient and p.time <= o.time and (
                        (p.keep, p.transient, p.time) != (o.keep, o.transient, o.time) or j < i
                    ):
                        dominated = True
                        break
                if not dominated:
                    keep_idx.append(i)
            groups.append([g[i] for i in keep_idx])
            gmaps.append(keep_idx)
        layers.append(LayerSpec(groups, spec.checkpoint, list(spec.alternatives)))
        maps.append(gmaps)
    return Problem(layers, problem.pre_bytes, problem.post), maps


def solve_plan(problem: Problem, budget: float, time_limit: float = 5.0, reuse: bool = True) -> Solution:
    """Cheapest plan (least added time) whose modelled peak stays within ``budget`` bytes; dominated
    options are pruned first (:func:`prune_dominated`), which does not change the optimum."""
    small, maps = prune_dominated(problem)
    sol = _solve_pruned(small, budget, time_limit, reuse)
    sol.choices = [[gm[i] for gm, i in zip(lm, ch)] for lm, ch in zip(maps, sol.choices)]
    return sol


def _solve_pruned(problem: Problem, budget: float, time_limit: float, reuse: bool) -> Solution:
    """Cheapest plan (least added time) whose modelled peak stays within ``budget`` bytes.

    When every layer is identical, one layer plan reused across all layers is solved first and kept
    when it is proven optimal (its time equals the LP relaxation bound of the full problem). On a time
    limit without a feasible solution the greedy plan is returned (logged); when the solver reports no
    plan, or the greedy search finds none, the plan of smallest peak is used if it fits (the solver can
    call a large problem infeasible, or run out of time, well above that peak). Raises
    :class:`PlanInfeasible` (a ``ValueError``) when no plan fits, naming the budget, the smallest feasible
    peak and why.
    """
    t0 = time.perf_counter()
    if reuse and len(problem.layers) > 1 and len({s.signature() for s in problem.layers}) == 1:
        uni = _uniform(problem, budget, time_limit)
        if uni is not None:
            _, lp = _solve_milp(problem, budget, time_limit, relax=True)
            if lp.x is not None and uni.time <= lp.fun + 1e-9 * max(1.0, abs(lp.fun)):
                uni.solve_s = time.perf_counter() - t0
                return uni
    b, res = _solve_milp(problem, budget, time_limit)
    if res.x is not None and res.status in (0, 1):
        wh, ch, post = b.decode(res.x)
        peak, tm = evaluate(problem, wh, ch, post)
        status = "optimal" if res.status == 0 else "time-limit"
        return _solution(problem, wh, ch, post, peak, tm, status, time.perf_counter() - t0)
    if res.status == 2:  # infeasible: true below the smallest peak; above it, the solver's numerics
        sol = _floor_plan(problem, budget, max(time_limit, 10.0), "the MILP solver reported no feasible plan")
    else:
        log.warning("MILP ended without a solution (%s); using the greedy plan", res.message)
        try:
            sol = greedy_plan(problem, budget)
        except PlanInfeasible as exc:
            sol = _floor_plan(problem, budget, max(time_limit, 10.0),
                              f"the MILP stopped without a plan ({res.message}) and {exc.reason}")
    sol.solve_s = time.perf_counter() - t0
    return sol


def greedy_plan(problem: Problem, budget: float) -> Solution:
    """Fallback: start from the fastest option everywhere, then repeatedly apply the single change with
    the best peak reduction per added second until the modelled peak fits. Raises ``ValueError`` if it
    cannot. Each round scores every change in O(1) from prefix/suffix maxima of the peak terms."""
    layers = problem.layers
    n = len(layers)
    ch = [[min(range(len(g)), key=lambda i, g=g: (g[i].time, g[i].keep)) for g in s.groups] for s in layers]
    wh = []
    for s, h in zip(layers, ch):  # the fastest way to run each layer
        cands = ([(layer_cost(s, -1, h)[2], -1)] if s.groups else []) + [(o.time, i) for i, o in enumerate(s.whole)]
        wh.append(min(cands)[1])
    posts = problem.post
    post = min(range(len(posts)), key=lambda i: (posts[i].time, posts[i].keep)) if posts else 0
    while True:
        cost = [layer_cost(s, w, h) for s, w, h in zip(layers, wh, ch)]
        keep = np.array([c[0] for c in cost])
        trans = np.array([c[1] for c in cost])
        prefix = problem.pre_bytes + np.cumsum(keep)
        terms = prefix + trans
        post_term = prefix[-1] + (posts[post].keep + posts[post].transient if posts else 0.0) if n else 0.0
        peak = max(float(terms.max()) if n else 0.0, post_term, problem.pre_bytes)
        if peak <= budget:
            break
        left = np.maximum.accumulate(np.concatenate([[problem.pre_bytes], terms]))[:-1]  # max over l' < l
        right = np.maximum.accumulate(terms[::-1])[::-1]
        right = np.concatenate([right[1:], [-np.inf]])  # max over l' > l
        best = None
        for layer, spec in enumerate(layers):
            cands = [(i, ch[layer]) for i in range(len(spec.whole)) if i != wh[layer]]
            for gi, g in enumerate(spec.groups):
                for oi in range(len(g)):
                    if wh[layer] >= 0 or oi != ch[layer][gi]:
                        h = list(ch[layer])
                        h[gi] = oi
                        cands.append((-1, h))
            for c2, h2 in cands:
                k2, t2, tm2 = layer_cost(spec, c2, h2)
                delta = k2 - keep[layer]
                p2 = max(left[layer], prefix[layer] + delta + t2, right[layer] + delta, post_term + delta)
                gain = peak - p2
                if gain <= 1e-12:
                    continue
                score = gain / max(tm2 - cost[layer][2], 1e-12)
                if best is None or score > best[0]:
                    best = (score, layer, c2, h2, None)
        for pi in range(len(posts)):
            if pi != post:
                p2 = max(float(terms.max()), prefix[-1] + posts[pi].keep + posts[pi].transient)
                if peak - p2 > 1e-12:
                    score = (peak - p2) / max(posts[pi].time - posts[post].time, 1e-12)
                    if best is None or score > best[0]:
                        best = (score, None, None, None, pi)
        if best is None:
            floor, *_, proven = _min_peak_choice(problem, 10.0)
            if floor > budget * (1 + 1e-9) and proven:
                why = f"the budget is {floor - budget:.0f} bytes below the smallest feasible peak"
            else:
                why = (f"the greedy search stopped at a peak of {peak:.0f} bytes (no single change lowers it; "
                       "the MILP finds plans a greedy search cannot)")
            raise PlanInfeasible(budget, floor, why, proven)
        _, layer, c2, h2, pi = best
        if pi is not None:
            post = pi
        else:
            wh[layer], ch[layer] = c2, h2
    peak, tm = evaluate(problem, wh, ch, post)
    return _solution(problem, wh, ch, post, peak, tm, "greedy")
