"""ab/: per invocation, steady E of group and head units and heads/groups step (summary.txt),
and for each head-unit run its repartitions (first layer's attention counts) and the moves a
measured attention re-deal made.

    .venv/bin/python results/measured-heads/ab/summarize.py
"""

import glob
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
for folder in sorted(glob.glob(f"{HERE}/tp*")):
    name = os.path.basename(folder)
    rows = [
        line.split()
        for line in open(f"{folder}/summary.txt")
        if line.startswith(("migrate ", "hybrid "))
    ]
    cells = "; ".join(f"{r[0]} groups {r[1]} heads {r[2]} (heads/groups step {r[5]})" for r in rows)
    print(f"{name}: {cells}")
    for path in sorted(glob.glob(f"{folder}/runs/*.jsonl")):
        moves = []
        for line in open(path):
            r = json.loads(line)
            if r.get("kind") == "decision" and r.get("plan"):
                plan = json.loads(r["plan"]) if isinstance(r["plan"], str) else r["plan"]
                counts = tuple(len(u) for u in plan["layers"][0]["attn"])
                measured = "attention blocks took" in r.get("reason", "")
                moves.append(f"{r['iteration']}:{counts}{'*' if measured else ''}")
        print(f"    {os.path.basename(path).rsplit('.', 3)[1]:13s} {' '.join(moves)}")
print("(* a measured attention re-deal)")
