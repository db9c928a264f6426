"""The simulator: step times of a TP x PP x DP job over a straggler trace, with the project's
own control loop (hettp.loop: detector, cost fit, planner) deciding on simulated timing reports
and its decisions applied at their predicted cost.

What a step takes (per data-parallel replica, then the slowest replica):
- a stage's micro-batch: its slowest TP rank's compute (its active units' FLOPs, with head
  units the K/V replicas of the groups it holds heads of, plus the output layer on the last
  stage, stretched by the GPU's slowdown) plus its layers' TP
  all-reduces (four per layer: two forward, two backward), forward one third, backward two;
- the pipeline: 1F1B over the stages with the hand-offs between them (hettp.sim.pipeline);
- the optimizer step (per parameter, stretched by the slowdown): between two data-parallel
  reduces a replica runs its optimizer step and its pipeline, so the slowest replica's sum
  paces the job;
- then the data-parallel gradient all-reduce of each stage (its largest rank's parameters) and
  `rest` (calibration).

Replicas at one TP position and stage share a unit plan (their gradients are all-reduced), so
one control loop per stage plans for all of them on the slowest replica's report, as
megatron/hetero/control.py does. A stage none of whose GPUs is ever slow in the trace gets the
same uniform report every step, which can never start a straggle: it runs no loop (exact, and
what makes 4096 GPUs fast). Decisions are taken at a step's end and shape the steps after
it; a migration stalls the step it ends by its predicted seconds (hettp.transfer.MigrationCost,
as the planner weighs it); a resize is free and its accuracy cost is not simulated. Speeds hold
between a trace's changes (no timing noise), so a report's median is its last step, and the
rebatch policy decides on the paces at each report interval's end. The joint policy (seed 002:
hettp.joint, pipeline stages excluded as in the runtime) weighs rebatching, TP moves and
resizes on the replicas' exact paces at each report, its moves stalling the step as a
migration's do, within --het-migration-budget.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..config import DEFAULT_MIGRATION_BUDGET
from ..detect import StragglerDetector
from ..joint import JointController, JointState, ReplicaPace, options
from ..loop import WARMUP_STEPS, ControlLoop, TimingReport
from ..memory import MemoryCap
from ..plan import PartitionPlan
from ..planner import Planner
from ..policy import policy as get_policy
from ..rebatch import RebatchError, check_counts, even_counts
from ..rebatch import decide as decide_rebatch
from ..stages import LayerSplit, StageError, balance_layers, check_split, tp_imbalance
from ..step_model import block_works, plan_work
from ..transfer import REBUILD_FACTOR, CostModel, MigrationCost, PrimitiveCost
from .network import Fabric, Link, all_reduce
from .pipeline import one_f_one_b
from .traces import Trace
from .workload import ModelSpec, WorkloadError

POLICIES = ("none", "resize", "migrate", "hybrid", "rebatch", "joint")
# Decided on the replicas' paces at each report (global rank 0's decision in the runtime), not
# by a control loop per stage.
DATA_POLICIES = ("rebatch", "joint")


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int = 1
    dp: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def rank(self, t: int, d: int, s: int) -> int:
        """megatron-core's default order: TP fastest, then data-parallel, then stages."""
        return t + self.tp * (d + self.dp * s)


@dataclass(frozen=True)
class Costs:
    """Seconds at full speed. `unit_seconds`: one unit's forward and backward for one
    micro-batch; `stage_extra`: per stage and micro-batch, compute no unit carries (the
    output layer); `optimizer_per_param`: the optimizer step per parameter a rank holds;
    `rest`: per step, everything else (a measured remainder when calibrating)."""

    unit_seconds: dict
    stage_extra: tuple[float, ...]
    optimizer_per_param: float = 0.0
    rest: float = 0.0
    optimizer: float = 0.0  # per step and rank, measured: stretched by any slowdown (an
    # emulation's sharded mode times the optimizer step too)
    comm: bool = True  # model the TP, pipeline and data-parallel transfers


