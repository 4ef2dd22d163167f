"""Calibration: a plan's modelled peak is a prediction, the measured one decides.

:class:`Calibration` solves a shape's problem, installs the plan on the model and measures one step
under it; while the measured peak is over the budget it lowers the planner's budget by the overshoot and
solves again, falls back to the plan of smallest modelled peak when that one holds, and otherwise
raises :class:`~leanml.errors.LeanmlError` naming the smallest budget that holds. Under
``torch.distributed`` every rank takes rank 0's plan and the same decisions.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from leanml.errors import LeanmlError
from leanml.memory.costs import Profile
from leanml.memory.devices import broadcast_plan, max_over_ranks
from leanml.memory.plan_types import PlanInfeasible
from leanml.memory.planner import min_peak_plan, solve_plan
from leanml.memory.records import PlanRecord, ShapePlan

log = logging.getLogger(__name__)

MIB = 2**20


@dataclass
class Calibration:
    """How plans are tried on the model: ``install(record, profile)`` puts a plan on (replacing the one
    installed), ``remove()`` takes it off, ``measure()`` is the measured peak of one forward+backward of
    the planned inputs under the installed plan. ``calibrate``: measure and tighten, up to
    ``max_calibrations`` solves (else one solve, unmeasured); ``time_limit``: the solver's, in seconds."""

    install: Callable[[PlanRecord, Profile], None]
    remove: Callable[[], None]
    measure: Callable[[], int]
    time_limit: float
    max_calibrations: int
    calibrate: bool

    def plan(self, entry: ShapePlan, budget: float) -> PlanRecord:
        """The calibrated plan of a new shape under ``budget`` bytes, installed. Raises when the budget is
        below the smallest feasible peak, naming the smallest plan's measured peak."""
        profile = entry.profile
        if budget < entry.floor:
            smallest = max(entry.floor, self.measure_smallest(entry, budget)[0])
            raise LeanmlError(
                f"memory budget {budget / MIB:.1f} MiB is below the smallest feasible plan "
                f"{smallest / MIB:.1f} MiB ({smallest / profile.peak_bytes:.1%} of the unoptimized peak "
                f"{profile.peak_bytes / MIB:.1f} MiB for inputs [{profile.shape}]); raise the budget to at least that")
        return self.calibrated(entry, budget)

    def calibrated(self, entry: ShapePlan, budget: float) -> PlanRecord:
        """Solve, install and (with ``calibrate``) measure; tighten the planner's budget (starting at
        ``budget``) by any overshoot. Raises when the measured peak stays over ``budget``, naming the
        smallest budget that holds."""
        record = None
        model_budget = budget
        attempts = self.max_calibrations if self.calibrate else 1
        for attempt in range(attempts):
            try:
                sol = solve_plan(entry.problem, model_budget, self.time_limit)
            except PlanInfeasible as exc:
                self.remove()
                lowered = "" if record is None else (
                    f" (the budget lowered by calibration: the previous plan measured "
                    f"{(record.measured_peak or 0) / MIB:.1f} MiB)")
                raise LeanmlError(
                    f"memory budget {budget / MIB:.1f} MiB cannot be planned: the planner's budget "
                    f"{model_budget / MIB:.1f} MiB{lowered} got no plan because {exc.reason}; the smallest "
                    f"{'feasible peak is' if exc.proven else 'peak of a plan found is'} {exc.floor / MIB:.1f} MiB; "
                    f"raise the budget above {max(budget, exc.floor) / MIB:.1f} MiB"
                    + ("" if exc.proven
                       else f" or give the solver more time (time_limit, now {self.time_limit:g} s)")) from None
            if sol.status == "greedy":
                log.warning("planner: MILP time limit reached without a solution, using the greedy plan")
            sol = broadcast_plan(sol)
            record = entry.record_of(sol, budget, model_budget)
            self.install(record, entry.profile)
            if not self.calibrate:
                return record
            record.measured_peak = self.measure()
            # every rank must take the same decision, or their broadcasts no longer pair up
            over = max_over_ranks(record.measured_peak - budget)
            if over <= 0:
                return record
            log.info("plan measured %.1f MiB over budget; tightening the planner's budget", over / MIB)
            if model_budget <= entry.floor or attempt == attempts - 1:
                break
            model_budget = max(entry.floor, model_budget - over - 0.01 * budget)
        assert record is not None
        measured = record.measured_peak or 0
        smallest, fallback = self.measure_smallest(entry, budget, keep=True)
        if smallest <= budget:  # the plan with the smallest modelled peak holds the budget: run that one
            log.info("adacc: calibration fell back to the smallest plan (%.1f MiB)", smallest / MIB)
            return fallback
        self.remove()
        raise LeanmlError(
            f"memory budget {budget / MIB:.1f} MiB cannot be held: after {attempts} calibrations the plan measured "
            f"{measured / MIB:.1f} MiB; the smallest plan measures {smallest / MIB:.1f} MiB "
            f"({smallest / entry.profile.peak_bytes:.1%} of the unoptimized peak "
            f"{entry.profile.peak_bytes / MIB:.1f} MiB); raise the budget to at least that")

    def measure_smallest(self, entry: ShapePlan, budget: float, keep: bool = False) -> tuple[float, PlanRecord]:
        """Measured peak of the plan with the smallest modelled peak, and its record (left installed
        when ``keep``)."""
        sol = broadcast_plan(min_peak_plan(entry.problem, max(self.time_limit, 10.0)))
        record = entry.record_of(sol, budget, sol.peak)
        record.status = "smallest"
        self.install(record, entry.profile)
        try:
            record.measured_peak = int(max_over_ranks(self.measure()))
        finally:
            if not keep:
                self.remove()
        return float(record.measured_peak), record

    def tightened(self, entry: ShapePlan, plan: PlanRecord, over: float) -> PlanRecord:
        """A training step under ``plan`` measured ``over`` bytes over its budget: re-solve with the
        planner's budget lowered by the overshoot (no new profile) and install that plan. Raises when
        ``plan`` is already the smallest."""
        budget = plan.budget_bytes
        if plan.model_budget_bytes <= entry.floor * (1 + 1e-9):
            self.remove()
            raise LeanmlError(
                f"memory budget {budget / MIB:.1f} MiB cannot be held: a training step measured "
                f"{(budget + over) / MIB:.1f} MiB under the smallest plan; raise the budget to at least that")
        model_budget = max(entry.floor, plan.model_budget_bytes - over - 0.01 * budget)
        sol = broadcast_plan(solve_plan(entry.problem, model_budget, self.time_limit))
        record = entry.record_of(sol, budget, model_budget)
        self.install(record, entry.profile)
        return record
