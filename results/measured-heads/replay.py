"""What hettp.measured.measured_attention_split asks for on the recorded reports of runs with
head units: for every timing record during a straggle, at the plan a repartition set, the
split's predicted gain as a share of the step, and the moves (first layer's head counts, from
-> to) it would make at more than MEASURED_LEAN x min_gain (1.5%) of the step. Head units come
from the run's flags (a plan's JSON does not carry them), a K/V replica's weight from the run's
`priced` record (unit_work's kv over attn, as the planner reads it).

    .venv/bin/python results/measured-heads/replay.py [ROOT ...]   (default: results/)
"""

import collections
import dataclasses
import glob
import json
import sys

from hettp.measured import Measured, measured_attention_split
from hettp.plan import PartitionPlan
from hettp.report import run_head_units

gains, moves = collections.Counter(), collections.Counter()
for root in sys.argv[1:] or ["results"]:
    for path in sorted(glob.glob(f"{root}/**/*.jsonl", recursive=True)):
        plan = heads = None
        kv = 0.0
        for line in open(path):
            r = json.loads(line)
            kind = r.get("kind")
            if kind == "run":
                heads = run_head_units(r.get("args") or {})
            if heads is None:
                continue
            if kind == "priced":
                work = r["unit_work"]
                kv = work.get("kv", 0.0) / work["attn"]
            elif kind == "repartition":
                plan = dataclasses.replace(PartitionPlan.from_json(r["plan"]), heads=heads)
            elif kind == "timing" and plan and r.get("attention_s"):
                if max(r.get("slowdown") or [1.0]) <= 1.3:
                    continue
                seen = Measured(
                    r["step_s"],
                    tuple(r["compute_s"]),
                    tuple(r["fixed_s"]),
                    tuple(r["attention_s"]),
                )
                factors = tuple(s / min(r["slowdown"]) for s in r["slowdown"])
                split = measured_attention_split(plan, seen, factors, kv)
                share = 0.0 if split is None else split.gain / r["step_s"]
                gains[
                    "none"
                    if split is None
                    else ">3%"
                    if share > 0.03
                    else ">1.5%"
                    if share > 0.015
                    else "<=1.5%"
                ] += 1
                if share > 0.015:
                    key = (
                        tuple(round(f, 1) for f in factors),
                        plan.counts(0, "attn"),
                        split.plan.counts(0, "attn"),
                    )
                    moves[key] += 1
print("reports with head units, by the split's gain:", dict(gains))
for (factors, frm, to), count in moves.most_common():
    print(f"{count:3d}  slowdowns {factors}: {frm} -> {to}")
