"""Each `rebalance (measured)` that re-dealt attention, against what the next reports measured:
per rank holding attention, the attention seconds the split predicted at the new plan and the
median of the next two reports' (a report right after a move may hold its one-off costs).

    .venv/bin/python results/measured-heads/predicted.py RUNS_DIR...
"""

import glob
import json
import re
import statistics
import sys

PATTERN = re.compile(r"the attention blocks took \[([^\]]*)\] s a step by rank, \[([^\]]*)\]")


def floats(text):
    return [float(x) for x in text.split(",")]


errors = []
for root in sys.argv[1:]:
    for path in sorted(glob.glob(f"{root}/**/*.jsonl", recursive=True)):
        records = [json.loads(line) for line in open(path)]
        for i, r in enumerate(records):
            if r.get("kind") != "decision":
                continue
            m = PATTERN.search(r.get("reason", ""))
            if not m:
                continue
            before, predicted = floats(m.group(1)), floats(m.group(2))
            after = [x["attention_s"] for x in records[i + 1 :] if x.get("kind") == "timing"][:2]
            if not after:
                continue
            measured = [statistics.median(a[k] for a in after) for k in range(len(predicted))]
            held = [k for k, p in enumerate(predicted) if p > 0]
            ratio = [round(measured[k] / predicted[k], 3) for k in held]
            errors += [measured[k] / predicted[k] - 1 for k in held]
            slowest_before = max(before[k] for k in range(len(before)))
            slowest_after = max(measured[k] for k in held)
            print(
                f"{path.split('/')[-1]:45s} it {r['iteration']:3d}: took {before} "
                f"predicted {predicted} measured {[round(x, 3) for x in measured]} "
                f"(measured / predicted {ratio}); slowest {slowest_before:.3f} -> "
                f"{slowest_after:.3f} s"
            )
if errors:
    errors.sort()
    print(
        f"{len(errors)} rank readings: measured / predicted - 1, median "
        f"{statistics.median(errors):+.3f}, range {errors[0]:+.3f} .. {errors[-1]:+.3f}"
    )
