#!/usr/bin/env python
"""The README's first command: a small GPT on 2 CPU ranks (gloo), trained on the same mock data
and seed:

1. vanilla megatron-core TP=2, then het-TP with an uneven static plan (rank 0 holds 3 of 4
   query groups and 3/4 of the MLP): both loss curves' ends, and a check that the loss fell and
   the uneven partition trained the same model;
2. with TP rank 1 emulated 3x slower from iteration 5 (its sharded GEMMs stretched by
   sleeping): vanilla, whose every step waits for rank 1, against het-TP's control loop
   (--het-tp-policy migrate), which moves units off rank 1. One line: tokens/s of both after
   the straggle began, the speedup, and the largest loss gap (migration is lossless).

    python scripts/demo.py [--iters 20] [--straggler-iters 24] [--out logs/demo]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

from gloo_ranks import pretrain_command

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
STRAGGLER = ["--het-tp-emulate", "persistent:rank=1,factor=3,start=5", "--het-tp-interval", "5"]
# Wider layers and longer sequences for the straggler runs: the sharded GEMMs (the work TP
# splits, and what the emulated straggler slows) then dominate a step, as they do on GPUs.
WIDE = {"--hidden-size": "256", "--seq-length": "128", "--max-position-embeddings": "128"}
STRAGGLER_RUNS = {
    "vanilla TP=2, rank 1 3x slower": ["--het-tp-policy", "none", *STRAGGLER],
    "het-TP TP=2 migrate, rank 1 3x slower": ["--het-tp-policy", "migrate", *STRAGGLER],
}


def _widened(model):
    flags = list(model)
    for flag, value in WIDE.items():
        flags[flags.index(flag) + 1] = value
    return flags


def train(name, extra, iters, out, model=MODEL):
    metrics = os.path.join(out, name.split(",")[0].replace(" ", "-").replace("=", "") + ".jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    cmd = pretrain_command(
        [*model, *extra, "--train-iters", str(iters), "--eval-interval", str(iters)]
        + ["--metrics-file", metrics]
    )
    print(f"\n=== {name}\n+ pretrain_gpt.py {' '.join(model + extra)}", flush=True)
    subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=ROOT)
    return [r["lm_loss"] for r in read_metrics(metrics, "train")], metrics


def steady_tokens_per_s(metrics: str) -> float:
    """Median tokens/s over the second half of the run (the straggle began at iteration 5, the
    loop acts within a few steps)."""
    rates = [r["tokens_per_s"] for r in read_metrics(metrics, "train")]
    return statistics.median(rates[len(rates) // 2 :])


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--iters", type=int, default=20, help="iterations of the loss comparison (>= 6)")
    p.add_argument(
        "--straggler-iters",
        type=int,
        default=24,
        help="iterations of the straggler comparison (>= 12: the straggle starts at 5)",
    )
    p.add_argument("--out", default=os.path.join(ROOT, "logs", "demo"))
    args = p.parse_args(argv)
    # the loss check compares the mean of the first 3 losses with the last 3; the speed check
    # takes the second half of the run, after the straggle's onset and the loop's first moves
    if args.iters < 6:
        p.error(f"--iters must be >= 6 (two windows of 3 losses), got {args.iters}")
    if args.straggler_iters < 12:
        p.error(f"--straggler-iters must be >= 12, got {args.straggler_iters}")
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

    runs = {
        name: train(name, extra, args.straggler_iters, args.out, _widened(MODEL))
        for name, extra in STRAGGLER_RUNS.items()
    }
    (vanilla, vanilla_metrics), (het, het_metrics) = runs.values()
    slow, fast = steady_tokens_per_s(vanilla_metrics), steady_tokens_per_s(het_metrics)
    gap = max(abs(a - b) / abs(a) for a, b in zip(vanilla, het))
    decisions = [r for r in read_metrics(het_metrics) if r["kind"] == "decision"]
    print(
        f"\ndemo: rank 1 3x slower from iteration 5: vanilla {slow:.0f} tokens/s, het-TP "
        f"migrate {fast:.0f} tokens/s (median of the second half): speedup {fast / slow:.2f}x; "
        f"{len(decisions)} decision(s), first at iteration "
        f"{decisions[0]['iteration'] if decisions else '-'}; largest loss gap {gap:.1e}"
    )
    if gap > 1e-5:
        sys.exit("demo: migration changed the losses")


if __name__ == "__main__":
    main()
