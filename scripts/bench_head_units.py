"""Query heads against query groups as attention units, side by side in one invocation.

    python scripts/bench_head_units.py [--tp 2] [--factor 3] [--rank 0] [--hidden-size 512]
                                       [--seq-length 128] [--repeats 2] [--iters 24]
                                       [--mode sharded] [--out results/head_units]

A GQA model with one query group per TP rank (Llama-style: SwiGLU, RoPE, RMSNorm), a persistent
straggler of --factor on TP rank --rank (--mode: what the emulation slows, `sharded` the work the
rank's units carry, `device` all of its compute, as a slow GPU is): one scripts/compare.py
invocation runs migrate and hybrid with whole groups as attention units (the default) and with
one query head per unit (migrate-heads, hybrid-heads: --het-tp-attn-granularity 1), interleaved
round by round, against one plain vanilla baseline; this prints their steady E and step times
side by side. With more ranks than cores the runs are dilated (compare.py --dilation auto). The
report lands in --out/tp<T>-<F>x-rank<R>[-device]/, the side-by-side table in summary.txt there.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

COMPARE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compare.py")


TOKENS = 512  # per step: --micro-batch-size is TOKENS / --seq-length


def model(tp: int, hidden: int, seq: int = 128) -> list[str]:
    """One query group per TP rank, four query heads per group, TOKENS tokens a step."""
    return (
        f"--num-layers 2 --hidden-size {hidden} --num-attention-heads {4 * tp} "
        f"--group-query-attention --num-query-groups {tp} --swiglu "
        f"--ffn-hidden-size {hidden * 11 // 4} --position-embedding-type rope "
        f"--normalization RMSNorm --disable-bias-linear --seq-length {seq} "
        f"--max-position-embeddings {seq} --micro-batch-size {TOKENS // seq} --lr 1e-4 "
        "--mock-data --vocab-size 255 --hidden-dropout 0 --attention-dropout 0"
    ).split()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--factor", type=float, default=3.0, help="the straggler's slowdown")
    p.add_argument("--rank", type=int, default=0, help="the straggling TP rank")
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument(
        "--seq-length",
        type=int,
        default=128,
        help=f"tokens a sequence; a step holds {TOKENS} tokens, so core attention's share of a "
        "step grows with it while its per-call part does not",
    )
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--iters", type=int, default=24)
    p.add_argument(
        "--mode",
        choices=("sharded", "device"),
        default="sharded",
        help="what the emulated straggler slows (hettp/emulate.py)",
    )
    p.add_argument("--out", default="results/head_units")
    a = p.parse_args(argv)
    if not 0 <= a.rank < a.tp:
        p.error(f"--rank {a.rank} is not a TP rank of --tp {a.tp}")
    if a.seq_length < 1 or TOKENS % a.seq_length:
        p.error(f"--seq-length {a.seq_length} must divide the {TOKENS} tokens of a step")
    device = "-device" if a.mode == "device" else ""
    seq = f"-seq{a.seq_length}" if a.seq_length != 128 else ""
    out = os.path.join(a.out, f"tp{a.tp}-{a.factor:g}x-rank{a.rank}{seq}{device}")
    os.makedirs(out, exist_ok=True)
    scenario = os.path.join(out, "scenario.json")
    name = f"persistent-{a.factor:g}x-rank{a.rank}"
    with open(scenario, "w", encoding="utf-8") as f:
        emulate = f"persistent:rank={a.rank},factor={a.factor:g},mode={a.mode}"
        json.dump([{"name": name, "emulate": emulate}], f)
    code = subprocess.call(
        [
            sys.executable,
            COMPARE,
            "--tp",
            str(a.tp),
            "--scenarios",
            f"none,{scenario}",  # none: the baseline (T_fast, C)
            "--policies",
            "migrate,hybrid,migrate-heads,hybrid-heads",
            "--repeats",
            str(a.repeats),
            "--iters",
            str(a.iters),
            "--out",
            out,
            "--",
            *model(a.tp, a.hidden_size, a.seq_length),
        ]
    )
    if code:
        return code
    with open(os.path.join(out, "report.json"), encoding="utf-8") as f:
        rows = {(r["scenario"], r["policy"]): r for r in json.load(f)["rows"]}
    lines = [
        f"head units vs group units: TP={a.tp}, one query group per rank, hidden "
        f"{a.hidden_size}, sequence {a.seq_length}, rank {a.rank} {a.factor:g}x slower "
        f"({a.mode} emulation); steady E (1.0 = the bound) and step ms, medians of "
        f"{a.repeats} interleaved rounds",
        f"{'policy':<8} {'groups E':>9} {'heads E':>8} {'groups ms':>10} {'heads ms':>9} "
        f"{'heads/groups step':>18}",
    ]
    for policy in ("migrate", "hybrid"):
        g, h = rows[(name, policy)], rows[(name, f"{policy}-heads")]
        lines.append(
            f"{policy:<8} {g['E']:>9.3f} {h['E']:>8.3f} {g['step_s'] * 1e3:>10.1f} "
            f"{h['step_s'] * 1e3:>9.1f} {h['step_s'] / g['step_s']:>18.3f}"
        )
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(out, "summary.txt"), "w", encoding="utf-8") as f:
        f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
