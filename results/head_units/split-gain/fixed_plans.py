"""Summarise fixed_plans.sh's runs: per run, the median step (iterations 6-20) and each rank's
median busy time (its compute, the optimizer's included) from the `timing` records."""

import glob
import json
import os
import statistics
import sys

out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/split_gain"
print("run                    step ms  busy r0  busy r1")
for path in sorted(glob.glob(os.path.join(out, "*.jsonl"))):
    rows = [json.loads(line) for line in open(path)]
    timing = [r for r in rows if r.get("kind") == "timing" and r["iteration"] >= 6]
    steps = [r["elapsed_ms"] for r in rows if r.get("kind") == "train" and r["iteration"] > 5]
    busy = [1e3 * statistics.median(r["busy_s"][k] for r in timing) for k in (0, 1)]
    name = os.path.basename(path)[: -len(".jsonl")]
    print(f"{name:<22} {statistics.median(steps):7.1f}  {busy[0]:7.1f}  {busy[1]:7.1f}")
