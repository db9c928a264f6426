"""The attention probe in four processes on two cores at once (two a core), timed by the wall
clock or by the thread's CPU time: how far its price of the per-call part spreads.

    for c in wall cpu; do
      for r in 0 1 2 3; do .venv/bin/python results/dilation/probe_clock.py $((r % 2)) $c & done
      wait
    done
"""

import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from hettp import attention_probe  # noqa: E402


def main(core: int, clock: str) -> None:
    torch.set_num_threads(1)
    os.sched_setaffinity(0, {core})
    timer = time.thread_time if clock == "cpu" else time.perf_counter

    def timed(run, device):
        start = timer()
        run()
        return timer() - start

    attention_probe._timed = timed
    shape = attention_probe.ProbeShape(
        seq=128, batch=4, hidden=512, head_dim=32, heads_per_unit=1, mlp_rows=352
    )
    price = attention_probe.probe(shape)
    print(
        f"{clock} core{core} call_ms {price.call_s * 1e3:.3f} "
        f"gemm_ns/param {price.gemm_s_per_param * 1e9:.3f} work {price.work:.0f}",
        flush=True,
    )


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
