"""Runs of a persistent straggle whose straggle the loop ended and found again within 8 steps,
with the timing record's reading at each end ("anchor, model at ranks [r]": the fitted model's
end at a change; empty in runs recorded before readings were logged).

    python results/model-ends/flaps.py DIR    # every persistent*.jsonl under DIR
"""

import glob
import json
import sys

tot = flap = 0
for f in glob.glob(sys.argv[1] + "/**/persistent*.jsonl", recursive=True):
    decisions = []
    timing = {}
    try:
        for line in open(f):
            r = json.loads(line)
            if r["kind"] == "decision":
                decisions.append((r["iteration"], r["reason"]))
            elif r["kind"] == "timing":
                timing[r["iteration"]] = r.get("reading", "")
    except Exception:
        continue
    if not decisions:
        continue
    tot += 1
    ends = [(i, timing.get(i, "")) for i, why in decisions if why.startswith("no straggler left")]
    again = [i for i, why in decisions if why.startswith("ranks [")]
    fl = [(e, rd) for e, rd in ends if any(e < a <= e + 8 for a in again)]
    if fl:
        flap += 1
        print(f.split("results/")[-1], fl)
print(f"{flap} of {tot} runs with decisions flapped")
