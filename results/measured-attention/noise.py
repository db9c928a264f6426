"""How much a plan's slowest block moves from one report to the next while nothing changes:
over the recorded runs' consecutive timing records of one split during a straggle, the change
in the slowest rank's MLP (and attention) seconds a step, as a share of the step. Percentiles.

    .venv/bin/python results/measured-attention/noise.py
"""

import glob
import json


def mlp(r):
    return [c - x - a for c, x, a in zip(r["compute_s"], r["fixed_s"], r["attention_s"])]


moved = {"mlp": [], "attn": []}
for path in glob.glob("results/**/*.jsonl", recursive=True):
    prev = None
    for line in open(path):
        r = json.loads(line)
        if r.get("kind") != "timing" or not r.get("attention_s") or r["iteration"] < 6:
            continue
        straggle = max(r.get("slowdown") or [1.0]) > 1.4
        if prev and prev["work"] == r["work"] and straggle and max(prev["slowdown"]) > 1.4:
            step = (r["step_s"] + prev["step_s"]) / 2
            moved["mlp"].append(abs(max(mlp(r)) - max(mlp(prev))) / step)
            moved["attn"].append(abs(max(r["attention_s"]) - max(prev["attention_s"])) / step)
        prev = r
for block, values in moved.items():
    values.sort()
    cut = ", ".join(f"p{p} {values[int(p / 100 * len(values))]:.4f}" for p in (50, 90, 95))
    print(f"{block}: {len(values)} report pairs; slowest block's change / step: {cut}")
