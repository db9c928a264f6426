"""Where a TP group waits: per collective, each rank's compute before it and its wait in it.

    python scripts/sync_waits.py TRACE_DIR [--step N]

TRACE_DIR holds one torch profiler trace per rank of one run (`pretrain_gpt.py ... --profile
--use-pytorch-profiler --profile-step-start S --profile-step-end E --profile-ranks 0 1
--tensorboard-dir TRACE_DIR`, CPU ranks on gloo). For profiler step N (default: the last one
every trace holds) this prints, collective by collective, each rank's segment (wall time from
the end of its previous collective to the start of this one: its compute) and its wait (the
collective's duration on that rank: the transfer, plus the time its peers took to arrive).

Every TP block ends in a collective, so a step is the sum over collectives of the slowest
rank's segment plus the transfer, not the slowest rank's total: the summary line separates
the two. `sum of slowest` minus `slowest total` is what per-block imbalance costs, the part a
plan that balances each rank's total leaves; `transfer` is the smallest wait at each
collective, summed. Gloo's collectives run on their own thread and record their whole
duration there; on GPUs (NCCL) the CPU side records only the launch, so this reads CPU runs.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
from dataclasses import dataclass

STEP = re.compile(r"ProfilerStep#(\d+)")
COLLECTIVE = "gloo:"


@dataclass(frozen=True)
class Sync:
    name: str  # the collective, e.g. all_reduce
    segment_ms: float  # this rank's time from its previous collective's end to this one's start
    wait_ms: float  # the collective's duration on this rank


@dataclass(frozen=True)
class RankStep:
    step_ms: float
    syncs: tuple[Sync, ...]  # in order; the last one's name is "end" (the step's tail)


@dataclass(frozen=True)
class Summary:
    step_ms: tuple[float, ...]  # per rank
    busy_ms: tuple[float, ...]  # per rank: the sum of its segments
    sum_of_slowest_ms: float  # over collectives, the slowest rank's segment
    transfer_ms: float  # over collectives, the shortest wait

    @property
    def imbalance_ms(self) -> float:
        """What per-block imbalance costs beyond the slowest rank's total."""
        return self.sum_of_slowest_ms - max(self.busy_ms)


class TraceError(ValueError):
    """A trace this reader cannot use."""


def rank_step(trace: dict, step: int) -> RankStep:
    """One rank's profiler step `step` as collectives in order."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    marks = [e for e in events if STEP.fullmatch(e.get("name", "")) and _step(e) == step]
    if not marks:
        raise TraceError(f"no ProfilerStep#{step} in the trace")
    mark = marks[0]
    start, end = mark["ts"], mark["ts"] + mark["dur"]
    collectives = sorted(
        (e for e in events if e["name"].startswith(COLLECTIVE) and start <= e["ts"] < end),
        key=lambda e: e["ts"],
    )
    syncs, previous = [], start
    for e in collectives:
        syncs.append(Sync(e["name"][len(COLLECTIVE) :], (e["ts"] - previous) / 1e3, e["dur"] / 1e3))
        previous = max(previous, e["ts"] + e["dur"])
    syncs.append(Sync("end", max(0.0, end - previous) / 1e3, 0.0))
    return RankStep(mark["dur"] / 1e3, tuple(syncs))


def summarize(ranks: list[RankStep]) -> Summary:
    counts = {len(r.syncs) for r in ranks}
    if len(counts) != 1:
        raise TraceError(
            f"the ranks' steps hold different numbers of collectives ({sorted(counts)}): "
            "traces of one TP group's ranks, of one step, are needed"
        )
    points = list(zip(*(r.syncs for r in ranks)))
    return Summary(
        tuple(r.step_ms for r in ranks),
        tuple(sum(s.segment_ms for s in r.syncs) for r in ranks),
        sum(max(s.segment_ms for s in point) for point in points),
        sum(min(s.wait_ms for s in point) for point in points[:-1]),
    )


def _step(event: dict) -> int:
    return int(STEP.fullmatch(event["name"]).group(1))


def load(directory: str) -> list[dict]:
    """The traces in `directory`, ordered by the rank each names (its `distributedInfo`)."""
    paths = glob.glob(os.path.join(directory, "*.json"))
    if not paths:
        raise TraceError(f"{directory}: no *.json profiler traces")
    traces = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            trace = json.load(f)
        rank = trace.get("distributedInfo", {}).get("rank")
        traces.append((rank if rank is not None else len(traces), path, trace))
    ranks = [rank for rank, _, _ in traces]
    if len(set(ranks)) != len(ranks):
        twice = sorted({r for r in ranks if ranks.count(r) > 1})
        raise TraceError(
            f"{directory}: more than one trace for ranks {twice}: one run's traces are needed "
            "(clear the directory before profiling into it again)"
        )
    return [t for _, _, t in sorted(traces, key=lambda item: (item[0], item[1]))]


def last_common_step(traces: list[dict]) -> int:
    steps = [
        {_step(e) for e in t.get("traceEvents", []) if STEP.fullmatch(e.get("name", ""))}
        for t in traces
    ]
    common = set.intersection(*steps) if steps else set()
    if not common:
        raise TraceError("the traces share no profiler step")
    return max(common)


def render(ranks: list[RankStep], summary: Summary) -> str:
    header = "  #  collective      " + "".join(
        f"  r{r} seg ms  r{r} wait" for r in range(len(ranks))
    )
    lines = [header]
    for i, point in enumerate(zip(*(r.syncs for r in ranks))):
        cells = "".join(f"  {s.segment_ms:9.1f}  {s.wait_ms:7.1f}" for s in point)
        lines.append(f"{i:3d}  {point[0].name:<14}{cells}")
    lines.append(
        "step ms "
        + " / ".join(f"{s:.1f}" for s in summary.step_ms)
        + "; busy ms "
        + " / ".join(f"{b:.1f}" for b in summary.busy_ms)
        + f"; sum of slowest {summary.sum_of_slowest_ms:.1f}"
        + f" (per-block imbalance {summary.imbalance_ms:.1f} beyond the slowest total)"
        + f"; transfer {summary.transfer_ms:.1f}"
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace_dir", help="the run's --tensorboard-dir (one trace per rank)")
    p.add_argument("--step", type=int, default=None, help="profiler step (default: the last)")
    a = p.parse_args(argv)
    try:
        traces = load(a.trace_dir)
        step = a.step if a.step is not None else last_common_step(traces)
        ranks = [rank_step(t, step) for t in traces]
        summary = summarize(ranks)
    except (TraceError, OSError, json.JSONDecodeError) as err:
        print(f"sync_waits: {err}", file=sys.stderr)
        return 2
    print(f"profiler step {step}, {len(ranks)} ranks")
    print(render(ranks, summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
