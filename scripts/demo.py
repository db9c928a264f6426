#!/usr/bin/env python
"""The README's first command: train a small GPT with TP=2 on 2 CPU ranks (gloo) on mock data,
then read the run's JSONL metrics and check the loss fell.

    python scripts/demo.py [--iters 30] [--out logs/demo]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from hettp.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out", default=os.path.join(ROOT, "logs", "demo"))
    args = p.parse_args(argv)

    os.makedirs(args.out, exist_ok=True)
    metrics = os.path.join(args.out, "vanilla-tp2.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        os.path.join(ROOT, "pretrain_gpt.py"),
        "--tensor-model-parallel-size", "2",
        "--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4",
        "--seq-length", "64", "--max-position-embeddings", "64",
        "--micro-batch-size", "4", "--global-batch-size", "8",
        "--train-iters", str(args.iters), "--lr", "3e-3", "--min-lr", "3e-4",
        "--lr-decay-style", "cosine", "--lr-warmup-iters", "3",
        "--mock-data", "--vocab-size", "255",
        "--log-interval", "5", "--eval-interval", str(args.iters), "--eval-iters", "2",
        "--metrics-file", metrics,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    print("+ " + " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True, env=env, cwd=ROOT)

    losses = [r["lm_loss"] for r in read_metrics(metrics, "train")]
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    print(f"\ndemo: TP=2 on 2 CPU ranks, {len(losses)} iterations; lm loss (mean of 3) "
          f"{first:.3f} -> {last:.3f}, ratio last/first {last / first:.3f}")
    print(f"demo: metrics in {metrics}")
    if not last < first:
        sys.exit("demo: the loss did not fall")


if __name__ == "__main__":
    main()