def flop_costs(model: ModelSpec, layout: Layout, gpu_flops: float, hbm_bytes_s: float = 3e12):
    """Costs of a GPU that sustains `gpu_flops` in the layers; the optimizer step reads and
    writes ~40 bytes a parameter (bf16 weight and grad, fp32 master and two moments)."""
    flops = model.unit_flops()
    extra = [0.0] * layout.pp
    extra[-1] = model.logits_flops(layout.tp) / gpu_flops
    return Costs(
        {kind: f / gpu_flops for kind, f in flops.items()},
        tuple(extra),
        optimizer_per_param=40.0 / hbm_bytes_s,
    )


@dataclass
class Result:
    policy: str
    step_s: list[float]  # per step
    ideal_s: list[float]  # per step, docs/design.md's T_ideal over every GPU of the job
    decisions: list[dict] = field(default_factory=list)
    planner_seconds: list[float] = field(default_factory=list)  # per report, wall
    moved_seconds: float = 0.0

    def window(self, first: int = 2) -> tuple[list[float], list[float]]:
        return self.step_s[first - 1 :], self.ideal_s[first - 1 :]

    @property
    def E(self) -> float:
        steps, ideal = self.window()
        return sum(ideal) / sum(steps)

    @property
    def mean_step(self) -> float:
        steps, _ = self.window()
        return sum(steps) / len(steps)


class SimError(ValueError):
    """A simulation that cannot be set up as asked (named flag or value)."""


