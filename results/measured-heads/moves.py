"""Each run's decisions under a comparison folder: iteration and the first layer's attention
counts after it, `*` where a measured attention re-deal made it (how often attention moved).

    python results/measured-heads/moves.py COMPARE_OUT_DIR
"""

import glob
import json
import os
import sys


def moves(path: str) -> list[str]:
    """One run's decisions, as `iteration:(counts)` with `*` for a measured re-deal."""
    out = []
    for line in open(path):
        r = json.loads(line)
        if r.get("kind") == "decision" and r.get("plan"):
            plan = json.loads(r["plan"]) if isinstance(r["plan"], str) else r["plan"]
            counts = tuple(len(u) for u in plan["layers"][0]["attn"])
            mark = "*" if "attention blocks took" in r.get("reason", "") else ""
            out.append(f"{r['iteration']}:{counts}{mark}")
    return out


if __name__ == "__main__":
    for path in sorted(glob.glob(f"{sys.argv[1]}/**/*.jsonl", recursive=True)):
        name = os.path.basename(path)
        if ".vanilla." not in name and ".none." not in name:
            print(f"{name:45s} {' '.join(moves(path))}")
