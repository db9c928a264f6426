#!/usr/bin/env python
"""Migration benchmark: for a hidden-512 GPT with Adam state, apply several plan changes and
print bytes moved, migration time, and migration time as a ratio of one all_reduce of the same
bytes on the same group, side by side; then the cost model fitted on this machine.

    python scripts/bench_migration.py [--tp 4] [--repeats 3] [--granularity 16] \
        [--out results/migration.json]

Ranks are spawned on this machine (gloo on CPU). Each change goes from the current plan to new
per-rank counts moving the fewest units. Times are medians over --repeats rounds, each round
applying every change once; the all_reduce is timed right after each change.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = ("pack", "exchange", "verify")  # hettp.exchange.STAGES; the parent imports no torch


def plan_changes(tp, mlp_units):
    """(name, attn counts, mlp counts), applied in order, each from the previous plan with the
    fewest moves (PartitionPlan.rebalanced)."""

    def share(weights, total):
        counts = [total * w // sum(weights) for w in weights]
        counts[0] += total - sum(counts)
        return counts

    even = [1] * tp
    skew = [2, 1] if tp == 2 else [2, 1, 1, 0]
    solo = [1] + [0] * (tp - 1)
    return [
        (f"{':'.join(map(str, skew))} share", share(skew, 8), share(skew, mlp_units)),
        ("back to even", share(even, 8), share(even, mlp_units)),
        ("all to rank 0", share(solo, 8), share(solo, mlp_units)),
        ("back to even", share(even, 8), share(even, mlp_units)),
    ]


def worker(rank, world, port, opts, out_path):
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    sys.path.insert(0, ROOT)
    from hettp.exchange import measure_costs
    from megatron.hetero.arguments import parse_args
    from megatron.hetero.data import build_datasets, build_loader, build_tokenizer
    from megatron.hetero.runtime import HetTPRuntime
    from megatron.hetero.training import initialize, setup_model_and_optimizer, shutdown, train_step

    ffn = 2048
    argv = (
        f"--num-layers 4 --hidden-size 512 --num-attention-heads 8 --ffn-hidden-size {ffn} "
        f"--seq-length 64 --micro-batch-size 1 --global-batch-size 1 --train-iters 2 --lr 1e-4 "
        f"--mock-data --vocab-size 255 --tensor-model-parallel-size {world} --het-tp "
        f"--het-tp-granularity {opts.granularity} --hidden-dropout 0 --attention-dropout 0"
    ).split()
    args = parse_args(argv)
    runtime = HetTPRuntime.from_args(args)
    initialize(args)
    tokenizer = build_tokenizer(args.tokenizer_type, args.vocab_size)
    state = setup_model_and_optimizer(args, tokenizer.vocab_size, runtime)
    runtime.attach(state)
    train_ds, _, _ = build_datasets(args, tokenizer)
    train_step(args, state, iter(build_loader(train_ds, 0, args, 0, 1)))  # Adam moments exist
    partition = runtime.partition
    group = partition.group
    rows = {}
    for _ in range(opts.repeats):
        for number, (name, attn, mlp) in enumerate(plan_changes(world, ffn // opts.granularity), 1):
            plan = partition.plan.rebalanced(attn, mlp)
            dist.barrier()
            t0 = time.perf_counter()
            migration = partition.repartition(state, plan)
            total = time.perf_counter() - t0
            schedule, result, predictions = (
                migration.schedule,
                migration.result,
                migration.predictions,
            )
            payload = torch.ones(max(result.payload_bytes // 4, 1))
            reduce_times = []
            for _ in range(3):
                dist.barrier()
                t1 = time.perf_counter()
                dist.all_reduce(payload, group=group)
                reduce_times.append(time.perf_counter() - t1)
            times = torch.tensor(
                [total, result.seconds, statistics.median(reduce_times)]
                + [result.stages.get(stage, 0.0) for stage in STAGES],
                dtype=torch.float64,
            )
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
            row = rows.setdefault(
                f"{number}. {name} (attn {'/'.join(map(str, attn))})",
                {
                    "units": len(schedule.moves),
                    "bytes": result.payload_bytes,
                    "primitive": result.primitive,
                    "predicted_ms": predictions.get(result.primitive, 0) * 1e3,
                    "total": [],
                    "transfer": [],
                    "all_reduce": [],
                    **{stage: [] for stage in STAGES},
                },
            )
            row["total"].append(times[0].item())
            row["transfer"].append(times[1].item())
            row["all_reduce"].append(times[2].item())
            for i, stage in enumerate(STAGES):
                row[stage].append(times[3 + i].item())
    fitted = measure_costs(group)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(
                {
                    "tp": world,
                    "granularity": opts.granularity,
                    "rows": rows,
                    "cost_model": {
                        p: vars(getattr(fitted, p))
                        for p in ("p2p", "all_to_all", "scatter", "broadcast")
                    },
                },
                f,
            )
    runtime.close()
    shutdown()


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tp", type=int, default=4, choices=[2, 4])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--granularity", type=int, default=16, help="ffn neurons per MLP unit")
    p.add_argument("--out", default=os.path.join(ROOT, "results", "migration.json"))
    opts = p.parse_args(argv)
    os.makedirs(os.path.dirname(os.path.abspath(opts.out)), exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(
        worker, args=(opts.tp, port, opts, opts.out), nprocs=opts.tp, start_method="spawn"
    )
    data = json.load(open(opts.out))
    print(
        f"migration benchmark: hidden 512, ffn 2048, 4 layers, Adam state, TP={opts.tp} on CPU "
        f"(gloo), MLP units of {opts.granularity} neurons; medians of {opts.repeats} rounds"
    )
    print(
        f"{'plan change':40s} {'units':>5s} {'MB':>7s} {'via':>4s} {'pack':>6s} {'exch':>6s} "
        f"{'verify':>6s} {'transfer':>8s} {'total':>7s} {'AR':>6s} {'transfer/AR':>11s} "
        f"{'total/AR':>8s}"
    )
    for name, row in data["rows"].items():
        transfer = statistics.median(row["transfer"]) * 1e3
        total = statistics.median(row["total"]) * 1e3
        reduce = statistics.median(row["all_reduce"]) * 1e3
        stages = [statistics.median(row.get(stage, [0.0])) * 1e3 for stage in STAGES]
        print(
            f"{name:40s} {row['units']:5d} {row['bytes'] / 1e6:7.2f} {row['primitive']:>4s} "
            + " ".join(f"{ms:6.1f}" for ms in stages)
            + f" {transfer:8.1f} {total:7.1f} {reduce:6.1f} {transfer / reduce:11.2f} "
            f"{total / reduce:8.2f}"
        )
    print(
        "ms; transfer = pack + exchange + verify (each the slowest rank's, plus the votes "
        "between them); total adds the commit and the rebuild of the DDP wrapper and "
        "optimizer; AR = one all_reduce of the same bytes on the TP group."
    )
    print("cost model fitted on this machine (call s, alpha s/message, beta bytes/s):")
    for name, c in data["cost_model"].items():
        print(f"  {name:10s} call {c['call']:.2e}  alpha {c['alpha']:.2e}  beta {c['beta']:.2e}")
    print(f"results: {opts.out}")


if __name__ == "__main__":
    main()
