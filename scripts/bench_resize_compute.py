"""How much compute resizing saves on a straggler: its forward+backward at active fractions.

    python scripts/bench_resize_compute.py [--hidden 1024] [--repeats 5]

One rank (TP=1 holds every unit, as a straggler's shard would), one intra-op thread, thread
CPU time. A step is T(f) = rest + f x sharded work, so with T(0) (every unit skipped: only
embedding, norms, logits and the all-reduce plumbing run) the sharded work at fraction f is
T(f) - T(0). Printed: that work relative to f = 1 (ideal: f) and the whole step's ratio.
Fractions are interleaved and repeated; medians are quoted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--fractions", default="1,0.75,0.5,0.25,0")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=os.path.join(ROOT, "results", "resize_compute"))
    a = p.parse_args(argv)
    if a.repeats < 1:
        p.error(f"--repeats must be >= 1, got {a.repeats}")
    try:
        fractions = [float(f) for f in a.fractions.split(",")]
    except ValueError:
        p.error(f"--fractions {a.fractions!r}: comma-separated numbers in [0, 1]")
    if not {0.0, 1.0} <= set(fractions) or not all(0.0 <= f <= 1.0 for f in fractions):
        p.error(
            "--fractions must include 0 and 1 (the fixed part and the full step), all in [0, 1]"
        )

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import torch

    torch.set_num_threads(1)
    from hettp.resize import skipped_count
    from megatron.hetero.arguments import parse_args
    from megatron.hetero.model import build_gpt_model, transformer_config
    from megatron.hetero.partition import het_blocks
    from megatron.hetero.spec import get_het_gpt_layer_spec
    from megatron.hetero.training import initialize, shutdown

    args = parse_args(
        f"--num-layers {a.layers} --hidden-size {a.hidden} --num-attention-heads "
        f"{a.heads} --seq-length {a.seq} --micro-batch-size {a.batch} --train-iters 1 "
        f"--lr 1e-3 --mock-data --vocab-size 255 --het-tp".split()
    )
    initialize(args)
    try:
        model = build_gpt_model(
            args, transformer_config(args), 256, get_het_gpt_layer_spec(args.normalization, 1)
        )
        blocks = het_blocks(model)
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 256, (a.batch, a.seq), generator=gen)
        position = torch.arange(a.seq).expand_as(tokens)
        mask = torch.triu(torch.ones(1, 1, a.seq, a.seq, dtype=torch.bool), diagonal=1)

        def step():
            model.zero_grad(set_to_none=True)
            start = time.thread_time()
            model(tokens, position, mask, labels=tokens).mean().backward()
            return time.thread_time() - start

        times = {f: [] for f in fractions}
        step()  # warm-up
        for _ in range(a.repeats):
            for f in fractions:  # interleaved
                for block in blocks.values():
                    n = len(block.units)
                    block.set_active(n - skipped_count(n, 1.0 - f))
                times[f].append(step())
        med = {f: statistics.median(v) for f, v in times.items()}
        full = med[1.0] - med[0.0]
        rows = []
        lines = [
            f"resize compute on one rank: hidden {a.hidden}, {a.heads} heads, ffn "
            f"{4 * a.hidden}, {a.layers} layers, {a.batch}x{a.seq} tokens, 1 thread, "
            f"medians of {a.repeats} interleaved",
            f"{'active':>7} {'step/full step':>15} {'sharded work/full':>18} {'ideal':>6}",
        ]
        for f in fractions:
            work = (med[f] - med[0.0]) / full
            rows.append(
                {
                    "active_fraction": f,
                    "step_ratio": med[f] / med[1.0],
                    "sharded_work_ratio": work,
                    "seconds": times[f],
                }
            )
            lines.append(f"{f:>7.2f} {med[f] / med[1.0]:>15.3f} {work:>18.3f} {f:>6.2f}")
        lines.append(f"sharded work share of the full step: {full / med[1.0]:.2f}")
        print("\n".join(lines))
        os.makedirs(os.path.dirname(a.out), exist_ok=True)
        with open(a.out + ".json", "w") as fh:
            json.dump({"config": vars(a), "rows": rows}, fh, indent=1)
        with open(a.out + ".txt", "w") as fh:
            fh.write("\n".join(lines) + "\n")
    finally:
        shutdown()


if __name__ == "__main__":
    main()
