"""What the planner's split check (hettp.planner.split_check) chooses for the head-units
benchmark's TP=4 shape (hidden 512, 4 query groups of 4 heads, one head a unit), with unit works
as a run priced them (results/measured-heads/final-tp4-3x-rank1: attn 63828, kv 32768, call
31240) and a step model near that run's first report (rest 0.077 s, a fast rank's blocks
0.19 s, fixed 0.01 s, optimizer 0.02 s), one rank slowed by each factor: the split, the same
split with no head on the slowed rank (trimmed), whole groups, and the split's gain over the
trimmed split at each attention cost and call price of the range.

    .venv/bin/python results/trimmed-split/split_check.py
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from hettp.plan import HeadUnits, PartitionPlan  # noqa: E402
from hettp.planner import split_check  # noqa: E402
from hettp.step_model import StepModel, plan_work  # noqa: E402

WORK = {"attn": 63828.0, "mlp": 1536.0, "kv": 32768.0, "call": 31240.0}
EVEN = PartitionPlan.from_counts(4, 2, 16, 1408, (4,) * 4, (352,) * 4, 1, HeadUnits(1, 4, 4))

print("factor  split         trimmed       whole         chosen        split over trimmed")
for factor in (2.2, 2.6, 2.9, 3.2, 3.5, 4.0):
    factors = (1.0, factor, 1.0, 1.0)
    model = StepModel(0.077, factors, slope=(0.22 - 0.03) / 1.72e6, fixed=0.01, apart=0.02)
    check = split_check(EVEN, model, WORK, model.balanced_work(sum(plan_work(EVEN, WORK))))
    over = " ".join(f"{g:+.3f}" for g in check.over_trimmed.values()) or "-"
    trimmed = check.trimmed.counts(0, "attn") if check.trimmed else "-"
    print(
        f"{factor:<7} {check.split.counts(0, 'attn')!s:13} {trimmed!s:13} "
        f"{check.whole.counts(0, 'attn')!s:13} {check.chosen.counts(0, 'attn')!s:13} {over}"
    )