class Simulation:
    """One policy over one trace. `interval`, `onset`, ... as the --het-tp flags."""

    def __init__(
        self,
        model: ModelSpec,
        layout: Layout,
        costs: Costs,
        trace: Trace,
        policy: str,
        fabric: Fabric | None = None,
        microbatches: int = 8,
        interval: int = 10,
        detector: dict | None = None,
        max_resize: float = 0.5,
        device: bool = True,
        layers: Sequence[int] | None = None,
        counts: Sequence[int] | None = None,
        budget: float = DEFAULT_MIGRATION_BUDGET,
        memory_cap: float | None = None,
    ):
        """`memory_cap`: --het-tp-memory-cap (moves within it; with it, layers stay in their
        stages, as the trainer requires)."""
        refused = refusal(policy, layout)
        if refused:
            raise SimError(refused)
        if trace.gpus != layout.world:
            raise SimError(f"trace has {trace.gpus} GPUs, the layout {layout.world}")
        if layers is None and model.num_layers % layout.pp:
            raise SimError(f"{model.num_layers} layers do not split over {layout.pp} stages")
        try:
            plan = model.even_plan(layout.tp, model.num_layers)
        except WorkloadError as err:
            raise SimError(str(err)) from err
        self.model, self.layout, self.costs, self.trace = model, layout, costs, trace
        self.fabric = fabric or Fabric()
        self.policy, self.device = policy, device
        self.max_resize = max_resize
        self.interval = interval
        per_stage = model.num_layers // layout.pp
        self.layers = list(layers) if layers is not None else [per_stage] * layout.pp
        try:
            check_split(self.layers, model.num_layers, layout.pp)
            self.counts = (
                check_counts(counts, microbatches * layout.dp)
                if counts is not None
                else even_counts(microbatches * layout.dp, layout.dp)
            )
        except (StageError, RebatchError) as err:
            raise SimError(str(err)) from err
        starts = [sum(self.layers[:s]) for s in range(layout.pp)]
        self.plans = [plan.stage(starts[s], self.layers[s]) for s in range(layout.pp)]
        self.shares = [(0.0,) * layout.tp for _ in range(layout.pp)]
        self.unit_work = model.unit_work()
        self.unit_bytes = {b: n * model.state_bytes for b, n in model.unit_params().items()}
        self.factors = [1.0] * layout.world
        self._links()
        spec = get_policy(policy) if policy not in DATA_POLICIES else None
        touched_stages = {self._where(g)[2] for g in trace.touched}
        self.loops: dict[int, ControlLoop] = {}
        self.migration_cost: dict[int, MigrationCost] = {}
        try:
            memory = MemoryCap(memory_cap, model.unit_params()) if memory_cap is not None else None
        except ValueError as err:
            raise SimError(f"--het-tp-memory-cap: {err}") from err
        self.memory = memory
        if spec is not None and spec.decides:
            for s in sorted(touched_stages):
                cost = MigrationCost(self._transfer_costs(s)) if spec.migrates else None
                if cost is not None:
                    cost.unit_bytes = dict(self.unit_bytes)
                planner = Planner(
                    policy,
                    self.unit_work,
                    max_resize,
                    migration_seconds=cost.seconds if cost else None,
                    memory=memory,
                )
                self.loops[s] = ControlLoop(
                    planner,
                    StragglerDetector(layout.tp, **(detector or {})),
                    cost,
                    interval=interval,
                )
                self.migration_cost[s] = cost
        # layers move under migrate only: under resizing policies they stay (as the runtime)
        self.moves_layers = (
            spec is not None
            and spec.migrates
            and not spec.resizes
            and layout.pp > 1
            and memory is None
        )
        self.onset = StragglerDetector(layout.tp, **(detector or {})).onset
        self.joint = None
        if policy == "joint":
            try:
                self.joint = JointController(budget)
            except ValueError as err:
                raise SimError(f"--het-migration-budget: {err}") from err
            self.joint_cost = MigrationCost(self._transfer_costs(0), dict(self.unit_bytes))
        self._trained = self._moved = 0.0  # since the last report: seconds stepping, moving
        self._cache: dict = {}

    def _transfer_costs(self, s: int) -> CostModel:
        """Migration primitives over stage s's TP link (replica 0's: replicas move alike, at
        once); the per-call overheads are gloo's measured ones (hettp.transfer defaults),
        unless this is a CPU replay that keeps the measured model whole."""
        if not self.costs.comm:
            return CostModel()
        L = self.layout
        link = self.fabric.ring_link([L.rank(t, 0, s) for t in range(L.tp)])
        base = CostModel()
        return CostModel(
            *(
                PrimitiveCost(getattr(base, name).call, link.alpha, link.beta)
                for name in ("p2p", "all_to_all", "scatter", "broadcast")
            )
        )

    # ---- the machine ------------------------------------------------------------------------

    def _where(self, gpu: int) -> tuple[int, int, int]:
        tp, dp = self.layout.tp, self.layout.dp
        return gpu % tp, gpu // tp % dp, gpu // (tp * dp)

    def _links(self) -> None:
        """Per-transfer seconds. The link between sites is one pipe that every transfer
        crossing it shares: the hand-offs of all replicas (one flow per TP rank: each sends
        its copy of the hidden states) and, at the step's end, the data-parallel rings of
        every stage that spans sites."""
        L, f, act = self.layout, self.fabric, self.model.activation()
        comm = self.costs.comm

        def crosses(a: int, b: int) -> bool:
            return bool(f.clusters) and f.cluster_of(a) != f.cluster_of(b)

        hand_off_flows = L.tp * sum(
            crosses(L.rank(0, d, s), L.rank(0, d, s + 1))
            for d in range(L.dp)
            for s in range(L.pp - 1)
        )
        self.tp_comm = {}  # (replica, stage) -> seconds per layer per micro-batch
        self.hand_off = {}  # replica -> per boundary seconds
        for d in range(L.dp):
            for s in range(L.pp):
                link = f.ring_link([L.rank(t, d, s) for t in range(L.tp)])
                self.tp_comm[d, s] = 4 * all_reduce(act, L.tp, link) if comm else 0.0
            hand_off = []
            for s in range(L.pp - 1):
                a, b = L.rank(0, d, s), L.rank(0, d, s + 1)
                link = f.link(a, b)
                if crosses(a, b):
                    link = Link(link.alpha, link.beta / hand_off_flows)
                hand_off.append(link.time(act) if comm else 0.0)
            self.hand_off[d] = tuple(hand_off)
        ring_crosses = [
            any(crosses(L.rank(0, d, s), L.rank(0, (d + 1) % L.dp, s)) for d in range(L.dp))
            for s in range(L.pp)
        ]
        # at the step's end: the crossing rings and, with stages, the tied-embedding reduce
        # between the first and the last stage of every replica that spans the sites
        self.embedding_crosses = L.pp > 1 and crosses(L.rank(0, 0, 0), L.rank(0, 0, L.pp - 1))
        step_end_flows = L.tp * (
            sum(ring_crosses)
            + (L.dp if self.embedding_crosses and self.model.tied_embeddings else 0)
        )
        self.step_end_flows = max(1, step_end_flows)
        rings = [f.ring_link([L.rank(0, d, s) for d in range(L.dp)]) for s in range(L.pp)]
        self.dp_link = [
            Link(link.alpha, link.beta / self.step_end_flows) if cross else link
            for link, cross in zip(rings, ring_crosses)
        ]

    def _block_seconds(self, s: int) -> list[tuple[tuple[float, ...], int]]:
        """Stage s's blocks as (each TP rank's seconds in the block per micro-batch at full
        speed, how many of the stage's blocks split so): a block ends in a TP collective, so
        it lasts as long as its slowest rank's share, and blocks split alike cost alike."""
        rows: dict[tuple[float, ...], int] = {}
        for row in block_works(self.plans[s], self.costs.unit_seconds, self.shares[s]):
            rows[row] = rows.get(row, 0) + 1
        return list(rows.items())

    def _rank_seconds(self, s: int) -> list[float]:
        """Per TP rank of stage s, its units' seconds per micro-batch at full speed."""
        out = [0.0] * self.layout.tp
        for row, count in self.blocks[s]:
            for rank, seconds in enumerate(row):
                out[rank] += count * seconds
        return out

    def _rank_params(self, s: int) -> list[float]:
        """Parameters each TP rank of stage s holds: its units', and the embeddings (vocab-
        parallel word embeddings and position embeddings on the first stage; the output
        layer's, or the tied copy, on the last)."""
        plan, L, m = self.plans[s], self.layout, self.model
        extra = 0.0
        if s == 0:
            extra += m.vocab * m.hidden / L.tp + m.seq * m.hidden
        if s == L.pp - 1 and (L.pp > 1 or not m.tied_embeddings):
            extra += m.vocab * m.hidden / L.tp
        return [extra + work for work in plan_work(plan, self.unit_work)]

    def _refresh(self) -> None:
        """After a change of plans, shares or layers: what every step reuses."""
        L = self.layout
        self.blocks = [self._block_seconds(s) for s in range(L.pp)]
        self.seconds = [self._rank_seconds(s) for s in range(L.pp)]
        self.params = [self._rank_params(s) for s in range(L.pp)]
        self.work = [plan_work(self.plans[s], self.unit_work, self.shares[s]) for s in range(L.pp)]
        self.dp_seconds = (
            max(
                all_reduce(max(self.params[s]) * self.model.grad_bytes, L.dp, self.dp_link[s])
                if self.costs.comm
                else 0.0
                for s in range(L.pp)
            )
            + self._embedding_sync()
        )
        self._cache.clear()

    def _embedding_sync(self) -> float:
        """With stages, the first and the last hold the tied word embeddings and all-reduce
        their gradient after the data-parallel reduce (megatron-core's embedding group)."""
        L, model = self.layout, self.model
        if L.pp == 1 or not self.costs.comm or not model.tied_embeddings:
            return 0.0
        nbytes = model.vocab * model.hidden / L.tp * model.grad_bytes
        link = self.fabric.link(L.rank(0, 0, 0), L.rank(0, 0, L.pp - 1))
        if self.embedding_crosses:  # every replica's TP ranks share the link between sites
            link = Link(link.alpha, link.beta / self.step_end_flows)
        return all_reduce(nbytes, 2, link)

    def _replica_time(self, d: int, counts: int) -> float:
        L, extra = self.layout, self.costs.stage_extra
        factors = tuple(
            tuple(self.factors[L.rank(t, d, s)] for t in range(L.tp)) for s in range(L.pp)
        )
        key = (factors, counts, self.hand_off[d], tuple(self.tp_comm[d, s] for s in range(L.pp)))
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        per_mb = [
            sum(count * max(f * sec for f, sec in zip(factors[s], row)) for row, count in blocks)
            + max(self._slow(f) for f in factors[s]) * extra[s]
            + self.layers[s] * self.tp_comm[d, s]
            for s, blocks in enumerate(self.blocks)
        ]
        value = one_f_one_b(
            [p / 3 for p in per_mb], [2 * p / 3 for p in per_mb], counts, self.hand_off[d]
        )
        self._cache[key] = value
        return value

    def step_time(self) -> float:
        if "step" not in self._cache:
            self._cache["step"] = self._step_time()
        return self._cache["step"]

    def _slow(self, factor: float) -> float:
        """The slowdown of a GPU's compute outside its units: a slow device's (or a busy
        neighbour's) is the same as in its units; an emulation in sharded mode slows only the
        units' work."""
        return factor if self.device else 1.0

    def _step_time(self) -> float:
        """Between two data-parallel reduces a replica runs its optimizer step, then its
        micro-batches: the slowest replica's sum paces the job (a slow replica's optimizer
        step overlaps a fast one's longer pipeline)."""
        return (
            max(
                self._replica_time(d, self.counts[d]) + self._optimizer_time(d)
                for d in range(self.layout.dp)
            )
            + self.dp_seconds
            + self.costs.rest
        )

    def _optimizer_time(self, d: int) -> float:
        L = self.layout
        ranks = [(s, t, self.factors[L.rank(t, d, s)]) for s in range(L.pp) for t in range(L.tp)]
        per_param = max(self._slow(f) * self.params[s][t] for s, t, f in ranks)
        slowest = max(f for _, _, f in ranks)
        return per_param * self.costs.optimizer_per_param + self.costs.optimizer * slowest

    # ---- the run ------------------------------------------------------------------------------

    def run(self, steps: int) -> Result:
        if steps < 2:
            raise SimError(f"simulate at least 2 steps (the first is left out), not {steps}")
        L = self.layout
        self._refresh()
        fast = self._uniform_time(compute=1.0)
        compute = fast - self._uniform_time(compute=0.0)
        changes = self.trace.changes()
        result = Result(self.policy, [], [])
        report_wall = 0.0
        for step in range(1, steps + 1):
            for gpu in changes.get(step, ()):
                self.factors[gpu] = self.trace.factor(gpu, step)
            if step in changes:
                self._cache.clear()
            t = self.step_time()
            self._trained += t
            if "pooled" not in self._cache:
                self._cache["pooled"] = L.world / sum(1.0 / f for f in self.factors)
            ideal = (fast - compute) + compute * self._cache["pooled"]
            # the control loops see this step's timings and act at its end boundary
            stall, wall, decided = self._control(step, t)
            report_wall += wall
            if decided is not None:
                result.decisions.extend(decided)
            if step % self.interval == 0:
                result.planner_seconds.append(report_wall)
                report_wall = 0.0
            result.step_s.append(t + stall)
            result.ideal_s.append(ideal)
            result.moved_seconds += stall
            self._moved += stall
        return result

    def steady_step(self, step: int = 1) -> float:
        """The step time at `step`'s GPU speeds with nothing decided: what a layout costs as
        built. The cross-cluster planner prices each grid by it, without the uniform steps
        `run` simulates for T_ideal."""
        saved = list(self.factors)
        self.factors = [self.trace.factor(g, step) for g in range(self.layout.world)]
        self._refresh()
        value = self.step_time()
        self.factors = saved
        self._refresh()
        return value

    def _uniform_time(self, compute: float) -> float:
        saved = (self.factors, self.costs)
        self.factors = [1.0] * self.layout.world
        self.costs = dataclasses.replace(
            self.costs,
            unit_seconds={b: v * compute for b, v in self.costs.unit_seconds.items()},
            stage_extra=tuple(e * compute for e in self.costs.stage_extra),
            optimizer_per_param=self.costs.optimizer_per_param * compute,
            optimizer=self.costs.optimizer * compute,
        )
        self._cache.clear()
        self._refresh()
        value = self.step_time()
        self.factors, self.costs = saved
        self._refresh()
        return value

    def _stage_report(self, s: int, step: int, step_time: float) -> TimingReport:
        """Stage s's TP ranks at the slowest replica: seconds of unit compute per step at the
        even micro-batch count (as control.py scales a rebatched replica's)."""
        L = self.layout
        key = ("report", s)
        if key in self._cache:
            compute = self._cache[key]
            return TimingReport(step, compute, tuple(self.work[s]), step_time)
        even = sum(self.counts) / L.dp
        compute = self._cache[key] = tuple(
            max(self.factors[L.rank(t, d, s)] for d in range(L.dp)) * self.seconds[s][t] * even
            for t in range(L.tp)
        )
        return TimingReport(step, compute, tuple(self.work[s]), step_time)

    def _control(self, step: int, step_time: float):
        """(stall seconds, planner wall seconds, decisions) at the end of `step`."""
        wall, stall, decisions = 0.0, 0.0, []
        changed = False
        for s, loop in self.loops.items():
            due = loop.step(self._stage_report(s, step, step_time))
            if due is None:
                continue
            began = time.perf_counter()
            verdict = loop.observe(
                due.report, due.detection, self.plans[s], self.shares[s], True, self.unit_bytes
            )
            wall += time.perf_counter() - began
            loop.close(due, verdict)
            decision = verdict.decision
            if decision is None:
                continue
            moved = 0.0
            if decision.plan != self.plans[s]:
                cost = self.migration_cost[s]
                moved = cost.seconds(self.plans[s], decision.plan)
                loop.migrated(moved, moved / cost.factor)
            stall = max(stall, moved)  # stages move at once, in parallel
            self.plans[s], self.shares[s] = decision.plan, tuple(decision.shares)
            loop.applied()
            changed = True
            decisions.append(
                {"step": step, "stage": s, "action": decision.action, "seconds": round(moved, 4)}
            )
        if changed:
            self._refresh()
        if self.joint is not None and step > WARMUP_STEPS and step % self.interval == 0:
            began = time.perf_counter()
            moved, decided = self._joint_step(step)
            wall += time.perf_counter() - began
            stall = max(stall, moved)
            decisions.extend(decided)
        if self.policy == "rebatch" and step > WARMUP_STEPS and step % self.interval == 0:
            began = time.perf_counter()
            paces = self._replica_paces()
            choice = decide_rebatch(self.counts, paces)
            wall += time.perf_counter() - began
            if choice is not None:
                self.counts = choice.after
                self._cache.clear()
                decisions.append({"step": step, "action": "rebatch", "counts": list(choice.after)})
        # as the runtime: not at a boundary where units moved (the stages report afresh first)
        interval_end = step > WARMUP_STEPS and step % self.interval == 0
        if self.moves_layers and interval_end and not changed:
            began = time.perf_counter()
            split = self._move_layers()
            wall += time.perf_counter() - began
            if split is not None:
                stall = max(stall, split.move_seconds)
                decisions.append({"step": step, "action": "layers", "layers": list(split.counts)})
        return stall, wall, decisions

    def _joint_step(self, step: int) -> tuple[float, list[dict]]:
        """The joint policy at a report (as megatron/hetero/runtime.py's, on exact paces):
        account the interval's moving and training, weigh hettp.joint's options, apply the
        choice. Returns (seconds moving, decisions)."""
        joint = self.joint
        joint.account(self._moved, self._trained + self._moved)
        self._trained = self._moved = 0.0
        state = self._joint_state()
        slow = frozenset(
            (d, t)
            for d, pace in enumerate(state.paces)
            for t, f in enumerate(pace.factors)
            if f >= self.onset
        )
        horizon = joint.hold(step, slow, self.interval)
        found = options(
            state, self.unit_work, self.max_resize, self.joint_cost.seconds, memory=self.memory
        )
        option = joint.choose(found, horizon).option
        if option.action == "none":
            return 0.0, []
        moved = option.move_seconds if option.plan != self.plans[0] else 0.0
        self.plans[0], self.shares[0] = option.plan, tuple(option.shares)
        self.counts = tuple(option.counts)
        self._refresh()
        decision = {"step": step, "action": option.action, "counts": list(self.counts)}
        return moved, [{**decision, "seconds": round(moved, 4)}]

    def _joint_state(self) -> JointState:
        """hettp.joint's inputs from the machine (one stage: joint runs without stages):
        per replica the TP ranks' slowdowns against the fastest GPU and, per micro-batch, what
        no unit carries (the output layer and the TP all-reduces); the seconds per unit of
        work; the optimizer step."""
        L, costs = self.layout, self.costs
        fastest = min(self.factors)
        comm = self.layers[0] * max(self.tp_comm[d, 0] for d in range(L.dp))
        paces = []
        for d in range(L.dp):
            factors = tuple(self.factors[L.rank(t, d, 0)] / fastest for t in range(L.tp))
            extra = max(self._slow(f) for f in factors) * costs.stage_extra[0] * fastest
            paces.append(ReplicaPace(extra + comm, factors))
        slope = sum(self.seconds[0]) / sum(self.work[0]) * fastest
        fixed = costs.optimizer + costs.optimizer_per_param * max(self.params[0])
        return JointState(
            self.plans[0],
            tuple(self.shares[0]),
            tuple(self.counts),
            tuple(paces),
            slope,
            fixed * fastest,
        )

    def _replica_paces(self) -> list[float]:
        """Each replica's seconds per micro-batch: its slowest stage's slowest rank's."""
        L, extra = self.layout, self.costs.stage_extra
        return [
            max(
                self.factors[L.rank(t, d, s)] * self.seconds[s][t]
                + self._slow(self.factors[L.rank(t, d, s)]) * extra[s]
                for s in range(L.pp)
                for t in range(L.tp)
            )
            for d in range(L.dp)
        ]

    def _move_layers(self) -> LayerSplit | None:
        """hettp.stages on the stages' slowest ranks' layer compute per step (units first: not
        while a stage's ranks are uneven); the layers keep their unit plans."""
        L = self.layout
        even = sum(self.counts) / L.dp
        per_rank = [
            [
                max(self.factors[L.rank(t, d, s)] for d in range(L.dp)) * self.seconds[s][t] * even
                for t in range(L.tp)
            ]
            for s in range(L.pp)
        ]
        if any(tp_imbalance(r) >= self.onset for r in per_rank if min(r) > 0):
            return None
        layer_bytes = self.model.layer_params() * self.model.state_bytes / L.tp
        move = (
            max(
                self.fabric.link(L.rank(0, 0, s), L.rank(0, 0, s + 1)).time(layer_bytes)
                for s in range(L.pp - 1)
            )
            * REBUILD_FACTOR
        )
        split = balance_layers(self.layers, [max(r) for r in per_rank], move)
        if split is None:
            return None
        whole = PartitionPlan.joined(self.plans)
        first, plans = 0, []
        for n in split.counts:
            plans.append(whole.stage(first, n))
            first += n
        self.layers, self.plans = list(split.counts), plans
        for loop in self.loops.values():
            loop.applied()
        self._refresh()
        return split


