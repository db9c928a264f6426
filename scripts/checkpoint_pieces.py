#!/usr/bin/env python
"""How many pieces a het-TP checkpoint's MLP tensors take at a large model's shape after a run
of migrations: a piece per stretch of unit ids a rank holds (since 2026-12-07), against pieces
of one shape per tensor as before (their length the gcd of the unit count and every id where
an owner changes, over all layers). Counts only: no model is built, nothing is timed.

    python scripts/checkpoint_pieces.py [--ffn 28672] [--tp 8] [--layers 80] [--moves 8] [--ends]

The plans are the planner's own (`hettp.dealing.proportional_plan`, MLP counts in its 8-neuron
chunks) for a straggler whose speed is drawn anew at each move (0.3-1.0 of the others', one
rank), from Megatron's even split; with --ends each straggle ends before the next begins
(every other move is back to even: the loop's revert). Per MLP tensor part over all layers:
fc2's weight, fc1's (twice as many under SwiGLU, a piece per half), and as many again for each
optimizer state.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hettp.dealing import proportional_plan  # noqa: E402
from hettp.plan import PartitionPlan  # noqa: E402


def stretches(plan: PartitionPlan) -> int:
    """Pieces of one MLP tensor now: every rank's stretches of consecutive ids, every layer."""
    total = 0
    for layer in range(plan.num_layers):
        for rank in range(plan.tp_size):
            ids = sorted(plan.units(layer, "mlp", rank))
            total += sum(1 for i, u in enumerate(ids) if i == 0 or ids[i - 1] != u - 1)
    return total


def one_shape(plan: PartitionPlan) -> int:
    """Pieces of one MLP tensor before: runs of the gcd of the owner changes, every layer."""
    units, run = plan.num_units("mlp"), plan.num_units("mlp")
    for layer in range(plan.num_layers):
        owner = plan.owner_map(layer, "mlp")
        for unit in range(1, units):
            if owner[unit] != owner[unit - 1]:
                run = math.gcd(run, unit)
    return plan.num_layers * units // run


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ffn", type=int, default=28672, help="MLP neurons (units of one neuron)")
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--layers", type=int, default=80)
    p.add_argument("--groups", type=int, default=8, help="attention units")
    p.add_argument("--moves", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--ends", action="store_true", help="every other move ends the straggle (back to even)"
    )
    a = p.parse_args(argv)
    rng = random.Random(a.seed)
    plan = PartitionPlan.even(a.tp, a.layers, a.groups, a.ffn)
    print(
        f"MLP of {a.ffn} neurons at TP={a.tp}, {a.layers} layers: pieces of one MLP tensor over "
        "all layers, per plan"
    )
    print(f"{'move':>4s} {'slow rank':>9s} {'speed':>5s} {'before':>7s} {'now':>5s} {'ratio':>6s}")
    before, now = one_shape(plan), stretches(plan)
    print(f"{0:4d} {'-':>9s} {'-':>5s} {before:7d} {now:5d} {before / now:6.1f}")
    for move in range(1, a.moves + 1):
        slow, speed = rng.randrange(a.tp), rng.uniform(0.3, 1.0)
        if a.ends and move % 2 == 0:
            slow, speed = "-", 1.0
        speeds = [speed if r == slow else 1.0 for r in range(a.tp)]
        plan = proportional_plan(plan, speeds)
        before, now = one_shape(plan), stretches(plan)
        print(f"{move:4d} {slow:>9} {speed:5.2f} {before:7d} {now:5d} {before / now:6.1f}")


if __name__ == "__main__":
    main()
