"""How far apart repeated probes price attention's call, with one set of rounds and with
hettp.attention_probe.SETS, interleaved, at the head-units benchmark's shape (TP=2, hidden
512, 8 heads of 64, sequence 128, micro-batch 4, one thread).

    taskset -c 0 .venv/bin/python results/attention_call/probe_spread.py [--probes N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from hettp.attention_probe import SETS, ProbeShape, probe  # noqa: E402

SHAPE = ProbeShape(seq=128, batch=4, hidden=512, head_dim=64, heads_per_unit=1, mlp_rows=1024)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probes", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(1)
    calls = {1: [], SETS: []}
    for _ in range(args.probes):
        for sets in calls:
            calls[sets].append(probe(SHAPE, sets=sets).call_s * 1e3)
    print(f"attention's per-call part, ms a layer, {args.probes} probes each, interleaved")
    for sets, values in calls.items():
        v = sorted(values)
        median = statistics.median(v)
        print(
            f"sets {sets}: median {median:.3f}, range {v[0]:.3f}-{v[-1]:.3f} "
            f"({(v[-1] - v[0]) / median:.0%} of the median), "
            f"stdev {statistics.stdev(v) / median:.0%} of it; all: "
            + " ".join(f"{x:.2f}" for x in values)
        )


if __name__ == "__main__":
    main()
