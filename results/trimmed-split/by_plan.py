"""Per run, the median step (train records' elapsed_ms) under each first-layer attention split
during the straggle, leaving out the step of each repartition and the one after, and where a
run held two splits, the first's median over the second's: what a slowed rank's one head cost
against the same run's steps without it.

    .venv/bin/python results/trimmed-split/by_plan.py OUT/runs/persistent-*heads*.jsonl
"""

import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from hettp.plan import PartitionPlan  # noqa: E402

START = 8  # the straggle starts at iteration 6 in the benchmark's scenarios

for path in sys.argv[1:]:
    records = [json.loads(line) for line in open(path)]
    steps = {r["iteration"]: r["elapsed_ms"] for r in records if r.get("kind") == "train"}
    changes = [
        (r["iteration"], PartitionPlan.from_json(r["plan"]).counts(0, "attn"))
        for r in records
        if r.get("kind") == "repartition"
    ]
    by = {}
    for it, ms in sorted(steps.items()):
        if it < START or any(i in (it, it - 1) for i, _ in changes):
            continue
        held = [counts for i, counts in changes if i < it]
        if held:
            by.setdefault(held[-1], []).append(ms)
    cells = "  ".join(
        f"{counts}: {statistics.median(v):.0f} ms ({len(v)})" for counts, v in by.items()
    )
    medians = [statistics.median(v) for v in by.values()]
    ratio = f"  first / second {medians[0] / medians[1]:.3f}" if len(medians) == 2 else ""
    print(f"{os.path.basename(path):44s} {cells}{ratio}")
