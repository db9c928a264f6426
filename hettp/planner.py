"""The planner: from measured rank speeds to a decision (resize, migrate, both, or nothing).

Pure data in, pure data out: a decision is a partition plan plus per-rank resize shares, the
reason, and the predicted step time before and after. The caller (one rank per TP group)
broadcasts it and every rank applies it at the same step boundary.

Cost model (StepModel): a step takes `rest + max_r factor_r * (fixed + slope * work_r)`, where
work is the rank's active units weighted by their size, `slope` an unslowed rank's seconds per
unit of work in the modules its units carry, `fixed` its timed compute that no split changes
(the optimizer step: hettp/costfit.py), and `rest` (embedding, logits, norms, collectives)
does not depend on the partition. A migration
costs its predicted transfer time; a resize costs accuracy in proportion to the resized share,
and nothing in time. The MLP counts a migration plans are multiples of MLP_ALIGN neurons where
the ffn size allows (mlp_chunk); resized ranks' active widths are not aligned.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from .detect import Detection
from .memory import MemoryCap, water_filled
from .plan import BLOCKS, PartitionPlan
from .policy import policy as get_policy
from .resize import check_shares, skipped_count


@dataclass(frozen=True)
class StepModel:
    """A step takes `rest + max_r factor_r * (fixed + slope * work_r) + max_r factor_r *
    apart`: `slope * work` is an unslowed rank's time in the work its units carry, `fixed`
    its per-call costs in the blocks that no split changes, `apart` what it computes after
    the blocks whatever its units (the optimizer's per-tensor work), `factor_r` the rank's
    slowdown. Every block ends in a TP collective, so the ranks wait for each other before
    the optimizer: a slow rank's optimizer time is not made up for by giving it fewer units
    in the blocks, and only the blocks' part is balanced."""

    rest: float
    factors: tuple[float, ...]
    slope: float
    fixed: float = 0.0
    apart: float = 0.0

    def rank_time(self, rank: int, work: float) -> float:
        """The rank's time in the blocks."""
        return self.factors[rank] * (self.fixed + self.slope * work)

    def rank_compute(self, rank: int, work: float) -> float:
        """All of the rank's timed compute: its blocks and what it computes after them (the
        cost fit's line at `work`, times its slowdown)."""
        return self.rank_time(rank, work) + self.factors[rank] * self.apart

    def step_time(self, work: Sequence[float]) -> float:
        blocks = max(self.rank_time(r, w) for r, w in enumerate(work))
        return self.rest + blocks + max(self.factors) * self.apart

    def blocks_time(self, blocks: Sequence[Sequence[float]]) -> float:
        """The step where each block waits for its slowest rank (`blocks`: per block, each
        rank's work; hettp.planner.block_works), the per-call part spread evenly over them.
        What the blocks of a plan that balances every block take is step_time's; a plan that
        evens out a rank's totals across blocks (more MLP where it holds less attention) is
        not balanced in any block, and only this sees it."""
        if not blocks:
            return self.step_time((0.0,) * len(self.factors))
        per = self.fixed / len(blocks)
        slowest = sum(
            max(f * (per + self.slope * w) for f, w in zip(self.factors, works)) for works in blocks
        )
        return self.rest + slowest + max(self.factors) * self.apart

    def balanced_work(self, total: float) -> list[float]:
        """Per-rank work that makes every rank finish together; a rank too slow to finish its
        fixed part in that time gets none."""
        ranks = list(range(len(self.factors)))
        while True:
            speed = sum(1.0 / self.factors[r] for r in ranks)
            finish = (self.slope * total + len(ranks) * self.fixed) / speed
            work = [0.0] * len(self.factors)
            for r in ranks:
                work[r] = (finish / self.factors[r] - self.fixed) / self.slope
            idle = [r for r in ranks if work[r] < 0]
            if not idle:
                return work
            ranks = [r for r in ranks if r not in idle]


def core_attention_work(query_heads: int, seq_length: int, head_dim: int) -> int:
    """Core attention over `query_heads` heads in a linear's parameters' terms (two FLOPs a
    parameter a token): QK^T and AV take 4 x seq_length x head_dim FLOPs a token a head, all
    of them where the scores are computed in full, as megatron-core's local attention does.
    An attention unit weighed by its parameters alone looked about seq_length / hidden
    lighter than it computes, so a slow rank was given too many query heads."""
    return 2 * query_heads * seq_length * head_dim


def block_works(
    plan: PartitionPlan, unit_work: Mapping[str, float], shares: Sequence[float] | None = None
) -> list[tuple[float, ...]]:
    """Per layer and block, in the order a step computes them, each rank's work in its active
    units. Every block ends in a TP collective, so each waits for its slowest rank. With key
    "call", attention's per-call part on each rank computing any attention unit
    (hettp.attention_probe)."""
    shares = shares or (0.0,) * plan.tp_size
    kv = unit_work.get("kv", 0.0) if plan.heads is not None else 0.0
    call = unit_work.get("call", 0.0)
    out = []
    for layer in plan.layers:
        for block in BLOCKS:
            active = [
                len(units) - skipped_count(len(units), shares[rank])
                for rank, units in enumerate(layer[block])
            ]
            work = [n * unit_work[block] for n in active]
            if block == "attn" and kv:  # head units: each group a rank holds a head of, K/V
                work = [w + kv * len(plan.heads.groups_of(u)) for w, u in zip(work, layer[block])]
            if block == "attn" and call:
                work = [w + call * (n > 0) for w, n in zip(work, active)]
            out.append(tuple(work))
    return out


def plan_work(
    plan: PartitionPlan, unit_work: Mapping[str, float], shares: Sequence[float] | None = None
) -> tuple[float, ...]:
    """Per rank, the work of its active units (every layer and block)."""
    return tuple(map(sum, zip(*block_works(plan, unit_work, shares))))


# GEMM widths that are multiples of 8 run at full speed; unaligned widths cost more per neuron
# (CPU kernels block by 8 or more, GPU tensor cores want multiples of 8), which would make a rank
# that took units look slower than it is (results/notes.md). Query groups are whole heads,
# already wide enough.
MLP_ALIGN = 8


def mlp_chunk(plan: PartitionPlan, align: int = MLP_ALIGN) -> int:
    """MLP units the planner moves together so that the ffn widths it plans are multiples of
    `align` neurons; 1 where the units cannot be cut into such chunks, or into at least 4 per
    rank (coarser, whole layers would go unevenly to few ranks)."""
    chunk = align // math.gcd(align, plan.mlp_unit_size)
    if plan.mlp_units % chunk or plan.mlp_units // chunk < 4 * plan.tp_size:
        return 1
    return chunk


def proportional_plan(
    plan: PartitionPlan,
    speeds: Sequence[float],
    align: int = MLP_ALIGN,
    kv: float = 0.0,
    call: float = 0.0,
) -> PartitionPlan:
    """Unit counts proportional to `speeds`, moving the fewest units from `plan`.

    Every block ends in a TP collective, so each block of each layer waits for its slowest
    rank: a block's spare units (its target rounded down leaves them) go one by one to the
    rank that would finish it first, which makes each block as short as whole units allow
    (e.g. 4 query groups at speeds 2:1 give 3/1 in every layer: 1.5 units of time, where 3/1
    and 2/2 in turn would track the 2.67/1.33 target over layers at 1.75 a layer). Among
    equally fast choices, the rank furthest behind its target over the layers so far.
    MLP counts are rounded in chunks of `mlp_chunk(plan, align)` units; a layer already
    within one chunk of its target keeps its counts, aligned or not. Where a layer has at
    least 4 chunks a rank, every rank keeps one, even a rank too slow to be given any: a
    rank with no units reads no speed, so neither its recovery nor its next slowdown could
    be seen (its per-call costs are paid either way, so the chunk costs it little).

    `kv` (head units): a K/V replica's work in attention units. Attention is then dealt unit by
    unit to whoever would finish first with the replicas its units bring (a rank's units taken
    from as few groups as they fill): dealt by count, a slow rank given two heads of a group
    paid that group's K and V too, and ran its attention 25-30% over the fast rank's. `call`:
    attention's per-call part in attention units, which a rank's first unit brings."""
    total = sum(speeds)
    if total <= 0 or any(s < 0 for s in speeds):
        raise ValueError(f"speeds must be non-negative with a positive sum, got {list(speeds)}")
    changes: dict[int, dict[str, list[int]]] = {}
    for block in BLOCKS:
        chunk = mlp_chunk(plan, align) if block == "mlp" else 1
        n = plan.num_units(block) // chunk
        target = [n * s / total for s in speeds]  # in chunks
        assigned = [0.0] * plan.tp_size
        finish = None
        for index in range(plan.num_layers):
            current = [c / chunk for c in plan.counts(index, block)]
            floor = 1 if block == "mlp" and n >= 4 * plan.tp_size else 0
            if (
                chunk > 1
                and all(abs(c - t) < 1 for c, t in zip(current, target))
                and min(current) >= floor
            ):
                assigned = [a + c for a, c in zip(assigned, current)]  # below the resolution
                continue
            if block == "attn" and kv and plan.heads is not None:
                if finish is None:  # per rank, when it would finish its first c units
                    per_group = plan.heads.units_per_group
                    finish = [
                        [
                            _finish(_with_replicas(c, per_group, kv, call), s, total)
                            for c in range(n + 1)
                        ]
                        for s in speeds
                    ]
                counts = [0] * plan.tp_size
                for _ in range(n):
                    behind = [(index + 1) * t - a - c for t, a, c in zip(target, assigned, counts)]
                    rank = min(
                        range(plan.tp_size),
                        key=lambda r: (finish[r][counts[r] + 1], -behind[r], r),
                    )
                    counts[rank] += 1
                assigned = [a + c for a, c in zip(assigned, counts)]
                changes.setdefault(index, {})[block] = counts
                continue
            counts = [max(floor, math.floor(t)) for t in target]  # within one chunk of target
            while sum(counts) > n:  # the floors' chunks: from whoever would finish last
                rank = max(
                    (r for r in range(plan.tp_size) if counts[r] > floor),
                    key=lambda r: (_finish(counts[r], speeds[r], total), r),
                )
                counts[rank] -= 1
            for _ in range(n - sum(counts)):  # the spare ones: whoever would finish first
                behind = [(index + 1) * t - a - c for t, a, c in zip(target, assigned, counts)]
                rank = min(
                    range(plan.tp_size),
                    key=lambda r: (_finish(counts[r] + 1, speeds[r], total), -behind[r], r),
                )
                counts[rank] += 1
            assigned = [a + c for a, c in zip(assigned, counts)]
            changes.setdefault(index, {})[block] = [c * chunk for c in counts]
    return plan.recounted(changes)


def grouped_plan(
    plan: PartitionPlan, speeds: Sequence[float], proportional: PartitionPlan | None = None
) -> PartitionPlan:
    """Head units kept in whole query groups (no K/V replicas): each rank takes the groups
    dealt one by one to whoever would finish them first at `speeds`, a group staying with the
    rank holding most of its heads where it fits (few units move); the MLP as `proportional`
    (proportional_plan's at `speeds`) splits it. Each block ends in a TP collective, so an
    MLP that made up for attention (more neurons to the rank holding fewer groups) balanced
    the ranks' totals and neither block: the slow rank waited in attention and the fast one
    in the MLP."""
    heads, n = plan.heads, plan.tp_size
    total = sum(speeds)
    share = [s / total for s in speeds]
    fits = [0] * n
    for _ in range(heads.groups):
        rank = min(range(n), key=lambda r: ((fits[r] + 1) / max(share[r], 1e-12), r))
        fits[rank] += 1
    proportional = proportional or proportional_plan(plan, speeds)
    layers = []
    for index, layer in enumerate(plan.layers):
        room = list(fits)
        held = [[0] * heads.groups for _ in range(n)]
        for rank, units in enumerate(layer["attn"]):
            for unit in units:
                held[rank][heads.group_of(unit)] += 1
        owner = {}
        for _, group, rank in sorted(
            (-held[r][g], g, r) for r in range(n) for g in range(heads.groups) if held[r][g]
        ):
            if group not in owner and room[rank]:
                owner[group], room[rank] = rank, room[rank] - 1
        for group in range(heads.groups):
            if group not in owner:
                rank = min(
                    (r for r in range(n) if room[r]),
                    key=lambda r: ((fits[r] - room[r] + 1) / max(share[r], 1e-12), r),
                )
                owner[group], room[rank] = rank, room[rank] - 1
        attn = []
        for rank, units in enumerate(layer["attn"]):
            kept = [u for u in units if owner[heads.group_of(u)] == rank]
            had = set(kept)
            gained = [
                u
                for u in range(plan.attn_units)
                if owner[heads.group_of(u)] == rank and u not in had
            ]
            attn.append(tuple(kept + gained))
        mlp = list(proportional.counts(index, "mlp"))
        layers.append((dict(layer, attn=tuple(attn)), mlp))
    grouped = dataclasses.replace(plan, layers=tuple(layer for layer, _ in layers))
    return grouped.recounted({i: {"mlp": mlp} for i, (_, mlp) in enumerate(layers)})


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
class Measured:
    """What one report measured, that the planner judges plans and moves by."""

    step: float  # wall seconds per step
    compute: tuple[float, ...] = ()  # per rank, all of its timed compute (empty: not known)
    fixed: tuple[float, ...] = ()  # per rank, of that, the part no split changes (empty: 0)
    attention: tuple[float, ...] = ()  # per rank, of the blocks, attention's (empty: unknown)

    @property
    def blocks(self) -> tuple[float, ...]:
        """Per rank, seconds per step in the blocks: its timed compute less the fixed part."""
        fixed = self.fixed or (0.0,) * len(self.compute)
        return tuple(max(0.0, c - f) for c, f in zip(self.compute, fixed))

    @property
    def mlp(self) -> tuple[float, ...]:
        """Per rank, seconds per step in the MLP blocks (empty where attention's are unknown)."""
        if len(self.attention) != len(self.compute):
            return ()
        return tuple(max(0.0, b - a) for b, a in zip(self.blocks, self.attention))


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

# measured_attention_split fits a per-call and a per-unit part to the ranks' attention seconds:
# only where the units a rank holds a layer differ by this ratio between two ranks. The
# per-call part is the intercept of a line through two points at n and k x n units, which
# carries each point's noise times k / (k - 1) and 1 / (k - 1): at 1.5x, 3 and 2 (a 2% jitter
# in a rank's seconds, the 95th percentile between reports, moves it by 7% of them); at 6 : 5
# groups, 6 and 5.
ATTENTION_FIT_SPREAD = 1.5

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
        self._seen: Measured | None = None  # the report being decided on
        self._work: tuple[float, ...] = ()  # per rank, its work at the plan being decided on
        self.refused: str | None = None  # the last decide's move refused by what it measured

    def state_dict(self) -> dict:
        return {
            "onset": self._onset,
            "leaning": self._leaning,
            "measured": [[list(map(list, k)), v] for k, v in self._measured.items()],
            "visited": [p.to_json() for p in self._visited.values()],
            "reverted": [list(map(list, k)) for k in self._reverted],
        }

    def load_state_dict(self, state: dict) -> None:
        self._onset = state["onset"]
        self._leaning = state.get("leaning", 0)  # checkpoints before it: none seen yet
        self._measured = {
            tuple(map(tuple, k)): list(v) for k, v in state.get("measured", ())
        }  # absent before it: nothing measured yet
        plans = (PartitionPlan.from_json(text) for text in state.get("visited", ()))
        self._visited = {_counts(p): p for p in plans}  # absent before it: none to move back to
        self._reverted = {tuple(map(tuple, k)) for k in state.get("reverted", ())}

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
            self._measured, self._visited, self._reverted = {}, {}, set()
        if measured is not None and measured.step > 0 and not any(shares):
            seen = self._measured.setdefault(_counts(plan), [])
            seen[:] = [*seen, measured.step][-MEASURED_REPORTS:]
            self._visited[_counts(plan)] = plan
        self._work = plan_work(plan, self.unit_work, shares)
        before = model.step_time(self._work)
        leaning = self._leaning
        decision = self.RULES[self.policy.name](
            self, iteration, detection, model, plan, shares, before
        )
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
        measurements say lost is undone (_measured_revert)."""
        revert = self._measured_revert(plan, before, detection, action, shares)
        if revert is not None:
            return revert
        decision = self._migrate(plan, model, before, detection, action, shares)
        if decision is None and detection.stragglers:  # a steady cluster's rates are noise
            return self._measured_rebalance(plan, model, before, detection, action, shares)
        if decision is None:
            return None
        missed = self._model_missed(plan, model)
        if missed is not None:  # a move was asked for, by a model that misses the report
            self.refused = missed
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
        here = self._measured.get(_counts(plan))
        if any(shares) or not here or len(here) < REVERT_READINGS:
            return None
        options = [
            (statistics.median(steps), key)
            for key, steps in self._measured.items()
            if key != _counts(plan)
            and key in self._visited
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
        self._reverted.add(_counts(plan))
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
        (measured_mlp_split, measured_attention_split), where that shortens the step by
        min_gain, or by MEASURED_LEAN of it at REBALANCE_REPORTS reports in a row. The model
        prices a rank's units at one slowdown and one rate; a small GEMM's lower rate, the
        emulation's overshoot on the slow rank and attention's per-call part as a run pays it
        are in no term: after the first move a 3.8x rank's MLP ran 21% over the fast rank's
        while the model saw the split balanced, and a 2.8x rank kept two of eight query groups
        whose attention ran 25% over the fast rank's six (results/notes.md)."""
        seen = self._seen
        if seen is None or any(shares):
            return None
        splits = [
            split
            for split in (
                measured_mlp_split(plan, seen),
                measured_attention_split(
                    plan,
                    seen,
                    model.factors,
                    self.unit_work.get("kv", 0.0) / self.unit_work["attn"],
                ),
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
        if gain <= self.min_gain * seen.step:  # small enough to be noise, unless it repeats
            self._leaning += 1
            if self._leaning < REBALANCE_REPORTS:
                return None
            why = f"rebalance (measured) at {self._leaning} reports in a row"
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
        there, here = self._measured.get(_counts(target)), self._measured.get(_counts(plan))
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
        `min_gain` of the step."""
        target = self._target(plan, model) if target is None else target
        after = model.step_time(plan_work(target, self.unit_work))
        min_gain = self.min_gain if min_gain is None else min_gain
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

    def placed(ceiling):
        return _balanced(plan, model, unit_work, water_filled(speeds, [ceiling] * n))

    both = _largest_fitting(placed, memory, even, top)
    if both is None:
        return plan
    candidates = [both.plan]
    for ceiling in (both.ceiling, both.over):
        attention = placed(ceiling)
        # the MLP as any balanced plan splits it (head units change only how attention is
        # dealt), without dealing attention again at every halving
        split = _largest_fitting(
            lambda c, a=attention: _with_attention(
                proportional_plan(plan, water_filled(speeds, [c] * n)), a
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


def _with_block(plan: PartitionPlan, other: PartitionPlan, block: str) -> PartitionPlan:
    """`plan` with `other`'s units of `block` in every layer (both of one model)."""
    layers = tuple(
        {**mine, block: theirs[block]} for mine, theirs in zip(plan.layers, other.layers)
    )
    return dataclasses.replace(plan, layers=layers)


def _with_attention(plan: PartitionPlan, attention: PartitionPlan) -> PartitionPlan:
    return _with_block(plan, attention, "attn")


def _balanced(
    plan: PartitionPlan, model: StepModel, unit_work: Mapping[str, float], speeds
) -> PartitionPlan:
    if plan.heads is None:
        return proportional_plan(plan, speeds)
    check = split_check(plan, model, unit_work, speeds)
    return check.split if check.taken else check.whole


@dataclass(frozen=True)
class SplitCheck:
    """Head units' split (proportional_plan's) against whole query groups (grouped_plan's),
    and the split's gain, a share of whole groups' step, at each attention cost in
    ATTENTION_COST_RANGE and per-call price in CALL_PRICE_RANGE."""

    split: PartitionPlan
    whole: PartitionPlan
    gains: dict[tuple[float, float], float]  # (attention cost, call price): gain

    @property
    def taken(self) -> bool:
        """The split gains SPLIT_GAIN at every cost and price."""
        return min(self.gains.values()) >= SPLIT_GAIN


def split_check(
    plan: PartitionPlan, model: StepModel, unit_work: Mapping[str, float], speeds
) -> SplitCheck:
    """The split and whole groups at `speeds`, block by block (blocks_time)."""
    attn, call = unit_work["attn"], unit_work.get("call", 0.0)
    split = proportional_plan(plan, speeds, kv=unit_work.get("kv", 0.0) / attn, call=call / attn)
    whole = grouped_plan(plan, speeds, split)
    gains = {}
    for scale, price in itertools.product(ATTENTION_COST_RANGE, CALL_PRICE_RANGE):
        work = {**unit_work, "attn": attn * scale, "call": call * price}
        gains[scale, price] = 1.0 - model.blocks_time(block_works(split, work)) / (
            model.blocks_time(block_works(whole, work))
        )
    return SplitCheck(split, whole, gains)


@dataclass(frozen=True)
class MeasuredSplit:
    """A plan whose split of one block follows the measured rates, and what it is predicted
    to save."""

    plan: PartitionPlan
    block: str  # the block it splits anew ("attn" or "mlp"); the other is as it was
    measured: tuple[float, ...]  # per rank, that block's seconds a step in the report
    predicted: tuple[float, ...]  # ... and at the new split, at the rates seen
    gain: float  # seconds a step the block's slowest layers shorten by

    def applied(self, plan: PartitionPlan) -> PartitionPlan:
        """`plan` with this split's units of its block (both plans of one model)."""
        return _with_block(plan, self.plan, self.block)

    def describe(self) -> str:
        name = "attention" if self.block == "attn" else "MLP"
        now = ", ".join(f"{t:.3f}" for t in self.measured)
        then = ", ".join(f"{t:.3f}" for t in self.predicted)
        return f"the {name} blocks took [{now}] s a step by rank, [{then}] at the rates measured"


def measured_mlp_split(plan: PartitionPlan, seen: Measured) -> MeasuredSplit | None:
    """`plan` with each layer's MLP split in proportion to the ranks' measured MLP speeds (MLP
    units a second, from `seen`'s MLP block seconds over the units held), attention as it is;
    None where a rank holds no MLP unit or attention's seconds are unknown. Every MLP block
    ends in a TP collective, so the slowest rank's MLP seconds are the step's. Read through
    the origin, a rate charges the per-call part to the units: at the new split the rank that
    gave units away is read faster than it will run and the one that took them slower, so the
    move falls short of balance, never past it, and the next report's rates take it further."""
    mlp = seen.mlp
    units = {"attn": 0.0, "mlp": 1.0}  # plan_work in MLP units
    held = plan_work(plan, units)
    if not mlp or min(held) == 0 or min(mlp) <= 0:
        return None
    rates = [t / n for t, n in zip(mlp, held)]  # seconds per MLP unit
    target = _with_attention(proportional_plan(plan, [1.0 / r for r in rates]), plan)
    if _counts(target) == _counts(plan):
        return None
    predicted = tuple(r * n for r, n in zip(rates, plan_work(target, units)))
    return MeasuredSplit(target, "mlp", mlp, predicted, max(mlp) - max(predicted))


def measured_attention_split(
    plan: PartitionPlan, seen: Measured, factors: Sequence[float], kv: float = 0.0
) -> MeasuredSplit | None:
    """`plan` with each layer's attention units dealt by what the report measured, the MLP as
    it is; None where the report cannot tell a unit's cost from the call's. A rank's
    attention seconds are taken as its slowdown (`factors`, the step model's) times a per-call
    part, paid in each layer where it holds a unit, plus a part per unit held; the two are
    fitted (least squares) over the ranks holding units, so they need two ranks whose units
    a layer differ by ATTENTION_FIT_SPREAD (not at an even split). Units are then dealt one by
    one, in each layer, to the rank that would finish first, and the layer's split changes
    only where that shortens its slowest rank. Whole groups are coarse: one group more or less
    is a large share of a rank's attention, and the probe's per-call price, against what a
    run pays, decides which count is the shorter (results/notes.md).

    Head units: a rank's units count each K/V replica it computes at `kv` head units (the
    step model's ratio: a replica's GEMM rows against a head's), in the fit and in the deal.
    Two seconds cannot part three costs; the model's ratio parts the replicas' from the
    heads', and the deal takes a rank's heads from as few groups as they fill."""
    attention, n = seen.attention, plan.tp_size
    if len(attention) != n or len(factors) != n:
        return None
    heads = plan.heads
    kv = kv if heads is not None else 0.0

    def units(p: PartitionPlan, layer: int, rank: int) -> float:
        """Attention units at `rank` in `layer`, a K/V replica counted at `kv`."""
        held = p.units(layer, "attn", rank)
        return len(held) + (kv * len(heads.groups_of(held)) if kv and held else 0.0)

    layers = range(plan.num_layers)
    held = [sum(units(plan, i, r) for i in layers) for r in range(n)]
    calls = [sum(1 for i in layers if plan.units(i, "attn", r)) for r in range(n)]
    rows = [(calls[r], held[r], attention[r] / factors[r]) for r in range(n) if held[r]]
    per_call = [h / c for c, h, _ in rows]
    if not rows or max(per_call) < ATTENTION_FIT_SPREAD * min(per_call):
        return None
    cc = sum(c * c for c, _, _ in rows)
    ch = sum(c * h for c, h, _ in rows)
    hh = sum(h * h for _, h, _ in rows)
    cy = sum(c * y for c, _, y in rows)
    hy = sum(h * y for _, h, y in rows)
    det = cc * hh - ch * ch
    if det <= 1e-9 * cc * hh:
        return None
    call, unit = (cy * hh - hy * ch) / det, (cc * hy - ch * cy) / det
    if call < 0:  # the ranks' seconds are below any per-call part: read through the origin
        call, unit = 0.0, hy / hh
    if unit <= 0:
        return None

    def seconds(r: int, work: float) -> float:
        return factors[r] * (call * (work > 0) + unit * work)

    def dealt(count: int) -> float:  # `count` units, with the fewest replicas they bring
        return _with_replicas(count, heads.units_per_group, kv) if kv else count

    dealing = {}
    for index in layers:
        current = plan.counts(index, "attn")
        counts = [0] * n
        for _ in range(sum(current)):  # a tie goes to a rank below its current count
            rank = min(
                range(n),
                key=lambda r: (
                    round(seconds(r, dealt(counts[r] + 1)), 12),
                    counts[r] >= current[r],
                    r,
                ),
            )
            counts[rank] += 1
        if tuple(counts) != current:
            dealing[index] = {"attn": counts}
    candidate = plan.recounted(dealing)  # the heads each rank then holds: its replicas
    changes, gain = {}, 0.0
    for index in dealing:
        now = max(seconds(r, units(plan, index, r)) for r in range(n))
        then = max(seconds(r, units(candidate, index, r)) for r in range(n))
        if then < now - 1e-12:
            changes[index], gain = dealing[index], gain + now - then
    if not changes:
        return None
    target = plan.recounted(changes)
    predicted = tuple(sum(seconds(r, units(target, i, r)) for i in layers) for r in range(n))
    return MeasuredSplit(target, "attn", tuple(attention), predicted, gain)


def measured_against(
    plan: PartitionPlan, target: PartitionPlan, unit_work: Mapping[str, float], seen: Measured
) -> str | None:
    """Why the move from `plan` to `target` lengthens the step whatever the ranks' speeds, or
    None: `seen` measured every block it changes already at least as long on each rank it
    gives work to as on each rank it takes work from. Then the slowdowns that asked for it are
    misread (a hiccup that continuity carried from anchor to anchor, or a fit off at an uneven
    split, read a 2.3x rank at 4.5x, and the plan moved further from balance:
    results/notes.md). A rank's time in a block is its measured block compute in proportion
    to its work there: its slowdown stretches all of its blocks alike, so no reading enters."""
    if len(seen.blocks) != plan.tp_size:
        return None
    old, new = block_works(plan, unit_work), block_works(target, unit_work)
    totals = [sum(works) for works in zip(*old)]
    changed = False
    for before, after in zip(old, new):
        gains = [r for r in range(plan.tp_size) if after[r] > before[r]]
        takes = [r for r in range(plan.tp_size) if after[r] < before[r]]
        if not gains and not takes:
            continue
        changed = True
        time = [seen.blocks[r] * before[r] / totals[r] if totals[r] else 0.0 for r in gains + takes]
        if not takes or min(time[: len(gains)]) < max(time[len(gains) :]):
            return None  # a block where the move gives work to a rank measured shorter
    if not changed:
        return None
    return (
        f"move to {target.summary()} refused: ranks measured at "
        f"{[round(b, 3) for b in seen.blocks]} s in the blocks; it gives work only to the "
        "longer ones"
    )


def _counts(plan: PartitionPlan) -> tuple:
    """Per layer and block, each rank's unit count: what a plan's step time depends on."""
    return tuple(plan.counts(i, b) for i in range(plan.num_layers) for b in BLOCKS)


def groups_filled(units: int, per_group: int) -> int:
    """The query groups (K/V replicas) `units` head units bring at fewest, `per_group` units a
    group."""
    return -(-units // per_group)


def _with_replicas(units: int, per_group: int, kv: float, call: float = 0.0) -> float:
    """Attention work of `units` head units taken from as few query groups as they fill, with
    the per-call part where there is any."""
    return units + kv * groups_filled(units, per_group) + (call if units else 0.0)


def _finish(units: float, speed: float, total: float) -> float:
    """When a rank of `speed` (of `total`) finishes `units`, rounded so that ranks of one
    speed tie exactly."""
    return math.inf if speed <= 0 else round(units * total / speed, 9)


def _speeds(model: StepModel, plan: PartitionPlan, unit_work) -> list[float]:
    """Per-rank shares of the work that balance the step under `model`."""
    return model.balanced_work(sum(plan_work(plan, unit_work)))


def _factors(model: StepModel, ranks) -> str:
    """The slowdowns planned for (the report's level, not the detector's smoothed one)."""
    return ", ".join(f"{model.factors[r]:.2f}x" for r in sorted(ranks))
