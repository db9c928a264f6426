"""What resizing costs in accuracy: final eval loss of vanilla vs resize, per share and scorer.

    python scripts/bench_resize_accuracy.py [--iters 400] [--out results/resize_accuracy]

A small byte-level GPT on the indexed standard-library text (built first if missing: `make
corpus`), TP=2 on CPU, same seed and data for every run (one more vanilla run with another
seed shows the run-to-run spread). Rank 1 skips 10%, 25% or 50% of its
units for the whole run, with each priority scorer (dw, magnitude, wg), plus the paper's
public-code baseline (`--het-tp-policy zero`: a fixed 50% cut by accumulated |dW|, skipped
gradients imputed). The cosine schedule decays to --min-lr by the end, where the loss has
flattened. Prints a table and writes it (.txt, .json).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from hettp.metrics import read_metrics  # noqa: E402

CORPUS = os.path.join(ROOT, "data", "stdlib_text_document")


def model_flags(iters: int) -> list[str]:
    return (
        "--tensor-model-parallel-size 2 --num-layers 2 --hidden-size 64 "
        "--num-attention-heads 8 --seq-length 128 --max-position-embeddings 128 "
        "--micro-batch-size 16 --global-batch-size 16 --lr 5e-3 --min-lr 5e-4 "
        "--lr-decay-style cosine --lr-warmup-iters 30 --weight-decay 0.1 "
        "--hidden-dropout 0 --attention-dropout 0 --tokenizer-type ByteLevelTokenizer "
        f"--split 98,2,0 --log-interval 100 --eval-iters 20 --train-iters {iters} "
        f"--eval-interval {iters // 4} --data-path {CORPUS}"
    ).split()


def runs() -> dict:
    # The second vanilla run differs only in its seed: the spread a resize must be read against.
    out = {"vanilla": [], "vanilla, another seed": ["--seed", "4321"]}
    for share in (0.1, 0.25, 0.5):
        for scorer in ("dw", "magnitude", "wg"):
            out[f"resize {share:.0%} {scorer}"] = [
                "--het-tp-resize",
                f"0,{share}",
                "--het-tp-priority",
                scorer,
            ]
    out["paper baseline (zero) 50% dw"] = ["--het-tp-policy", "zero", "--het-tp-resize", "0,0.5"]
    return out


def train(name, extra, iters, out_dir) -> dict:
    metrics = os.path.join(
        out_dir, re.sub(r"[^A-Za-z0-9]+", "_", name.replace("%", "pct")) + ".jsonl"
    )
    if os.path.exists(metrics):
        os.remove(metrics)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        "29561",
        os.path.join(ROOT, "pretrain_gpt.py"),
        *model_flags(iters),
        *extra,
        "--metrics-file",
        metrics,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise SystemExit(f"run '{name}' failed with exit code {proc.returncode}")
    records = list(read_metrics(metrics))
    evals = {r["iteration"]: r["lm_loss"] for r in records if r["kind"] == "eval"}
    train_losses = [r["lm_loss"] for r in records if r["kind"] == "train"]
    resize = next((r for r in records if r["kind"] == "resize"), None)
    tail = train_losses[-max(1, len(train_losses) // 10) :]
    return {
        "name": name,
        "flags": extra,
        "evals": evals,
        "final_eval": evals[max(evals)],
        "train_tail": sum(tail) / len(tail),
        "asked": resize["shares"][1] if resize else 0.0,
        "realized": resize["realized"][1] if resize else 0.0,
        "seconds": time.perf_counter() - start,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=400)
    p.add_argument("--out", default=os.path.join(ROOT, "results", "resize_accuracy"))
    p.add_argument("--only", default=None, help="comma-separated run names (default: all)")
    a = p.parse_args(argv)
    if not os.path.exists(CORPUS + ".bin"):
        subprocess.run(
            [
                sys.executable,
                os.path.join(ROOT, "scripts", "preprocess_data.py"),
                "--stdlib",
                "--output-prefix",
                os.path.join(ROOT, "data", "stdlib"),
                "--max-bytes",
                "8000000",
            ],
            check=True,
        )
    work = os.path.join(ROOT, "logs", "bench_resize_accuracy")
    os.makedirs(work, exist_ok=True)
    chosen = runs()
    if a.only:
        chosen = {k: v for k, v in chosen.items() if k in a.only.split(",") or k == "vanilla"}
    total = time.perf_counter()
    results = []
    for name, extra in chosen.items():
        results.append(train(name, extra, a.iters, work))
        r = results[-1]
        print(f"  {name}: final eval loss {r['final_eval']:.4f} ({r['seconds']:.0f} s)", flush=True)

    base = results[0]["final_eval"]
    evals_at = sorted(results[0]["evals"])
    lines = [
        f"resize accuracy: byte-level GPT (2 layers, hidden 64, 8 heads, ffn 256), stdlib "
        f"corpus, TP=2, {a.iters} iterations x 16 sequences of 128 bytes, rank 1 resized "
        f"for the whole run",
        f"{'run':<30} {'skipped (asked/realized)':>24} {'final eval':>10} "
        f"{'vs vanilla':>10} {'train (last 10%)':>16}   eval at "
        + " ".join(str(i) for i in evals_at),
    ]
    for r in results:
        share = f"{r['asked']:.0%}/{r['realized']:.1%}"
        curve = " ".join(f"{r['evals'][i]:.3f}" for i in evals_at)
        lines.append(
            f"{r['name']:<30} {share:>24} {r['final_eval']:>10.4f} "
            f"{r['final_eval'] / base:>10.4f} {r['train_tail']:>16.4f}   {curve}"
        )
    lines.append(
        "'vs vanilla' is the ratio of final eval losses (1.0 = no accuracy cost; the "
        "other seed shows the run-to-run spread); 'realized' is the share of rank 1's "
        "unit parameters skipped (counts round down)."
    )
    lines.append(f"{len(results)} runs in {(time.perf_counter() - total) / 60:.1f} min")
    print("\n".join(lines))
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out + ".txt", "w") as fh:
        fh.write("\n".join(lines) + "\n")
    with open(a.out + ".json", "w") as fh:
        json.dump(
            {"iters": a.iters, "model_flags": model_flags(a.iters), "runs": results}, fh, indent=1
        )


if __name__ == "__main__":
    main()
