#!/usr/bin/env python
"""What het-TP layers cost a checkpoint: save and load times of vanilla megatron-core layers and
of het-TP layers under an uneven plan, and under a plan whose owners migrations scattered (each
rank holding several stretches of unit ids), side by side.

    python scripts/bench_het_checkpoint.py [--hidden-size 128] [--num-layers 2] [--repeats 3]

TP=2 on 2 CPU ranks (gloo), Adam state, MLP units of one neuron (--het-tp-granularity 1), the
plan attn=5,3 mlp=5/8 : 3/8 of the neurons, or that plan after four rebalances; times are rank
0's, medians of --repeats saves and loads into a fresh folder. Every piece of a tensor costs its
own planning, validation, write and read, so the piece count matters: a tensor is a piece per
stretch of unit ids a rank holds.

    python scripts/bench_het_checkpoint.py --head-units [--num-attention-heads 64 \
        --num-query-groups 8 --num-layers 2,8]

Query heads as units (--het-tp-attn-granularity 1) under a plan that splits a group: a head
and a K/V are pieces of their own (dist-checkpointing wants one piece shape per key, and a
split group has no coarser one), so a Llama-70B-like attention (64 heads, 8 groups) has ~80
pieces per layer per tensor. Vanilla against head units at each layer count, with the pieces
the checkpoint holds (its metadata's chunks), to show how the cost grows with them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODES = ("vanilla", "het, plan 5:3", "het, scattered owners")
HEAD_MODES = ("vanilla", "het, query heads as units")


def _rank(opts, mode: str) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(1)
    from megatron.hetero import checkpointing
    from megatron.hetero.arguments import parse_args
    from megatron.hetero.data import build_datasets, build_loader, tokenizer_from_args
    from megatron.hetero.runtime import HetTPRuntime
    from megatron.hetero.training import initialize, setup_model_and_optimizer, shutdown, train_step

    ffn = 4 * opts.hidden_size
    flags = (
        f"--num-layers {opts.num_layers} --hidden-size {opts.hidden_size} "
        f"--num-attention-heads {opts.num_attention_heads} --seq-length 64 --micro-batch-size 1 "
        "--train-iters 2 --lr 1e-4 --mock-data --vocab-size 255 --tensor-model-parallel-size 2"
    )
    if opts.num_query_groups:
        flags += f" --group-query-attention --num-query-groups {opts.num_query_groups}"
    if mode == "het, query heads as units":
        heads = opts.num_attention_heads
        per_group = heads // (opts.num_query_groups or heads)
        first = heads // 2 + per_group // 2 or 1  # half a group past the even split
        flags += (
            f" --het-tp --het-tp-attn-granularity 1 --het-tp-plan "
            f"attn={first},{heads - first};mlp={ffn // 2},{ffn // 2}"
        )
    elif mode == "het, plan 5:3":
        flags += f" --het-tp --het-tp-plan attn=5,3;mlp={ffn * 5 // 8},{ffn * 3 // 8}"
    elif mode == "het, scattered owners":
        flags += f" --het-tp --het-tp-plan {_scattered_plan(opts, ffn)}"
    args = parse_args(flags.split(), world_size=2)
    initialize(args)
    runtime = HetTPRuntime.from_args(args, cuda_available=False)
    tokenizer = tokenizer_from_args(args)
    state = setup_model_and_optimizer(args, tokenizer.vocab_size, runtime)
    train_ds, _, _ = build_datasets(args, tokenizer)
    train_step(args, state, iter(build_loader(train_ds, 0, args, 0, 1)))  # Adam state exists
    times = {"save": [], "load": []}
    for repeat in range(opts.repeats):
        root = os.path.join(opts.folder, f"{(MODES + HEAD_MODES).index(mode)}-{repeat}")
        t0 = time.perf_counter()
        checkpointing.save_checkpoint(
            root, 1, 1, state.model, state.optimizer, state.scheduler, args
        )
        times["save"].append(time.perf_counter() - t0)
        pieces = _pieces(checkpointing.checkpoint_dir(root, 1))
        t0 = time.perf_counter()
        checkpointing.load_checkpoint(root, state.model, state.optimizer, state.scheduler, args)
        times["load"].append(time.perf_counter() - t0)
    shutdown()
    return {"times": times, "pieces": pieces}


def _scattered_plan(opts, ffn: int) -> str:
    """A JSON plan file: the 5:3 plan after rebalances to 3:1, 9:7, 3:5 and back to 5:3 (each
    moving the fewest units), as migrations leave the owners."""
    from hettp.plan import PartitionPlan

    plan = PartitionPlan.even(2, opts.num_layers, opts.num_attention_heads, ffn)
    for share in (5, 6, 4.5, 3, 5):  # eighths of the MLP on rank 0
        mlp = int(ffn * share / 8)
        plan = plan.rebalanced(attn_counts=(5, 3), mlp_counts=(mlp, ffn - mlp))
    path = os.path.join(opts.folder, f"scattered-{opts.num_layers}.json")
    os.makedirs(opts.folder, exist_ok=True)
    with open(path, "w") as f:
        f.write(plan.to_json())
    return path


def _pieces(folder: str) -> int:
    """The tensor pieces a checkpoint holds: its torch metadata's chunks over every key."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(folder).read_metadata()
    return sum(
        len(m.chunks)
        for m in metadata.state_dict_metadata.values()
        if isinstance(m, TensorStorageMetadata)
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-layers", default="2", help="layer counts, comma-separated")
    p.add_argument("--num-attention-heads", type=int, default=8)
    p.add_argument("--num-query-groups", type=int, default=None)
    p.add_argument("--head-units", action="store_true", help="vanilla against head units")
    p.add_argument("--repeats", type=int, default=3)
    opts = p.parse_args(argv)
    if opts.repeats < 1:
        p.error(f"--repeats must be >= 1, got {opts.repeats}")
    from tests.utils import run_ranks

    modes = HEAD_MODES if opts.head_units else MODES
    layer_counts = [int(n) for n in opts.num_layers.split(",")]
    groups = opts.num_query_groups or opts.num_attention_heads
    print(
        f"het-TP checkpoints: hidden {opts.hidden_size}, ffn {4 * opts.hidden_size}, "
        f"{opts.num_attention_heads} heads in {groups} groups, TP=2 (2 CPU ranks), Adam, "
        + (
            "query heads as units, a plan splitting a group"
            if opts.head_units
            else "MLP units of 1 neuron, plan 5:3"
        )
        + f"; rank 0, medians of {opts.repeats}; pieces: the checkpoint's chunks, all keys"
    )
    print(
        f"{'layers':>6s} {'':26s} {'pieces':>7s} {'save s':>7s} {'x vanilla':>9s} "
        f"{'load s':>7s} {'x vanilla':>9s}"
    )
    with tempfile.TemporaryDirectory() as folder:
        for layers in layer_counts:
            opts.num_layers, opts.folder = layers, os.path.join(folder, str(layers))
            rows = {mode: run_ranks(_rank, 2, opts, mode)[0] for mode in modes}
            base = {k: statistics.median(rows["vanilla"]["times"][k]) for k in ("save", "load")}
            for mode, row in rows.items():
                save, load = (statistics.median(row["times"][k]) for k in ("save", "load"))
                print(
                    f"{layers:6d} {mode:26s} {row['pieces']:7d} {save:7.3f} "
                    f"{save / base['save']:9.2f} {load:7.3f} {load / base['load']:9.2f}"
                )


if __name__ == "__main__":
    main()
