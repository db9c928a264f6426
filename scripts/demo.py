#!/usr/bin/env python
"""The README's first command: a small GPT on 2 CPU ranks (gloo), trained twice on the same mock
data and seed: vanilla megatron-core TP=2, then het-TP with an uneven static plan (rank 0 holds
3 of 4 query groups and 3/4 of the MLP). Prints both loss curves' ends and checks the loss fell
and the uneven partition trained the same model.

    python scripts/demo.py [--iters 30] [--out logs/demo]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from hettp.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = [
    "--tensor-model-parallel-size",
    "2",
    "--num-layers",
    "2",
    "--hidden-size",
    "128",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "64",
    "--max-position-embeddings",
    "64",
    "--micro-batch-size",
    "4",
    "--global-batch-size",
    "8",
    "--lr",
    "3e-3",
    "--min-lr",
    "3e-4",
    "--lr-decay-style",
    "cosine",
    "--lr-warmup-iters",
    "3",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--mock-data",
    "--vocab-size",
    "255",
    "--log-interval",
    "10",
    "--eval-iters",
    "2",
]
RUNS = {
    "vanilla TP=2": [],
    "het-TP TP=2, plan attn 3/1 mlp 384/128": ["--het-tp-plan", "attn=3,1;mlp=384,128"],
}


def train(name, extra, iters, out):
    metrics = os.path.join(out, name.split(",")[0].replace(" ", "-").replace("=", "") + ".jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        os.path.join(ROOT, "pretrain_gpt.py"),
        *MODEL,
        *extra,
        "--train-iters",
        str(iters),
        "--eval-interval",
        str(iters),
        "--metrics-file",
        metrics,
    ]
    print(f"\n=== {name}\n+ pretrain_gpt.py {' '.join(MODEL + extra)}", flush=True)
    subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=ROOT)
    return [r["lm_loss"] for r in read_metrics(metrics, "train")], metrics


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out", default=os.path.join(ROOT, "logs", "demo"))
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    curves = {name: train(name, extra, args.iters, args.out) for name, extra in RUNS.items()}
    print()
    for name, (losses, metrics) in curves.items():
        first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
        print(
            f"demo: {name}: lm loss (mean of 3) {first:.3f} -> {last:.3f}, "
            f"ratio last/first {last / first:.3f}  [{metrics}]"
        )
        if not last < first:
            sys.exit(f"demo: the loss did not fall in '{name}'")
    (vanilla, _), (het, _) = curves.values()
    gap = max(abs(a - b) / abs(a) for a, b in zip(vanilla, het))
    print(f"demo: largest per-iteration relative loss gap het-TP vs vanilla: {gap:.1e}")
    if gap > 1e-5:
        sys.exit("demo: the uneven partition did not train the same model")


if __name__ == "__main__":
    main()
