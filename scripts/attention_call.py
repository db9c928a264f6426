#!/usr/bin/env python
"""Attention's per-call part as runs' own timings price it, against the probe's price.

    python scripts/attention_call.py RUN.jsonl [RUN.jsonl ...]

Reads `--metrics-file` JSONL of het-TP runs that moved attention units (compare.py writes them
under `OUT/runs/`). Per run: the unslowed ranks' attention seconds of every report interval
under one plan (hettp.attention_fit), the line they give per layer, and its intercept (the
call) in the planner's unit of work, next to the call the probe priced at the run's start (its
`priced` record). A run whose reports all held the same attention work cannot price it (no
move yet): it says so. Intervals with resized units are left out (a skipped unit still holds
its place in the plan). TP runs: with pipeline stages the records are the first stage's.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hettp.attention_fit import MeasuredCall, attention_samples, measured_call  # noqa: E402
from hettp.metrics import read_metrics  # noqa: E402
from hettp.plan import PartitionPlan  # noqa: E402
from hettp.report import run_head_units  # noqa: E402


@dataclasses.dataclass(frozen=True)
class RunCall:
    """One run's call: measured (None where its reports cannot price it) and probed."""

    path: str
    probed: float | None  # unit_work["call"] of the run's `priced` record
    probed_s: float | None  # ... and the probe's seconds for it a step (all micro-batches)
    attn_unit: float  # one attention unit's work, to say the call in units
    measured: MeasuredCall | None
    samples: int  # unslowed ranks' report intervals read
    works: tuple[float, ...]  # the distinct attention works a layer sampled, ascending

    @property
    def ratio(self) -> float | None:
        if self.measured is None or not self.probed:
            return None
        return self.measured.work / self.probed


def _microbatches(args: dict) -> int:
    """Micro-batches a rank runs a step (the probe times one)."""
    per_step = args["micro_batch_size"] * args.get("data_parallel_size", 1)
    return max(1, args["global_batch_size"] // per_step)


def run_call(path: str) -> RunCall:
    """The samples of every report interval of `path` that ran under one plan, unresized."""
    records = list(read_metrics(path))
    runs = [r for r in records if r["kind"] == "run"]
    priced = [r for r in records if r["kind"] == "priced"]
    if not runs or not priced:
        raise ValueError("no run or priced record: not a het-TP run that can migrate")
    heads = run_head_units(runs[0]["args"])
    unit_work = priced[-1]["unit_work"]
    # plans (and resize shares) in force: each from the step after the iteration it was set at
    changes = []
    for r in records:
        if r["kind"] == "plan" or (r["kind"] == "repartition" and r.get("plan")):
            changes.append((r["iteration"], r["plan"], None))
        elif r["kind"] in ("decision", "resize") and r.get("shares") is not None:
            changes.append((r["iteration"], None, any(r["shares"])))
    samples, start = [], None
    for t in (r for r in records if r["kind"] == "timing"):
        first, start = start, t["iteration"]
        if first is None:  # the first interval holds the cold first step
            continue
        plan_json, resized, ok = None, False, True
        for iteration, plan, shares in changes:
            if iteration >= t["iteration"]:
                break
            if first < iteration:  # changed inside the interval
                ok = False
            plan_json = plan if plan is not None else plan_json
            resized = shares if shares is not None else resized
        if not ok or resized or plan_json is None or not t.get("attention_s"):
            continue
        plan = dataclasses.replace(PartitionPlan.from_json(plan_json), heads=heads)
        samples += attention_samples(plan, unit_work, t["attention_s"], t["factor"])
    works = tuple(sorted({round(s.work / s.calls, 1) for s in samples}))
    return RunCall(
        path,
        unit_work.get("call"),
        priced[-1]["call_s"] * _microbatches(runs[0]["args"]) if "call_s" in priced[-1] else None,
        unit_work["attn"],
        measured_call(samples),
        len(samples),
        works,
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="metrics JSONL files of het-TP runs")
    args = parser.parse_args(argv)
    ratios = []
    for path in args.runs:
        name = os.path.basename(path)
        try:
            got = run_call(path)
        except ValueError as err:
            print(f"{name}: skipped: {err}")
            continue
        probe = f"{got.probed / got.attn_unit:.2f}" if got.probed else "none"
        if got.probed_s is not None:
            probe += f" ({got.probed_s * 1e3:.2f} ms)"
        if got.measured is None:
            print(f"{name}: cannot price the call: attention works {list(got.works)} a layer")
            continue
        m = got.measured
        line = (
            f"{name}: call {m.work / got.attn_unit:.2f} attention units a layer "
            f"({m.call_s * 1e3:.2f} ms a step), probed {probe}"
        )
        if got.ratio is not None:
            ratios.append(got.ratio)
            line += f": measured / probed {got.ratio:.2f}"
        print(f"{line} ({m.samples} samples)")
    if len(ratios) > 1:
        print(f"median measured / probed over {len(ratios)} runs: {statistics.median(ratios):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
