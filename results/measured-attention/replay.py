"""What hettp.measured.measured_attention_split asks for on the recorded reports: for every
timing record during a straggle at a plan a repartition set, the split's predicted gain as a
share of the step, and the moves (first layer's counts, from -> to) it would make at more than
MEASURED_LEAN x min_gain (1.5%) of the step, by the ranks' slowdowns. A plan's JSON does not
carry head units; they are read from the run's flags, a K/V replica's weight from the run's
`priced` record (unit_work's kv over attn, as the planner reads it). replay.txt was written
when runs with head units got no split (before 6840701).

    .venv/bin/python results/measured-attention/replay.py            # every run
    .venv/bin/python results/measured-attention/replay.py --heads    # runs with head units
"""

import collections
import dataclasses
import glob
import json
import sys

from hettp.measured import Measured, measured_attention_split
from hettp.plan import PartitionPlan
from hettp.report import run_head_units

heads_only = "--heads" in sys.argv[1:]
gains, moves = collections.Counter(), collections.Counter()
for path in sorted(glob.glob("results/**/*.jsonl", recursive=True)):
    plan = heads = None
    kv = 0.0
    for line in open(path):
        r = json.loads(line)
        if r.get("kind") == "run":
            heads = run_head_units(r.get("args") or {})
        if heads_only and heads is None:
            continue
        if r.get("kind") == "priced":
            kv = r["unit_work"].get("kv", 0.0) / r["unit_work"]["attn"]
        elif r.get("kind") == "repartition":
            plan = dataclasses.replace(PartitionPlan.from_json(r["plan"]), heads=heads)
        elif r.get("kind") == "timing" and plan and r.get("attention_s"):
            if max(r.get("slowdown") or [1.0]) <= 1.3:
                continue
            seen = Measured(r["step_s"], *(tuple(r[k]) for k in ("compute_s", "fixed_s")))
            seen = Measured(seen.step, seen.compute, seen.fixed, tuple(r["attention_s"]))
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
print("reports by the split's gain:", dict(gains))
for (factors, frm, to), count in moves.most_common():
    print(f"{count:3d}  slowdowns {factors}: {frm} -> {to}")
