#!/usr/bin/env python
"""What checkpoint integrity costs: save and load times with and without the manifest (its
SHA-256 of every file, written at save, checked at load, plus the safe read of .metadata), side
by side in one process.

    python scripts/bench_checkpoint.py [--hidden-size 512] [--num-layers 4] [--repeats 3]

One CPU rank, Adam state; times are medians of --repeats saves and loads into a fresh folder.
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    opts = p.parse_args(argv)
    if opts.repeats < 1:
        p.error(f"--repeats must be >= 1, got {opts.repeats}")
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(1)
    from megatron.hetero import checkpointing, ckpt_integrity
    from megatron.hetero.arguments import parse_args
    from megatron.hetero.data import build_datasets, build_loader, tokenizer_from_args
    from megatron.hetero.training import initialize, setup_model_and_optimizer, shutdown, train_step

    args = parse_args(
        f"--num-layers {opts.num_layers} --hidden-size {opts.hidden_size} "
        "--num-attention-heads 8 --seq-length 64 --micro-batch-size 1 --train-iters 2 "
        "--lr 1e-4 --mock-data --vocab-size 255".split(),
        world_size=1,
    )
    initialize(args)
    tokenizer = tokenizer_from_args(args)
    state = setup_model_and_optimizer(args, tokenizer.vocab_size)
    train_ds, _, _ = build_datasets(args, tokenizer)
    train_step(args, state, iter(build_loader(train_ds, 0, args, 0, 1)))  # Adam state exists
    real_manifest = ckpt_integrity.write_manifest
    rows = {"save": {}, "load": {}}
    size = 0
    for mode in ("plain", "verified") * opts.repeats:
        ckpt_integrity.write_manifest = real_manifest if mode == "verified" else (lambda f: None)
        with tempfile.TemporaryDirectory() as root:
            t0 = time.perf_counter()
            path = checkpointing.save_checkpoint(
                root, 1, 1, state.model, state.optimizer, state.scheduler, args
            ).path
            rows["save"].setdefault(mode, []).append(time.perf_counter() - t0)
            size = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
            t0 = time.perf_counter()
            checkpointing.verify_latest(root, 1)  # no manifest in plain: the metadata check
            checkpointing.load_checkpoint(root, state.model, state.optimizer, state.scheduler, args)
            rows["load"].setdefault(mode, []).append(time.perf_counter() - t0)
    shutdown()
    print(
        f"checkpoint integrity: hidden {opts.hidden_size}, {opts.num_layers} layers, Adam, "
        f"{size / 1e6:.1f} MB per checkpoint, 1 CPU rank; medians of {opts.repeats}"
    )
    print(f"{'':6s} {'plain s':>8s} {'verified s':>11s} {'ratio':>6s}")
    for what, times in rows.items():
        plain, verified = statistics.median(times["plain"]), statistics.median(times["verified"])
        print(f"{what:6s} {plain:8.3f} {verified:11.3f} {verified / plain:6.2f}")


if __name__ == "__main__":
    main()
