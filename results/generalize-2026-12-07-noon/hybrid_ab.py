"""Migrate against hybrid (dw scorer) and hybrid (magnitude scorer: no per-step observation) on
seed 24157's generalize case, in interleaved rounds; the median step of iterations 17-32.

    .venv/bin/python results/generalize-2026-12-07-noon/hybrid_ab.py [ROUNDS]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from gloo_ranks import pretrain_command  # noqa: E402 - the scripts folder, put on the path

MODEL = (
    "--num-layers 2 --hidden-size 640 --num-attention-heads 10 --ffn-hidden-size 2560 "
    "--seq-length 128 --max-position-embeddings 128 --micro-batch-size 2 --lr 1e-4 --mock-data "
    "--vocab-size 255 --hidden-dropout 0 --attention-dropout 0 --group-query-attention "
    "--num-query-groups 2 --normalization RMSNorm --position-embedding-type rope "
    "--disable-bias-linear --tensor-model-parallel-size 2 --global-batch-size 2 "
    "--train-iters 32 --eval-iters 0 --log-interval 100 --het-tp-interval 4 "
    "--het-tp-emulate persistent:rank=0,factor=3.7,start=10"
).split()
CONFIGS = {
    "migrate": ["--het-tp-policy", "migrate"],
    "hybrid-dw": ["--het-tp-policy", "hybrid"],
    "hybrid-magnitude": ["--het-tp-policy", "hybrid", "--het-tp-priority", "magnitude"],
}
SCORED = (24, 32)  # the dw scorer's sampled steps in the window (every 8th)


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    out = {name: [] for name in CONFIGS}
    folder = tempfile.mkdtemp()
    for round_ in range(rounds):
        for name, flags in CONFIGS.items():
            metrics = os.path.join(folder, f"{name}.{round_}.jsonl")
            command = pretrain_command(
                MODEL + flags + ["--metrics-file", metrics], port=29600 + round_
            )
            env = dict(os.environ, OMP_NUM_THREADS="1")
            run = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT)
            if run.returncode:
                lines = (run.stdout + run.stderr).splitlines()
                sys.exit(f"{name} failed: {[x for x in lines if 'rror' in x][:5]}")
            with open(metrics) as f:
                records = [json.loads(line) for line in f]
            steps = {r["iteration"]: r["elapsed_ms"] for r in records if r["kind"] == "train"}
            window = range(17, 33)
            row = (
                statistics.median(steps[i] for i in window),
                statistics.median(steps[i] for i in window if i not in SCORED),
                [round(steps[i]) for i in SCORED],
            )
            out[name].append(row)
            print(f"{name} round {round_}: {row[0]:.1f} ms, {row[1]:.1f} ms, {row[2]}", flush=True)
    for name, rows in out.items():
        both = statistics.median(r[0] for r in rows)
        unscored = statistics.median(r[1] for r in rows)
        print(
            f"{name}: median step 17-32 {both:.1f} ms; without iterations 24, 32 {unscored:.1f} ms"
        )


if __name__ == "__main__":
    main()
