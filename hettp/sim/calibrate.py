"""Replay a measured comparison (scripts/compare.py's report.json and its runs' JSONL) in the
simulator and say how far its step times are from the measured ones.

The replay takes from the comparison what a simulation of it needs and nothing of the result:
the model flags, TP size, micro-batches, the control loop's flags of each run, the no-straggler
baseline (T_fast and each rank's timed compute C, which give the seconds per unit and the rest
of the step) and each scenario's speeds: an emulated scenario's pattern (who is slow when) with
the slowdown its vanilla runs measured (the emulation only approximates its nominal factor),
a real-contention scenario's speeds as its vanilla runs measured them per report. Each row's
predicted step time is taken over the iterations its measured one was (report.Run.window).
The rows whose runs gave an input (the vanilla rows: T_fast, the speeds) are `fitted`; the
others are predictions, and `max_rel_error` is over them."""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass

from ..metrics import read_metrics
from ..report import PLAIN, START_UP
from ..scenarios import ScenarioSpec
from .engine import POLICIES, Costs, Layout, Simulation
from .traces import from_factors
from .workload import ModelSpec

# A CPU run keeps fp32 weights and two fp32 Adam moments per parameter (no separate master).
CPU_STATE_BYTES = 12


@dataclass(frozen=True)
class Row:
    scenario: str
    policy: str
    measured_s: float
    predicted_s: float
    fitted: bool  # the row's own runs gave the replay an input (T_fast, or the speeds)

    @property
    def rel_error(self) -> float:
        return abs(self.predicted_s - self.measured_s) / self.measured_s


def _run_args(report_dir: str, row: dict) -> dict:
    path = os.path.join(report_dir, row["runs"][0])
    for record in read_metrics(path, "run"):
        return record["args"]
    raise ValueError(f"{path}: no run record")


def _timing_factors(
    report_dir: str, rows: list[dict], by_step: tuple[float, float] | None = None
) -> dict[int, list[float]]:
    """Report iteration -> per-rank slowdown against the fastest rank, median over the runs:
    of the timed compute, or (`by_step` = (rest, C)) the slowest rank's as the step implies."""
    by_it: dict[int, list[list[float]]] = {}
    for row in rows:
        for path in row["runs"]:
            for record in read_metrics(os.path.join(report_dir, path), "timing"):
                compute = record["compute_s"]
                fastest = min(compute)
                factors = [c / fastest for c in compute]
                if by_step is not None:
                    rest, c = by_step
                    slow = factors.index(max(factors))
                    factors[slow] = max(1.0, (record["step_s"] - rest) / c)
                by_it.setdefault(record["iteration"], []).append(factors)
    return {
        it: [statistics.median(v) for v in zip(*values)] for it, values in sorted(by_it.items())
    }


def scenario_factors(
    spec: dict, measured: dict[int, list[float]], tp: int, iterations: int, interval: int
) -> list[tuple[float, ...]]:
    """Per iteration, per rank: the emulation's pattern at its measured level (module
    docstring); real contention: the measured factors of the report interval each iteration
    falls in; no straggler: full speed."""
    ends = sorted(measured)
    if spec.get("emulate"):
        nominal = ScenarioSpec(spec["name"], spec["emulate"]).factors(tp, iterations)
        levels = []
        for rank in range(tp):
            # reports whose interval was slow throughout (a report holds its steps' medians)
            slow = [
                measured[e][rank]
                for e in ends
                if all(nominal[i - 1][rank] > 1.0 for i in range(max(1, e - interval + 1), e + 1))
            ]
            levels.append(max(1.0, statistics.median(slow)) if slow else None)
        # a rank never slow throughout a report (short bursts) keeps its nominal factor
        return [
            tuple(f if f == 1.0 or levels[r] is None else levels[r] for r, f in enumerate(row))
            for row in nominal
        ]
    if spec.get("noisy_neighbor_rank") is None or not ends:
        return [(1.0,) * tp] * iterations
    out = []
    for i in range(1, iterations + 1):
        end = next((e for e in ends if e >= i), ends[-1])
        out.append(tuple(max(1.0, f) for f in measured[end]))
    return out


