#!/usr/bin/env python
"""Policies side by side against vanilla Megatron, per straggler scenario, in one command.

    python scripts/compare.py [--tp 2] [--dp 1] [--pp 1] [--microbatches M]
                              [--scenarios none,persistent-2x,transient,noisy]
                              [--policies resize,migrate,hybrid] [--repeats 3]
                              [--iters 24] [--interval 4] [--out results/compare]
                              [--dilation auto] [--quick] [-- MEGATRON MODEL FLAGS]

Each (scenario, policy) is a pretrain_gpt.py run on the same seed and mock data; runs are
interleaved (round after round of every configuration, each round in another order:
`round_order`) so machine drift hits all alike. The
baseline, `vanilla`, is plain megatron-core: pretrain_gpt.py with no het-TP flag beyond the
scenario's emulation; its no-straggler runs give T_fast. Policy `none` is the same layers,
timed: its no-straggler runs give C, its real-contention runs the measured speeds, and its
no-straggler row shows what the timing costs; it runs in other scenarios when --policies names
it. All measured here, never taken from a constant. Writes report.md,
report.json, step_time.png and loss.png under --out, and each run's JSONL under --out/runs.

Scenarios are built-in names (none, persistent-2x, persistent-4x, transient, rotating, multi,
noisy, mild, rare-3x, episode, slow-rank-0, several, or all; with --pp also stage-rank-2x and
stage-2x; with --dp also replica-3x and crossed-3x) or JSON files (hettp/scenarios.py). With
--dp > 1 the policies rebatch and joint (heterogeneous data parallelism) can run, and T_ideal
pools every rank of the job.
`noisy` is real contention: a busy process
(scripts/noisy_neighbor.py) on rank 1's core; it needs a core per rank. Every rank is pinned to
a core (rank % cores); with more ranks than cores every run gets --het-tp-emulate-dilation
(--dilation), so each rank's sharded GEMMs take the time of a device of its own. The compute
timer (--het-tp-timer) is thread CPU time, immune to the machine's own jitter, except in
real-contention scenarios, which only wall-clock time (with collective waits left out) can
see. Model flags after `--` replace the default model (a compute-dominated GPT: hidden 512,
ffn 2048, 2 layers, 4x128 tokens per micro-batch); flags this script sets itself are refused
there.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import platform
import shlex
import socket
import subprocess
import sys
import time
from datetime import datetime, timezone

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from hettp.emulate import ScenarioError  # noqa: E402
from hettp.metrics import read_metrics  # noqa: E402
from hettp.policy import POLICIES as POLICY_TABLE  # noqa: E402
from hettp.policy import compared_policies  # noqa: E402
from hettp.report import PLAIN, VANILLA, Run, compare, markdown  # noqa: E402
from hettp.scenarios import resolve  # noqa: E402

POLICIES = tuple(compared_policies())
# Variants compared side by side with their policy: (its --het-tp-policy, the flags they add).
# With --pp: migrate with only one kind of move (plain `migrate` moves units and layers).
PIPELINE_VARIANTS = {
    "migrate-units": ("migrate", ["--het-tp-pipeline-moves", "units"]),
    "migrate-layers": ("migrate", ["--het-tp-pipeline-moves", "layers"]),
}
# Query heads as attention units (a GQA model's groups split over ranks; whole groups without).
HEAD_VARIANTS = {
    "migrate-heads": ("migrate", ["--het-tp-attn-granularity", "1"]),
    "hybrid-heads": ("hybrid", ["--het-tp-attn-granularity", "1"]),
}
# Moves within a cap on a rank's unit state (--het-tp-memory-cap, at compare's --memory-cap).
MEMORY_VARIANTS = {
    "migrate-capped": ("migrate", ["--het-tp-memory-cap"]),
    "hybrid-capped": ("hybrid", ["--het-tp-memory-cap"]),
}
VARIANTS = {**PIPELINE_VARIANTS, **HEAD_VARIANTS, **MEMORY_VARIANTS}
OWN_FLAGS = (
    "--tensor-model-parallel-size",
    "--pipeline-model-parallel-size",
    "--train-iters",
    "--het-tp-policy",
    "--het-tp-emulate",
    "--het-tp-interval",
    "--het-tp-timer",
    "--metrics-file",
    "--seed",
    "--log-interval",
    "--global-batch-size",
    "--save",
    "--load",
    "--het-tp-emulate-dilation",
    "--het-tp-pipeline-moves",
)
# compare.py's runs count iterations (--iters): no sample-based length, schedule or ramp
SAMPLE_FLAGS = (
    "--train-samples",
    "--lr-decay-samples",
    "--lr-warmup-samples",
    "--rampup-batch-size",
)


def model_flags(quick: bool) -> list[str]:
    if quick:
        return (
            "--num-layers 2 --hidden-size 128 --num-attention-heads 4 --seq-length 64 "
            "--max-position-embeddings 64 --micro-batch-size 2 --lr 1e-3 --mock-data "
            "--vocab-size 255 --hidden-dropout 0 --attention-dropout 0"
        ).split()
    return (
        "--num-layers 2 --hidden-size 512 --num-attention-heads 8 --ffn-hidden-size 2048 "
        "--seq-length 128 --max-position-embeddings 128 --micro-batch-size 4 --lr 1e-4 "
        "--mock-data --vocab-size 255 --hidden-dropout 0 --attention-dropout 0"
    ).split()


def _flag_value(flags: list[str], name: str, default: str | None) -> str | None:
    """The value of Megatron flag `name` in `flags` (`--name value` or `--name=value`; the
    last one given wins, as argparse takes it)."""
    value = default
    for i, flag in enumerate(flags):
        if flag == name and i + 1 < len(flags):
            value = flags[i + 1]
        elif flag.startswith(name + "="):
            value = flag.split("=", 1)[1]
    return value


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


# Every rank forks from a server that imported these once: a fresh interpreter spent about 8 s
# of each launch importing torch and megatron-core (a third of the default comparison's time).
# The server never initialises anything, so each run still starts from a clean slate.
# pretrain_gpt comes first: it silences megatron-core's import-time warnings about GPU extras.
PRELOAD = ["pretrain_gpt", "megatron.hetero.training"]


def _rank(env: dict, core: int, log_path: str, argv: list[str]) -> None:
    """One pretrain_gpt.py rank: torchrun's variables, its own core, output into the run's log."""
    os.environ.update(env)
    os.sched_setaffinity(0, {core})
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    import torch

    torch.set_num_threads(1)  # the server loaded OpenMP before OMP_NUM_THREADS was set here
    import pretrain_gpt

    pretrain_gpt.main(argv)


class Progress:
    """One status line: run k of n, elapsed, ETA, and the running job's iteration."""

    def __init__(self, total: int):
        self.total, self.done, self.start = total, 0, time.monotonic()
        self.tty = sys.stdout.isatty()

    def _clock(self, seconds: float) -> str:
        seconds = int(seconds)
        return f"{seconds // 60:02d}:{seconds % 60:02d}"

    def show(self, label: str, iteration: int, iterations: int, final: bool = False) -> None:
        elapsed = time.monotonic() - self.start
        finished = self.done + int(final)
        eta_text = (
            self._clock(elapsed / finished * (self.total - finished)) if finished else "--:--"
        )
        line = (
            f"[{self.done + 1:3d}/{self.total}  {self._clock(elapsed)} "
            f"eta {eta_text}] {label}: iteration {iteration}/{iterations}"
        )
        if self.tty:
            sys.stdout.write("\r" + line.ljust(100) + ("\n" if final else ""))
            sys.stdout.flush()
        elif final:
            print(line, flush=True)


