"""Balance efficiency of the control loop's policies against vanilla, with one rank 2x slower.

    python scripts/bench_control.py [--tp 4] [--iters 60] [--repeats 3]

TP ranks on CPU, a compute-dominated GPT (hidden 512), one rank emulated 2x slower from the
first step (`--het-tp-emulate persistent:rank=1,factor=2`). Per DESIGN.md "Metrics", measured in
this invocation: T_fast (no straggler, vanilla) and C (the largest per-rank sharded compute per
step in that run), T_ideal = (T_fast - C) + C * n / sum(s_i), E = T_ideal / T, R = (T_vanilla -
T) / (T_vanilla - T_ideal), and the no-straggler overhead of hybrid over vanilla. Steady state:
the median step time over the second half of each run. Runs are interleaved and repeated;
medians are quoted with their spread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from hettp.metrics import read_metrics  # noqa: E402

FACTOR = 2.0
STRAGGLER = 1


def model_flags(tp: int, iters: int, interval: int) -> list[str]:
    return (f"--tensor-model-parallel-size {tp} --num-layers 4 --hidden-size 512 "
            "--num-attention-heads 8 --seq-length 128 --max-position-embeddings 128 "
            "--micro-batch-size 4 --global-batch-size 4 --lr 1e-4 --mock-data --vocab-size 255 "
            f"--hidden-dropout 0 --attention-dropout 0 --train-iters {iters} "
            f"--log-interval {iters} --het-tp-interval {interval}").split()


def configs() -> list[tuple[str, str, list[str]]]:
    slow = ["--het-tp-emulate", f"persistent:rank={STRAGGLER},factor={FACTOR:g}"]
    return [("none", "no", ["--het-tp-policy", "none"]),
            ("hybrid", "no", ["--het-tp-policy", "hybrid"]),
            ("none", "2x", ["--het-tp-policy", "none", *slow]),
            ("resize", "2x", ["--het-tp-policy", "resize", *slow]),
            ("migrate", "2x", ["--het-tp-policy", "migrate", *slow]),
            ("hybrid", "2x", ["--het-tp-policy", "hybrid", *slow])]


def run(tp, iters, interval, extra, path) -> dict:
    if os.path.exists(path):
        os.remove(path)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(tp),
           "--master_port", "29571", os.path.join(ROOT, "pretrain_gpt.py"),
           *model_flags(tp, iters, interval), *extra, "--metrics-file", path]
    proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, cwd=ROOT)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise SystemExit(f"run {extra} failed with exit code {proc.returncode}")
    records = list(read_metrics(path))
    steps = [r["elapsed_ms"] / 1e3 for r in records if r["kind"] == "train"]
    compute = [max(r["compute_s"]) for r in records if r["kind"] == "timing"]
    decisions = [(r["iteration"], r["action"]) for r in records if r["kind"] == "decision"]
    return {"step": statistics.median(steps[len(steps) // 2:]),
            "compute": statistics.median(compute[len(compute) // 2:]),
            "decisions": decisions}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--iters", type=int, default=60)
    p.add_argument("--interval", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=os.path.join(ROOT, "results", "control"))
    a = p.parse_args(argv)
    work = os.path.join(ROOT, "logs", "bench_control")
    os.makedirs(work, exist_ok=True)
    start = time.perf_counter()
    results = {(policy, slow): [] for policy, slow, _ in configs()}
    for repeat in range(a.repeats):
        for policy, slow, extra in configs():  # interleaved
            path = os.path.join(work, f"{policy}-{slow}-{repeat}.jsonl")
            results[(policy, slow)].append(run(a.tp, a.iters, a.interval, extra, path))
            r = results[(policy, slow)][-1]
            print(f"  round {repeat + 1}: {policy:8s} straggler {slow}: step "
                  f"{r['step'] * 1e3:.1f} ms, decisions {r['decisions']}", flush=True)

    def med(key, field="step"):
        return statistics.median(r[field] for r in results[key])

    t_fast = med(("none", "no"))
    c = med(("none", "no"), "compute")
    speeds = [1.0 / FACTOR if r == STRAGGLER else 1.0 for r in range(a.tp)]
    t_ideal = (t_fast - c) + c * a.tp / sum(speeds)
    t_vanilla = med(("none", "2x"))
    lines = [f"control loop, TP={a.tp} on CPU: hidden 512, 8 heads, ffn 2048, 4 layers, 4x128 "
             f"tokens per step, rank {STRAGGLER} emulated {FACTOR:g}x slower from the start; "
             f"{a.iters} iterations, reports every {a.interval}; medians of {a.repeats} "
             f"interleaved runs (steady state: second half)",
             f"T_fast {t_fast * 1e3:.1f} ms, C {c * 1e3:.1f} ms (C/T_fast {c / t_fast:.2f}), "
             f"T_ideal {t_ideal * 1e3:.1f} ms",
             f"{'policy':<8} {'straggler':>9} {'step ms':>8} {'spread ms':>10} {'E':>6} "
             f"{'R':>6} {'vs vanilla':>10}  decisions (first run)"]
    rows = []
    for (policy, slow), runs in results.items():
        t = med((policy, slow))
        spread = max(r["step"] for r in runs) - min(r["step"] for r in runs)
        e = t_ideal / t if slow == "2x" else t_fast / t
        r_value = ((t_vanilla - t) / (t_vanilla - t_ideal)
                   if slow == "2x" and t_vanilla > t_ideal else float("nan"))
        base = t_vanilla if slow == "2x" else t_fast
        rows.append({"policy": policy, "straggler": slow, "step_s": t, "spread_s": spread,
                     "E": e if slow == "2x" else None, "R": r_value if slow == "2x" else None,
                     "vs_vanilla": t / base, "decisions": runs[0]["decisions"],
                     "runs": runs})
        lines.append(f"{policy:<8} {slow:>9} {t * 1e3:>8.1f} {spread * 1e3:>10.1f} "
                     f"{(f'{e:.3f}' if slow == '2x' else '-'):>6} "
                     f"{(f'{r_value:.2f}' if slow == '2x' else '-'):>6} {t / base:>10.3f}  "
                     f"{runs[0]['decisions']}")
    lines.append(f"no-straggler overhead of hybrid vs none: "
                 f"{med(('hybrid', 'no')) / t_fast:.3f}; {len(configs()) * a.repeats} runs in "
                 f"{(time.perf_counter() - start) / 60:.1f} min")
    print("\n".join(lines))
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out + ".txt", "w") as fh:
        fh.write("\n".join(lines) + "\n")
    with open(a.out + ".json", "w") as fh:
        json.dump({"t_fast": t_fast, "c": c, "t_ideal": t_ideal, "t_vanilla": t_vanilla,
                   "rows": rows, "args": vars(a)}, fh, indent=1)


if __name__ == "__main__":
    main()
