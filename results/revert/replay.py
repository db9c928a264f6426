"""Replays hettp.planner's measured revert (REVERT_GAIN, REVERT_READINGS) over recorded runs'
report records: per plan, the last 3 report steps while a rank reads >= 1.3x; where the plan in
effect measured slower than another one (both over 2 reports or more) by the bar, a revert is
counted, and the replay follows the run as recorded (it cannot follow the plan it would have
taken). An approximation: the detector's changes are not in the records, resized intervals
are left out by the decision's shares.

    .venv/bin/python results/revert/replay.py 0.08 'results/head_units/gemm/*/runs/*.jsonl' ...
"""

import glob
import json
import statistics
import sys

from hettp.metrics import read_metrics

bar, patterns = float(sys.argv[1]), sys.argv[2:]
runs = reverts = 0
for pattern in patterns:
    for path in sorted(glob.glob(pattern)):
        records = [r for r in read_metrics(path) if r["kind"] in ("timing", "decision")]
        if not any(r["kind"] == "decision" for r in records):
            continue
        runs += 1
        plan, measured, left = "even", {}, set()
        for r in records:
            if r["kind"] == "decision":
                plan = None if any(r.get("shares") or ()) else json.dumps(r["plan"])
                continue
            if plan is None or not r.get("slowdown") or max(r["slowdown"]) < 1.3:
                continue
            steps = measured.setdefault(plan, [])
            steps[:] = [*steps, r["step_s"]][-3:]
            if len(steps) < 2:
                continue
            here = statistics.median(steps)
            options = [
                (statistics.median(v), k)
                for k, v in measured.items()
                if k != plan and k not in left and len(v) >= 2
            ]
            if options and min(options)[0] < (1 - bar) * here:
                reverts += 1
                there = min(options)[0]
                print(
                    f"{path}: iteration {r['iteration']}: {here:.3f} s against {there:.3f} s "
                    f"({here / there:.3f}x)"
                )
                left.add(plan)
                plan = min(options)[1]
print(f"bar {bar:.0%}: {runs} runs with decisions, {reverts} reverts")