def _timer(scenario) -> str:
    """CPU time does not see a busy neighbour; wall time also sees a shared VM's jitter (on a
    2-core VM it made a steady cluster look 1.3-1.5x uneven in a third of the runs)."""
    return "wall" if scenario.real else "cpu"


def _iterations_done(path: str) -> int:
    """Train records written so far (complete lines only: the run is still writing)."""
    try:
        with open(path, encoding="utf-8") as f:
            return sum(1 for line in f if line.endswith("\n") and '"kind": "train"' in line)
    except FileNotFoundError:
        return 0


def launch(
    a, flags: list[str], path: str, neighbor_core: int | None, label: str, progress: Progress
) -> None:
    """Run pretrain_gpt.py on tp x dp pinned ranks (rank i on core i % cores); wait, showing
    progress; raise SystemExit naming the run if any rank fails."""
    world = a.tp * a.dp * a.pp
    cores = _cores()
    for stale in (path, path[: -len(".jsonl")] + ".log"):
        if os.path.exists(stale):
            os.remove(stale)
    port = _free_port()
    log_path = path[: -len(".jsonl")] + ".log"
    log = open(log_path, "w")
    neighbor = None
    if neighbor_core is not None:
        neighbor = subprocess.Popen(
            [
                sys.executable,
                os.path.join(ROOT, "scripts", "noisy_neighbor.py"),
                "--cpu",
                str(neighbor_core),
                "--duration",
                "86400",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    ranks = multiprocessing.get_context("forkserver")
    ranks.set_forkserver_preload(PRELOAD)
    procs, timed_out = [], False
    try:
        for rank in range(world):
            env = dict(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world),
                LOCAL_WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                OMP_NUM_THREADS="1",
            )
            procs.append(
                ranks.Process(
                    target=_rank,
                    name=f"rank{rank}",
                    args=(
                        env,
                        cores[rank % len(cores)],
                        log_path,
                        [*flags, "--metrics-file", path],
                    ),
                )
            )
            procs[-1].start()
        deadline = time.monotonic() + a.run_timeout
        while any(p.exitcode is None for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs):
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            progress.show(label, _iterations_done(path), a.iters)
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.exitcode is None:
                p.kill()
        if neighbor is not None:
            neighbor.terminate()
            neighbor.wait()
        log.close()
    for p in procs:
        p.join()
    codes = [p.exitcode for p in procs]
    if any(codes):
        with open(log_path) as f:
            sys.stderr.write(f.read()[-4000:])
        why = (
            f"ran past --run-timeout {a.run_timeout:g} s and was stopped" if timed_out else "failed"
        )
        raise SystemExit(f"compare: run {label} {why} (exit codes {codes}); log {log_path}")
    progress.show(label, a.iters, a.iters, final=True)


def _check_ran_as(a, scenario, policy: str, path: str) -> None:
    """--report-only: the run at `path` ran with this command's layout, length and scenario
    (the report is built from the flags: a report of 48 iterations over runs of 24 failed, one
    at --tp 2 over runs at --tp 4 bounded them wrongly, silently). Exits naming the flag."""
    with open(path) as f:
        first = json.loads(f.readline() or "{}")
    ran = first.get("args", {})
    for flag, want, key in (
        ("--tp", a.tp, "tensor_model_parallel_size"),
        ("--pp", a.pp, "pipeline_model_parallel_size"),
        ("--iters", a.iters, "train_iters"),
        ("--interval", a.interval, "het_tp_interval"),
        ("--scenarios", scenario.emulate, "het_tp_emulate"),
    ):
        if key == "het_tp_interval" and policy == PLAIN:
            continue  # nothing is timed or reported there (compare.sbatch does not pass it)
        if key in ran and ran[key] != want:
            raise SystemExit(
                f"compare: --report-only {flag}: {path} ran with {key} {ran[key]!r}, this "
                f"command gives {want!r}: pass the flags the runs were made with (report.json's "
                "command)"
            )
    if first.get("data_parallel_size", a.dp) != a.dp:
        raise SystemExit(
            f"compare: --report-only --dp: {path} ran {first['data_parallel_size']} replicas, "
            f"this command gives {a.dp}: pass the flags the runs were made with"
        )


def parse(argv):
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    p.add_argument("--dp", type=int, default=1, help="data-parallel size")
    p.add_argument(
        "--pp",
        type=int,
        default=1,
        help="pipeline stages (--pipeline-model-parallel-size; the model's layers split evenly)",
    )
    p.add_argument(
        "--microbatches",
        type=int,
        default=None,
        help="micro-batches per step and replica (default 1; 2 x --pp with pipeline stages, so "
        "that 1F1B reaches its steady state; 4 with --dp > 1, so that replicas can be "
        "rebatched)",
    )
    p.add_argument(
        "--scenarios",
        default=None,
        help="comma-separated built-in names and/or JSON files "
        "(default: none,persistent-2x,transient,noisy; with --dp > 1 none,replica-3x,crossed-3x)",
    )
    p.add_argument(
        "--policies",
        default=None,
        help=f"comma-separated from {', '.join(POLICIES)}, {', '.join(HEAD_VARIANTS)} (the "
        "policy with query heads as attention units, --het-tp-attn-granularity 1), "
        f"{', '.join(MEMORY_VARIANTS)} (the policy within --memory-cap) (with --pp "
        f"also {', '.join(PIPELINE_VARIANTS)}: migrate moving only TP units inside stages, or "
        "only layers between them; migrate does both); plain vanilla always runs, and "
        "none (timed vanilla) where C or real speeds come from it (default: "
        "resize,migrate,hybrid; with --dp > 1 migrate,rebatch,joint)",
    )
    p.add_argument(
        "--memory-cap",
        type=float,
        default=1.25,
        metavar="F",
        help="--het-tp-memory-cap of the -capped policies: no rank holds more than F times "
        "the even split's unit state (default 1.25)",
    )
    p.add_argument("--repeats", type=int, default=None, help="rounds of every run (default 3)")
    p.add_argument("--iters", type=int, default=None, help="iterations per run (default 24)")
    p.add_argument(
        "--interval", type=int, default=None, help="--het-tp-interval of every run (default 4)"
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=None, help="output folder (default results/compare)")
    p.add_argument(
        "--report-only",
        action="store_true",
        help="launch nothing: rebuild the report from the runs already in --out/runs",
    )
    p.add_argument(
        "--dilation",
        default="auto",
        help="--het-tp-emulate-dilation of every run: 'auto' (1 with a core per "
        "rank, else 1.5 x the ranks on the busiest core, so that each rank "
        "behaves as if it had its own device) or a number >= 1",
    )
    p.add_argument("--run-timeout", type=float, default=900.0, help="seconds per run")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a tiny model, 12 iterations, scenarios none,persistent-4x,noisy, "
        "policy migrate, 2 rounds: the whole path in under a minute on 2 cores",
    )
    a = p.parse_args(argv)
    # --quick includes the real-contention path when each of its 2 ranks can have a core
    quick = dict(
        # 4x: on the tiny model a 2x straggle of the sharded GEMMs reads 1.5-1.8x, so whether
        # the planner acts in 12 steps was up to the VM's noise
        scenarios="none,persistent-4x" + (",noisy" if len(_cores()) >= 2 else ""),
        policies="migrate",
        repeats=2,
        iters=12,
        interval=3,
        out=os.path.join(ROOT, "results", "compare-quick"),
    )
    full = dict(
        scenarios="none,persistent-2x,transient,noisy",
        policies="resize,migrate,hybrid",
        repeats=3,
        iters=24,
        interval=4,
        out=os.path.join(ROOT, "results", "compare"),
    )
    if a.dp > 1 and a.tp > 1:
        full.update(scenarios="none,replica-3x,crossed-3x", policies="migrate,rebatch,joint")
        quick.update(scenarios="none,replica-3x", policies="rebatch")
    elif a.dp > 1:  # one rank a replica: nothing to split within it, only micro-batches to move
        full.update(scenarios="none,replica-3x", policies="rebatch")
        quick.update(scenarios="none,replica-3x", policies="rebatch")
    for key, value in (quick if a.quick else full).items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    for name, value, low in (
        ("--tp", a.tp, 1),
        ("--dp", a.dp, 1),
        ("--pp", a.pp, 1),
        ("--repeats", a.repeats, 1),
        ("--iters", a.iters, 4),
        ("--interval", a.interval, 1),
    ):
        if value < low:
            p.error(f"{name} must be >= {low}, got {value}")
    if not 0 < a.run_timeout < math.inf:
        p.error(f"--run-timeout must be a positive number of seconds, got {a.run_timeout:g}")
    if a.microbatches is None:
        a.microbatches = 2 * a.pp if a.pp > 1 else 4 if a.dp > 1 else 1
    if a.microbatches < 1:
        p.error(f"--microbatches must be >= 1, got {a.microbatches}")
    if a.pp > 1 and a.dp > 1:  # scenarios map global ranks to (stage, TP rank) with one replica
        p.error("--pp with --dp > 1: a comparison runs pipeline stages of one replica for now")
    if 2 * a.interval > a.iters:
        p.error(f"--interval {a.interval} leaves fewer than two reports in --iters {a.iters}")
    policies = [x.strip() for x in a.policies.split(",") if x.strip()]
    known = (
        POLICIES
        + tuple(HEAD_VARIANTS)
        + tuple(MEMORY_VARIANTS)
        + (tuple(PIPELINE_VARIANTS) if a.pp > 1 else ())
    )
    bad = [x for x in policies if x not in known]
    rebatching = [x for x in policies if x in known and POLICY_TABLE[_base(x)].rebatches]
    if rebatching and a.dp == 1:
        p.error(f"--policies {', '.join(rebatching)}: needs --dp > 1 (data-parallel replicas)")
    if bad:
        staged = [x for x in bad if x in PIPELINE_VARIANTS]
        if staged:
            p.error(f"--policies {', '.join(staged)}: needs --pp > 1 (moves of pipeline stages)")
        p.error(f"--policies: unknown {', '.join(bad)}; choose from {', '.join(known)}")
    if a.memory_cap < 1.0:
        p.error(f"--memory-cap {a.memory_cap}: below 1 not even the even split fits")
    # plain vanilla in every scenario; timed vanilla where C or real speeds come from it, and
    # everywhere when asked for
    a.timed_everywhere = VANILLA in policies
    a.policy_list = [PLAIN, VANILLA] + [x for x in dict.fromkeys(policies) if x != VANILLA]
    try:
        a.scenario_list = resolve(a.scenarios, a.tp, a.iters, stages=a.pp, replicas=a.dp)
    except ScenarioError as err:
        p.error(str(err))
    if "none" not in [s.name for s in a.scenario_list]:  # T_fast and C come from it
        a.scenario_list.insert(0, resolve("none", a.tp, a.iters)[0])
    taken = [f for f in extra if f.split("=")[0] in OWN_FLAGS]
    if taken:
        p.error(f"model flags after -- may not set {', '.join(taken)}: compare.py sets them")
    samples = [f for f in extra if f.split("=")[0] in SAMPLE_FLAGS]
    if samples:
        p.error(
            f"model flags after -- may not set {', '.join(samples)}: compare.py's runs count "
            "iterations (--iters)"
        )
    a.model = extra or model_flags(a.quick)
    layers = int(_flag_value(a.model, "--num-layers", "1"))
    if layers % a.pp:
        p.error(f"--pp {a.pp}: the model's --num-layers {layers} do not split evenly over it")
    world = a.tp * a.dp * a.pp
    if a.dp > 1 and any(s.real for s in a.scenario_list):
        p.error("real-contention scenarios with --dp > 1: compare.py bounds them by one replica")
    if a.report_only:  # nothing runs here: this machine's cores do not bound the runs
        # how the runs were dilated comes from the previous report.json where there is one
        a.dilation = 1.0 if a.dilation == "auto" else _dilation(p, a.dilation, world, world)
        return a
    if world > len(_cores()) and any(s.real for s in a.scenario_list):
        p.error(
            f"real-contention scenarios need a core per rank: {world} ranks, {len(_cores())} cores"
        )
    a.dilation = _dilation(p, a.dilation, world, len(_cores()))
    if a.dilation > 1 and any(s.device(a.tp) for s in a.scenario_list):
        p.error(
            f"--dilation {a.dilation:g}: device-mode scenarios slow each rank by its own CPU "
            "time between collectives and need a core per rank (--dilation 1)"
        )
    if a.dilation > 1 and any(s.real for s in a.scenario_list):
        p.error(
            f"--dilation {a.dilation:g} stretches CPU time, which a busy neighbour does not "
            "show; real-contention scenarios need --dilation 1"
        )
    return a


