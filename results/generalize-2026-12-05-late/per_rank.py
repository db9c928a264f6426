"""Per run, over the second half of its report records: the step, and per rank its busy,
timed compute, attention and fixed (optimizer) seconds a step, and the step less the busiest
rank's busy time ("rest": collectives and waits). Medians of the records.

    .venv/bin/python results/generalize-2026-12-05-late/per_rank.py RUNS_DIR
"""

import glob
import statistics
import sys

from hettp.metrics import read_metrics


def per_rank(records, key):
    """Per rank, the median of `key` over `records`."""
    ranks = range(len(records[0][key]))
    return [round(statistics.median(r[key][i] for r in records), 3) for i in ranks]


for path in sorted(glob.glob(sys.argv[1] + "/*.jsonl")):
    timing = list(read_metrics(path, "timing"))
    if not timing:
        continue
    half = timing[len(timing) // 2 :]
    step = statistics.median(r["step_s"] for r in half)
    busy = per_rank(half, "busy_s")
    comp, attn = per_rank(half, "compute_s"), per_rank(half, "attention_s")
    fixed, name = per_rank(half, "fixed_s"), path.split("/")[-1][:40]
    print(
        f"{name:40} step {step:.3f} busy {busy} comp {comp} attn {attn} fixed {fixed} "
        f"rest {step - max(busy):.3f}"
    )
