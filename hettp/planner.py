"""The planner: from measured rank speeds to a decision (resize, migrate, both, or nothing).

Pure data in, pure data out: a decision is a partition plan plus per-rank resize shares, the
reason, and the predicted step time before and after. The caller (one rank per TP group)
broadcasts it and every rank applies it at the same step boundary.

A migration's target is the plan the step model (hettp/step_model.py) balances, dealt by
hettp/dealing.py; it costs its predicted transfer time. Where the model sees nothing to gain,
the blocks are split by what the report measured (hettp/measured.py). A resize costs accuracy
in proportion to the resized share, and nothing in time; resized ranks' active widths are not
aligned.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from .dealing import grouped_plan, proportional_plan, with_block
from .detect import Detection
from .measured import (
    Measured,
    attention_fits,
    measured_against,
    measured_attention_split,
    measured_mlp_split,
)
from .memory import MemoryCap, water_filled
from .plan import PartitionPlan
from .policy import policy as get_policy
from .resize import check_shares
from .step_model import StepModel, attention_counts, block_works, plan_work, unit_counts


def balancing_shares(
    plan: PartitionPlan, unit_work: Mapping[str, float], model: StepModel, stragglers, cap: float
) -> tuple[float, ...]:
    """Resize shares that bring each straggler down to the slowest other rank's compute time
    (no migration: everybody else keeps its work), within the cap."""
    work = plan_work(plan, unit_work)
    # head units' K/V replicas are computed whatever a rank skips: not resizable
    # (nor attention's per-call part)
    kept = plan_work(
        plan,
        {
            "attn": 0.0,
            "mlp": 0.0,
            "kv": unit_work.get("kv", 0.0),
            "call": unit_work.get("call", 0.0),
        },
    )
    others = [model.rank_time(r, w) for r, w in enumerate(work) if r not in stragglers]
    target = max(others) if others else 0.0
    shares = []
    for rank, w in enumerate(work):
        movable = w - kept[rank]
        if rank not in stragglers or movable <= 0 or model.rank_time(rank, w) <= target:
            shares.append(0.0)
            continue
        keep = (target / model.factors[rank] - model.fixed) / model.slope - kept[rank]
        shares.append(round(min(cap, 1.0 - keep / movable), 4))
    return tuple(shares)


@dataclass(frozen=True)
class Decision:
    action: str  # resize | migrate | hybrid-resize | hybrid-migrate | restore | zero
    plan: PartitionPlan  # the plan to be in after the decision (unchanged for a resize)
    shares: tuple[float, ...]
    reason: str
    predicted_before: float  # seconds per step, before and after
    predicted_after: float
    details: dict = field(default_factory=dict)

    @property
    def migrates(self) -> bool:
        return self.action in ("migrate", "hybrid-migrate")


# An attention unit's work counts its GEMMs by their parameters and its core attention by its
# FLOPs in the same terms (core_attention_work) at a price per FLOP the run measures in its
# first steps (hettp.costfit.core_attention_scale), which per-step noise leaves uncertain.
# The planner splits a query group over ranks only where that is faster at both ends of this
# range of what an attention unit may cost against its modelled work.
ATTENTION_COST_RANGE = (1.0, 2.0)

# ... and at every price of attention's per-call part in this range, in multiples of the
# probe's (hettp.attention_probe): a split gives a rank that held no head its first, and the
# call with it, at that rank's pace. Runs' own reports price the call above the probe, which
# leaves out megatron-core's modules and autograd nodes; the top of the range is their median
# (results/attention_call/). Where the call is a large share of a head's work, splits the
# probe's price called faster ran slower; where it is a small one, splits ran faster than
# whole groups, and a higher top left some of them untaken (results/notes.md).
CALL_PRICE_RANGE = (1.0, 2.3)

# ... and faster by this share of the step, a move's least gain.
SPLIT_GAIN = 0.03

# A move at a report, the straggle unchanged, must gain this much of the predicted step: the
# model's noise between reports stays below it, a first move made before the model knew the
# per-call cost does not. A smaller gain (above the planner's min_gain) is acted on where
# REBALANCE_REPORTS reports in a row predict one: noise does not lean the same way twice, a
# split that overloads a rank by 5-10% (what a unit's modelled weight missed) does, and left
# alone it costs that much of every step for as long as the straggle lasts.
REBALANCE_GAIN = 0.06
REBALANCE_REPORTS = 2

# A rebalance on the measured block seconds (Planner._measured_rebalance) that gains less than
# min_gain but more than this share of it is made where REBALANCE_REPORTS reports in a row ask
# for it. Over the recorded runs' reports during straggles, a plan's slowest MLP block moved
# by 0.6% of the step from one report to the next at the median, 2.3% at the 95th percentile
# (attention's: 0.3% and 1.5%), so one report's 1.5-3% may be noise; two in a row lean alike
# only where the split is off (results/measured-attention/).
MEASURED_LEAN = 0.5


# A measured re-deal of attention reads this many reports at the current attention split (the
# median of each rank's seconds over the latest MEASURED_REPORTS). A 2.5x rank holding one or
# two query heads read 0.176 s and then 0.309 s at one split in consecutive reports of a
# disturbed hour, and on single reports the heads moved 6 : 2, 7 : 1, 6 : 2, 8 : 0 in 12 steps
# (results/measured-heads/).
ATTENTION_READINGS = 2

# Reports of a plan's measured step that the planner keeps while a straggle lasts (their median
# judges the plan): a rebalance back to a plan measured already must be faster by min_gain in
# what was measured, not only in the model. Readings of a slow rank move with the split (1.4-2x
# for a 2.1x rank after moves between two near-equal plans), and each one makes the plan just
# left look better: the plan then alternated, a migration every few reports.
MEASURED_REPORTS = 3

# A rebalance trusts the step model's prediction for another plan only where the model puts
# each rank's compute at the current plan within this share of what the report measured.
# In the recorded runs, rebalances made where the model missed a rank by more than this left the
# measured step where it was, those within half of it shortened it by about 6%
# (results/notes.md): the cost fit's per-call part jumps now and then (to 0.065 s from 0.019 in
# one report), and the plan then gave a 1.8x rank a ninth of the work.
MODEL_ERROR = 0.2

# A move the measurements say lost this much of the step is undone: where the plan now has
# measured slower than one measured earlier in the straggle by this share (medians of at least
# REVERT_READINGS reports each), the planner moves back to the faster one, whatever the model
# predicts. The model stands for costs it has seen only in part (a split's per-call part, a
# small GEMM's rate); a move it called a gain that lost is evidence it missed one. Medians of
# 2-3 reports of plans that ran alike differ by up to 6% on this VM: replayed over the report
# records of the 42 runs with decisions in 2026-12-05's benchmarks, a 3% bar undid 3 moves, a
# 5% bar 2, this one none; over 208 older runs it undid 4, two of them moves that cost 14% of
# the step (results/revert/).
REVERT_GAIN = 0.08
REVERT_READINGS = 2


class Planner:
    """Decides for one TP group. `migration_seconds(old, new)` predicts a transfer's time."""

    def __init__(
        self,
        policy: str,
        unit_work: Mapping[str, float],
        cap: float = 0.5,
        migration_seconds: Callable[[PartitionPlan, PartitionPlan], float] = None,
        min_gain: float = 0.03,
        memory: MemoryCap | None = None,
    ):
        """`memory`: the most unit state a rank may hold (--het-tp-memory-cap); moves plan
        within it, and hybrid resizes what it leaves on a straggler."""
        self.policy = get_policy(policy)
        if self.policy.decides and self.policy.name not in self.RULES:
            raise ValueError(f"policy '{policy}' decides, but the planner has no rule for it")
        self.unit_work, self.cap = dict(unit_work), cap
        self.migration_seconds = migration_seconds or (lambda old, new: 0.0)
        self.min_gain = min_gain
        self.memory = memory
        self._onset = None  # iteration the current straggle began (hybrid)
        self._leaning = 0  # reports in a row whose rebalance gains above min_gain only
        # per plan's unit counts, its latest measured steps since the straggle last changed
        self._measured: dict[tuple, list[float]] = {}
        self._visited: dict[tuple, PartitionPlan] = {}  # those plans, to move back to
        self._reverted: set[tuple] = set()  # plans left by a revert, not returned to by one
        # per attention split (each layer's counts), the ranks' attention seconds of its latest
        # reports since the straggle last changed: what a measured re-deal of attention reads
        self._attention: dict[tuple, list[tuple[float, ...]]] = {}
        self._redealt: set[tuple] = set()  # attention splits a measured re-deal left
        self._seen: Measured | None = None  # the report being decided on
        self._work: tuple[float, ...] = ()  # per rank, its work at the plan being decided on
        self.refused: str | None = None  # the last decide's move refused by what it measured

    def forget_measured(self) -> None:
        """Drop the steps measured per plan, and the plans to move back to: a new straggle, or
        a stage whose layers changed, measures afresh (a remembered plan of another layer count
        could not be applied)."""
        self._measured, self._visited, self._reverted = {}, {}, set()
        self._attention, self._redealt = {}, set()

    def state_dict(self) -> dict:
        return {
            "onset": self._onset,
            "leaning": self._leaning,
            "measured": [[list(map(list, k)), v] for k, v in self._measured.items()],
            "visited": [p.to_json() for p in self._visited.values()],
            "reverted": [list(map(list, k)) for k in self._reverted],
            "redealt": [list(map(list, k)) for k in self._redealt],
            "attention": [
                [list(map(list, k)), list(map(list, v))] for k, v in self._attention.items()
            ],
        }

    def load_state_dict(self, state: dict) -> None:
        self._onset = state["onset"]
        self._leaning = state.get("leaning", 0)  # checkpoints before it: none seen yet
        self._measured = {
            tuple(map(tuple, k)): list(v) for k, v in state.get("measured", ())
        }  # absent before it: nothing measured yet
        plans = (PartitionPlan.from_json(text) for text in state.get("visited", ()))
        self._visited = {unit_counts(p): p for p in plans}  # absent before it: none to move back to
        self._reverted = {tuple(map(tuple, k)) for k in state.get("reverted", ())}
        self._attention = {
            tuple(map(tuple, k)): [tuple(r) for r in v] for k, v in state.get("attention", ())
        }  # absent before it: no attention read yet
        self._redealt = {tuple(map(tuple, k)) for k in state.get("redealt", ())}

    def decide(
        self,
        iteration: int,
        detection: Detection,
        model: StepModel,
        plan: PartitionPlan,
        shares: Sequence[float],
        measured: Measured | None = None,
    ) -> Decision | None:
        """`measured`: what the report measured; its step is kept per plan while the straggle
        lasts, and a move its block compute contradicts is not made."""
        if not self.policy.decides:
            return None
        shares = tuple(shares)
        self._seen, self.refused = measured, None
        if detection.changed:
            self.forget_measured()
        if measured is not None and measured.step > 0 and not any(shares):
            seen = self._measured.setdefault(unit_counts(plan), [])
            seen[:] = [*seen, measured.step][-MEASURED_REPORTS:]
            self._visited[unit_counts(plan)] = plan
            if len(measured.attention) == plan.tp_size:
                read = self._attention.setdefault(attention_counts(plan), [])
                read[:] = [*read, tuple(measured.attention)][-MEASURED_REPORTS:]
        self._work = plan_work(plan, self.unit_work, shares)
        before = model.step_time(self._work)
        leaning = self._leaning
        decision = self.RULES[self.policy.name](
            self, iteration, detection, model, plan, shares, before
        )
        if decision is not None and (decision.plan, decision.shares) == (plan, shares):
            # Nothing to apply (a resize re-planned at its cap, 3x easing to 2x). Applied, it
            # would re-base the anchor for nothing, and a straggle ending right after would be
            # carried into the new base as the rank's level (read 2x for good, resize kept).
            decision = None
        if decision is not None or self._leaning == leaning:  # acted, or nothing leaned
            self._leaning = 0
        if decision is not None and decision.migrates and self.memory is not None:
            held = [round(x, 3) for x in self.memory.of_even(decision.plan)]  # logged
            decision = dataclasses.replace(
                decision, details={**decision.details, "unit_state": held}
            )
        return decision

    # ---- policies: one rule per deciding policy of hettp.policy.POLICIES -------------------

    def _zero(self, iteration, detection, model, plan, shares, before):
        if not detection.changed:
            return None
        stragglers, cut = detection.stragglers, self.policy.cut
        new = tuple(cut if r in stragglers else 0.0 for r in range(plan.tp_size))
        return self._resize(
            new,
            plan,
            model,
            before,
            "zero",
            f"straggling ranks {sorted(stragglers)}: fixed {cut:.0%} cut (paper baseline)",
        )

    def _resize_rule(self, iteration, detection, model, plan, shares, before):
        if not detection.changed:
            return None
        stragglers = detection.stragglers
        new = balancing_shares(plan, self.unit_work, model, stragglers, self.cap)
        why = (
            f"ranks {sorted(stragglers)} at {_factors(model, stragglers)}"
            if stragglers
            else "no straggler left"
        )
        return self._resize(new, plan, model, before, "resize" if any(new) else "restore", why)

    def _migrate_rule(self, iteration, detection, model, plan, shares, before):
        if not detection.changed:
            return self._rebalance(plan, model, before, detection, "migrate", shares)
        return self._migrate(plan, model, before, detection, "migrate", shares)

    def _rebalance(self, plan, model, before, detection, action, shares):
        """At a report with the straggle unchanged: the plan the model balances now, where it
        gains more than REBALANCE_GAIN, or more than min_gain at REBALANCE_REPORTS reports in
        a row. The model learns after a move (the cost of the units a rank was left with, the
        per-call part), so the first move's split is corrected. First, a move the
        measurements say lost is undone (_measured_revert). Where the model asks for no move,
        or for one it is not trusted with (it misses the report, _model_missed, returns
        attention to a split a measured re-deal left, or moves attention the reports have read
        at a split they can fit, _attention_read), the measured blocks decide
        (_measured_rebalance): in 21 of the 29 reports in results/ whose model move was
        refused as missing the report (and that timed attention), the measured splits
        predicted more than 1.5% of the step, and the plan had stayed
        (results/trimmed-split/refused.txt)."""
        revert = self._measured_revert(plan, before, detection, action, shares)
        if revert is not None:
            return revert
        decision = self._migrate(plan, model, before, detection, action, shares)
        if decision is not None and self._returns_attention(plan, decision.plan):
            self.refused = (
                f"rebalance to {decision.plan.summary()} not made: its attention split is one "
                "a measured re-deal left this straggle"
            )
            decision = None
        if decision is not None and self._attention_read(plan, decision.plan):
            self.refused = (
                f"rebalance to {decision.plan.summary()} not made: attention at this split is "
                f"read from {len(self._attention[attention_counts(plan)])} reports, and the "
                "measured split deals it"
            )
            decision = None
        if decision is not None:
            missed = self._model_missed(plan, model)
            if missed is not None:  # a move asked for by a model that misses the report
                self.refused, decision = missed, None
        if decision is None and detection.stragglers:  # a steady cluster's rates are noise
            return self._measured_rebalance(plan, model, before, detection, action, shares)
        if decision is None:
            return None
        if not self._measured_faster(decision.plan, plan):
            return None
        if before - decision.predicted_after <= REBALANCE_GAIN * before:
            self._leaning += 1
            if self._leaning < REBALANCE_REPORTS:
                return None
            why = f"rebalance ({self._leaning} reports in a row)"
        else:
            why = "rebalance"
        return dataclasses.replace(decision, reason=f"{why}: {decision.reason}")

    def _measured_revert(self, plan, before, detection, action, shares) -> Decision | None:
        """Back to the plan measured fastest this straggle, where `plan` has measured slower
        than it by REVERT_GAIN (both over REVERT_READINGS reports or more); not to a plan a
        revert left, so that two plans that measure alike are not alternated. The model that
        chose `plan` is then not asked: _measured_faster keeps it from moving there again."""
        here = self._measured.get(unit_counts(plan))
        if any(shares) or not here or len(here) < REVERT_READINGS:
            return None
        options = [
            (statistics.median(steps), key)
            for key, steps in self._measured.items()
            if key != unit_counts(plan)
            and key in self._visited
            and self._visited[key].num_layers == plan.num_layers
            and key not in self._reverted
            and len(steps) >= REVERT_READINGS
        ]
        if not options:
            return None
        there, key = min(options)
        now = statistics.median(here)
        target = self._visited[key]
        if there >= (1.0 - REVERT_GAIN) * now:
            return None
        if self.memory is not None and not self.memory.fits(target):
            return None
        self._reverted.add(unit_counts(plan))
        return Decision(
            action,
            target,
            (0.0,) * plan.tp_size,
            f"revert (measured): ranks {sorted(detection.stragglers)} slow; this plan stepped "
            f"{now * 1e3:.1f} ms (median of {len(here)} reports), {target.summary()} "
            f"{there * 1e3:.1f} ms this straggle",
            before,
            before * there / now,
            {"migration_s": self.migration_seconds(plan, target)},
        )

    def _measured_rebalance(
        self, plan, model, before, detection, action, shares
    ) -> Decision | None:
        """Where the model sees nothing to gain: each block split by what the report measured
        (measured_mlp_split; measured_attention_split on the median of ATTENTION_READINGS
        reports or more at the attention split), where that shortens the step by min_gain, or
        by MEASURED_LEAN of it at REBALANCE_REPORTS reports in a row (an attention re-deal,
        read over several reports already, at the first above MEASURED_LEAN; where one report
        asks for it, the MLP's split waits for the next, and both move at once). The model
        prices a rank's units at one slowdown and one rate; a small GEMM's lower rate, the
        emulation's overshoot on the slow rank and attention's per-call part as a run pays it
        are in no term: after the first move a 3.8x rank's MLP ran 21% over the fast rank's
        while the model saw the split balanced, and a 2.8x rank kept two of eight query groups
        whose attention ran 25% over the fast rank's six (results/notes.md)."""
        seen = self._seen
        if seen is None or any(shares):
            return None
        if self._attention_pending(plan, seen, model):
            return None  # both blocks at the next report, in one move
        splits = [
            split
            for split in (
                measured_mlp_split(plan, seen),
                self._attention_split(plan, seen, model),
            )
            if split is not None
        ]
        gain = sum(split.gain for split in splits)
        if gain <= MEASURED_LEAN * self.min_gain * seen.step:
            return None
        target = plan
        for split in splits:
            target = split.applied(target)
        if self.memory is not None and not self.memory.fits(target):
            return None
        if not self._measured_faster(target, plan):
            return None
        why = "rebalance (measured)"
        floor = MEASURED_LEAN * self.min_gain * seen.step
        # small enough to be noise, unless it repeats; an attention re-deal above the floor
        # read its seconds over ATTENTION_READINGS reports already
        settled = any(split.block == "attn" and split.gain > floor for split in splits)
        if gain <= self.min_gain * seen.step and not settled:
            self._leaning += 1
            if self._leaning < REBALANCE_REPORTS:
                return None
            why = f"rebalance (measured) at {self._leaning} reports in a row"
        if any(split.block == "attn" for split in splits):
            self._redealt.add(attention_counts(plan))
        return Decision(
            action,
            target,
            (0.0,) * plan.tp_size,
            f"{why}: ranks {sorted(detection.stragglers)} slow; "
            + "; ".join(split.describe() for split in splits),
            before,
            before - gain,
            {"migration_s": self.migration_seconds(plan, target)},
        )

    def _returns_attention(self, plan: PartitionPlan, target: PartitionPlan) -> bool:
        """`target` moves attention back to a split a measured re-deal left this straggle. The
        step model prices attention as the measured seconds did not, and in a generalize draw
        (seed 32389, head units) the two moved a 2.2x rank's heads 3 -> 2 -> 3 -> 2 in 12
        steps; the model's rebalance is then not made, and the measured one may be."""
        there = attention_counts(target)
        return there != attention_counts(plan) and there in self._redealt

    def _attention_read(self, plan: PartitionPlan, target: PartitionPlan) -> bool:
        """`target` moves attention from a split whose seconds the reports can part into a
        per-call and a per-unit cost (attention_fits) and have read ATTENTION_READINGS times.
        The model prices the call by the probe, whose price of it moved by 40% between two runs
        of one case (0.98 and 1.36 ms a layer): at TP=2 with a 2.7x rank holding 2 of 8 heads,
        the run with the higher price moved them all off it (the step 3% longer than at 1 of 8,
        where the measured re-deal took the other run; results/head-units-3-rounds/)."""
        if attention_counts(target) == attention_counts(plan):
            return False
        read = self._attention.get(attention_counts(plan), [])
        return len(read) >= ATTENTION_READINGS and attention_fits(
            plan, _in_attention_units(self.unit_work, "kv")
        )

    def _attention_pending(self, plan, seen: Measured, model: StepModel) -> bool:
        """This report alone asks to re-deal attention, and the split has fewer than
        ATTENTION_READINGS reports yet: the MLP's measured split waits for the next, so that
        the two blocks move together (a move each cost a migration more)."""
        read = self._attention.get(attention_counts(plan), [])
        if len(read) >= ATTENTION_READINGS:
            return False
        return (
            measured_attention_split(
                plan, seen, model.factors, _in_attention_units(self.unit_work, "kv")
            )
            is not None
        )

    def _attention_split(self, plan, seen: Measured, model: StepModel):
        """measured_attention_split on the median of each rank's attention seconds over the
        reports at this attention split (the last MEASURED_REPORTS), once there are
        ATTENTION_READINGS of them; head units' K/V replicas weighed as the step model weighs
        them."""
        read = self._attention.get(attention_counts(plan), [])
        if len(read) < ATTENTION_READINGS:
            return None
        medians = tuple(statistics.median(r[k] for r in read) for k in range(plan.tp_size))
        return measured_attention_split(
            plan,
            dataclasses.replace(seen, attention=medians),
            model.factors,
            _in_attention_units(self.unit_work, "kv"),
        )

    def _model_missed(self, plan: PartitionPlan, model: StepModel) -> str | None:
        """Why the model is not trusted to rebalance (MODEL_ERROR), or None: a rank whose
        modelled compute at `plan` (its work as `decide` found it) is off the report's
        measured by more than that."""
        seen = self._seen
        if seen is None or len(seen.compute) != plan.tp_size:
            return None
        for rank, measured in enumerate(seen.compute):
            modelled = model.rank_compute(rank, self._work[rank])
            if measured > 0 and abs(modelled / measured - 1.0) > MODEL_ERROR:
                return (
                    f"rebalance not made: the step model puts rank {rank}'s compute at "
                    f"{modelled:.3f} s, the report measured {measured:.3f} s"
                )
        return None

    def _measured_faster(self, target: PartitionPlan, plan: PartitionPlan) -> bool:
        """`target`, where it was measured this straggle, stepped faster than `plan` by
        min_gain (medians of their reports); a plan not measured yet may be."""
        there, here = self._measured.get(unit_counts(target)), self._measured.get(unit_counts(plan))
        if not there or not here:
            return True
        return statistics.median(there) < (1.0 - self.min_gain) * statistics.median(here)

    def _contradicted(self, plan: PartitionPlan, target: PartitionPlan, shares) -> bool:
        """The move is one the report's measurement contradicts (measured_against); sets
        `refused` to say why. Not judged while a resize is in effect: a resized rank's compute
        understates its units'."""
        if self._seen is None or any(shares):
            return False
        why = measured_against(plan, target, self.unit_work, self._seen)
        if why is not None:
            self.refused = why
        return why is not None

    def _hybrid(self, iteration, detection, model, plan, shares, before):
        stragglers = detection.stragglers
        # a straggler that settled at a milder level (3x, then 1.2x for a while) gets units
        # back at once, as at an end: planned as an onset, a move must repay itself within a
        # step and a resize finds nothing to cut, so the fast ranks carried its units until
        # the end was seen
        target = self._target(plan, model) if detection.changed and stragglers else None
        settling = target is not None and self._recovering(plan, target, stragglers)
        if detection.changed:
            self._onset = iteration if stragglers and not settling else None
            if self._onset is not None:  # resize at once, unless the move repays within a step
                move = self._hybrid_move(iteration, model, plan, shares, before, stragglers)
                if move is not None:
                    return move
                new = balancing_shares(plan, self.unit_work, model, stragglers, self.cap)
                if new != shares:
                    return self._resize(
                        new,
                        plan,
                        model,
                        before,
                        "hybrid-resize",
                        f"ranks {sorted(stragglers)} at {_factors(model, stragglers)}; resize now",
                    )
            else:  # the straggle ended or eased: back to the plan that fits the speeds now
                why = (
                    f"ranks {sorted(stragglers)} recovering, at {_factors(model, stragglers)}"
                    if stragglers
                    else "no straggler left"
                )
                decision = self._migrate(
                    plan, model, before, detection, "hybrid-migrate", shares, why=why, target=target
                )
                if decision is None and any(shares):
                    return self._resize((0.0,) * plan.tp_size, plan, model, before, "restore", why)
                return decision
        if self._onset is None and not any(shares):
            return self._rebalance(plan, model, before, detection, "hybrid-migrate", shares)
        if not stragglers or self._onset is None:
            return None
        return self._hybrid_move(iteration, model, plan, shares, before, stragglers)

    def _recovering(self, plan, target, stragglers) -> bool:
        """`target` (the plan the model balances) gives every straggler more work than it
        holds in `plan`."""
        now, then = plan_work(plan, self.unit_work), plan_work(target, self.unit_work)
        return all(then[r] > now[r] for r in stragglers)

    def _hybrid_move(self, iteration, model, plan, shares, before, stragglers) -> Decision | None:
        """The migration, where the straggle is predicted to last long enough to repay it: as
        long again as it has lasted since its onset, one step at the onset itself. Against
        the straggle without the resize: the resize is a lossy stopgap that the migration
        replaces, so the move must repay itself on time alone; where it repays within a step,
        resizing first would only cost accuracy. Where a memory cap stops the move short of
        balance, the stragglers keep a resize for the rest (_capped_resize)."""
        target = self._target(plan, model)
        if target == plan or self._contradicted(plan, target, shares):
            return None
        unresized = model.step_time(plan_work(plan, self.unit_work))
        after = model.step_time(plan_work(target, self.unit_work))
        cost = self.migration_seconds(plan, target)
        remaining = max(1, iteration - self._onset)  # lasted t steps: ~t more predicted
        gain = remaining * (unresized - after)
        details = {
            "remaining_steps": remaining,
            "gain_s": round(gain, 4),
            "migration_s": round(cost, 4),
            "resized_share": sum(shares) / len(shares),
        }
        if gain <= cost:
            return None
        self._onset = None  # handled: the next move waits for the detector to see a change
        kept = self._capped_resize(target, model, stragglers)
        if any(kept):  # by blocks, as the resize was chosen (above the totals' step_time)
            undone = f"resized {list(kept)} for what the memory cap keeps on the stragglers"
            after = model.blocks_time(block_works(target, self.unit_work, kept))
            details["resized_share"] = sum(kept) / len(kept)
        else:
            undone = "resize undone" if any(shares) else "no resize needed"
        return Decision(
            "hybrid-migrate",
            target,
            kept,
            f"straggle predicted to last ~{remaining} more steps: saves {gain:.2f} s "
            f"over the unresized plan for a {cost:.2f} s move; {undone}",
            before,
            after,
            details,
        )

    def _capped_resize(self, target, model, stragglers) -> tuple[float, ...]:
        """Resize shares for the stragglers at `target` where the memory cap kept the move
        short of the balance it would make uncapped, and resizing shortens the step (its
        blocks, blocks_time) by min_gain; none otherwise. Resizing frees compute, not memory,
        so it finishes what the cap left undone. By blocks: a capped plan is out of balance
        block by block (a fast rank holding two query groups bounds attention, the slow rank
        the MLP), where ranks' totals can look even. Each straggler's share is the best of
        RESIZE_STEPS steps up to the cap, the others' held."""
        shares = [0.0] * target.tp_size
        if self.memory is None or not stragglers:
            return tuple(shares)
        if balanced_target(target, model, self.unit_work) == target:
            return tuple(shares)  # the cap did not bind

        def step(candidate):
            return model.blocks_time(block_works(target, self.unit_work, candidate))

        at = step(shares)
        for rank in sorted(stragglers):
            options = [round(self.cap * k / RESIZE_STEPS, 4) for k in range(RESIZE_STEPS + 1)]
            shares[rank] = min(
                options, key=lambda s: (step([*shares[:rank], s, *shares[rank + 1 :]]), s)
            )
        if step(shares) >= (1 - self.min_gain) * at:
            return (0.0,) * target.tp_size
        return tuple(shares)

    def _target(self, plan, model) -> PartitionPlan:
        return balanced_target(plan, model, self.unit_work, self.memory)

    def _migrate(
        self, plan, model, before, detection, action, shares, why=None, min_gain=None, target=None
    ):
        """The move to `target` (default: the plan `model` balances), where it gains more than
        `min_gain` of the step; at the end of the last straggle, any move back to even (held
        to min_gain, a recovered rank left 720 units where the others held 784 stayed so: the
        model priced the move back at 2% of the step)."""
        target = self._target(plan, model) if target is None else target
        after = model.step_time(plan_work(target, self.unit_work))
        if min_gain is None:
            # the last straggle ended: back to even, however little the model says it gains
            ended = detection.changed and detection.ends and not detection.stragglers
            min_gain = -math.inf if ended else self.min_gain
        if target == plan or before - after <= min_gain * before:
            return None
        if self._contradicted(plan, target, shares):
            return None
        stragglers = detection.stragglers
        why = why or (
            f"ranks {sorted(stragglers)} at {_factors(model, stragglers)}"
            if stragglers
            else "no straggler left"
        )
        return Decision(
            action,
            target,
            (0.0,) * plan.tp_size,
            why,
            before,
            after,
            {"migration_s": self.migration_seconds(plan, target)},
        )

    def _resize(self, new, plan, model, before, action, why):
        check_shares(new, self.cap, "planner")
        after = model.step_time(plan_work(plan, self.unit_work, new))
        return Decision(
            action, plan, tuple(new), why, before, after, {"resized_share": sum(new) / len(new)}
        )

    def _joint(self, iteration, detection, model, plan, shares, before):
        """None: the joint policy decides at reports, with every data-parallel replica's
        timings (hettp/joint.py); the TP group's loop detects and fits for it."""
        return None

    # The decision rule of each policy that decides (hettp.policy.POLICIES).
    RULES = {
        "resize": _resize_rule,
        "migrate": _migrate_rule,
        "hybrid": _hybrid,
        "zero": _zero,
        "joint": _joint,
    }


