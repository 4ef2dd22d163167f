"""The planner's fallback when the MILP stops without a plan: a greedy search on the memory model."""

from __future__ import annotations

import numpy as np

from leanml.memory.milp import min_peak_choice
from leanml.memory.plan_types import PlanInfeasible, Problem, Solution, evaluate, layer_cost, make_solution


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
            floor, *_, proven = min_peak_choice(problem, 10.0)
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
    return make_solution(problem, wh, ch, post, peak, tm, "greedy")
