"""How closely a dilated CPU run steps like ranks with a device each.

    python scripts/bench_dilation.py [--ranks 4] [--dilation 3] [--steps 30] [--unit-ms 2]

With more ranks than cores, `--het-tp-emulate-dilation D` stretches each timed region to D x
its CPU time (x the rank's emulated factor), so that every region lasts what its own work says.
On devices of their own, ranks that meet at a collective inside every block step as their
slowest rank between two collectives says, however the ranks' totals compare. This spawns
`--ranks` gloo ranks (pinned round-robin to this machine's cores), each a chain of blocks of
burnt CPU time with an all-reduce inside each block (after BEFORE of its work, as a TP layer's
row-parallel linear has), timed by megatron.hetero.timing's ComputeTimer with dilation, and
prints each work pattern's median step against the device step: the collectives' times when
every rank's work between two of them lasts D x its factor x its CPU time, plus the bare
collectives (the same chain with no work). A ratio of 1 is a device's step; below it, the
dilated run hides the imbalance of its blocks.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
import types
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

warnings.filterwarnings("ignore", category=UserWarning)  # megatron-core's missing GPU extras

from megatron.hetero.timing import ComputeTimer  # noqa: E402

# Per pattern, per rank, the work of each block of a layer in units (attention, MLP); every
# layer's forward and backward repeat it. "even": the same work everywhere. "blocks": every
# rank's total is the same, but rank 0 holds more attention and less MLP (a split whose totals
# balance and whose blocks do not). "slow": rank 1 at 2x with half the units of each block.
PATTERNS = {
    "even": lambda n: [(1.0, 2.0)] * n,
    "blocks": lambda n: [(1.6, 1.4)] + [(0.8, 2.2)] * (n - 1),
    "slow": lambda n: [(1.0, 2.0)] + [(0.5, 1.0)] + [(1.0, 2.0)] * (n - 2),
}
FACTORS = {"slow": {1: 2.0}}
LAYERS = 2
BEFORE = 0.9  # of a block's work, the share before its collective


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _blocks(work: tuple[float, float]) -> list[float]:
    """A rank's blocks in a step, forward then backward, from its work per layer."""
    forward = list(work) * LAYERS
    return forward + forward[::-1]


def device_step(works, factors, dilation: float, unit: float) -> float:
    """The step (collectives' own time left out) of ranks with a device each: a collective
    starts when the last rank reaches it, each rank's work since the previous one taking
    dilation x its factor x its CPU time."""
    chains = [
        [w * factors.get(r, 1.0) * dilation * unit for w in _blocks(work)]
        for r, work in enumerate(works)
    ]
    at, tail = 0.0, [0.0] * len(works)
    for block in range(len(chains[0])):
        at = max(at + tail[r] + BEFORE * chain[block] for r, chain in enumerate(chains))
        tail = [(1 - BEFORE) * chain[block] for chain in chains]
    return at + max(tail)


def _rank(rank: int, args, port: int, results) -> None:
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    model = types.SimpleNamespace(decoder=types.SimpleNamespace(layers=[]))
    timer = ComputeTimer(model, "cpu", args.dilation)
    buffer = torch.zeros(1024)
    unit = args.unit_ms / 1e3
    out = {}
    for name in ("bare", *PATTERNS):
        works = [(0.0, 0.0)] * args.ranks if name == "bare" else PATTERNS[name](args.ranks)
        blocks = _blocks(works[rank])
        steps = []
        for _step in range(args.steps + 2):
            timer.reset(FACTORS.get(name, {}).get(rank, 1.0))
            dist.barrier()
            start = time.perf_counter()
            for work in blocks:
                timer.start()
                _burn(BEFORE * work * unit)
                dist.all_reduce(buffer)
                _burn((1 - BEFORE) * work * unit)
                timer.stop()
            dist.all_reduce(buffer)  # the step ends when the slowest rank's last block does
            steps.append(time.perf_counter() - start)
        out[name] = statistics.median(steps[2:])
    timer.remove()
    if rank == 0:
        results.update(out)
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--dilation", type=float, default=3.0)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--unit-ms", type=float, default=2.0, help="CPU milliseconds of a work unit")
    args = p.parse_args(argv)
    if args.ranks < 2 or args.dilation <= 1.0:
        p.error("--ranks must be >= 2 and --dilation > 1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(args, port, results), nprocs=args.ranks)
        results = dict(results)
    cores = len(os.sched_getaffinity(0))
    print(
        f"{args.ranks} gloo ranks on {cores} cores, dilation {args.dilation:g}, "
        f"{LAYERS} layers of 2 blocks forward and backward, a unit {args.unit_ms:g} ms CPU, "
        f"medians of {args.steps} steps"
    )
    print(f"{'pattern':8s} {'step ms':>8s} {'device ms':>10s} {'step/device':>12s}")
    bare = results["bare"]
    for name, pattern in PATTERNS.items():
        device = bare + device_step(
            pattern(args.ranks), FACTORS.get(name, {}), args.dilation, args.unit_ms / 1e3
        )
        step = results[name]
        print(f"{name:8s} {step * 1e3:8.1f} {device * 1e3:10.1f} {step / device:12.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
