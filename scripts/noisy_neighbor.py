"""Real contention for one rank: a busy neighbour on its CPU core, or a kernel loop on its GPU.

    python scripts/noisy_neighbor.py --cpu 1 [--pin PID ...] [--duration 60] [--delay 0]
    python scripts/noisy_neighbor.py --gpu 0 [--duration 60] [--size 8192]

CPU: the neighbour pins itself (and the processes given with --pin, e.g. one training rank) to
core N and spins there, so that rank gets about half the core: a 2x straggler for real, with no
emulation in the trainer. GPU: back-to-back matrix multiplies on the device share its SMs with
the training rank. Stops after --duration seconds, or on SIGTERM / Ctrl-C; prints what it did.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time


def _spin_cpu(deadline: float) -> int:
    loops = 0
    x = 0
    while time.monotonic() < deadline:
        for i in range(10000):
            x = (x * 1103515245 + i) & 0xFFFFFFFF
        loops += 1
    return loops


def _spin_gpu(device: int, size: int, deadline: float) -> int:
    import torch

    a = torch.randn(size, size, device=f"cuda:{device}", dtype=torch.bfloat16)
    b = torch.randn(size, size, device=f"cuda:{device}", dtype=torch.bfloat16)
    loops = 0
    while time.monotonic() < deadline:
        for _ in range(10):
            a = a @ b
            a = a / a.norm()
        torch.cuda.synchronize(device)
        loops += 10
    return loops


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--cpu", type=int, metavar="CORE", help="core to contend on")
    where.add_argument("--gpu", type=int, metavar="DEVICE", help="CUDA device to contend on")
    p.add_argument(
        "--pin",
        type=int,
        nargs="*",
        default=[],
        metavar="PID",
        help="processes to pin to the same core (--cpu)",
    )
    p.add_argument("--duration", type=float, default=60.0, help="seconds of contention")
    p.add_argument("--delay", type=float, default=0.0, help="seconds to wait before starting")
    p.add_argument("--size", type=int, default=8192, help="matrix size (--gpu)")
    a = p.parse_args(argv)
    if a.duration <= 0 or a.delay < 0:
        p.error("--duration must be positive and --delay non-negative")
    if a.pin and a.gpu is not None:
        p.error("--pin pins processes to --cpu's core; a GPU is shared without it")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))

    if a.cpu is not None:
        cores = os.sched_getaffinity(0)
        if a.cpu not in cores:
            p.error(f"--cpu {a.cpu}: this process may run on cores {sorted(cores)} only")
        for pid in a.pin:
            try:
                os.sched_setaffinity(pid, {a.cpu})
            except ProcessLookupError:
                p.error(f"--pin {pid}: no such process")
            except PermissionError:
                p.error(f"--pin {pid}: not permitted to set its affinity (another user's?)")
        os.sched_setaffinity(0, {a.cpu})
    time.sleep(a.delay)
    start = time.monotonic()
    try:
        if a.cpu is not None:
            loops = _spin_cpu(start + a.duration)
        else:
            loops = _spin_gpu(a.gpu, a.size, start + a.duration)
    except KeyboardInterrupt:
        loops = -1
    target = f"core {a.cpu}" if a.cpu is not None else f"cuda:{a.gpu}"
    pinned = f", pinned {a.pin} there" if a.pin else ""
    print(
        f"noisy neighbour on {target}{pinned}: {time.monotonic() - start:.1f} s, {loops} loops",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
