"""One TP group's control loop on the per-step timings a busy machine gives, step by step as
the Megatron controller drives it: one rank turns slow part-way through a step, every rank's
compute carries independent per-step noise, and a per-call part the timed optimizer step
covers only half of. Time is block-synchronous: each block waits for its slowest rank, and
the optimizer step after them for its. What the loop decides and how close its split holds
to the best one, in milliseconds; tests/hettp/test_noisy_timings.py and
scripts/bench_noisy_loop.py run it."""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from ..detect import StragglerDetector
from ..loop import ControlLoop, TimingReport, near_even
from ..plan import PartitionPlan
from ..planner import Planner
from ..step_model import plan_work
from ..transfer import MigrationCost

UNIT_WORK = {"attn": 64.0, "mlp": 1.0}  # 8 query groups of 64 and 1024 neurons a layer
PER_CALL = 0.08  # seconds a step whatever the units; the timed optimizer step is half of it
SHARDED = 0.28  # seconds a step of the sharded work at the even split (TP=2), unslowed
REST = 0.1  # seconds a step outside the sharded compute


@dataclass(frozen=True)
class Decided:
    step: int
    action: str
    reason: str
    planned: tuple[float, ...]  # the slowdowns the planner planned for


@dataclass(frozen=True)
class NoisyRun:
    decisions: tuple[Decided, ...]
    steady_e: float  # the best split's step time over the mean of the last 30 steps' (noise-free)
    slow_rank: int = 0
    # with a straggle that stops: the first step from its stop run at a split the loop reads
    # as even again (works within NEAR_EVEN; None: never, or the straggle does not stop)
    restored: int | None = None

    @property
    def ended(self) -> bool:
        """The loop declared the straggle over while it lasted."""
        return any("no straggler left" in d.reason for d in self.decisions)

    @property
    def swapped(self) -> bool:
        """The loop planned for a fast rank as a straggler."""
        return any(
            f > 1.0 for d in self.decisions for r, f in enumerate(d.planned) if r != self.slow_rank
        )


def straggle(
    policy: str,
    factor: float,
    noise: float,
    seed: int,
    sharded_only: bool,
    steps: int = 60,
    onset: int = 8,
    interval: int = 4,
    tp: int = 2,
    slow_rank: int = 0,
    per_call: float = PER_CALL,
    stop: int | None = None,
) -> NoisyRun:
    """Rank `slow_rank` of `tp` `factor`x slower from step `onset` on, the onset step
    half-slowed (the straggle began mid-step); `noise`: each rank's compute times 1 ± up to
    `noise`, drawn per step. `sharded_only`: only the slow rank's per-unit work is slowed, as
    --het-tp-emulate does; else all of its compute, as a slow device. `per_call`: the seconds
    a step that do not shrink with a rank's units (at TP=4 on this VM, about as much as its
    units at the even split). `stop`: the first step at full speed again (None: it lasts)."""
    if not 0 <= slow_rank < tp:
        raise ValueError(f"slow rank {slow_rank} is not in a TP group of {tp}")
    rng = random.Random(seed)
    plan, shares = PartitionPlan.even(tp, 2, 8, 1024), (0.0,) * tp
    migration = MigrationCost(unit_bytes={"attn": 64 * 4096, "mlp": 4096})
    planner = Planner(policy, UNIT_WORK, cap=0.5, migration_seconds=migration.seconds)
    loop = ControlLoop(planner, StragglerDetector(tp), migration, interval=interval)
    total = sum(plan_work(plan, UNIT_WORK))
    per_unit = SHARDED / (total / 2)

    def blocks(rank: int, work: float, slow: float) -> float:
        """The rank's compute in the blocks: half the per-call part, and its units."""
        f = slow if rank == slow_rank else 1.0
        return per_call / 2 * (1.0 if sharded_only else f) + per_unit * work * f

    def apart(rank: int, slow: float) -> float:
        """After the blocks: the timed optimizer step, the per-call part's other half."""
        return per_call / 2 * (slow if rank == slow_rank and not sharded_only else 1.0)

    def step_time(work, slow: float) -> float:
        """Each block waits for its slowest rank, and so does the optimizer's next step."""
        return (
            REST
            + max(blocks(r, w, slow) for r, w in enumerate(work))
            + max(apart(r, slow) for r in range(len(work)))
        )

    restored = None
    decisions, times = [], []
    for step in range(1, steps + 1):
        slow = 1.0 if step < onset else factor if step > onset else (1 + factor) / 2
        work = plan_work(plan, UNIT_WORK, shares)
        if stop is not None and step >= stop:
            slow = 1.0
            if restored is None and near_even(work):
                restored = step
        clean = [blocks(r, w, slow) + apart(r, slow) for r, w in enumerate(work)]
        noisy = [1 + rng.uniform(-noise, noise) for _ in clean]
        measured = tuple(c * n for c, n in zip(clean, noisy))
        timed = tuple(apart(r, slow) * n for r, n in zip(range(tp), noisy))
        times.append(step_time(work, slow))
        report = TimingReport(step, measured, tuple(work), times[-1], timed)
        verdict = loop.run_step(report, plan, shares)
        if verdict is not None and verdict.decision is not None:
            d = verdict.decision
            decisions.append(Decided(step, d.action, d.reason, verdict.model.factors))
            plan, shares = d.plan, d.shares
            loop.applied()
    best = _best_step(step_time, total, tp, slow_rank, factor)
    return NoisyRun(tuple(decisions), best / statistics.mean(times[-30:]), slow_rank, restored)


def end_lags(
    cases: Sequence[tuple[int, int]],
    factors: Sequence[float],
    stops: Sequence[int],
    seeds: int,
    sharded_only: bool,
    noise: float = 0.05,
    steps: int = 44,
    per_call: float = PER_CALL,
) -> list[int | None]:
    """Per run of migrate over `cases` (TP size, slow rank) x `factors` x `stops` x `seeds`, the
    steps from its straggle's stop to a split read as even again (None: never)."""
    lags = []
    for tp, rank in cases:
        for factor in factors:
            for stop in stops:
                for seed in range(seeds):
                    run = straggle(
                        "migrate", factor, noise, seed, sharded_only, steps=steps, tp=tp,
                        slow_rank=rank, per_call=per_call, stop=stop,
                    )  # fmt: skip
                    lags.append(None if run.restored is None else run.restored - stop)
    return lags


def _best_step(step_time, total: float, tp: int, slow_rank: int, factor: float) -> float:
    """The least step time over splits that give the slow rank w and the others an equal
    share of the rest (the fast ranks are alike, so no better split treats them apart)."""

    def at(w: float) -> float:
        rest = (total - w) / (tp - 1)
        return step_time([w if r == slow_rank else rest for r in range(tp)], factor)

    return min(at(w) for w in range(int(total) + 1))


def even_split_ratio(factor: float, sharded_only: bool) -> float:
    """The slow rank's compute over the fast one's at the even split: what a slow step reads."""
    return (PER_CALL * (1 if sharded_only else factor) + SHARDED * factor) / (PER_CALL + SHARDED)
