"""The split of results/head_units/gemm/same_plan_and_split.txt (2 of rank 0's 8 heads at 2.7x)
against whole groups, as the step model predicts it with attention's per-call part at the
probe's price and at the one each run's own reports give (scripts/attention_call.py).

    .venv/bin/python results/attention_call/split_check.py
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]

from attention_call import run_call  # noqa: E402

from hettp.metrics import read_metrics  # noqa: E402
from hettp.plan import PartitionPlan  # noqa: E402
from hettp.report import run_head_units  # noqa: E402
from hettp.step_model import StepModel, block_works  # noqa: E402

RUNS = os.path.join(ROOT, "results/head_units/gemm/tp2-2.7x-rank0/runs")
for i in range(3):
    path = os.path.join(RUNS, f"persistent-2.7x-rank0.migrate-heads.{i}.jsonl")
    records = list(read_metrics(path))
    heads = run_head_units(records[0]["args"])
    unit_work = [r for r in records if r["kind"] == "priced"][-1]["unit_work"]
    first = PartitionPlan.from_json([r for r in records if r["kind"] == "plan"][0]["plan"])

    def plan(attn, mlp0, first=first, heads=heads):
        return PartitionPlan.from_counts(
            2,
            len(first.layers),
            first.attn_units,
            first.mlp_units,
            attn,
            [mlp0, first.mlp_units - mlp0],
            first.mlp_unit_size,
            heads=heads,
        )

    whole, split = plan([0, 8], 352), plan([2, 6], 344)  # the two runs' plans after the move
    model = StepModel(0.0, (2.7, 1.0), 1.0)
    for name, call in (("probed", unit_work["call"]), ("measured", run_call(path).measured.work)):
        work = {**unit_work, "call": call}
        ratio = model.blocks_time(block_works(split, work)) / model.blocks_time(
            block_works(whole, work)
        )
        print(
            f"run {i}: call {name:8s} {call / unit_work['attn']:.2f} heads a layer: "
            f"split / whole groups, predicted blocks {ratio:.3f}"
        )
