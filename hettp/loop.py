"""The path from timings to a decision, pure: timings -> slowdown factors -> detection -> step
model -> planner. Detection runs every step on a few floats per rank; the planner runs when the
detection changes or at a report (every `--het-tp-interval` steps, the steps' medians), where
the cost fit also learns. The Megatron controller (megatron/hetero/control.py) gathers the
timings over the process groups, calls `ControlLoop.step`, `observe` and `close` and applies what
comes back; a simulator can drive the same object with simulated timings.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .anchor import SlowdownAnchor, relative
from .costfit import ComputeFit
from .detect import Detection, StragglerDetector
from .measured import Measured
from .plan import PartitionPlan
from .planner import Decision, Planner
from .step_model import StepModel, plan_work
from .transfer import MigrationCost


@dataclass(frozen=True)
class TimingReport:
    """One step, or the median of several, of one TP group, per TP rank."""

    iteration: int  # the step boundary it was taken at
    compute: tuple[float, ...]  # seconds per step in the rank's timed compute
    work: tuple[float, ...]  # the rank's active work (unit-weighted) in those steps
    step: float  # wall seconds per step
    fixed: tuple[float, ...] | None = None  # of compute, the part no split changes (None: 0)
    busy: tuple[float, ...] | None = None  # all of the rank's compute in the step, if known
    # of compute, the seconds in the attention modules (the rest past `fixed` is the MLP's),
    # if known: what each block took, where the totals hide which block a rank waits in
    attention: tuple[float, ...] | None = None

    @property
    def measured(self) -> Measured:
        """What the planner judges by: the step, and each rank's compute (all of it, and in
        the blocks)."""
        return Measured(
            self.step, tuple(self.compute), tuple(self.fixed or ()), tuple(self.attention or ())
        )

    @classmethod
    def from_dict(cls, saved: dict) -> TimingReport:
        """The inverse of dataclasses.asdict (lists back to tuples)."""
        fixed, busy, attention = saved.get("fixed"), saved.get("busy"), saved.get("attention")
        return cls(
            saved["iteration"],
            tuple(saved["compute"]),
            tuple(saved["work"]),
            saved["step"],
            tuple(fixed) if fixed is not None else None,
            tuple(busy) if busy is not None else None,
            tuple(attention) if attention is not None else None,  # absent in older checkpoints
        )

    @classmethod
    def median(cls, steps: Sequence[TimingReport]) -> TimingReport:
        """Several steps as one report: per rank, the median step, so one slow step (a hiccup,
        a burst's tail) does not make a report slow."""
        if not steps:
            raise ValueError("a report needs at least one step")
        return cls._combine(steps, steps[-1].iteration, statistics.median)

    @classmethod
    def latest_level(cls, steps: Sequence[TimingReport], band: float) -> TimingReport:
        """Several steps of one split as the report of the level the last is at: per rank,
        the median of the steps whose compute is within `band` of the last step's. Where a
        straggle began or ended among them, the median of all would plan half way."""
        if not steps:
            raise ValueError("a report needs at least one step")
        last = steps[-1]
        picked = [
            [s for s in steps if max(s.compute[r], c) < band * min(s.compute[r], c)]
            for r, c in enumerate(last.compute)
        ]

        def per_rank(name):
            if any(getattr(s, name) is None for s in steps):
                return None
            return tuple(
                statistics.median(getattr(s, name)[r] for s in picked[r])
                for r in range(len(picked))
            )

        slowest = max(range(len(picked)), key=lambda r: last.compute[r])
        return cls(
            last.iteration,
            per_rank("compute"),
            last.work,
            statistics.median(s.step for s in picked[slowest]),
            per_rank("fixed"),
            per_rank("busy"),
            per_rank("attention"),
        )

    @classmethod
    def slowest_replica(cls, reports: Sequence[TimingReport]) -> TimingReport:
        """Data-parallel replicas at one TP position all-reduce their gradients, so they share
        one plan; the slowest of them sets everyone's pace, so that is the one to plan for."""
        return cls._combine(reports, reports[0].iteration, max)

    @classmethod
    def _combine(cls, reports: Sequence[TimingReport], iteration: int, reduce) -> TimingReport:
        """Reports reduced per rank (and the step time) with `reduce`; a per-rank field one of
        them lacks is left out."""

        def per_rank(name):
            rows = [getattr(r, name) for r in reports]
            if any(row is None for row in rows):
                return None
            return tuple(reduce(values) for values in zip(*rows))

        return cls(
            iteration,
            per_rank("compute"),
            per_rank("work"),
            reduce([r.step for r in reports]),
            per_rank("fixed"),
            per_rank("busy"),
            per_rank("attention"),
        )


@dataclass(frozen=True)
class Verdict:
    """What one report led to."""

    factors: tuple[float | None, ...]  # per rank: compute per unit over an unslowed rank's
    detection: Detection | None  # None where nothing detects (no policy that decides)
    model: StepModel | None
    decision: Decision | None
    refused: str | None = None  # a move the planner refused on what the report measured
    # where `factors` came from: "anchor" (continuity across the last change of the split;
    # "anchor, model at ranks [r]" where the fitted model overruled it there), "fit" (the cost
    # fit's line), or "prior" (the fit before its points span a line)
    reading: str = ""
    # the cost fit's slowdowns of the report, relative to the fastest rank, wherever `factors`
    # came from (None before the fit has a line): what the anchor's model checks weigh
    modelled: tuple[float | None, ...] | None = None


def step_model(
    report: TimingReport,
    factors: Sequence[float | None],
    stragglers,
    per_unit: float,
    fixed: float = 0.0,
    apart: float = 0.0,
) -> StepModel:
    """The planner's model of a step from a report: measured factors for stragglers, 1 for the
    rest (their spread is noise; planning on it would shuffle units for nothing), each rank's
    compute as `fixed` + `per_unit` x work times its factor, of which `apart` runs after the
    blocks (hettp.costfit.Line), and the time outside the slowest rank's compute as the part
    no partition changes."""
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
        max(0.0, fixed - apart) * fastest,
        min(apart, fixed) * fastest,
    )


