"""Side-by-side metrics of policies against vanilla, from the runs' JSONL records.

Definitions are DESIGN.md "Metrics": T_fast and C come from the no-straggler vanilla runs of the
same invocation, T_ideal(t) = (T_fast - C) + C * n / sum(s_i(t)), E = T_ideal / T,
R = (T_vanilla - T) / (T_vanilla - T_ideal). A run's step time T is the median over its second
half (steady state), or the mean over the whole run after its first step where who is slow
changes during the run (then T_ideal is averaged over the same steps). Per policy the median
over repeats is reported with the spread (max - min). Pure: no process group, no megatron.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from .costfit import theil_sen
from .dealing import groups_filled, mlp_chunk
from .plan import BLOCKS, HeadUnits, PartitionPlan
from .policy import VANILLA
from .stages import split_text
from .step_model import StepModel

# Plain megatron-core, launched with no het-TP flag beyond the scenario's emulation: the speed
# every policy is compared with. VANILLA ("none", the same layers, timed) gives C and the real
# speeds, and its own row shows what timing costs.
PLAIN = "vanilla"

REACTION_BAND = 0.10  # "within 10% of the new steady state"
# Iterations a run's mean leaves out as start-up, for every policy alike: the first (cold) step,
# and the second, whose time holds the boundary after the first, where het-TP probes
# attention's per-call cost once a run (hettp.attention_probe).
START_UP = 2


@dataclass
class Run:
    """One training run's records, reduced to what the report needs."""

    scenario: str
    policy: str
    repeat: int
    path: str
    step_s: dict[int, float] = field(default_factory=dict)
    loss: dict[int, float] = field(default_factory=dict)
    compute: list[tuple[int, list[float]]] = field(default_factory=list)  # (iteration, per rank)
    busy: list[tuple[int, list[float]]] = field(default_factory=list)  # all compute, per rank
    fixed: list[tuple[int, list[float]]] = field(default_factory=list)  # of compute, unmovable
    # per timing record: each rank's unit-weighted work, compute and the loop's slowdown factor
    loads: list[tuple[list[float], list[float], list[float | None]]] = field(default_factory=list)
    decisions: list[dict] = field(default_factory=list)
    tokens_per_step: int = 0
    stages: int = 1  # pipeline stages: per-rank lists hold each stage's TP ranks in turn
    plan: str | None = None  # the initial partition plan (JSON), where the run logged one
    unit_work: dict[str, float] | None = None  # the planner's weight of a unit, latest
    heads: HeadUnits | None = None  # head units (--het-tp-attn-granularity), not in `plan`

    @classmethod
    def from_records(
        cls, records: Iterable[dict], scenario: str, policy: str, repeat: int, path: str
    ) -> Run:
        run = cls(scenario, policy, repeat, path)
        timing: dict[int, dict[int, dict]] = {}  # iteration -> pipeline stage -> record
        stages = 1
        for r in records:
            kind = r.get("kind")
            if kind == "train":
                run.step_s[r["iteration"]] = r["elapsed_ms"] / 1e3
                run.loss[r["iteration"]] = float(r["lm_loss"])
            elif kind == "timing":
                timing.setdefault(r["iteration"], {})[r.get("stage") or 0] = r
            elif kind == "decision":
                run.decisions.append(r)
            elif kind == "plan" and run.plan is None:
                run.plan = r["plan"]
            elif kind == "priced":
                run.unit_work = dict(r["unit_work"])
            elif kind == "layers":  # a layer move between pipeline stages (its own planner)
                run.decisions.append(
                    {
                        "action": f"layers {split_text(r['after'])}",
                        "iteration": r["iteration"],
                        "bytes": r["bytes"],
                        "min_bytes": r["bytes"],
                    }
                )
            elif kind == "run":
                args = r["args"]
                run.tokens_per_step = args["global_batch_size"] * args["seq_length"]
                stages = args.get("pipeline_model_parallel_size") or 1
                run.heads = run_head_units(args)
        # per rank: the stages' TP ranks in turn, at every report, each stage's latest (a stage
        # reports on its own when its detection changes, and a decision restarts its interval)
        run.stages = stages
        latest: dict[int, dict] = {}
        for iteration, by_stage in sorted(timing.items()):
            latest.update(by_stage)
            if len(latest) < stages:
                continue
            record = latest[0]
            if stages == 1 and all(record.get(k) for k in ("work", "compute_s", "factor")):
                run.loads.append((record["work"], record["compute_s"], record["factor"]))
            for name, key in (("compute", "compute_s"), ("busy", "busy_s"), ("fixed", "fixed_s")):
                rows = [latest[stage].get(key) for stage in range(stages)]
                if all(row is not None for row in rows):
                    flat = [float(c) for row in rows for c in row]
                    getattr(run, name).append((iteration, flat))
        if not run.step_s:
            raise ValueError(f"{path}: no training iterations recorded")
        return run

    @property
    def iterations(self) -> int:
        return max(self.step_s)

    def window(self, varying: bool) -> list[int]:
        """The iterations a step time is taken over: the second half, or where who is slow
        changes, all but the start-up's (START_UP)."""
        its = sorted(self.step_s)
        if varying:
            return [i for i in its if i > START_UP]
        return [i for i in its if i > len(its) // 2]

    def step_time(self, varying: bool) -> float:
        times = [self.step_s[i] for i in self.window(varying)]
        return statistics.fmean(times) if varying else statistics.median(times)

    def sharded_compute(self, kind: str = "compute") -> list[float]:
        """Per-rank compute per step in the timed regions (kind "compute"), of it the part no
        split moves ("fixed"), or all of it ("busy"), median over the second half's reports."""
        records = getattr(self, kind)
        late = [c for it, c in records if it > self.iterations // 2] or [c for _, c in records]
        if not late:
            raise ValueError(
                f"{self.path}: no timing records (is --het-tp-interval larger than the run?)"
            )
        return [statistics.median(c[r] for c in late) for r in range(len(late[0]))]

    @property
    def final_loss(self) -> float:
        return self.loss[self.iterations]


def ideal_step(
    t_fast: float,
    slowed: float,
    speeds: Sequence[float],
    movable: float | None = None,
    stages: int = 1,
) -> float:
    """The step with the units split in proportion to speed: `slowed` is a rank's compute per
    step at full speed that its slowdown stretches, `movable` the part of it that moves with
    its units (default: all); the rest of the step is unchanged. With pipeline stages
    (`speeds` holds each stage's TP ranks in turn), units move inside a stage only and the
    slowest stage paces the pipeline."""
    movable = slowed if movable is None else movable
    tp = len(speeds) // stages
    steps = []
    for stage in range(stages):
        group = speeds[stage * tp : (stage + 1) * tp]
        model = StepModel(
            t_fast - slowed, tuple(1.0 / s for s in group), movable, max(0.0, slowed - movable)
        )
        steps.append(model.step_time(model.balanced_work(tp)))
    return max(steps)


def run_head_units(args: dict) -> HeadUnits | None:
    """The run's head units, from its flags (as hettp.config.HetTPConfig.head_units reads)."""
    heads = args.get("num_attention_heads") or 0
    groups = (args.get("group_query_attention") and args.get("num_query_groups")) or heads
    per_unit = args.get("het_tp_attn_granularity") or 0
    if not groups or not 0 < per_unit < heads // groups:
        return None
    return HeadUnits(per_unit, heads // groups, groups)


class BlockPieces(NamedTuple):
    """How a migration can cut one block: `count` pieces, the block's `share` of a layer's
    work; with head units, `replica` is one K/V replica's share of it and `per_group` the
    pieces of a query group (a rank holding any of a group's pieces computes its K and V)."""

    count: int
    share: float
    replica: float = 0.0
    per_group: int = 0


def unit_pieces(
    plan_json: str, unit_work: dict[str, float], heads: HeadUnits | None = None
) -> dict[str, BlockPieces]:
    """Per block, the pieces a migration can give a rank (query groups or heads; the MLP's
    units in the planner's chunks, hettp.dealing.mlp_chunk) and the block's share of a layer's
    work, with `heads`' K/V replicas (one per group in the even plan's work)."""
    plan = dataclasses.replace(PartitionPlan.from_json(plan_json), heads=heads)
    weights = {block: plan.num_units(block) * unit_work[block] for block in BLOCKS}
    kv = unit_work.get("kv", 0.0) if plan.heads is not None else 0.0
    weights["attn"] += kv * (plan.heads.groups if kv else 0)
    total = sum(weights.values())
    if total <= 0:
        raise ValueError(f"unit work {unit_work} gives a layer no work")
    pieces = {"attn": plan.num_units("attn"), "mlp": plan.num_units("mlp") // mlp_chunk(plan)}
    out = {block: BlockPieces(pieces[block], weights[block] / total) for block in BLOCKS}
    if kv:
        out["attn"] = out["attn"]._replace(replica=kv / total, per_group=plan.heads.units_per_group)
    return out


def whole_unit_compute(
    speeds: Sequence[float],
    pieces: dict[str, BlockPieces],
    slowed: float,
    scaling: float,
) -> float:
    """The slowest rank's compute per step, summed over blocks, at the best split in whole
    `pieces`: `slowed` is a rank's compute at full speed and an even split, `scaling` the part
    of it that grows with its units (the rest, per-call costs and the optimizer's per-tensor
    work, it pays whatever it holds). Every block ends in a TP collective, so each block waits
    for its slowest rank and no block's surplus is made up in another: 8 query heads at speeds
    1 : 1/3.6 are at best 7 : 1, 7 heads' time where a proportional split takes 6.26. Per
    block, pieces dealt one by one to whoever would finish first (the least maximum), head
    units with the K/V replicas of the groups they fill."""
    if not speeds or min(speeds) <= 0:
        raise ValueError(f"speeds must be positive, got {list(speeds)}")
    n, total = len(speeds), 0.0
    for block in pieces.values():
        count, share, replica, per_group = BlockPieces(*block)
        groups = count / per_group if per_group else 0.0
        cost = _PieceCost(
            own=(slowed - scaling) * share,  # what a rank pays in the block whatever it holds
            piece=scaling * n * (share - replica * groups) / count if count else 0.0,
            replica=scaling * n * replica,
            per_group=per_group,
        )
        held = [0] * n
        for _ in range(count):
            rank = min(range(n), key=lambda r: (cost.work(held[r] + 1) / speeds[r], r))
            held[rank] += 1
        total += max(cost.work(h) / s for h, s in zip(held, speeds))
    return total


@dataclass(frozen=True)
class _PieceCost:
    own: float
    piece: float
    replica: float
    per_group: int

    def work(self, held: int) -> float:
        """A rank's compute in the block holding `held` pieces, packed into as few groups."""
        groups = groups_filled(held, self.per_group) if self.per_group else 0
        return self.own + self.piece * held + self.replica * groups


def scaling_share(runs: Sequence[Run]) -> float | None:
    """Of a rank's timed compute at an even split, the share that grows with its units: the
    line through the runs' timing records (work against compute at full speed, the loop's own
    factors undone; hettp.costfit.theil_sen), read at the even work. None where the records
    span too little work for a line."""
    points, even = [], []
    for run in runs:
        for work, compute, factor in run.loads:
            points += [
                (w, c / f) for w, c, f in zip(work, compute, factor) if f and f > 0 and w > 0
            ]
            even.append(sum(work) / len(work))
    line = theil_sen(points)
    if line is None or not even:
        return None
    grows = line.per_unit * statistics.median(even)
    return grows / (grows + line.fixed)


def whole_unit_e(
    t_ideal: float,
    t_fast: float,
    slowed: float,
    scaling: float,
    speeds: Sequence[Sequence[float]],
    pieces: dict[str, BlockPieces],
) -> float:
    """The most E a split in whole `pieces` allows: T_ideal over the step with the rest of
    T_fast unchanged and the blocks at whole_unit_compute, over the steps whose `speeds` are
    given; at most 1 (finer pieces approach T_ideal)."""
    steps = [(t_fast - slowed) + whole_unit_compute(s, pieces, slowed, scaling) for s in speeds]
    return min(1.0, t_ideal / statistics.fmean(steps))


def undone_after(run: Run, ends: Sequence[int], onsets: Sequence[int]) -> list[int | None]:
    """Per straggle end (the first normal iteration), the normal steps the run had taken when
    a decision changed its plan back (2: at the boundary after the second normal step, as the
    loop's detector allows); None where no decision came before the next onset."""
    out = []
    for end in ends:
        following = [o for o in onsets if o > end]
        until = following[0] if following else math.inf
        acted = [d["iteration"] for d in run.decisions if end <= d["iteration"] < until]
        out.append(min(acted) - end + 1 if acted else None)
    return out


def measured_speeds(
    vanilla: Sequence[Run], base: Sequence[float], iterations: int, relative: bool = False
) -> list[tuple[float, ...]]:
    """Per-iteration rank speeds measured by `vanilla` runs: unslowed compute (`base`) over the
    compute they measured in each report interval (median over repeats). `relative`: over the
    least slowed rank's instead, which is taken as unslowed: real contention is timed on the
    wall clock and its base on the CPU clock, so their plain ratio read a rank no neighbour
    slowed at 0.93-0.95, and raised the bound (E and R) for every policy."""
    reports: dict[int, list[list[float]]] = {}
    for run in vanilla:
        for it, compute in run.compute:
            reports.setdefault(it, []).append(compute)
    ends = sorted(reports)
    if not ends:
        raise ValueError("real-contention scenario: its vanilla runs have no timing records")
    speeds = []
    for i in range(1, iterations + 1):
        end = next((e for e in ends if e >= i), ends[-1])
        compute = [statistics.median(c[r] for c in reports[end]) for r in range(len(base))]
        slow = [c / b if b > 0 and c > 0 else 1.0 for b, c in zip(base, compute)]
        least = min(slow) if relative else 1.0
        speeds.append(tuple(min(1.0, least / v) for v in slow))
    return speeds


def reaction_steps(run: Run, onset: int, steady: float) -> int | None:
    """Steps from `onset` until the step time is within 10% of `steady` for good (None: it
    never is). Each step is judged by the median of it and its two neighbours, so one noisy
    step neither ends nor resets the count."""
    its = [i for i in sorted(run.step_s) if i >= onset]
    settled = None
    for k, i in enumerate(its):
        med = statistics.median(run.step_s[j] for j in its[max(0, k - 1) : k + 2])
        if abs(med - steady) <= REACTION_BAND * steady:
            settled = i if settled is None else settled
        else:
            settled = None
    return None if settled is None else settled - onset


def _spread(values: Sequence[float]) -> float:
    return max(values) - min(values) if values else 0.0


def compare(
    runs: Sequence[Run],
    factors: dict[str, list[tuple[float, ...]]],
    varying: dict[str, bool],
    real: set[str] = frozenset(),
    device: set[str] = frozenset(),
    replicas: int = 1,
) -> dict:
    """Rows per (scenario, policy) and the baseline. `factors[scenario]` holds the emulated
    slowdown per rank for iterations 1..n; scenarios in `real` get speeds measured from their
    timed vanilla runs instead. T_fast and every row's speedup, E and R are against the plain
    vanilla runs (PLAIN) where the comparison has them. Scenarios in `device` slow all of a
    rank's compute (the emulation's device mode): their bound stretches all of it, where the
    others' stretches the timed compute only; in both, the part of it no split moves (the
    optimizer step) stays on each rank. With pipeline stages (the runs say how many),
    per-rank values hold each stage's TP ranks in turn, units move inside a stage only, and
    T_ideal is the slowest stage's balanced step with the rest of the step unchanged: an
    approximation that leaves out how 1F1B's bubbles scale with the slowest stage. With
    data-parallel `replicas`, `factors` hold every rank of the job (TP ranks, then replicas)
    and the bound pools them: work may move to any rank, by units or by data; their speeds
    are the emulated ones (the timing records hold the slowest replica's)."""
    stages = {run.stages for run in runs}
    if len(stages) > 1:
        raise ValueError(f"the runs have different pipeline sizes: {sorted(stages)}")
    stages = stages.pop() if stages else 1
    by_key: dict[tuple[str, str], list[Run]] = {}
    for run in runs:
        by_key.setdefault((run.scenario, run.policy), []).append(run)

    def baseline_of(scenario):  # plain runs where there are (older comparisons: timed ones)
        return by_key.get((scenario, PLAIN)) or by_key.get((scenario, VANILLA))

    timed_base = by_key.get(("none", VANILLA))
    if not timed_base or not baseline_of("none"):
        raise ValueError(
            "the no-straggler vanilla runs (scenario 'none', policies 'vanilla' and 'none') "
            "are missing: T_fast and C come from them"
        )
    t_fast = statistics.median(r.step_time(False) for r in baseline_of("none"))
    per_rank = [statistics.median(vals) for vals in zip(*(r.sharded_compute() for r in timed_base))]
    c = max(per_rank)
    baseline = {
        "t_fast_s": t_fast,
        "c_s": c,
        "c_over_t_fast": c / t_fast,
        "compute_per_rank_s": per_rank,
    }
    movable = c
    if all(r.fixed for r in timed_base):
        fixed = [
            statistics.median(v) for v in zip(*(r.sharded_compute("fixed") for r in timed_base))
        ]
        baseline["fixed_s"] = max(fixed)
        movable = c - baseline["fixed_s"]
    if device:  # a slow device is slow at all of its compute: the bound stretches that
        if not all(r.busy for r in timed_base):
            raise ValueError("device-mode scenarios need busy times from the timed vanilla runs")
        busy = [statistics.median(v) for v in zip(*(r.sharded_compute("busy") for r in timed_base))]
        baseline["busy_s"] = max(busy)

    pieces = {}  # per policy: how its plan cuts each block, from any of its runs
    for run in runs:
        if run.plan and run.unit_work and stages == replicas == 1 and run.policy not in pieces:
            pieces[run.policy] = unit_pieces(run.plan, run.unit_work, run.heads)
    rows, all_speeds, speeds_from, bounds = [], {}, {}, {}
    scenarios = list(dict.fromkeys(r.scenario for r in runs))
    for scenario in scenarios:
        vanilla = baseline_of(scenario)
        if not vanilla:
            raise ValueError(f"scenario '{scenario}' has no vanilla runs to compare against")
        iterations = vanilla[0].iterations
        timed = by_key.get((scenario, VANILLA))
        if scenario in real and not timed:
            raise ValueError(f"real-contention scenario '{scenario}' needs timed vanilla runs")
        vary = varying[scenario]
        emulated = [tuple(1.0 / f for f in fs) for fs in factors[scenario][:iterations]]
        # A constant emulated straggle is measured too (its vanilla runs time it): T_ideal then
        # uses the slowdown the planner sees, which the emulation only approximates.
        measured_from = (
            timed
            if scenario in real
            else next(
                (g for g in (vanilla, timed) if g and not vary and all(r.compute for r in g)),
                None,
            )
            if replicas == 1
            else None
        )
        if replicas > 1 and scenario in real:
            raise ValueError(f"real-contention scenario '{scenario}' with data parallelism")
        speeds = (
            measured_speeds(measured_from, per_rank, iterations, relative=scenario in real)
            if measured_from
            else emulated
        )
        if measured_from and scenario not in real:  # an unslowed rank stays at 1
            speeds = [
                tuple(1.0 if e == 1.0 else m for e, m in zip(es, ms))
                for es, ms in zip(emulated, speeds)
            ]
        all_speeds[scenario] = speeds
        speeds_from[scenario] = "measured" if measured_from else "emulated"
        window = vanilla[0].window(vary)
        slowed = baseline["busy_s"] if scenario in device else c
        bounds[scenario] = {"slowed_s": slowed, "movable_s": movable}
        ideal_per_it = [ideal_step(t_fast, slowed, speeds[i - 1], movable, stages) for i in window]
        t_ideal = statistics.fmean(ideal_per_it)

        in_window, e_units = [speeds[i - 1] for i in window], {}
        straggled = any(min(s) < 1.0 for s in speeds)  # else there is no E to bound
        for policy, cut in pieces.items() if straggled else ():
            share = scaling_share(by_key.get((scenario, policy), ()))
            scaling = movable if share is None else min(movable, share * c)
            e_units[policy] = whole_unit_e(t_ideal, t_fast, slowed, scaling, in_window, cut)
        t_vanilla = statistics.median(r.step_time(vary) for r in vanilla)
        slowed = [i for i, s in enumerate(speeds, 1) if min(s) < 1.0]
        onset = slowed[0] if slowed else None
        persistent = onset is not None and not vary and slowed == list(range(onset, iterations + 1))
        onsets = [i for i in slowed if i - 1 not in slowed]
        ends = [i for i in range(2, iterations + 1) if i - 1 in slowed and i not in slowed]
        if scenario in real:  # measured speeds: where a straggle ends is not known exactly
            onsets, ends = [], []
        vanilla_loss = {r.repeat: r.final_loss for r in vanilla}
        for policy in dict.fromkeys(r.policy for r in runs if r.scenario == scenario):
            group = sorted(by_key[(scenario, policy)], key=lambda r: r.repeat)
            times = [r.step_time(vary) for r in group]
            t = statistics.median(times)
            gaps = [
                r.final_loss - vanilla_loss[r.repeat] for r in group if r.repeat in vanilla_loss
            ]
            moved = [sum(d.get("bytes", 0) for d in r.decisions) for r in group]
            minimum = [sum(d.get("min_bytes", 0) for d in r.decisions) for r in group]
            reactions = (
                [reaction_steps(r, onset, r.step_time(False)) for r in group] if persistent else []
            )
            known = [x for x in reactions if x is not None]
            undone = [x for r in group for x in undone_after(r, ends, onsets)]
            straggling = onset is not None and t_vanilla > t_ideal
            rows.append(
                {
                    "scenario": scenario,
                    "policy": policy,
                    "repeats": len(group),
                    "step_s": t,
                    "spread_s": _spread(times),
                    "step_s_runs": times,
                    "tokens_per_s": group[0].tokens_per_step / t if t > 0 else math.nan,
                    "speedup": t_vanilla / t,
                    "t_ideal_s": t_ideal,
                    "t_vanilla_s": t_vanilla,
                    "E": t_ideal / t if onset is not None else None,
                    "R": (t_vanilla - t) / (t_vanilla - t_ideal) if straggling else None,
                    "reaction_steps": statistics.median(known) if known else None,
                    "E_whole_units": e_units.get(policy),
                    # per straggle end and run: normal steps until the plan changed back
                    "undone_after": undone if ends and any(r.decisions for r in group) else None,
                    "bytes_moved": statistics.median(moved),
                    "bytes_vs_min": (
                        statistics.median(m / n for m, n in zip(moved, minimum) if n)
                        if any(minimum)
                        else None
                    ),
                    "decisions": statistics.median(len(r.decisions) for r in group),
                    "decisions_first_run": [
                        f"{d['action']}@{d['iteration']}" for d in group[0].decisions
                    ],
                    "final_loss": statistics.median(r.final_loss for r in group),
                    "loss_gap": statistics.median(gaps) if gaps else None,
                    "runs": [r.path for r in group],
                }
            )
    return {
        "baseline": baseline,
        "rows": rows,
        "speeds": all_speeds,
        "speeds_from": speeds_from,
        "bounds": bounds,
    }


def _fmt(value, spec: str, none: str = "-", around: str = "{}") -> str:
    return (
        none
        if value is None or (isinstance(value, float) and math.isnan(value))
        else around.format(format(value, spec))
    )


def _undone(steps: Sequence[int | None] | None) -> str:
    """The slowest recovery over runs and straggle ends, and how many were never undone."""
    if not steps:
        return "-"
    known = [x for x in steps if x is not None]
    never = len(steps) - len(known)
    text = f"{max(known)}" if known else "never"
    return text + (f" ({never} never)" if never and known else "")


def markdown(result: dict) -> str:
    b = result["baseline"]
    lines = [
        f"T_fast {b['t_fast_s'] * 1e3:.1f} ms, C {b['c_s'] * 1e3:.1f} ms "
        f"(C/T_fast {b['c_over_t_fast']:.2f})",
        "",
        "| scenario | policy | step ms (spread) | tokens/s | speedup | E (whole-unit max) | R "
        "| reaction | undone after | MB moved (x min) | decisions | final loss (gap) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        moved = (
            f"{r['bytes_moved'] / 1e6:.1f} ({_fmt(r['bytes_vs_min'], '.2f')})"
            if r["bytes_moved"]
            else "0"
        )
        first = " ".join(r["decisions_first_run"][:3]) + (
            " ..." if len(r["decisions_first_run"]) > 3 else ""
        )
        lines.append(
            f"| {r['scenario']} | {r['policy']} | {r['step_s'] * 1e3:.1f} "
            f"({r['spread_s'] * 1e3:.1f}) | {r['tokens_per_s']:.0f} | {r['speedup']:.3f} | "
            f"{_fmt(r['E'], '.3f')}{_fmt(r.get('E_whole_units'), '.3f', '', ' ({})')} | "
            f"{_fmt(r['R'], '.2f')} | {_fmt(r['reaction_steps'], 'g')} | "
            f"{_undone(r.get('undone_after'))} | {moved} | {r['decisions']:g}"
            f"{' (' + first + ')' if first else ''} | {r['final_loss']:.5f} "
            f"({_fmt(r['loss_gap'], '+.1e')}) |"
        )
    return "\n".join(lines) + "\n"
