"""One TP=2 group's control loop on the per-step timings a busy machine gives, step by step as
the Megatron controller drives it: rank 0 turns slow part-way through a step, every rank's
compute carries independent per-step noise, and a per-call part the timed optimizer step
covers only half of. What the loop decides and how close its split holds to the best one, in
milliseconds; tests/hettp/test_noisy_timings.py and scripts/bench_noisy_loop.py run it."""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

from ..detect import StragglerDetector
from ..loop import ControlLoop, TimingReport
from ..plan import PartitionPlan
from ..planner import Planner, plan_work
from ..transfer import MigrationCost

UNIT_WORK = {"attn": 64.0, "mlp": 1.0}  # 8 query groups of 64 and 1024 neurons a layer
PER_CALL = 0.08  # seconds a step whatever the units; the timed optimizer step is half of it
SHARDED = 0.28  # seconds a step of the sharded work at the even split, unslowed
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

    @property
    def ended(self) -> bool:
        """The loop declared the straggle over while it lasted."""
        return any("no straggler left" in d.reason for d in self.decisions)

    @property
    def swapped(self) -> bool:
        """The loop planned for the fast rank (1) as a straggler."""
        return any(d.planned[1] > 1.0 for d in self.decisions)


def straggle(
    policy: str,
    factor: float,
    noise: float,
    seed: int,
    sharded_only: bool,
    steps: int = 60,
    onset: int = 8,
    interval: int = 4,
) -> NoisyRun:
    """Rank 0 `factor`x slower from step `onset` on, the onset step half-slowed (the straggle
    began mid-step); `noise`: each rank's compute times 1 ± up to `noise`, drawn per step.
    `sharded_only`: only rank 0's per-unit work is slowed, as --het-tp-emulate does; else all
    of its compute, as a slow device."""
    rng = random.Random(seed)
    plan, shares = PartitionPlan.even(2, 2, 8, 1024), (0.0, 0.0)
    migration = MigrationCost(unit_bytes={"attn": 64 * 4096, "mlp": 4096})
    planner = Planner(policy, UNIT_WORK, cap=0.5, migration_seconds=migration.seconds)
    loop = ControlLoop(planner, StragglerDetector(2), migration, interval=interval)
    total = sum(plan_work(plan, UNIT_WORK))
    per_unit = SHARDED / (total / 2)

    def compute(rank: int, work: float, slow: float) -> float:
        f = slow if rank == 0 else 1.0
        return PER_CALL * (1.0 if sharded_only else f) + per_unit * work * f

    decisions, times = [], []
    for step in range(1, steps + 1):
        slow = 1.0 if step < onset else factor if step > onset else (1 + factor) / 2
        work = plan_work(plan, UNIT_WORK, shares)
        clean = [compute(r, w, slow) for r, w in enumerate(work)]
        measured = tuple(c * (1 + rng.uniform(-noise, noise)) for c in clean)
        timed = tuple(PER_CALL / 2 * (slow if r == 0 and not sharded_only else 1) for r in (0, 1))
        times.append(max(clean) + REST)
        report = TimingReport(step, measured, tuple(work), max(measured) + REST, timed)
        verdict = loop.run_step(report, plan, shares)
        if verdict is not None and verdict.decision is not None:
            d = verdict.decision
            decisions.append(Decided(step, d.action, d.reason, verdict.model.factors))
            plan, shares = d.plan, d.shares
            loop.applied()
    best = min(
        max(compute(0, w, factor), compute(1, total - w, factor)) for w in range(int(total) + 1)
    )
    return NoisyRun(tuple(decisions), (best + REST) / statistics.mean(times[-30:]))


def even_split_ratio(factor: float, sharded_only: bool) -> float:
    """The slow rank's compute over the fast one's at the even split: what a slow step reads."""
    return (PER_CALL * (1 if sharded_only else factor) + SHARDED * factor) / (PER_CALL + SHARDED)