def _window(iterations: int, varying: bool) -> list[int]:
    """The iterations the report took the measured step over (report.Run.window)."""
    its = list(range(1, iterations + 1))
    return [i for i in its if i > START_UP] if varying else [i for i in its if i > len(its) // 2]


def replay(path: str, speeds: str = "timed") -> list[Row]:
    with open(path, encoding="utf-8") as f:
        report = json.load(f)
    report_dir = os.path.dirname(os.path.abspath(path))
    if report.get("dp", 1) != 1:
        raise ValueError(
            f"{path}: replays comparisons without data parallelism (dp {report['dp']})"
        )
    tp, iterations = report["tp"], report["iters"]
    rows = report["rows"]
    args = _run_args(report_dir, rows[0])
    if (args.get("pipeline_model_parallel_size") or 1) != 1:
        raise ValueError(f"{path}: replays comparisons without pipeline stages")
    model = ModelSpec.from_megatron_args(
        report["model"],
        state_bytes=CPU_STATE_BYTES,
        mlp_unit=args.get("het_tp_granularity") or 1,
    )
    microbatches = args["global_batch_size"] // args["micro_batch_size"]
    base = report["baseline"]
    compute = base["compute_per_rank_s"]
    # seconds per unit of work: an even rank's timed compute over its work (parameters, and
    # core attention in their terms: it is timed with the units)
    plan = model.even_plan(tp, model.num_layers)
    params = model.unit_work()
    even = sum(len(layer[b][0]) * params[b] for layer in plan.layers for b in params)
    # A rank's compute outside its units (norms, embedding, loss, the optimizer), where the
    # comparison timed all of it: a slow device or a busy neighbour stretches it too.
    busy = base.get("busy_s", max(compute))
    fixed = base.get("fixed_s", 0.0)  # of the timed compute, the optimizer step
    per_param = (max(compute) - fixed) / even / microbatches
    units = {b: per_param * n for b, n in params.items()}
    costs = Costs(
        units,
        ((busy - max(compute)) / microbatches,),
        rest=base["t_fast_s"] - busy,
        optimizer=fixed,
        comm=False,
    )
    specs = {s["name"]: s for s in report["scenarios"]}
    out = []
    for row in rows:
        if row["policy"] not in (PLAIN, *POLICIES):
            continue  # a compare.py variant (head units, a memory cap): not what the replay runs
        spec = specs[row["scenario"]]
        vanilla = [
            r for r in rows if r["scenario"] == row["scenario"] and r["policy"] in (PLAIN, "none")
        ]
        by_step = (base["t_fast_s"] - max(compute), max(compute)) if speeds == "step" else None
        measured = _timing_factors(report_dir, vanilla, by_step)
        run_args = _run_args(report_dir, row)
        factors = scenario_factors(spec, measured, tp, iterations, run_args["het_tp_interval"])
        policy = row["policy"] if row["policy"] != PLAIN else "none"
        real = spec.get("noisy_neighbor_rank") is not None
        sim = Simulation(
            model,
            Layout(tp),
            costs,
            from_factors(factors, row["scenario"]),
            policy,
            microbatches=microbatches,
            interval=run_args["het_tp_interval"],
            detector=dict(
                onset=run_args["het_tp_onset"],
                end=run_args["het_tp_end"],
                patience=run_args["het_tp_patience"],
                window=run_args["het_tp_window"],
                at_once=run_args["het_tp_onset_at_once"],
                end_patience=run_args.get("het_tp_end_patience", 1),
            ),
            max_resize=run_args["het_tp_max_resize"],
            device=real or "mode=device" in (spec.get("emulate") or ""),
        )
        result = sim.run(iterations)
        window = _window(iterations, spec.get("varying", False))
        times = [result.step_s[i - 1] for i in window]
        predicted = (
            statistics.fmean(times) if spec.get("varying", False) else statistics.median(times)
        )
        fitted = row in vanilla  # its runs gave the speeds (and, without a straggler, T_fast)
        out.append(Row(row["scenario"], row["policy"], row["step_s"], predicted, fitted))
    return out