def balanced_target(
    plan: PartitionPlan,
    model: StepModel,
    unit_work: Mapping[str, float],
    memory: MemoryCap | None = None,
) -> PartitionPlan:
    """The plan `model` balances: unit counts proportional to the ranks' speeds (with head
    units, attention dealt with the K/V replicas it brings). With head units, the plan keeping
    attention in whole query groups (no K/V replicas) unless the model predicts the split
    faster by SPLIT_GAIN of the step, block by block, at every attention cost in
    ATTENTION_COST_RANGE and every price of the per-call part in CALL_PRICE_RANGE: the split's
    K/V replicas and per-call work against the imbalance whole groups leave in attention.
    Under `memory`, no rank holds more unit state than the cap allows (capped_target). The
    planner and the joint controller (hettp/joint.py) both migrate to it."""
    speeds = _speeds(model, plan, unit_work)
    if memory is not None:
        return capped_target(plan, model, unit_work, speeds, memory)
    return _balanced(plan, model, unit_work, speeds)


# Shares a hybrid resize under a memory cap chooses among, per straggler: k/RESIZE_STEPS of
# the resize cap.
RESIZE_STEPS = 20

# Halvings of a range of ceilings on a rank's share of the work that capped_target tries.
CAP_BISECT = 10


def capped_target(
    plan: PartitionPlan,
    model: StepModel,
    unit_work: Mapping[str, float],
    speeds: Sequence[float],
    memory: MemoryCap,
) -> PartitionPlan:
    """The balanced plan with every rank within `memory`: the balanced plan where it fits,
    else the fastest (blocks_time) of plans placed under ceilings on a rank's share of the
    work, each rank's share in proportion to its speed up to the ceiling and the excess
    water-filled to the others (hettp.memory.water_filled). Every rank has the same limit, so
    one ceiling serves all ranks; it is bisected, because whole units land a rank's
    parameters only near its share. Attention's units are coarse (a query group with its
    K/V is a large step), so one ceiling for both blocks can stop well short of the cap: the
    MLP's ceiling is then bisected again under the attention of the last ceiling within the
    cap and of the first over it. Where none fits, `plan` itself: no move."""
    target = _balanced(plan, model, unit_work, speeds)
    if memory.fits(target):
        return target
    n = plan.tp_size
    even, top = 1.0 / n, max(speeds) / sum(speeds)  # every share even .. none capped

    # Under the ceilings the split is weighed against whole groups only: the trimmed split
    # deals a slowed rank's heads to the fast ranks with K/V replicas, which the cap is about,
    # and flips with the ceiling, which the bisection does not expect (with it, migrate's
    # simulated E at TP=8, a 4x rank and a 1.10x cap fell from 0.712 to 0.615).
    def placed(ceiling):
        return _balanced(plan, model, unit_work, water_filled(speeds, [ceiling] * n), trim=False)

    both = _largest_fitting(placed, memory, even, top)
    if both is None:
        return plan
    candidates = [both.plan]
    for ceiling in (both.ceiling, both.over):
        attention = placed(ceiling)
        # the MLP as any balanced plan splits it (head units change only how attention is
        # dealt), without dealing attention again at every halving
        split = _largest_fitting(
            lambda c, a=attention: with_block(
                proportional_plan(plan, water_filled(speeds, [c] * n)), a, "attn"
            ),
            memory,
            even,
            top,
        )
        if split is not None:
            candidates.append(split.plan)
    return min(candidates, key=lambda p: model.blocks_time(block_works(p, unit_work)))