WARMUP_STEPS = 3  # steps after a start or resume that detection leaves out
# A straggle the model ended at a change that starts again within this many detector windows
# was misread there (ControlLoop._check_model_ends): the end moves the plan back to even, where
# the ranks' ratios are read without a model, and the onset there takes one window.
REFUTE_WINDOWS = 2
# Works this close (largest over smallest) read as an even split: the ranks' compute ratios are
# their speed ratios to within the works' difference, with no model and no anchor to carry.
NEAR_EVEN = 1.05


@dataclass(frozen=True)
class Due:
    """The planner must run, on `report` with `detection`."""

    report: TimingReport  # the interval's median step, or at a change, the steps that showed it
    detection: Detection | None
    closes_interval: bool  # the fit learns from the report, and the next interval begins


class ControlLoop:
    """The decisions of one TP group. Every rank passes every step's gathered timings to `step`,
    which detects; the same timings give the same detection everywhere, so every rank knows
    alike, without a message, when the planner must run: where the detection changed, and at
    the end of each report interval (`interval` steps). Then only the deciding rank plans
    (`observe` with `decide=True`) and sends the decision, and every rank `close`s the step
    with the same verdict, so the cost fit, and the factors read from it, stay the same
    everywhere. `run_step` does it all in one process (tests, a simulator); `report` takes one
    report as a step and plans on it."""

    def __init__(
        self,
        planner: Planner | None,
        detector: StragglerDetector,
        migration_cost: MigrationCost | None = None,
        fit: ComputeFit | None = None,
        interval: int = 10,
    ):
        if interval < 1:
            raise ValueError(f"report interval must be >= 1, got {interval}")
        self.planner, self.detector = planner, detector
        self.migration_cost = migration_cost
        self.fit = fit or ComputeFit()
        self.anchor = SlowdownAnchor(
            detector.tp_size, detector.window, detector.onset, detector.end, detector.at_once
        )
        self.interval = interval
        self._steps: list[TimingReport] = []  # this report interval's steps
        # the latest steps detected on, all of one split: the level a change leaves
        self._recent: deque[TimingReport] = deque(maxlen=detector.window)
        self._seen = 0  # steps seen since this loop was created
        self.latest: TimingReport | None = None  # the last step seen, every rank's timings
        self._detected = 0  # steps detected on
        # per rank, the detected step at which the model ended its straggle at a change (not
        # checkpointed: a resume between an end and its refutation loses that refutation)
        self._model_ended: dict[int, int] = {}

    def step(self, step: TimingReport) -> Due | None:
        """One step's timings (every rank): detect where a planner decides; returns what to
        plan on where the planner must run."""
        warm = self._seen >= WARMUP_STEPS
        self._seen += 1
        self.latest = step
        # The first steps after a start or resume (allocations, the optimizer's lazy state,
        # caches) are no evidence of speed.
        detection = self.detect(step) if self.planner is not None and warm else None
        self._steps.append(step)
        closes = len(self._steps) >= self.interval
        changed = detection is not None and detection.changed
        if not closes and not changed:
            return None
        if not changed:
            return Due(TimingReport.median(self._steps), detection, True)
        # A straggle began or ended among these steps: the median of the interval would plan
        # half way between the levels (an end seen at an interval's last step was planned
        # as a 2x straggle where 3x had ended, and undone only a step later).
        recent = self._steps[-self.detector.window :]
        return Due(TimingReport.latest_level(recent, self.detector.onset), detection, closes)

    def close(self, due: Due, verdict: Verdict) -> None:
        """After `observe` and the deciding rank's decision: learn from an interval's report."""
        if due.closes_interval:
            self.learn(due.report, verdict)
            self._steps = []

    def run_step(
        self,
        step: TimingReport,
        plan: PartitionPlan | None,
        shares: Sequence[float],
        unit_bytes: Mapping[str, int] | None = None,
    ) -> Verdict | None:
        """One process: `step`, and where due, `observe` as the deciding rank, then `close`."""
        due = self.step(step)
        if due is None:
            return None
        verdict = self.observe(due.report, due.detection, plan, shares, True, unit_bytes)
        self.close(due, verdict)
        return verdict

    def factors(self, report: TimingReport) -> tuple[float | None, ...]:
        """Per rank, how many times slower than at full speed: anchored once the split has
        changed (hettp/anchor.py), before that read through the cost fit (at an even split,
        only the ranks' ratios count, and those need no model)."""
        if self.anchor.anchored:
            return self.anchor.factors(report.compute)
        return tuple(self.fit.factors(report.work, report.compute, report.fixed))

    def detect(self, step: TimingReport) -> Detection:
        """One step's timings into the detector (every rank, every step). While the anchor
        after a change fills, the detector waits; then it takes the anchor's steps at once."""
        self._recent.append(step)
        self._detected += 1
        if self.anchor.active and near_even(step.work):
            # An even split again, or within NEAR_EVEN of one (a move back after a straggle
            # lands on the MLP's chunks): the ranks' ratios need no anchor, and a slowdown it
            # carried across the change may be stale, read from one step at it.
            self.anchor.clear()
        anchoring = self.anchor.active and not self.anchor.anchored
        if self.anchor.active:
            modelled = None
            if self.fit.fitted:
                modelled = tuple(self.fit.factors(step.work, step.compute, step.fixed))
            rows = self.anchor.step(step.compute, modelled, step.work)
        else:
            rows = [tuple(self.fit.factors(step.work, step.compute, step.fixed))]
        if not rows:
            return self.detector.current()
        seen = [self.detector.update(row) for row in rows]
        last = seen[-1]
        onsets = frozenset().union(*(d.onsets for d in seen)) - last.ends
        ends = frozenset().union(*(d.ends for d in seen)) - last.onsets
        self._check_model_ends(onsets, ends & self.anchor.model_ends if anchoring else set())
        return Detection(last.slowdown, last.stragglers, any(d.changed for d in seen), onsets, ends)

    def _check_model_ends(self, onsets, model_ends) -> None:
        """A straggle the model ended at a change (`model_ends`, as the anchor completed) and
        that starts again within REFUTE_WINDOWS detector windows (read at the even split the
        end moved back to) was misread: the anchor stops taking the model's word for it."""
        for rank in model_ends:
            self._model_ended[rank] = self._detected
        within = REFUTE_WINDOWS * self.detector.window
        refuted = {
            rank
            for rank in onsets
            if rank in self._model_ended and self._detected - self._model_ended[rank] <= within
        }
        if refuted:
            self.anchor.refute(refuted)
        for rank in onsets:
            self._model_ended.pop(rank, None)

    def observe(
        self,
        report: TimingReport,
        detection: Detection | None,
        plan: PartitionPlan | None,
        shares: Sequence[float],
        decide: bool,
        unit_bytes: Mapping[str, int] | None = None,
    ) -> Verdict:
        """Where this rank decides, plan from `report` and the latest `detection`
        (`unit_bytes`: what one unit of each block carries now, for the migration's predicted
        cost); elsewhere, only the factors. Then `learn` from a report, with the verdict the
        deciding rank sent."""
        factors = self.factors(report)
        model = decision = None
        # Revisit the plan only on settled evidence: not between a change and its anchor (the
        # factors are read through a cost model that may not know the new split's costs yet),
        # and not while the report and the detector disagree on who is slow (a straggle is
        # starting or ending; the detector will say so within its window).
        settled = (self.anchor.anchored or not self.anchor.active) and (
            detection is not None and self._agrees(factors, detection)
        )
        if (
            decide
            and self.planner is not None
            and detection is not None
            and (settled or detection.changed)
        ):
            line = self.fit.line(report.work, report.compute, report.fixed)
            model = step_model(
                report, factors, detection.stragglers, line.per_unit, line.fixed, line.apart
            )
            if self.migration_cost is not None and unit_bytes is not None:
                self.migration_cost.unit_bytes = dict(unit_bytes)
            decision = self.planner.decide(
                report.iteration,
                detection,
                model,
                plan,
                tuple(shares),
                report.measured,
            )
        refused = self.planner.refused if model is not None else None
        modelled = None
        if self.fit.fitted:
            modelled = relative(self.fit.factors(report.work, report.compute, report.fixed))
        return Verdict(factors, detection, model, decision, refused, self.reading(), modelled)

    def reading(self) -> str:
        """Where `factors` reads a report's slowdowns from now (Verdict.reading)."""
        if self.anchor.anchored:
            overruled = sorted(self.anchor.overruled)
            return f"anchor, model at ranks {overruled}" if overruled else "anchor"
        return "fit" if self.fit.fitted else "prior"

    def _agrees(self, factors, detection: Detection) -> bool:
        """The report's factors put every straggler above the detector's end threshold, within
        its onset of the detector's level, and every other rank below its onset. An interval
        whose last steps came after a straggle ended has a median half way (2.7x where the
        detector read 1.4x after a 3.8x one, a TP=2 run); a rebalance planned on it moved
        units off the recovered rank."""
        end, onset = self.detector.end, self.detector.onset
        for rank, slow in enumerate(relative(factors)):
            if slow is None:
                continue
            if rank not in detection.stragglers:
                if slow >= onset:
                    return False
                continue
            level = detection.slowdown[rank]
            if slow < end or max(slow, level) >= onset * min(slow, level):
                return False
        return True

    def learn(self, report: TimingReport, verdict: Verdict) -> None:
        """Add the report's ranks to the fit, each at the compute it would take at the fastest
        rank's speed; a slow rank with few units tells the fit what few units cost."""
        self.fit.add(report.work, report.compute, verdict.factors, report.fixed)

    def report(
        self,
        report: TimingReport,
        plan: PartitionPlan | None,
        shares: Sequence[float],
        unit_bytes: Mapping[str, int] | None = None,
    ) -> Verdict:
        """One process, `report` taken as one step: `detect`, `observe` as the deciding rank,
        then `learn`."""
        verdict = self.observe(report, self.detect(report), plan, shares, True, unit_bytes)
        self.learn(report, verdict)
        return verdict

    def migrated(self, migration_seconds: float, predicted_transfer: float) -> None:
        """A migration was applied: it took `migration_seconds` in all, its transfer predicted
        at `predicted_transfer` (the migration cost learns its factor)."""
        if self.migration_cost is not None:
            self.migration_cost.learn(predicted_transfer, migration_seconds)

    def applied(self) -> None:
        """A decision changed the work split: anchor the slowdowns there, and re-base the
        detector's reference."""
        self._rebase_anchor()
        self.detector.rebase()
        self._steps = []  # a report's steps share one split

    def _rebase_anchor(self) -> None:
        """The split changed: the anchor carries `_carried` across, with each rank's compute
        and work at the level the latest steps are at (the detector's window of them), and
        where the cost fit has a line, the slowdowns it reads there."""
        recent = list(self._recent)
        self._recent.clear()
        if not recent or len({step.work for step in recent}) > 1:
            self.anchor.rebase(self._carried())
            return
        level = TimingReport.latest_level(recent, self.detector.onset)
        modelled = None
        if self.fit.fitted:
            modelled = tuple(self.fit.factors(level.work, level.compute, level.fixed))
        self.anchor.rebase(self._carried(), level.compute, level.work, modelled)

    def _carried(self) -> tuple[float, ...]:
        """The slowdowns the anchor carries across a change: each rank's level, but 1.0 for a
        rank that neither straggles nor reads past the detector's onset, as the planner reads
        it (step_model). Carried as read, a fast rank's noise at the change (1.14x) stayed in
        its every later reading, and a few slower steps on top read as a 1.3x onset (a TP=4
        run of this VM; the plan moved units off it). A rank past the onset that is not yet
        a straggler keeps its level: its straggle may be starting."""
        detector = self.detector
        return tuple(
            v if r in detector.stragglers or v >= detector.onset else 1.0
            for r, v in enumerate(detector.level())
        )

    def reweighed(self, work: Sequence[float] | None = None) -> None:
        """The units' weights changed (core attention priced): the work a report divides by is
        in new units. What was learned in the old ones (the fit's points, the detector's
        per-unit history) starts over; this interval's steps, where they share one split,
        take `work`, that split's per-rank work in the new units, and the interval goes on."""
        self.fit = ComputeFit()
        self.anchor.clear()
        self._recent.clear()  # their work is in the old units
        self.detector.rebase()
        if work is None or len({step.work for step in self._steps}) > 1:
            self._steps = []
        else:
            self._steps = [dataclasses.replace(step, work=tuple(work)) for step in self._steps]

    def work_scaled(self, factor: float) -> None:
        """Every rank's per-step work was multiplied by `factor` (a batch-size ramp changed the
        micro-batch count). No rank's speed changed: slowdowns carry across the change through
        the anchor, as across a decision, the detector starts its window over (it holds
        seconds), and the fit's seconds scale with the work."""
        if not factor > 0:
            raise ValueError(f"work scale must be positive, got {factor}")
        self.fit.rescale(factor)
        if self.anchor.active:
            self._rebase_anchor()
        self.detector.rebase()
        self._steps = []  # a report's steps share one batch

    def state_dict(self) -> dict:
        return {
            "fit": self.fit.state_dict(),
            "detector": self.detector.state_dict(),
            "planner": self.planner.state_dict() if self.planner is not None else None,
            "anchor": self.anchor.state_dict(),
            "steps": [dataclasses.asdict(step) for step in self._steps],
            "migration_cost": (
                self.migration_cost.state_dict() if self.migration_cost is not None else None
            ),
        }

    def load_state_dict(self, state: dict) -> None:
        self.fit.load_state_dict(state["fit"])
        self.detector.load_state_dict(state["detector"])
        if state.get("anchor") is not None:
            self.anchor.load_state_dict(state["anchor"])
        self._steps = [TimingReport.from_dict(step) for step in state.get("steps", ())]
        if self.migration_cost is not None and state.get("migration_cost") is not None:
            self.migration_cost.load_state_dict(state["migration_cost"])
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


def near_even(work) -> bool:
    """All works equal, or every rank has work and the largest is within NEAR_EVEN of the
    smallest."""
    return len(set(work)) == 1 or (min(work) > 0 and max(work) <= NEAR_EVEN * min(work))
