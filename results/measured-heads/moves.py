"""Each run's decisions under a comparison folder: iteration and the first layer's attention
counts after it, `*` where a measured attention re-deal made it (how often attention moved).

    python results/measured-heads/moves.py COMPARE_OUT_DIR
"""

import glob
import json
import os
import sys

root = sys.argv[1]
paths = sorted(glob.glob(f"{root}/**/*.jsonl", recursive=True))
for path in paths:
    name = os.path.basename(path)
    if ".vanilla." in name or ".none." in name:
        continue
    out = []
    for line in open(path):
        r = json.loads(line)
        if r.get("kind") == "decision" and r.get("plan"):
            plan = json.loads(r["plan"]) if isinstance(r["plan"], str) else r["plan"]
            counts = tuple(len(u) for u in plan["layers"][0]["attn"])
            mark = "*" if "attention blocks took" in r.get("reason", "") else ""
            out.append(f"{r['iteration']}:{counts}{mark}")
    print(f"{name:45s} {' '.join(out)}")
