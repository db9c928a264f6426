"""The control loop's distributed half: time this rank, gather a report over the TP group (and
the slowest replica over the data-parallel group), let TP rank 0 decide (hettp.loop, pure), and
broadcast the verdict so every rank applies the same decision at the same step boundary.

Every step each rank's compute time (timing.py) and active work are gathered (a few floats a
rank, with its attention's time and its work by block kind, which price core attention once
at the start) and fed to the detector; the planner runs where that detection changed and at every
report, the medians of `--het-tp-interval` steps. The runtime (runtime.py) applies what comes
back.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from hettp.attention_probe import CallPrice, probe
from hettp.config import HetTPConfig
from hettp.costfit import BlockSample, core_attention_scale
from hettp.detect import StragglerDetector
from hettp.loop import WARMUP_STEPS, ControlLoop, TimingReport, Verdict
from hettp.memory import MemoryCap
from hettp.planner import Planner
from hettp.transfer import CostModel, MigrationCost

from .model import unwrap_model
from .partition import comm_device
from .timing import ComputeTimer


class DecisionFailed(str):
    """What the deciding rank sends its peers instead of a decision (or a price) it failed to
    take: every rank then raises, and none is left waiting in the broadcast."""


def raise_if_failed(value, what: str):
    if isinstance(value, DecisionFailed):
        raise RuntimeError(f"{what} failed on the deciding rank: {value}")
    return value


@dataclass(frozen=True)
class _SplitWork:
    """This rank's work at one split: in all, and by kind (attention GEMMs, core attention,
    MLP; HetPartition.block_work)."""

    plan: object
    shares: tuple[float, ...]
    work: float
    kinds: tuple[float, float, float]


class Controller:
    def __init__(
        self,
        config: HetTPConfig,
        model,
        unit_work: dict | None,
        cost_model: CostModel | None = None,
        partition=None,
    ):
        self.group = parallel_state.get_tensor_model_parallel_group()
        self.tp_rank = dist.get_rank(self.group)
        self.tp_size = dist.get_world_size(self.group)
        self.dp_group = parallel_state.get_data_parallel_group()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.scenario = config.scenario
        device = config.scenario is not None and config.scenario.mode == "device"
        self.timer = ComputeTimer(
            model,
            config.timer,
            config.emulate_dilation,
            device,
            emulated=config.scenario is not None,
        )
        planner = None  # without a decision to take, the ranks are only timed
        migration_cost = MigrationCost(cost_model) if config.migrates else None
        if config.decides and unit_work is not None:
            memory = None
            if config.memory_cap is not None and partition is not None:
                memory = MemoryCap(config.memory_cap, partition.unit_params)
            planner = Planner(
                config.policy,
                unit_work,
                config.max_resize,
                migration_seconds=migration_cost.seconds if migration_cost else None,
                memory=memory,
            )
        self.decides = planner is not None
        self.migrates = self.decides and migration_cost is not None
        self.loop = ControlLoop(
            planner,
            StragglerDetector(
                self.tp_size,
                config.onset,
                config.end,
                config.patience,
                config.window,
                at_once=config.onset_at_once,
                end_patience=config.end_patience,
            ),
            migration_cost,
            interval=config.interval,
        )
        self._work: _SplitWork | None = None  # the split the last work() call was for
        # Core attention is priced from the first steps' timings by block kind, once: the
        # units of the planner's work change with it, so before anything is learned in them.
        self.partition = partition if self.decides else None
        self._samples: list[BlockSample] = []
        self._steps_timed = 0
        self.priced: tuple[float, float] | None = None  # (FLOP weight, measured) once priced
        # Attention's per-call part is probed once, after the first step, at the micro-batch
        # that step ran (hettp.attention_probe): before any block sample is taken in the units
        # it changes. Only moves deal attention, so only they need it.
        self.call_price: CallPrice | None = None
        self._tokens = None  # (sequence, micro-batch, device, dtype) core attention last saw
        self._probe_hook = None
        if self.partition is not None and config.migrates:
            core = unwrap_model(model).decoder.layers[0].self_attention.core_attention
            self._probe_hook = core.register_forward_pre_hook(self._saw_tokens)
        # Under --het-dp: each replica's micro-batch counts (its reports are scaled to the even
        # split's, so that a rebatch is no change of speed to the TP loop) and its last step.
        self.counts: tuple[int, ...] | None = None
        self.replica_steps: list | None = None  # per replica: TimingReport, as measured
        # With data parallelism one rank decides for every replica: they share a plan, and
        # what the loop learns from migrations' measured times differs between ranks.
        self.decider_group = self.group
        if self.dp_size > 1:
            self.decider_group = parallel_state.get_tensor_and_data_parallel_group()

    def begin_step(self, iteration: int) -> None:
        """Before the step that will be `iteration`: arm the timer (and the emulated factor)."""
        factor = (
            self.scenario.factor(
                self.tp_rank,
                iteration,
                dist.get_rank(),
                parallel_state.get_pipeline_model_parallel_rank(),
            )
            if self.scenario
            else 1.0
        )
        self.timer.reset(factor)

    def end_step(
        self, iteration: int, wall_seconds: float, work, plan, shares, unit_bytes
    ) -> tuple[TimingReport, Verdict] | None:
        """After the step: gather its timings (a few floats per rank) and pass them to the
        loop, which detects; where the planner must run, TP rank 0 plans and sends the decision.
        `work()` is this TP group's per-rank active work (called when the split changed) and
        `unit_bytes()` what one unit carries (called only where a decision is taken). Returns
        the report and the verdict every rank agrees on, where the planner ran."""
        self.timer.end_step()
        if self._probe_hook is not None:
            self._price_attention_call()
        if self._work is None or self._work.plan is not plan or self._work.shares != shares:
            kinds = (
                self.partition.block_work(plan, shares)[self.tp_rank]
                if self.partition is not None
                else (0.0, 0.0, 0.0)
            )
            self._work = _SplitWork(plan, tuple(shares), work()[self.tp_rank], kinds)
        step = self._gather(
            iteration,
            [self.timer.read(), self._work.work, wall_seconds, self.timer.read_fixed()],
            [self.timer.read_busy(), self.timer.read_attention(), *self._work.kinds],
        )
        verdict = self._decide(step, plan, shares, unit_bytes)
        self._price_core_attention(work)
        return verdict

    def _decide(self, step, plan, shares, unit_bytes):
        due = self.loop.step(step)  # the same on every rank: the same timings went in
        if due is None:
            return None
        decide = dist.get_rank(self.decider_group) == 0
        shared = self.decides and dist.get_world_size(self.decider_group) > 1
        failed = None
        try:
            verdict = self.loop.observe(
                due.report,
                due.detection,
                plan,
                shares,
                decide,
                unit_bytes() if decide and self.migrates else None,
            )
        except Exception as err:  # noqa: BLE001 - the peers learn of it below, then all raise
            if not (decide and shared):
                raise
            failed = DecisionFailed(f"{type(err).__name__}: {err}")
        if shared:
            box = [failed if failed is not None else verdict.decision]
            dist.broadcast_object_list(
                box,
                src=dist.get_global_rank(self.decider_group, 0),
                group=self.decider_group,
            )
            raise_if_failed(box[0], f"het-TP's decision at iteration {due.report.iteration}")
            verdict = dataclasses.replace(verdict, decision=box[0])
        self.loop.close(due, verdict)
        return due.report, verdict

    def _price_core_attention(self, work) -> None:
        """From the steps after the first (cold) one up to the end of the loop's warm-up, in
        which nothing is detected, planned or learned: price core attention, reweigh the
        units, and let the loop start over in the new units."""
        self._steps_timed += 1
        if not self._pricing or self._steps_timed < WARMUP_STEPS:
            return
        scale = core_attention_scale(self._samples)
        before = self.partition.core_scale
        if scale is not None:
            self._reweigh(scale, work)
        self.priced = (before, self.partition.core_scale)
        self._samples = []

    def _saw_tokens(self, module, args) -> None:
        query = args[0]
        self._tokens = (query.shape[0], query.shape[1], query.device, query.dtype)

    def _price_attention_call(self) -> None:
        """Probe attention's per-call part on the deciding rank (a rank of each TP group's
        stage would do; the decider's is the one the plans are made with), and give every rank
        the same price: they all weigh the work they report in the same units."""
        if self._tokens is None:  # every rank ran the same layers: all raise, none waits
            raise RuntimeError("het-TP: the first step ran no attention to probe the shape of")
        price = [None]
        shared = dist.get_world_size(self.decider_group) > 1
        if dist.get_rank(self.decider_group) == 0:
            seq, batch, device, dtype = self._tokens
            try:
                price = [probe(self.partition.probe_shape(seq, batch, device, dtype))]
            except Exception as err:  # noqa: BLE001 - as a failed decision: every rank raises
                if not shared:
                    raise
                price = [DecisionFailed(f"{type(err).__name__}: {err}")]
        if shared:
            dist.broadcast_object_list(
                price, src=dist.get_global_rank(self.decider_group, 0), group=self.decider_group
            )
        self._set_call_price(raise_if_failed(price[0], "het-TP's attention probe"))

    def _set_call_price(self, price: CallPrice) -> None:
        self._probe_hook.remove()
        self._probe_hook = None
        self.call_price = price
        self.partition.price_attention_call(price.work)
        self.loop.planner.unit_work.update(self.partition.unit_work)
        self._work = None

    @property
    def _pricing(self) -> bool:
        """Core attention is still to be priced (the block samples are still wanted)."""
        return self.partition is not None and self.priced is None

    def _reweigh(self, scale: float, work=None) -> None:
        """`work()`: the TP group's per-rank work at the current split, in the new weights."""
        self.partition.price_core_attention(scale)
        self.loop.planner.unit_work.update(self.partition.unit_work)
        self.loop.reweighed(work() if work is not None else None)
        self._work = None

    def work_scaled(self, factor: float) -> None:
        """Each step now does `factor` times the work (the micro-batch count changed)."""
        self.loop.work_scaled(factor)

    def applied(self) -> None:
        """The verdict's decision was applied everywhere: anchor the slowdowns and re-base
        the detector; the report interval starts over."""
        self.loop.applied()

    def layers_changed(self, model) -> None:
        """Layers moved between pipeline stages: time the ones held now, and let the planner
        forget the steps measured under the stage's old layers (they are not this stage's)."""
        self.timer.rehook(model)
        self._work = None
        if self.loop.planner is not None:  # a policy that moves only layers has none
            self.loop.planner.forget_measured()

    def close(self) -> None:
        self.timer.remove()

    def state_dict(self) -> dict:
        core = self.partition.core_scale if self.partition is not None else None
        priced = list(self.priced) if self.priced is not None else None
        call = dataclasses.asdict(self.call_price) if self.call_price is not None else None
        return {"loop": self.loop.state_dict(), "core_scale": core, "priced": priced, "call": call}

    def load_state_dict(self, state: dict) -> None:
        """A resumed run keeps the saved run's prices of core attention and of attention's
        per-call part (its fit is in those units); one saved before they were priced prices
        them again."""
        if self.partition is not None and state.get("priced") is not None:
            self._reweigh(state["core_scale"])
            self.priced = tuple(state["priced"])
        if self._probe_hook is not None and state.get("call") is not None:
            call = state["call"]
            self._set_call_price(
                CallPrice(call["call_s"], call["gemm_s_per_param"], tuple(call["sizes_s"]))
            )
        self.loop.load_state_dict(state["loop"])

    def _gather(self, iteration, row, extra) -> TimingReport:
        """This TP group's step from each rank's `row` (compute, work, wall, fixed) and `extra`
        (busy, then its attention seconds and its work by kind); with data parallelism, the
        slowest replica's at each TP position (replicas share a plan), each replica's scaled
        to the even split's micro-batch count under --het-dp. Every rank of every replica
        keeps the same block samples."""
        mine = torch.tensor([*row, *extra], dtype=torch.float64, device=comm_device())
        rows = [torch.empty_like(mine) for _ in range(self.tp_size)]
        dist.all_gather(rows, mine, group=self.group)
        table = torch.stack(rows)  # [tp, (compute, work, wall, fixed, busy, attn, kinds...)]
        tables = [table]
        if self.dp_size > 1:
            tables = [torch.empty_like(table) for _ in range(self.dp_size)]
            dist.all_gather(tables, table, group=self.dp_group)
        # the block samples that price core attention: from the steps after the first (cold)
        # one, until it is priced
        sampled = self._pricing and self._steps_timed >= 1
        reports = []
        for t in tables:
            rows = t.cpu().tolist()
            if sampled:
                self._samples += [
                    BlockSample(r[5], r[0] - r[3] - r[5], r[6], r[7], r[8]) for r in rows
                ]
            reports.append(
                TimingReport(
                    iteration,
                    tuple(r[0] for r in rows),
                    tuple(r[1] for r in rows),
                    max(r[2] for r in rows),
                    tuple(r[3] for r in rows),
                    tuple(r[4] for r in rows),
                    tuple(r[5] for r in rows),
                )
            )
        if self.counts is not None:
            self.replica_steps = reports
            even = sum(self.counts) / len(self.counts)
            reports = [_per_microbatches(r, even / n) for r, n in zip(reports, self.counts)]
        return TimingReport.slowest_replica(reports)


def _per_microbatches(report: TimingReport, scale: float) -> TimingReport:
    """`report` with the compute that scales with micro-batches (all but the fixed part)
    scaled by `scale`."""
    fixed = report.fixed or (0.0,) * len(report.compute)

    def scaled(values):
        return tuple(f + (v - f) * scale for v, f in zip(values, fixed))

    return dataclasses.replace(
        report,
        compute=scaled(report.compute),
        busy=scaled(report.busy) if report.busy is not None else None,
        attention=(
            tuple(a * scale for a in report.attention) if report.attention is not None else None
        ),
    )
