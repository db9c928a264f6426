"""Decisions that ended a straggle ("no straggler left") at the first report after a move, in
recorded runs, and the slowed rank's compute per unit of work in that report over the one before
the move (timing records' compute_s over work). In a persistent scenario such an end is false:
the anchor (hettp.anchor) took the fitted model's reading of a rank left few units over
continuity, and the plan went back to even and out again a report later. In the no-straggler
scenario (`none.*`) the end undoes a move a noisy report started, and is right. The ratio does
not tell the two apart (both 0.9-1.4 where the rank kept some work), so it is not a guard.

    .venv/bin/python results/trimmed-split/false_ends.py DIR [DIR ...]   # default: results
"""

import glob
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
roots = sys.argv[1:] or [os.path.join(ROOT, "results")]
paths = sorted(
    {p for root in roots for p in glob.glob(os.path.join(root, "**", "*.jsonl"), recursive=True)}
)
print("end at  after move  rate after/before  run")
for path in paths:
    records = [json.loads(line) for line in open(path)]
    timings = [r for r in records if r.get("kind") == "timing"]
    decisions = [r for r in records if r.get("kind") == "decision"]
    for prev, d in zip(decisions, decisions[1:]):
        if d["reason"] != "no straggler left":
            continue
        between = [t for t in timings if prev["iteration"] < t["iteration"] <= d["iteration"]]
        before = [t for t in timings if t["iteration"] <= prev["iteration"]]
        if len(between) != 1 or not before:
            continue  # not the first report after the move
        slow = max(range(len(prev["slowdown"])), key=lambda r: prev["slowdown"][r])
        then, now = before[-1], between[0]
        if min(then["work"][slow], now["work"][slow]) <= 0:
            continue
        ratio = (now["compute_s"][slow] / now["work"][slow]) / (
            then["compute_s"][slow] / then["work"][slow]
        )
        name = os.path.relpath(path, ROOT)
        print(f"{d['iteration']:6d}  {prev['iteration']:10d}  {ratio:17.3f}  {name}")
