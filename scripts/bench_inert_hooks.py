"""What the inert hooks that DDP rebuilds leave behind cost a backward.

    python scripts/bench_inert_hooks.py [--params 200] [--rebuilds 50] [--repeats 7]

megatron-core's DDP wrapper hooks every parameter's gradient accumulator and keeps no handle to
take the hook off, so after each migration's rebuild the parameters it did not re-shape would
carry one more hook that finds no bucket and returns (partition._rehook drops them with their
accumulators). This times a backward over `--params` small parameters with no such hook and
with `--rebuilds` of them on each (two parameter sets, interleaved rounds, one intra-op
thread); printed: the medians' ratio and the cost per hook.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _backward_seconds(params, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        sum((p * p).sum() for p in params).backward()
    return (time.perf_counter() - start) / steps


def _inert_hook(param, buckets):
    """DDP's backward hook once its wrapper is set aside: the parameter is in no bucket."""

    def hook(*unused):
        if param in buckets:
            raise AssertionError("an inert hook found a bucket")

    return hook


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=int, default=200)
    p.add_argument("--rebuilds", type=int, default=50)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--steps", type=int, default=20, help="backwards per timed round")
    a = p.parse_args(argv)
    for flag in ("params", "rebuilds", "repeats", "steps"):
        if getattr(a, flag) < 1:
            p.error(f"--{flag} must be >= 1, got {getattr(a, flag)}")
    torch.set_num_threads(1)
    plain = [torch.nn.Parameter(torch.randn(64)) for _ in range(a.params)]
    hooked = [torch.nn.Parameter(torch.randn(64)) for _ in range(a.params)]
    keep = []  # the accumulators stay alive as the wrappers' grad_accs keep them
    for _ in range(a.rebuilds):
        for param in hooked:
            accumulator = param.expand_as(param).grad_fn.next_functions[0][0]
            accumulator.register_hook(_inert_hook(param, {}))
            keep.append(accumulator)
    times = {"plain": [], "hooked": []}
    for _ in range(a.repeats):
        for name, params in (("plain", plain), ("hooked", hooked)):
            _backward_seconds(params, 1)  # warm
            times[name].append(_backward_seconds(params, a.steps))
    plain_s, hooked_s = (statistics.median(times[k]) for k in ("plain", "hooked"))
    hooks = a.params * a.rebuilds
    per_hook_us = (hooked_s - plain_s) / hooks * 1e6
    print(
        f"{a.params} parameters, {a.rebuilds} inert hooks each ({hooks}): backward "
        f"{hooked_s / plain_s:.2f}x the hook-free one, {per_hook_us:.2f} us a hook "
        f"(medians of {a.repeats} interleaved rounds of {a.steps})"
    )
    return {"ratio": hooked_s / plain_s, "per_hook_us": per_hook_us}


if __name__ == "__main__":
    main()
