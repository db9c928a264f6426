"""Decisions at a straggler's level change (not its onset or end, nor a rebalance) whose report
shows the straggler's own compute moved less than a fast rank's since the report before, at
the same plan: the level change was the fast rank's (hettp.detect.StragglerDetector._moved_itself
refuses it now). Per report, not per step as the detector sees it: a screen, not a replay.

    python results/level-change/scan.py 'results/**/runs/*.jsonl'
"""

import glob
import json
import math
import sys

found = seen = 0
paths = sorted({p for pattern in sys.argv[1:] for p in glob.glob(pattern, recursive=True)})
for path in paths:
    records = [json.loads(line) for line in open(path)]
    timing = [r for r in records if r.get("kind") == "timing"]
    decisions = [r for r in records if r.get("kind") == "decision"]
    for before, decision in zip(decisions, decisions[1:]):
        reason = decision["reason"]
        if reason.startswith("rebalance") or "no straggler" in reason:
            continue
        if before["action"] == "hybrid-resize" and decision["action"] == "hybrid-migrate":
            continue  # hybrid's move after its resize, once the straggle lasted: no new level
        slow = [r for r, v in enumerate(before.get("slowdown") or []) if v >= 1.3]
        if slow != [r for r, v in enumerate(decision.get("slowdown") or []) if v >= 1.3]:
            continue  # an onset or an end
        now = [t for t in timing if t["iteration"] == decision["iteration"]]
        earlier = [
            t for t in timing if before["iteration"] + 4 <= t["iteration"] < decision["iteration"]
        ]
        if len(slow) != 1 or not now or not earlier or now[0]["work"] != earlier[-1]["work"]:
            continue
        seen += 1
        ratio = [n / e for n, e in zip(now[0]["compute_s"], earlier[-1]["compute_s"])]
        own = ratio[slow[0]]
        fast = max((x for r, x in enumerate(ratio) if r != slow[0]), key=lambda x: abs(math.log(x)))
        if abs(math.log(own)) < abs(math.log(fast)) and abs(math.log(own)) < 0.5 * math.log(1.5):
            found += 1
            print(
                f"{path} it {decision['iteration']} {decision['action']} ({reason[:40]}): "
                f"straggler's compute x{own:.2f}, a fast rank's x{fast:.2f}"
            )
print(f"{found} of {seen} level-change decisions were a fast rank's")
