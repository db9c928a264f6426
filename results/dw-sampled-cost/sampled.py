"""The dw scorer's observed steps (every 8th: it copies the sharded weights before the step
and reads their change after it) against their neighbours, in two checkouts side by side:
hybrid, no straggler, seed 24157's generalize shape, interleaved rounds.

    python sampled.py ROUNDS OLD_CHECKOUT NEW_CHECKOUT
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile

MODEL = (
    "--num-layers 2 --hidden-size 640 --num-attention-heads 10 --ffn-hidden-size 2560 "
    "--seq-length 128 --max-position-embeddings 128 --micro-batch-size 2 --lr 1e-4 --mock-data "
    "--vocab-size 255 --hidden-dropout 0 --attention-dropout 0 --group-query-attention "
    "--num-query-groups 2 --normalization RMSNorm --position-embedding-type rope "
    "--disable-bias-linear --tensor-model-parallel-size 2 --global-batch-size 2 "
    "--train-iters 48 --eval-iters 0 --log-interval 100 --het-tp-interval 4"
).split()
rounds = int(sys.argv[1])
trees = {"old": sys.argv[2], "new": sys.argv[3]}
out = tempfile.mkdtemp()
res = {k: [] for k in trees}
for r in range(rounds):
    for name in list(trees) if r % 2 == 0 else list(trees)[::-1]:
        root = trees[name]
        m = os.path.join(out, f"{name}.{r}.jsonl")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(29800 + r),
            os.path.join(root, "pretrain_gpt.py"),
            *MODEL,
            "--het-tp-policy",
            "hybrid",
            "--metrics-file",
            m,
        ]
        run = subprocess.run(
            cmd,
            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root),
            capture_output=True,
            text=True,
            cwd=root,
        )
        if run.returncode:
            sys.exit((run.stdout + run.stderr)[-3000:])
        steps = {
            x["iteration"]: x["elapsed_ms"]
            for x in map(json.loads, open(m))
            if x["kind"] == "train"
        }
        sampled = [i for i in range(16, 49, 8)]
        extra = [
            steps[i]
            - statistics.median(
                [steps[i - 2], steps[i - 1], steps[i + 1] if i + 1 in steps else steps[i - 3]]
            )
            for i in sampled
        ]
        med = statistics.median(steps[i] for i in range(9, 49))
        mean = statistics.mean(steps[i] for i in range(9, 49))
        res[name].append((statistics.median(extra), med, mean))
        print(
            f"{name} round {r}: sampled steps +{statistics.median(extra):.1f} ms over "
            f"neighbours; median step {med:.1f}, mean {mean:.1f}",
            flush=True,
        )
for name, rows in res.items():
    print(
        name,
        "median extra",
        f"{statistics.median(r[0] for r in rows):.1f} ms",
        "median step",
        f"{statistics.median(r[1] for r in rows):.1f}",
        "mean step",
        f"{statistics.median(r[2] for r in rows):.1f}",
    )
