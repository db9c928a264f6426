"""The step model: what a step of a plan costs, from each rank's work in its units
(StepModel; block_works and plan_work weigh a plan's units, head units' K/V replicas and
attention's per-call part included)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .plan import BLOCKS, PartitionPlan
from .resize import skipped_count


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
        rank's work; block_works), the per-call part spread evenly over them.
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


def unit_counts(plan: PartitionPlan) -> tuple:
    """Per layer and block, each rank's unit count: what a plan's step time depends on."""
    return tuple(plan.counts(i, b) for i in range(plan.num_layers) for b in BLOCKS)


def attention_counts(plan: PartitionPlan) -> tuple:
    """Each layer's attention unit counts: what a rank's attention seconds depend on."""
    return tuple(plan.counts(i, "attn") for i in range(plan.num_layers))
