#!/usr/bin/env python
"""What het-TP costs a step with no straggler, measured inside one job so that the machine's
drift cancels: plain megatron-core against het-TP's layers untimed and het-TP as it runs
(layers, compute timer, control loop), interleaved block by block.

    python scripts/bench_timer_cost.py [--tp 2] [--rounds 16] [--steps 4] [--policy migrate]

Every rank builds two models of the same shape and seed: megatron-core's own GPTModel, and the
het-TP one (`--het-tp --het-tp-policy POLICY`, even plan, nothing to decide). Each round runs
one unmeasured step then `--steps` measured training steps of each variant, in orders that
cycle through all six (so no variant mostly follows the one sharing its weights):
- `plain`: megatron-core's model and optimizer, as `pretrain_gpt.py` without het flags;
- `het untimed`: het-TP's layers, with the compute timer's hooks removed and no control loop;
- `het timed`: het-TP as a run uses it: hooks, the timed optimizer step, and the control loop's
  per-step report (an all-gather of a few floats) at every step boundary.
Per variant and round: the mean step wall time and thread CPU time (the most over the ranks).
Prints medians over rounds and the per-round ratios' medians side by side; writes .txt/.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time

import torch.multiprocessing as mp
from gloo_ranks import ROOT, free_port, join

VARIANTS = ("plain", "het untimed", "het timed")
MODEL = (
    "--num-layers 2 --hidden-size 512 --num-attention-heads 8 --ffn-hidden-size 2048 "
    "--seq-length 128 --max-position-embeddings 128 --micro-batch-size 4 --lr 1e-4 "
    "--mock-data --vocab-size 255 --hidden-dropout 0 --attention-dropout 0"
)  # compare.py's default model


def model_flags(model: str) -> list[str]:
    """`--model`'s flags; without a --global-batch-size, two micro-batches a step (so the
    gradient accumulation path is measured too)."""
    flags = model.split()
    if "--global-batch-size" not in flags:
        micro = flags[flags.index("--micro-batch-size") + 1] if "--micro-batch-size" in flags else 1
        flags += ["--global-batch-size", str(2 * int(micro))]
    return flags


def worker(rank, world, port, opts, out_path):
    join(rank, world, port)
    import torch
    import torch.distributed as dist

    from megatron.hetero.arguments import parse_args
    from megatron.hetero.data import build_datasets, build_loader, tokenizer_from_args
    from megatron.hetero.runtime import HetTPRuntime
    from megatron.hetero.training import (
        freeze_imported_objects,
        initialize,
        set_seed,
        setup_model_and_optimizer,
        shutdown,
        train_step,
    )

    argv = (
        model_flags(opts.model)
        + (
            f"--train-iters 100000 "
            f"--tensor-model-parallel-size {opts.tp} --het-tp --het-tp-policy {opts.policy}"
        ).split()
    )
    args = parse_args(argv)
    freeze_imported_objects()
    initialize(args)
    tokenizer = tokenizer_from_args(args)
    plain = setup_model_and_optimizer(args, tokenizer.vocab_size)  # megatron-core's own
    set_seed(args.seed)
    runtime = HetTPRuntime.from_args(args)
    het = setup_model_and_optimizer(args, tokenizer.vocab_size, runtime)
    runtime.attach(het)
    even = runtime.partition.plan
    train_ds, _, _ = build_datasets(args, tokenizer)
    loaders = {v: iter(build_loader(train_ds, 0, args, 0, 1)) for v in VARIANTS}
    timer = runtime.controller.timer
    hooked = [True]
    iteration = [0]
    boundary = [0.0]  # CPU seconds in begin_step/end_step (waits in the gather left out)

    def step(variant):
        if variant == "plain":
            train_step(args, plain, loaders[variant])
            return
        if (variant == "het timed") != hooked[0]:  # hooks on only for the timed variant
            if hooked[0]:
                timer.unhook()
            else:
                timer.rehook(runtime.state.model)
            hooked[0] = not hooked[0]
        if variant == "het untimed":
            train_step(args, runtime.state, loaders[variant])
            return
        iteration[0] += 1
        c0 = time.thread_time()
        runtime.begin_step(iteration[0])
        start, c1 = time.perf_counter(), time.thread_time()
        train_step(args, runtime.state, loaders[variant], runtime)
        c2 = time.thread_time()
        runtime.end_step(iteration[0], time.perf_counter() - start)
        boundary[0] += (c1 - c0) + (time.thread_time() - c2)

    for variant in VARIANTS:  # warm-up: the first steps allocate and build caches
        for _ in range(2):
            step(variant)
    marks = [0]  # timed regions opened in one het-timed step: two per hooked block call

    def counting(fixed=False, _start=timer.start):
        marks[0] += 1
        _start(fixed)

    timer.start = counting
    step("het timed")
    del timer.start  # the class's own again
    # Counted from here: the warm-up held the attention probe (hettp.attention_probe), run once
    # after the first step, a start-up cost that spread over the counted steps read as 2% a step.
    boundary[0], counted_from = 0.0, iteration[0]
    rows = {v: {"wall": [], "cpu": []} for v in VARIANTS}
    orders = list(itertools.permutations(VARIANTS))  # each variant follows each other as often
    for r in range(opts.rounds):
        for variant in orders[r % len(orders)]:
            step(variant)  # unmeasured: it reloads the caches the previous variant took
            dist.barrier()
            wall, cpu = time.perf_counter(), time.thread_time()
            for _ in range(opts.steps):
                step(variant)
            spent = torch.tensor(
                [
                    (time.perf_counter() - wall) / opts.steps,
                    (time.thread_time() - cpu) / opts.steps,
                ],
                dtype=torch.float64,
            )
            dist.all_reduce(spent, op=dist.ReduceOp.MAX)
            rows[variant]["wall"].append(spent[0].item())
            rows[variant]["cpu"].append(spent[1].item())
    plan = runtime.partition.plan
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(
                {
                    "rows": rows,
                    "timed_steps": iteration[0] - counted_from,
                    "boundary_seconds": boundary[0],
                    "hooked_calls": (marks[0] - 1) // 2,  # less the optimizer's fixed region
                    "plan_at_end": plan.summary(),
                    "plan_changed": plan != even,
                },
                f,
            )
    runtime.close()
    shutdown()


def hook_cost(blocks: int = 24, calls: int = 300) -> float:
    """CPU seconds the compute timer adds to one hooked block call (forward and backward), on
    blocks too small to time anything else: hooked against unhooked, interleaved rounds."""
    import torch

    sys.path.insert(0, ROOT)
    from megatron.hetero.timing import ComputeTimer

    torch.set_num_threads(1)

    class Block(torch.nn.Module):  # the timer hooks a layer's attention and MLP blocks
        def __init__(self):
            super().__init__()
            self.first, self.second = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.second(self.first(x))

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attention, self.mlp = Block(), Block()

        def forward(self, x):
            return self.mlp(self.self_attention(x))

    model = torch.nn.Module()
    model.decoder = torch.nn.Module()
    model.decoder.layers = torch.nn.ModuleList(Layer() for _ in range(4))
    per_pass = 2 * len(model.decoder.layers)
    x = torch.randn(2, 8, requires_grad=True)

    def run() -> float:
        t = time.thread_time()
        for _ in range(calls // per_pass):
            y = x
            for layer in model.decoder.layers:
                y = layer(y)
            y.sum().backward()
        return (time.thread_time() - t) / (calls // per_pass * per_pass)

    timer = ComputeTimer(model)
    timer.reset()
    diffs = []
    for _ in range(blocks):
        timer.rehook(model)
        hooked = run()
        timer.unhook()
        diffs.append(hooked - run())
    return statistics.median(diffs)


def ratios(rows: dict, kind: str, over: str, under: str) -> float:
    """The median over rounds of `over`'s per-step time as a ratio of `under`'s, same round."""
    return statistics.median(
        a / b for a, b in zip(rows[over][kind], rows[under][kind], strict=True)
    )


def table(rows: dict, opts, extra: dict) -> list[str]:
    lines = [
        f"het-TP's cost with no straggler: TP={opts.tp}, "
        + ("compare.py's default model" if opts.model == MODEL else f"model {opts.model}")
        + ", "
        f"--het-tp-policy {opts.policy}, {opts.rounds} rounds x {opts.steps} steps per "
        "variant after one unmeasured, interleaved (all six orders in turn)",
        f"{'variant':<12} {'wall ms/step':>12} {'cpu ms/step':>12} {'wall vs plain':>14} "
        f"{'cpu vs plain':>13} {'wall vs untimed':>16} {'cpu vs untimed':>15}",
    ]
    for v in VARIANTS:
        wall = statistics.median(rows[v]["wall"]) * 1e3
        cpu = statistics.median(rows[v]["cpu"]) * 1e3
        line = (
            f"{v:<12} {wall:>12.1f} {cpu:>12.1f} {ratios(rows, 'wall', v, 'plain'):>14.4f} "
            f"{ratios(rows, 'cpu', v, 'plain'):>13.4f}"
        )
        if v == "het timed":
            line += (
                f" {ratios(rows, 'wall', v, 'het untimed'):>16.4f}"
                f" {ratios(rows, 'cpu', v, 'het untimed'):>15.4f}"
            )
        lines.append(line)
    spread = {
        v: (max(rows[v]["wall"]) - min(rows[v]["wall"])) / statistics.median(rows[v]["wall"])
        for v in VARIANTS
    }
    boundary = extra["boundary_seconds"] / extra["timed_steps"]
    hooks = extra["hook_seconds"] * extra["hooked_calls"]
    timed = statistics.median(rows["het timed"]["wall"])
    lines.append(
        "the timers' own cost, counted in CPU time: step boundary (begin_step + end_step: "
        f"report, gather, decide) {boundary * 1e3:.2f} ms + hooks {extra['hooked_calls']} calls x "
        f"{extra['hook_seconds'] * 1e6:.1f} us = {hooks * 1e3:.2f} ms; together "
        f"{(boundary + hooks) * 1e3:.2f} ms, {(boundary + hooks) / timed:.2%} of het timed's step"
    )
    lines.append(
        "ratios: median over rounds of the variant's step time over the other's in the same "
        "round; wall spread over rounds (max-min)/median: "
        + ", ".join(f"{v} {s:.1%}" for v, s in spread.items())
    )
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2, choices=[2, 4])
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--steps", type=int, default=4, help="steps per variant per round")
    p.add_argument("--policy", default="migrate", choices=["none", "migrate", "hybrid", "resize"])
    p.add_argument("--out", default=os.path.join(ROOT, "results", "timer_cost"))
    p.add_argument(
        "--model",
        default=MODEL,
        help="pretrain_gpt.py's model flags, in one string (default: compare.py's default "
        "model; without --global-batch-size, two micro-batches a step)",
    )
    opts = p.parse_args(argv)
    for name in ("rounds", "steps"):
        if getattr(opts, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(opts, name)}")
    raw = opts.out + ".json"
    os.makedirs(os.path.dirname(raw) or ".", exist_ok=True)
    began = time.perf_counter()
    mp.spawn(worker, args=(opts.tp, free_port(), opts, raw), nprocs=opts.tp, join=True)
    with open(raw) as f:
        result = json.load(f)
    result["hook_seconds"] = hook_cost()
    lines = table(result["rows"], opts, result)
    lines.append(f"{time.perf_counter() - began:.0f} s in all")
    print("\n".join(lines))
    with open(opts.out + ".txt", "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(raw, "w") as f:
        json.dump({**result, "tp": opts.tp, "policy": opts.policy, "rounds": opts.rounds}, f)


if __name__ == "__main__":
    main()
