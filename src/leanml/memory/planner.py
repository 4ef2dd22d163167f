"""The memory planner: choose, per activation group, retain / recompute / compress-with-X.

:func:`solve_plan` finds the plan of least added time whose modelled peak fits the budget
(:mod:`leanml.memory.plan_types` holds the problem and its memory model): dominated options are pruned,
identical layers are first solved as one, then the MILP (:mod:`leanml.memory.milp`) runs. On a time
limit without a solution it falls back to :func:`~leanml.memory.greedy.greedy_plan`; when both find
nothing above the smallest peak, the plan of smallest peak is used; below it, :class:`PlanInfeasible`.
"""

from __future__ import annotations

import logging
import time

from leanml.memory.greedy import greedy_plan
from leanml.memory.milp import min_peak, min_peak_choice, solve_milp
from leanml.memory.plan_types import (
    LayerSpec,
    Option,
    PlanInfeasible,
    Problem,
    Solution,
    evaluate,
    make_solution,
)

log = logging.getLogger(__name__)


def min_peak_plan(problem: Problem, time_limit: float = 10.0) -> Solution:
    """A plan reaching the smallest peak (ties broken towards less added time)."""
    floor = min_peak(problem, time_limit)
    return solve_plan(problem, floor * (1 + 1e-9) + 1e-6, time_limit, reuse=False)


def _floor_plan(problem: Problem, budget: float, time_limit: float, why: str) -> Solution:
    """When the cheapest-plan search fails (``why``): the smallest-peak plan if it fits ``budget``, else
    :class:`PlanInfeasible` naming the budget, the smallest peak and why."""
    peak, wh, ch, post, proven = min_peak_choice(problem, time_limit)
    if peak <= budget * (1 + 1e-9):
        log.warning("planner: %s; using the plan of smallest peak (%.0f bytes) instead of the cheapest", why, peak)
        return make_solution(problem, wh, ch, post, peak, evaluate(problem, wh, ch, post)[1], "smallest")
    if proven:
        raise PlanInfeasible(budget, peak, f"the budget is {peak - budget:.0f} bytes below the smallest feasible peak")
    raise PlanInfeasible(budget, peak, f"{why}, and the smallest peak found ({time_limit:g} s solver limit) is "
                         f"{peak - budget:.0f} bytes above the budget", proven=False)


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
    b, res = solve_milp(single, budget, time_limit)
    if res.x is None or res.status != 0:
        return None
    wh, ch, post = b.decode(res.x)
    sol_wh, sol_ch = wh * n_layers, [list(ch[0]) for _ in range(n_layers)]
    peak, tm = evaluate(problem, sol_wh, sol_ch, post)
    if peak > budget * (1 + 1e-9):
        return None
    return make_solution(problem, sol_wh, sol_ch, post, peak, tm, "uniform")


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
            _, lp = solve_milp(problem, budget, time_limit, relax=True)
            if lp.x is not None and uni.time <= lp.fun + 1e-9 * max(1.0, abs(lp.fun)):
                uni.solve_s = time.perf_counter() - t0
                return uni
    b, res = solve_milp(problem, budget, time_limit)
    if res.x is not None and res.status in (0, 1):
        wh, ch, post = b.decode(res.x)
        peak, tm = evaluate(problem, wh, ch, post)
        status = "optimal" if res.status == 0 else "time-limit"
        return make_solution(problem, wh, ch, post, peak, tm, status, time.perf_counter() - t0)
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
