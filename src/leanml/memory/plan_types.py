"""The planning problem and its memory model: what the planner reads and what it answers.

A :class:`Problem` holds, for every layer, the options of each of its groups (bytes kept until the
layer's backward, transient bytes while the group's backward runs, seconds added per step, relative
error) and its whole-layer options (a checkpoint of the layer; the layer run by compiled kernels with
the compiler's own budgeted recomputation, possibly with its saved tensors compressed), each replacing
all of the layer's group choices; plus bytes retained before the layers (``pre_bytes``) and the options
of the group after them (``post``: head and loss). Times may be negative (a compiled layer can be faster
than the eager one it replaces). A :class:`Solution` is a plan; :class:`PlanInfeasible` says why none fits.

Memory model of one training step (layers run 0..L-1 forward, then L-1..0 backward):

* the head's backward runs first: ``pre + sum_l R_l + R_post + T_post <= budget``;
* while layer ``l`` runs backward, layers ``< l`` still hold what they kept and layer ``l`` adds a
  transient (recomputed or decompressed tensors): ``pre + sum_{l' <= l} R_l' + T_l <= budget`` with
  ``T_l = max`` over the layer's groups of the chosen option's transient (or the whole-layer option's).

:func:`evaluate` is the plain definition of this model, used by the solvers and for checking and brute
force.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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


def evaluate(problem: Problem, whole: list[bool] | list[int], choices: list[list[int]],
             post: int) -> tuple[float, float]:
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


class PlanInfeasible(ValueError):
    """No plan was found within ``budget`` bytes. ``floor``: the smallest peak a plan reaches (proven by
    the solver when ``proven``, else the smallest peak of a plan found, an upper bound); ``reason``: why
    this budget got no plan. The message names all three."""

    def __init__(self, budget: float, floor: float, reason: str, proven: bool = True) -> None:
        self.budget, self.floor, self.reason, self.proven = float(budget), float(floor), reason, proven
        smallest = "the smallest feasible peak is" if proven else "the smallest peak of a plan found is"
        super().__init__(f"no plan fits {budget:.0f} bytes: {reason}; {smallest} {floor:.0f} bytes")


def smallest_keep_choice(problem: Problem) -> tuple[list[int], list[list[int]], int]:
    """``(whole, choices, post)`` taking, per group and per layer, the option of smallest keep (then
    transient): a plan of small peak found without a solver."""
    wh, ch = [], []
    for spec in problem.layers:
        per_group = [min(range(len(g)), key=lambda i, g=g: (g[i].keep, g[i].transient)) for g in spec.groups]
        options = [(layer_cost(spec, -1, per_group)[:2], -1)]
        options += [((o.keep, o.transient), i) for i, o in enumerate(spec.whole)]
        wh.append(min(options)[1] if spec.groups else min(options[1:])[1])
        ch.append(per_group)
    post = min(range(len(problem.post)), key=lambda i: problem.post[i].keep) if problem.post else 0
    return wh, ch, post


def make_solution(problem: Problem, whole: list[int], choices: list[list[int]], post: int, peak: float, tm: float,
                  status: str, solve_s: float = 0.0) -> Solution:
    """The :class:`Solution` of per-layer ``whole`` indices and group ``choices`` (``checkpoint`` derived)."""
    ck = [w == 0 and spec.checkpoint is not None for spec, w in zip(problem.layers, whole)]
    return Solution(ck, choices, post, peak, tm, status, solve_s, list(whole))

