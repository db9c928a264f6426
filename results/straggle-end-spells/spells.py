"""The resize end-of-straggle case of tests/hetero/test_control.py, driven through the pure
control loop (hettp.loop) step by step, with one spell of the machine's own on top: rank 0 or 1
slowed 1.2-2.2x for 1-4 steps starting anywhere in steps 12-25. Counts the runs whose straggle
end (rank 1 3x in steps 12-20) was not acted on at steps 22-24 by a decision that gives rank 1
work back, leaving out those where the spell itself kept rank 1 slow past the end.

    python results/straggle-end-spells/spells.py [RUNS]
"""

from __future__ import annotations

import random
import sys

from hettp.detect import StragglerDetector
from hettp.loop import ControlLoop, TimingReport
from hettp.plan import PartitionPlan
from hettp.planner import Planner
from hettp.step_model import plan_work

UNIT_WORK = {"attn": 4.0, "mlp": 1.0}


def run(seed: int):
    rng = random.Random(seed)
    loop = ControlLoop(
        Planner("resize", UNIT_WORK, cap=0.5),
        StragglerDetector(2, onset=1.5, end=1.15, patience=3, window=3, at_once=1.6),
        None,
        interval=5,
    )
    plan, shares = PartitionPlan.even(2, 2, 4, 64), (0.0, 0.0)
    rank, factor = rng.randrange(2), rng.uniform(1.2, 2.2)
    first = rng.randrange(12, 26)
    last = first + rng.randrange(0, 4)
    decisions, spared = [], {}
    for step in range(1, 41):
        speed = [1.0, 3.0 if 12 <= step <= 20 else 1.0]
        if first <= step <= last:
            speed[rank] *= factor
        speed = [s * (1 + rng.uniform(-0.03, 0.03)) for s in speed]
        work = plan_work(plan, UNIT_WORK, shares)
        compute = tuple(1e-3 * s * w for s, w in zip(speed, work))
        verdict = loop.run_step(
            TimingReport(step, compute, work, 0.02 + max(compute)), plan, shares
        )
        if verdict is not None and verdict.decision is not None:
            decision = verdict.decision
            decisions.append((step, decision.action, decision.reason))
            plan, shares = decision.plan, decision.shares
            loop.applied()
        spared[step] = shares[1]
    if rank == 1 and first <= 24 and last >= 21:
        return None  # the spell kept rank 1 slow past the end: no case
    reacted = [d for d in decisions if 22 <= d[0] <= 24]
    missed = not reacted or spared[reacted[0][0]] >= spared[20]
    return missed, (rank, round(factor, 2), first, last), decisions


def main():
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    cases = missed = 0
    for seed in range(runs):
        result = run(seed)
        if result is None:
            continue
        cases += 1
        if result[0]:
            missed += 1
            if missed <= 10:
                print(f"seed {seed}: spell (rank, factor, first, last) {result[1]}: {result[2]}")
    print(f"end missed at steps 22-24 in {missed} of {cases} runs")


if __name__ == "__main__":
    main()