def _base(policy: str) -> str:
    """The --het-tp-policy of a compared policy (a variant's is the policy it varies)."""
    return VARIANTS[policy][0] if policy in VARIANTS else policy


def _variant_flags(policy: str, a) -> list[str]:
    """The flags a variant adds to its policy's (none for a policy itself)."""
    if policy not in VARIANTS:
        return []
    flags = list(VARIANTS[policy][1])
    if policy not in MEMORY_VARIANTS:
        return flags
    # a cap bounds the units a rank holds: with stages, whole layers would move past it
    stages = ["--het-tp-pipeline-moves", "units"] if a.pp > 1 else []
    return [*flags, str(a.memory_cap), *stages]


def _layout(a) -> str:
    text = f"TP={a.tp} DP={a.dp}"
    if a.pp > 1:
        text += f" PP={a.pp} ({a.microbatches} micro-batches per step)"
    return text


def _dilation(p, value: str, world: int, cores: int) -> float:
    """Ranks sharing a core take turns, so a sleeping straggler lends its core to the others
    and costs vanilla nothing; stretching each GEMM past ranks-per-core times its CPU time
    (timing.py) gives every rank the time of a device of its own."""
    if value == "auto":  # rank r runs on core r % cores
        return 1.0 if world <= cores else 1.5 * math.ceil(world / cores)
    try:
        dilation = float(value)
    except ValueError:
        dilation = 0.0
    if not 1.0 <= dilation < math.inf:
        p.error(f"--dilation must be 'auto' or a number >= 1, got {value!r}")
    return dilation