@dataclass(frozen=True)
class _Fit:
    ceiling: float  # the highest ceiling found whose plan fits
    over: float  # the lowest found whose plan does not (or the range's top)
    plan: PartitionPlan  # the plan placed at `ceiling`


def _largest_fitting(place, memory: MemoryCap, low: float, high: float) -> _Fit | None:
    """The highest ceiling in [low, high] whose `place`d plan fits `memory`, bisected; None
    where not even `low`'s does."""
    best = place(low)
    if not memory.fits(best):
        return None
    for _ in range(CAP_BISECT):
        mid = (low + high) / 2
        trial = place(mid)
        if memory.fits(trial):
            low, best = mid, trial
        else:
            high = mid
    return _Fit(low, high, best)


def _balanced(
    plan: PartitionPlan,
    model: StepModel,
    unit_work: Mapping[str, float],
    speeds,
    trim: bool = True,
) -> PartitionPlan:
    if plan.heads is None:
        return proportional_plan(plan, speeds)
    return split_check(plan, model, unit_work, speeds, trim).chosen


@dataclass(frozen=True)
class SplitCheck:
    """Head units dealt in proportion (proportional_plan's `split`), the same with no unit on a
    slowed rank that the split leaves part of a query group (`trimmed`; None where it leaves
    none so), and whole query groups (grouped_plan's `whole`), with the gains of the first two
    over whole groups, a share of whole groups' step, at each attention cost in
    ATTENTION_COST_RANGE and per-call price in CALL_PRICE_RANGE. A slowed rank's first units
    bring a call and a K/V replica at its pace, which the model prices least surely: at TP=4
    with one group of 4 heads a rank, the model at a straggle's first report called one head
    of 16 on the slowed rank 0-2% faster than none at the top of CALL_PRICE_RANGE; runs that
    held it stepped slower than after its move to a fast rank in 7 of 9 (2-24%) at 3x (hidden
    512) and in 3 of 3 (12-20%) at 3.4x (hidden 768) (results/trimmed-split/)."""

    split: PartitionPlan
    whole: PartitionPlan
    gains: dict[tuple[float, float], float]  # (attention cost, call price): split's gain
    trimmed: PartitionPlan | None = None
    trimmed_gains: dict[tuple[float, float], float] = field(default_factory=dict)

    @property
    def over_trimmed(self) -> dict[tuple[float, float], float]:
        """The split's gain over the trimmed split, a share of the trimmed one's step (none
        where there is no trimmed split)."""
        return {
            key: 1.0 - (1.0 - self.gains[key]) / (1.0 - gain)
            for key, gain in self.trimmed_gains.items()
        }

    @property
    def chosen(self) -> PartitionPlan:
        """Whole groups; then the trimmed split where it gains SPLIT_GAIN over them at every
        cost and price; then the split where it gains that over the plan so chosen. Each
        brings more K/V replicas and calls than the one before, so each is held to the same
        margin (at TP=2 with a group a rank, the trimmed split is whole groups)."""
        chosen, over = self.whole, self.gains
        if self.trimmed is not None and min(self.trimmed_gains.values()) >= SPLIT_GAIN:
            chosen, over = self.trimmed, self.over_trimmed
        return self.split if min(over.values()) >= SPLIT_GAIN else chosen

    @property
    def taken(self) -> bool:
        """The split is chosen."""
        return self.chosen is self.split


