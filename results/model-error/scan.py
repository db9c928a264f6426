"""Rebalances of recorded runs, by how far the step model missed the report's measured compute
at the plan it left (each rank's modelled compute: the cost fit replayed over the run's timing
records, times the slowdown the decision planned for; the largest miss over the ranks), with
the measured step after the move over the step before it (medians of the reports 8 steps
before and up to 12 after). hettp.planner.MODEL_ERROR keeps a rebalance from being made
where the miss exceeds it. A screen of what was recorded, not a replay of the planner.

    python results/model-error/scan.py 'results/**/runs/*.jsonl'
"""

import glob
import json
import statistics
import sys

from hettp.costfit import ComputeFit

rows = []
paths = sorted({p for pattern in sys.argv[1:] for p in glob.glob(pattern, recursive=True)})
for path in paths:
    if ".vanilla." in path or ".none." in path:
        continue
    records = [json.loads(line) for line in open(path)]
    timing = [r for r in records if r.get("kind") == "timing"]
    moves = sorted(r["iteration"] for r in records if r.get("kind") == "decision")
    fit, lines = ComputeFit(), {}
    for r in timing:
        lines[r["iteration"]] = fit.line(r["work"], r["compute_s"], r.get("fixed_s"))
        fit.add(r["work"], r["compute_s"], r["factor"], r.get("fixed_s"))
    at = {r["iteration"]: r for r in timing}
    for d in records:
        if d.get("kind") != "decision" or not d["reason"].startswith("rebalance"):
            continue
        it, t = d["iteration"], at.get(d["iteration"])
        if t is None:
            continue
        line, slow = lines[it], d.get("slowdown") or t["factor"]
        fastest = min(slow)
        miss = max(
            abs(
                (s / fastest if s / fastest >= 1.3 else 1.0) * (line.fixed + line.per_unit * w) / c
                - 1
            )
            for w, c, s in zip(t["work"], t["compute_s"], slow)
        )
        stop = min([m for m in moves if m > it], default=10**9)
        before = [r["step_s"] for r in timing if it - 8 <= r["iteration"] <= it]
        after = [r["step_s"] for r in timing if it + 4 <= r["iteration"] <= min(it + 12, stop)]
        if before and after:
            rows.append((miss, statistics.median(after) / statistics.median(before)))
for low, high in ((0.0, 0.1), (0.1, 0.2), (0.2, float("inf"))):
    band = [ratio for miss, ratio in rows if low <= miss < high]
    if band:
        span = f"{low:.0%}-{high:.0%}" if high < float("inf") else f"over {low:.0%}"
        print(
            f"model missed a rank by {span}: {len(band)} rebalances, step after / "
            f"before median {statistics.median(band):.3f}, {sum(r > 1 for r in band)} slower"
        )
