"""Reports whose step-model rebalance the planner refused because the model missed the report
(Planner._model_missed; the `refused` field of the run's timing records), and what the measured
splits (hettp.measured: measured_mlp_split, and measured_attention_split on the report alone)
predict they would save there, as a share of the report's step. Before 2026-12-06 (later) the
planner made no move at such a report.

    .venv/bin/python results/trimmed-split/refused.py [RUN.jsonl ...]   # default: results/**
"""

import collections
import dataclasses
import glob
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from hettp.measured import Measured, measured_attention_split, measured_mlp_split  # noqa: E402
from hettp.plan import PartitionPlan  # noqa: E402
from hettp.report import run_head_units  # noqa: E402

MISSED = "rebalance not made: the step model puts"
paths = sys.argv[1:] or sorted(glob.glob(os.path.join(ROOT, "results/**/*.jsonl"), recursive=True))
shares, runs = collections.Counter(), set()
for path in paths:
    plan = heads = None
    kv = 0.0
    for line in open(path):
        r = json.loads(line)
        kind = r.get("kind")
        if kind == "run":
            heads = run_head_units(r.get("args") or {})
        elif kind == "priced":
            kv = r["unit_work"].get("kv", 0.0) / r["unit_work"]["attn"]
        elif kind == "repartition":
            plan = dataclasses.replace(PartitionPlan.from_json(r["plan"]), heads=heads)
        elif kind == "timing" and plan and (r.get("refused") or "").startswith(MISSED):
            runs.add(path)
            if not r.get("attention_s"):
                shares["no attention seconds in the report"] += 1
                continue
            seen = Measured(r["step_s"], tuple(r["compute_s"]), tuple(r["fixed_s"]))
            seen = dataclasses.replace(seen, attention=tuple(r["attention_s"]))
            factors = tuple(s / min(r["slowdown"]) for s in r["slowdown"])
            splits = (
                measured_mlp_split(plan, seen),
                measured_attention_split(plan, seen, factors, kv),
            )
            share = sum(s.gain for s in splits if s is not None) / r["step_s"]
            shares["> 3%" if share > 0.03 else "1.5-3%" if share > 0.015 else "<= 1.5%"] += 1
print(
    f"{sum(shares.values())} refused reports in {len(runs)} runs; measured splits' predicted gain:"
)
for key in ("> 3%", "1.5-3%", "<= 1.5%", "no attention seconds in the report"):
    print(f"  {key:36s} {shares[key]}")
