"""One report's path to a decision, pure: timings -> slowdown factors -> detection -> step model
-> planner. The Megatron controller (megatron/hetero/control.py) gathers the report over the
process groups, calls `ControlLoop.observe` and applies what comes back; a simulator can drive
the same object with simulated reports.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .costfit import ComputeFit
from .detect import Detection, StragglerDetector
from .plan import PartitionPlan
from .planner import Decision, Planner, StepModel, plan_work
from .transfer import MigrationCost


@dataclass(frozen=True)
class TimingReport:
    """One report interval of one TP group, per TP rank."""

    iteration: int  # the step boundary it was taken at
    compute: tuple[float, ...]  # median seconds per step in the sharded compute
    work: tuple[float, ...]  # the rank's active work (unit-weighted) in those steps
    step: float  # median wall seconds per step

    @classmethod
    def slowest_replica(cls, reports: Sequence[TimingReport]) -> TimingReport:
        """Data-parallel replicas at one TP position all-reduce their gradients, so they share
        one plan; the slowest of them sets everyone's pace, so that is the one to plan for."""
        return cls(
            reports[0].iteration,
            tuple(max(values) for values in zip(*(r.compute for r in reports))),
            tuple(max(values) for values in zip(*(r.work for r in reports))),
            max(r.step for r in reports),
        )


@dataclass(frozen=True)
class Verdict:
    """What one report led to."""

    factors: tuple[float | None, ...]  # per rank: compute per unit over an unslowed rank's
    detection: Detection | None  # None where this rank does not decide
    model: StepModel | None
    decision: Decision | None


def step_model(
    report: TimingReport, factors: Sequence[float | None], stragglers, per_unit: float
) -> StepModel:
    """The planner's model of a step from a report: measured factors for stragglers, 1 for the
    rest (their spread is noise; planning on it would shuffle units for nothing), and the time
    outside the slowest rank's sharded compute as the part no partition changes."""
    known = [f for f in factors if f is not None]
    fastest = min(known) if known else 1.0
    slowest = max(known) if known else 1.0
    return StepModel(
        max(0.0, report.step - max(report.compute)),
        tuple(
            max(1.0, (f if f is not None else slowest) / fastest) if r in stragglers else 1.0
            for r, f in enumerate(factors)
        ),
        per_unit * fastest,
    )


class ControlLoop:
    """The decisions of one TP group. Only the deciding rank detects and plans (`observe` with
    `decide=True`); every rank then `learn`s from the report with the verdict it was sent, so
    the cost fit, and the factors read from it, are the same everywhere. `report` does both in
    one process (tests, a simulator)."""

    def __init__(
        self,
        planner: Planner | None,
        detector: StragglerDetector,
        migration_cost: MigrationCost | None = None,
        fit: ComputeFit | None = None,
    ):
        self.planner, self.detector = planner, detector
        self.migration_cost = migration_cost
        self.fit = fit or ComputeFit()

    def observe(
        self,
        report: TimingReport,
        plan: PartitionPlan | None,
        shares: Sequence[float],
        decide: bool,
        unit_bytes: Mapping[str, int] | None = None,
    ) -> Verdict:
        """Where this rank decides, detect and plan from `report` (`unit_bytes`: what one unit
        of each block carries now, for the migration's predicted cost); elsewhere, only the
        factors. Call `learn` next, with the verdict the deciding rank sent."""
        factors = tuple(self.fit.factors(report.work, report.compute))
        detection = model = decision = None
        if decide and self.planner is not None:
            detection = self.detector.update(factors)
            model = step_model(
                report,
                factors,
                detection.stragglers,
                self.fit.per_unit(report.work, report.compute),
            )
            if self.migration_cost is not None and unit_bytes is not None:
                self.migration_cost.unit_bytes = dict(unit_bytes)
            decision = self.planner.decide(report.iteration, detection, model, plan, tuple(shares))
        return Verdict(factors, detection, model, decision)

    def learn(self, report: TimingReport, verdict: Verdict) -> None:
        """Add the report's ranks that are neither slow nor detected stragglers to the fit."""
        slow = {
            r for r, f in enumerate(verdict.factors) if f is not None and f >= self.detector.onset
        }
        stragglers = verdict.detection.stragglers if verdict.detection else set()
        self.fit.add(report.work, report.compute, slow | stragglers)

    def report(
        self,
        report: TimingReport,
        plan: PartitionPlan | None,
        shares: Sequence[float],
        unit_bytes: Mapping[str, int] | None = None,
    ) -> Verdict:
        """`observe` as the deciding rank, then `learn`: one process's whole report."""
        verdict = self.observe(report, plan, shares, True, unit_bytes)
        self.learn(report, verdict)
        return verdict

    def applied(self) -> None:
        """A decision changed the work split: re-base the detector's reference."""
        self.detector.rebase()

    def state_dict(self) -> dict:
        return {
            "fit": self.fit.state_dict(),
            "detector": self.detector.state_dict(),
            "planner": self.planner.state_dict() if self.planner is not None else None,
        }

    def load_state_dict(self, state: dict) -> None:
        self.fit.load_state_dict(state["fit"])
        self.detector.load_state_dict(state["detector"])
        if self.planner is not None and state["planner"] is not None:
            self.planner.load_state_dict(state["planner"])


def work_of(
    plan: PartitionPlan | None,
    unit_work: Mapping[str, float] | None,
    shares: Sequence[float],
    tp_size: int,
) -> tuple[float, ...]:
    """Per rank, the work a report divides its compute by: the active units of the plan, or
    an even share where the layers are megatron-core's own."""
    if plan is None or unit_work is None:
        return (1.0,) * tp_size
    return plan_work(plan, unit_work, shares)
