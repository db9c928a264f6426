#!/usr/bin/env python
"""Migration benchmark: for a hidden-512 GPT with Adam state, apply several plan changes and
print bytes moved, migration time, and migration time as a ratio of one all_reduce of the same
bytes on the same group, side by side; then the cost model fitted on this machine.

    python scripts/bench_migration.py [--tp 4] [--repeats 3] [--granularity 16] \
        [--out results/migration.json]
    python scripts/bench_migration.py --tp 2 --dp 2 --vs-distributed-optimizer

The second runs TP x DP ranks twice, with the plain optimizer and with
--use-distributed-optimizer, and prints per plan change the migration's total time and, per
rank, the optimizer state held between steps and the peak memory the migrations added.

Ranks are spawned on this machine (gloo on CPU). Each change goes from the current plan to new
per-rank counts moving the fewest units. Times are medians over --repeats rounds, each round
applying every change once; the all_reduce is timed right after each change.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch.multiprocessing as mp
from gloo_ranks import ROOT, free_port, join

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


def _optimizer_bytes(optimizer) -> int:
    """Bytes of fp32 masters and optimizer state this rank holds (not the model weights)."""
    import torch

    seen, total = set(), 0
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in sub.optimizer.param_groups:
            for param in group["params"]:
                tensors = [param] + [
                    v for v in sub.optimizer.state.get(param, {}).values() if torch.is_tensor(v)
                ]
                for t in tensors:
                    if t.data_ptr() not in seen and t.dim():
                        seen.add(t.data_ptr())
                        total += t.numel() * t.element_size()
    return total


def _peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def worker(rank, world, port, opts, out_path, distributed_optimizer=False, freeze=True):
    join(rank, world, port)
    import torch
    import torch.distributed as dist

    from hettp.exchange import measure_costs
    from megatron.hetero.arguments import parse_args
    from megatron.hetero.data import build_datasets, build_loader, tokenizer_from_args
    from megatron.hetero.runtime import HetTPRuntime
    from megatron.hetero.training import (
        freeze_imported_objects,
        initialize,
        setup_model_and_optimizer,
        shutdown,
        train_step,
    )

    ffn = 2048
    argv = (
        f"--num-layers 4 --hidden-size 512 --num-attention-heads 8 --ffn-hidden-size {ffn} "
        f"--seq-length 64 --micro-batch-size 1 --global-batch-size {opts.dp} --train-iters 2 "
        "--lr 1e-4 "
        f"--mock-data --vocab-size 255 --tensor-model-parallel-size {opts.tp} --het-tp "
        f"--het-tp-granularity {opts.granularity} --hidden-dropout 0 --attention-dropout 0"
    ).split()
    if distributed_optimizer:
        argv.append("--use-distributed-optimizer")
    args = parse_args(argv)
    if freeze:  # as pretrain() does
        freeze_imported_objects()
    runtime = HetTPRuntime.from_args(args)
    initialize(args)
    tokenizer = tokenizer_from_args(args)
    state = setup_model_and_optimizer(args, tokenizer.vocab_size, runtime)
    runtime.attach(state)
    train_ds, _, _ = build_datasets(args, tokenizer)
    dp_rank = torch.distributed.get_rank() // opts.tp
    loader = build_loader(train_ds, 0, args, dp_rank, opts.dp)
    train_step(args, state, iter(loader))  # Adam moments exist
    optimizer_bytes = [_optimizer_bytes(state.optimizer)]
    rss_before = _peak_rss()
    partition = runtime.partition
    group = partition.group
    rows = {}
    for _ in range(opts.repeats):
        for number, (name, attn, mlp) in enumerate(
            plan_changes(opts.tp, ffn // opts.granularity), 1
        ):
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
            optimizer_bytes.append(_optimizer_bytes(state.optimizer))
    memory = torch.tensor([max(optimizer_bytes), _peak_rss() - rss_before], dtype=torch.float64)
    dist.all_reduce(memory, op=dist.ReduceOp.MAX)
    fitted = measure_costs(group)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(
                {
                    "tp": opts.tp,
                    "dp": opts.dp,
                    "optimizer_mb": memory[0].item() / 1e6,
                    "peak_added_mb": memory[1].item() / 1e6,
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


def _spawn(opts, out, distributed_optimizer=False, freeze=True):
    port = free_port()
    world = opts.tp * opts.dp
    mp.start_processes(
        worker,
        args=(world, port, opts, out, distributed_optimizer, freeze),
        nprocs=world,
        start_method="spawn",
    )
    return json.load(open(out))


def _compare_gc(opts) -> None:
    """The trainer's processes with and without the imports' objects frozen out of the garbage
    collector's full collections (training.freeze_imported_objects), side by side."""
    stem, ext = os.path.splitext(opts.out)
    walked = _spawn(opts, f"{stem}_gc_walked{ext}", freeze=False)
    frozen = _spawn(opts, f"{stem}_gc_frozen{ext}")
    print(
        f"migration with the imports' objects in and out of the collector's full collections: "
        f"hidden 512, ffn 2048, 4 layers, Adam, TP={opts.tp} x DP={opts.dp} on CPU (gloo), MLP "
        f"units of {opts.granularity} neurons; medians of {opts.repeats} rounds"
    )
    print(
        f"{'plan change':40s} {'units':>5s} {'MB':>6s} {'total walked':>12s} "
        f"{'total frozen':>12s} {'ratio':>6s} {'max walked':>10s} {'max frozen':>10s} {'ratio':>6s}"
    )
    for name, row in walked["rows"].items():
        other = frozen["rows"][name]
        a, b = (statistics.median(r["total"]) * 1e3 for r in (row, other))
        ma, mb = (max(r["total"]) * 1e3 for r in (row, other))
        print(
            f"{name:40s} {row['units']:5d} {row['bytes'] / 1e6:6.1f} {a:12.1f} {b:12.1f} "
            f"{b / a:6.2f} {ma:10.1f} {mb:10.1f} {mb / ma:6.2f}"
        )
    print(
        "ms, the slowest rank's; total = transfer, commit and the rebuild of the DDP wrapper "
        "and optimizer; median and max over the rounds (a collection lands in some rounds "
        "only); ratio = frozen / walked."
    )
    print(f"results: {stem}_gc_walked{ext}, {stem}_gc_frozen{ext}")