def split_check(
    plan: PartitionPlan,
    model: StepModel,
    unit_work: Mapping[str, float],
    speeds,
    trim: bool = True,
) -> SplitCheck:
    """The split, the trimmed split (unless not `trim`) and whole groups at `speeds`, block by
    block (blocks_time)."""
    attn, call = unit_work["attn"], unit_work.get("call", 0.0)
    kv, call_units = _in_attention_units(unit_work, "kv"), _in_attention_units(unit_work, "call")
    split = proportional_plan(plan, speeds, kv=kv, call=call_units)
    whole = grouped_plan(plan, speeds, split)
    partial = _partial_group_ranks(split, speeds) if trim else set()
    trimmed = None
    if partial:
        kept = [0.0 if r in partial else s for r, s in enumerate(speeds)]
        trimmed = with_block(split, proportional_plan(plan, kept, kv=kv, call=call_units), "attn")
    gains, trimmed_gains = {}, {}
    for scale, price in itertools.product(ATTENTION_COST_RANGE, CALL_PRICE_RANGE):
        work = {**unit_work, "attn": attn * scale, "call": call * price}
        grouped = model.blocks_time(block_works(whole, work))
        gains[scale, price] = 1.0 - model.blocks_time(block_works(split, work)) / grouped
        if trimmed is not None:
            trimmed_gains[scale, price] = (
                1.0 - model.blocks_time(block_works(trimmed, work)) / grouped
            )
    return SplitCheck(split, whole, gains, trimmed, trimmed_gains)


def _in_attention_units(unit_work: Mapping[str, float], key: str) -> float:
    """A head unit's K/V replica ("kv") or attention's per-call part ("call") in attention
    units, as the step model weighs them (0 where the run has none)."""
    return unit_work.get(key, 0.0) / unit_work["attn"]


def _partial_group_ranks(split: PartitionPlan, speeds) -> set[int]:
    """Ranks slower than the fastest that `split` gives some units, fewer than a query group
    holds, in a layer."""
    fastest = max(speeds)
    per_group = split.heads.units_per_group
    return {
        rank
        for rank in range(split.tp_size)
        if speeds[rank] < fastest
        and any(
            0 < n < per_group
            for n in (split.counts(i, "attn")[rank] for i in range(split.num_layers))
        )
    }


def _speeds(model: StepModel, plan: PartitionPlan, unit_work) -> list[float]:
    """Per-rank shares of the work that balance the step under `model`."""
    return model.balanced_work(sum(plan_work(plan, unit_work)))


def _factors(model: StepModel, ranks) -> str:
    """The slowdowns planned for (the report's level, not the detector's smoothed one)."""
    return ", ".join(f"{model.factors[r]:.2f}x" for r in sorted(ranks))
