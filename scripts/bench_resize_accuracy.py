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
import time

from corpus_runs import ROOT, CorpusRun, byte_gpt_flags, ensure_corpus, train


def model_flags(iters: int) -> list[str]:
    return byte_gpt_flags(iters, micro_batch=16, tp=2)


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


def summary(run: CorpusRun) -> dict:
    resize = run.first("resize")
    return {
        **run.summary(),
        "asked": resize["shares"][1] if resize else 0.0,
        "realized": resize["realized"][1] if resize else 0.0,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=400)
    p.add_argument("--out", default=os.path.join(ROOT, "results", "resize_accuracy"))
    p.add_argument("--only", default=None, help="comma-separated run names (default: all)")
    a = p.parse_args(argv)
    ensure_corpus()
    work = os.path.join(ROOT, "logs", "bench_resize_accuracy")
    os.makedirs(work, exist_ok=True)
    chosen = runs()
    if a.only:
        chosen = {k: v for k, v in chosen.items() if k in a.only.split(",") or k == "vanilla"}
    total = time.perf_counter()
    results = []
    for name, extra in chosen.items():
        results.append(summary(train(name, model_flags(a.iters), extra, work, 29561)))
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
