#!/usr/bin/env python
"""What het-TP layers cost a checkpoint: save and load times of vanilla megatron-core layers and
of het-TP layers under an uneven plan, with the tensors described as one piece per unit (as
before 2026-12-02) or as pieces of the plan's aligned runs of units (now), side by side.

    python scripts/bench_het_checkpoint.py [--hidden-size 128] [--num-layers 2] [--repeats 3]

TP=2 on 2 CPU ranks (gloo), Adam state, MLP units of one neuron (--het-tp-granularity 1), the
plan attn=5,3 mlp=5/8 : 3/8 of the neurons; times are rank 0's, medians of --repeats saves and
loads into a fresh folder. torch checks every pair of a tensor's pieces for overlap when it
saves and loads, so the piece count matters (a piece per unit grows with the square of the
ffn size: this small model keeps the old way's run to about a minute).
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

MODES = ("vanilla", "het, a piece per unit", "het, aligned runs")


def _rank(opts, mode: str) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(1)
    from megatron.hetero import checkpointing
    from megatron.hetero.arguments import parse_args
    from megatron.hetero.data import build_datasets, build_loader, tokenizer_from_args
    from megatron.hetero.partition import het_blocks
    from megatron.hetero.runtime import HetTPRuntime
    from megatron.hetero.training import initialize, setup_model_and_optimizer, shutdown, train_step

    ffn = 4 * opts.hidden_size
    flags = (
        f"--num-layers {opts.num_layers} --hidden-size {opts.hidden_size} "
        "--num-attention-heads 8 --seq-length 64 --micro-batch-size 1 --train-iters 2 "
        "--lr 1e-4 --mock-data --vocab-size 255 --tensor-model-parallel-size 2"
    )
    if mode != "vanilla":
        flags += f" --het-tp --het-tp-plan attn=5,3;mlp={ffn * 5 // 8},{ffn * 3 // 8}"
    args = parse_args(flags.split(), world_size=2)
    initialize(args)
    runtime = HetTPRuntime.from_args(args, cuda_available=False)
    tokenizer = tokenizer_from_args(args)
    state = setup_model_and_optimizer(args, tokenizer.vocab_size, runtime)
    if mode == "het, a piece per unit":
        for block in het_blocks(state.model).values():
            block.set_checkpoint_run(1)
    train_ds, _, _ = build_datasets(args, tokenizer)
    train_step(args, state, iter(build_loader(train_ds, 0, args, 0, 1)))  # Adam state exists
    times = {"save": [], "load": []}
    for repeat in range(opts.repeats):
        root = os.path.join(opts.folder, f"{MODES.index(mode)}-{repeat}")  # every rank's
        t0 = time.perf_counter()
        checkpointing.save_checkpoint(
            root, 1, 1, state.model, state.optimizer, state.scheduler, args
        )
        times["save"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        checkpointing.load_checkpoint(root, state.model, state.optimizer, state.scheduler, args)
        times["load"].append(time.perf_counter() - t0)
    blocks = het_blocks(state.model) if mode != "vanilla" else {}
    runs = sorted({b.linear_fc1.checkpoint_run for (_, n), b in blocks.items() if n == "mlp"})
    shutdown()
    return {"times": times, "mlp_run": runs}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    opts = p.parse_args(argv)
    from tests.utils import run_ranks

    rows = {}
    with tempfile.TemporaryDirectory() as folder:
        opts.folder = folder
        for mode in MODES:
            rows[mode] = run_ranks(_rank, 2, opts, mode)[0]
    print(
        f"het-TP checkpoints: hidden {opts.hidden_size}, ffn {4 * opts.hidden_size}, "
        f"{opts.num_layers} layers, TP=2 (2 CPU ranks), Adam, MLP units of 1 neuron, plan "
        f"5:3; rank 0, medians of {opts.repeats}"
    )
    base = {k: statistics.median(rows["vanilla"]["times"][k]) for k in ("save", "load")}
    print(f"{'':24s} {'save s':>7s} {'x vanilla':>9s} {'load s':>7s} {'x vanilla':>9s}  MLP run")
    for mode, row in rows.items():
        save, load = (statistics.median(row["times"][k]) for k in ("save", "load"))
        run = ",".join(map(str, row["mlp_run"])) or "-"
        print(
            f"{mode:24s} {save:7.3f} {save / base['save']:9.2f} {load:7.3f} "
            f"{load / base['load']:9.2f}  {run}"
        )


if __name__ == "__main__":
    main()