def refusal(policy: str, layout: Layout) -> str | None:
    """Why `policy` cannot run on `layout` (None where it can): the runtime's own limits."""
    if policy not in POLICIES:
        return f"policy '{policy}': the simulator runs {', '.join(POLICIES)}"
    if policy in DATA_POLICIES and layout.dp < 2:
        return f"policy '{policy}' needs data-parallel replicas (dp > 1)"
    if policy == "joint" and layout.pp > 1:
        return (
            "policy 'joint' is not built for pipeline stages (as --het-tp-policy joint): "
            "simulate it with pp 1"
        )
    return None


def applicable(layout: Layout) -> tuple[str, ...]:
    """The policies `layout` can run, in POLICIES order."""
    return tuple(p for p in POLICIES if refusal(p, layout) is None)


def simulate(
    model: ModelSpec,
    layout: Layout,
    costs: Costs,
    trace: Trace,
    policies: Sequence[str],
    steps: int,
    **kwargs,
) -> dict[str, Result]:
    return {p: Simulation(model, layout, costs, trace, p, **kwargs).run(steps) for p in policies}


def summary(result: Result) -> dict:
    planner = result.planner_seconds or [0.0]
    return {
        "E": round(result.E, 4),
        "step_s": round(result.mean_step, 6),
        "decisions": len(result.decisions),
        "moved_s": round(result.moved_seconds, 4),
        "planner_seconds": round(max(planner), 6),
        "planner_seconds_mean": round(sum(planner) / len(planner), 6),
    }