def round_order(configs: list, repeat: int, repeats: int) -> list:
    """Round `repeat`'s order of `configs`: the list rotated by that round's share of its
    length, and reversed in odd rounds. Each configuration takes another place, and runs
    after another one, from one round to the next: a drift within rounds, or what one run
    leaves the next, falls on all alike over the rounds."""
    shift = repeat * len(configs) // max(repeats, 1)
    order = configs[shift:] + configs[:shift]
    return order[::-1] if repeat % 2 else order


def main(argv=None) -> int:
    a = parse(argv)
    command = " ".join(
        ["python scripts/compare.py"]
        + [shlex.quote(x) for x in (sys.argv[1:] if argv is None else argv)]
    )
    runs_dir = os.path.join(a.out, "runs")
    os.makedirs(runs_dir, exist_ok=True)
    cores = _cores()
    micro = int(_flag_value(a.model, "--micro-batch-size", "1"))
    common = [
        *a.model,
        "--tensor-model-parallel-size",
        str(a.tp),
        "--pipeline-model-parallel-size",
        str(a.pp),
        "--global-batch-size",
        str(micro * a.dp * a.microbatches),
        "--train-iters",
        str(a.iters),
        "--log-interval",
        str(a.iters),
        "--het-tp-interval",
        str(a.interval),
        "--seed",
        str(a.seed),
    ]
    if a.dilation > 1:
        common += ["--het-tp-emulate-dilation", f"{a.dilation:g}"]
    if _flag_value(a.model, "--eval-iters", None) is None:
        # compared runs measure training; a finished run would evaluate Megatron-LM's default
        # 100 batches twice (validation, test). Model flags that set --eval-iters still do
        common += ["--eval-iters", "0"]
    configs = [
        (s, policy)
        for s in a.scenario_list
        for policy in a.policy_list
        if policy != VANILLA or a.timed_everywhere or s.name == "none" or s.real
    ]
    progress = Progress(len(configs) * a.repeats)
    print(
        f"compare: {_layout(a)}, {len(a.scenario_list)} scenarios, policies "
        f"{', '.join(a.policy_list)}, {a.repeats} rounds = {progress.total} runs of "
        f"{a.iters} iterations; ranks pinned to cores {cores}",
        flush=True,
    )
    start = time.monotonic()
    runs = []
    for repeat in range(a.repeats):  # interleaved: every configuration once per round
        for scenario, policy in round_order(configs, repeat, a.repeats):
            # plain vanilla: static, no het-TP layers; timed only where its emulation needs it
            het_policy = "static" if policy == PLAIN else _base(policy)
            flags = [*common, "--het-tp-policy", het_policy, "--het-tp-timer", _timer(scenario)]
            flags += _variant_flags(policy, a)
            if scenario.emulate:
                flags += ["--het-tp-emulate", scenario.emulate]
            path = os.path.join(runs_dir, f"{scenario.name}.{policy}.{repeat}.jsonl")
            neighbor_core = cores[scenario.neighbor_rank % len(cores)] if scenario.real else None
            if not a.report_only:
                launch(
                    a,
                    flags,
                    path,
                    neighbor_core,
                    f"{scenario.name} / {policy} / round {repeat + 1}",
                    progress,
                )
            elif not os.path.exists(path):
                raise SystemExit(f"compare: --report-only but {path} is missing")
            else:
                _check_ran_as(a, scenario, policy, path)
            progress.done += 1
            runs.append(
                Run.from_records(
                    read_metrics(path), scenario.name, policy, repeat, os.path.relpath(path, a.out)
                )
            )
    minutes = (time.monotonic() - start) / 60
    previous = os.path.join(a.out, "report.json")
    provenance = {}
    if a.report_only and os.path.exists(previous):  # keep when, where and how long they ran
        with open(previous) as f:
            provenance = json.load(f)
        minutes, command = provenance.get("minutes", minutes), provenance.get("command", command)
    dilation = provenance.get("dilation", a.dilation)  # how the runs ran, not this machine
    factors = {s.name: s.factors(a.tp, a.iters, a.pp, a.dp) for s in a.scenario_list}
    varying = {s.name: s.varying(a.tp, a.iters, a.pp, a.dp) for s in a.scenario_list}
    device = {s.name for s in a.scenario_list if s.emulate and s.emulation(a.tp).mode == "device"}
    result = compare(
        runs, factors, varying, {s.name for s in a.scenario_list if s.real}, device, a.dp
    )
    machine = (
        f"{platform.node()}: {len(os.sched_getaffinity(0))} cores "
        f"({platform.processor() or platform.machine()}), Python "
        f"{platform.python_version()}"
    )
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine, date = provenance.get("machine", machine), provenance.get("date", date)
    scenario_lines = [
        f"- `{s.name}`: {s.about or s.emulate or 'custom'}"
        + (f" (`--het-tp-emulate {s.emulate}`)" if s.emulate else "")
        + (", mean over the run" if varying[s.name] else "")
        + f"; compute timer {_timer(s)}; T_ideal from {result['speeds_from'][s.name]} speeds"
        for s in a.scenario_list
    ]
    header = [
        f"# het-TP vs vanilla: {_layout(a)}",
        "",
        f"`{command}` on {date}, {machine}; {progress.total} runs in {minutes:.1f} min.",
        f"Model: `{' '.join(a.model)}`; {a.iters} iterations per run, reports every "
        f"{a.interval}; medians over {a.repeats} interleaved rounds (spread = max - min); "
        "step time = median of the second half, or the mean after iteration 2 where "
        "who is slow changes."
        + (
            f" Each sharded GEMM is stretched to {dilation:g}x its CPU time "
            "(`--het-tp-emulate-dilation`): with more ranks than cores, a sleeping "
            "straggler would otherwise lend its core to the others."
            if dilation > 1
            else ""
        )
        + (
            f" {a.pp} pipeline stages: units move inside a stage only, so T_ideal is the "
            "slowest stage's balanced step."
            if a.pp > 1
            else ""
        ),
        "",
        *scenario_lines,
        "",
    ]
    with open(os.path.join(a.out, "report.md"), "w") as f:
        f.write("\n".join(header) + "\n" + markdown(result))
    with open(os.path.join(a.out, "report.json"), "w") as f:
        json.dump(
            {
                "command": command,
                "date": date,
                "machine": machine,
                "minutes": minutes,
                "tp": a.tp,
                "dp": a.dp,
                "pp": a.pp,
                "microbatches": a.microbatches,
                "iters": a.iters,
                "interval": a.interval,
                "repeats": a.repeats,
                "model": a.model,
                "dilation": dilation,
                "scenarios": [
                    {
                        "name": s.name,
                        "emulate": s.emulate,
                        "timer": _timer(s),
                        "noisy_neighbor_rank": s.neighbor_rank,
                        "about": s.about,
                        "varying": varying[s.name],
                    }
                    for s in a.scenario_list
                ],
                **result,
            },
            f,
            indent=1,
        )
    from hettp.plots import plot

    plot(
        runs,
        result["speeds"],
        result["baseline"],
        result["bounds"],
        os.path.join(a.out, "step_time.png"),
        os.path.join(a.out, "loss.png"),
    )
    print(markdown(result))
    print(
        f"compare: {progress.total} runs in {minutes:.1f} min; report in "
        f"{os.path.relpath(a.out, os.getcwd())}/report.md, report.json, step_time.png, "
        "loss.png",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