def _compare(opts) -> None:
    """Plain vs distributed optimizer, side by side."""
    stem, ext = os.path.splitext(opts.out)
    plain = _spawn(opts, f"{stem}_plain{ext}")
    sharded = _spawn(opts, f"{stem}_distopt{ext}", distributed_optimizer=True)
    print(
        f"migration with and without --use-distributed-optimizer: hidden 512, ffn 2048, "
        f"4 layers, Adam, TP={opts.tp} x DP={opts.dp} on CPU (gloo), MLP units of "
        f"{opts.granularity} neurons; medians of {opts.repeats} rounds"
    )
    print(f"{'plan change':40s} {'units':>5s} {'plain ms':>9s} {'dist-opt ms':>11s} {'ratio':>6s}")
    for name, row in plain["rows"].items():
        a = statistics.median(row["total"]) * 1e3
        b = statistics.median(sharded["rows"][name]["total"]) * 1e3
        print(f"{name:40s} {row['units']:5d} {a:9.1f} {b:11.1f} {b / a:6.2f}")
    print(
        f"{'optimizer state per rank, MB':40s} {'':5s} {plain['optimizer_mb']:9.1f} "
        f"{sharded['optimizer_mb']:11.1f} {sharded['optimizer_mb'] / plain['optimizer_mb']:6.2f}"
    )
    print(
        f"{'peak memory the migrations added, MB':40s} {'':5s} {plain['peak_added_mb']:9.1f} "
        f"{sharded['peak_added_mb']:11.1f}"
    )
    print(
        "total = transfer, commit and the rebuild of the DDP wrapper and optimizer, the slowest "
        "rank's; under the distributed optimizer it includes gathering the whole masters and "
        "moments over the DP group and writing the new ranges. Optimizer state: fp32 masters "
        "and Adam moments a rank holds between steps (largest over ranks and changes); peak "
        "added: growth of the largest rank's peak RSS over the migrations."
    )
    print(f"results: {stem}_plain{ext}, {stem}_distopt{ext}")


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tp", type=int, default=4, choices=[2, 4])
    p.add_argument("--dp", type=int, default=1, help="data-parallel size (ranks: TP x DP)")
    p.add_argument(
        "--vs-distributed-optimizer",
        action="store_true",
        help="run twice, without and with --use-distributed-optimizer, and compare",
    )
    p.add_argument(
        "--vs-gc-freeze",
        action="store_true",
        help="run twice, with the imports' objects left in the garbage collector's full "
        "collections (as the trainer before 2026-12-03) and frozen out of them, and compare",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--granularity", type=int, default=16, help="ffn neurons per MLP unit")
    p.add_argument("--out", default=os.path.join(ROOT, "results", "migration.json"))
    opts = p.parse_args(argv)
    if opts.dp < 1:
        p.error(f"--dp {opts.dp}: must be >= 1")
    os.makedirs(os.path.dirname(os.path.abspath(opts.out)), exist_ok=True)
    if opts.vs_distributed_optimizer:
        _compare(opts)
        return
    if opts.vs_gc_freeze:
        _compare_gc(opts)
        return
    data = _spawn(opts, opts.out)
    print(
        f"migration benchmark: hidden 512, ffn 2048, 4 layers, Adam state, TP={opts.tp} x "
        f"DP={opts.dp} on CPU "
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
