"""What the planner's split check (hettp.planner.split_check) chooses for the head-units
benchmark's TP=4 shapes (4 query groups of 4 heads, one head a unit) at the first move of a
straggle, one rank slowed by each factor: the split, the same split with no head on the slowed
rank (trimmed), whole groups, the plan chosen, and the split's gain over the trimmed split at
each attention cost and call price of the planner's ranges. Unit works as the runs priced them;
the step model as the first report gives it (no cost line yet: no per-call part, the optimizer's
seconds apart; rest and rates from the report at the onset).

    .venv/bin/python results/trimmed-split/split_check.py
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from hettp.plan import HeadUnits, PartitionPlan  # noqa: E402
from hettp.planner import split_check  # noqa: E402
from hettp.step_model import StepModel, plan_work  # noqa: E402

CASES = {
    # results/measured-heads/final-tp4-3x-rank1 (migrate-heads, round 0): priced, iteration 6
    "hidden 512, rank 1": (
        {"attn": 63828.0, "mlp": 1536.0, "kv": 32768.0, "call": 31240.0},
        1408,
        1,
        dict(rest=0.077, slope=(0.22 - 0.02) / 1.72e6, apart=0.02),
    ),
    # tp4-h768-3.4x-rank0 (migrate-heads, round 1): priced, iteration 6
    "hidden 768, rank 0": (
        {"attn": 112988.0, "mlp": 2304.0, "kv": 73728.0, "call": 34226.0},
        2112,
        0,
        dict(rest=1.486 - 1.39, slope=(0.41 - 0.031) / 3.55e6, apart=0.031),
    ),
}

for name, (work, mlp, rank, fit) in CASES.items():
    even = PartitionPlan.from_counts(
        4, 2, 16, mlp, (4,) * 4, (mlp // 4,) * 4, 1, HeadUnits(1, 4, 4)
    )
    print(name)
    print("factor  split         trimmed       whole         chosen        split over trimmed")
    for factor in (2.2, 2.6, 2.9, 3.2, 3.4, 3.8):
        factors = tuple(factor if r == rank else 1.0 for r in range(4))
        model = StepModel(fit["rest"], factors, fit["slope"], 0.0, fit["apart"])
        check = split_check(even, model, work, model.balanced_work(sum(plan_work(even, work))))
        over = " ".join(f"{g:+.3f}" for g in check.over_trimmed.values()) or "-"
        trimmed = check.trimmed.counts(0, "attn") if check.trimmed else "-"
        print(
            f"{factor:<7} {check.split.counts(0, 'attn')!s:13} {trimmed!s:13} "
            f"{check.whole.counts(0, 'attn')!s:13} {check.chosen.counts(0, 'attn')!s:13} {over}"
        )
