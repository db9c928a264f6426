"""ab/: per invocation, steady E of group and head units and heads/groups step (summary.txt),
and for each head-unit run its decisions (first layer's attention counts, `*` where a measured
attention re-deal made it: ../moves.py).

    .venv/bin/python results/measured-heads/ab/summarize.py
"""

import glob
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from moves import moves  # noqa: E402

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
        policy = os.path.basename(path).rsplit(".", 3)[1]
        print(f"    {policy:13s} {' '.join(moves(path))}")
print("(* a measured attention re-deal)")
