"""Which migrations of recorded runs the measured-compute guard would have refused
(hettp.measured.measured_against): each decision's plan before and after, judged on the timing
record of the report it was made at (compute less the timed fixed part), as the planner judges
it now.

    python results/head_units/measured-guard/replay.py 'results/**/runs/*.jsonl'
"""

import dataclasses
import glob
import json
import sys

from hettp.measured import Measured, measured_against
from hettp.plan import PartitionPlan
from hettp.report import run_head_units

judged = refused = 0
paths = sorted({p for pattern in sys.argv[1:] for p in glob.glob(pattern, recursive=True)})
for path in paths:
    plan = work = heads = shares = None
    timing = {}
    for line in open(path):
        r = json.loads(line)
        kind = r.get("kind")
        if kind == "run":
            heads = run_head_units(r["args"])
        elif kind == "plan" and plan is None:
            plan = r["plan"]
        elif kind == "priced":
            work = r["unit_work"]
        elif kind == "timing":
            timing[r["iteration"]] = r
        elif kind == "decision":
            t = timing.get(r["iteration"])
            if r["action"] in ("migrate", "hybrid-migrate") and plan and work and t:
                old, new = (PartitionPlan.from_json(p) for p in (plan, r["plan"]))
                if heads is not None:
                    old, new = (dataclasses.replace(p, heads=heads) for p in (old, new))
                seen = Measured(t["step_s"], tuple(t["compute_s"]), tuple(t.get("fixed_s") or ()))
                why = measured_against(old, new, work, seen)
                judged += 1
                if why is not None and not any(shares or ()):  # resized: not judged
                    refused += 1
                    print(f"{path} it {r['iteration']} {r['reason'][:40]!r}: {why}")
            plan, shares = r["plan"], r["shares"]
print(f"{refused} of {judged} migrations refused")
