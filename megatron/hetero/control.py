"""The control loop: time every rank, detect stragglers, decide, and apply at a step boundary.

Every `--het-tp-interval` iterations each rank's median compute time per step (timing.py) and its
active work are all-gathered over the TP group and, with data parallelism, the slowest replica
per TP position is taken (replicas share a plan). TP rank 0 of the group runs the detector and
the planner (hettp, pure), broadcasts the decision, and every rank applies it before the next
step: a migration (lossless, HetPartition via the Resizer) and/or new resize shares.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from hettp.costfit import ComputeFit
from hettp.detect import StragglerDetector
from hettp.emulate import Scenario
from hettp.planner import Planner, StepModel, plan_work
from hettp.transfer import plan_transfer

from .partition import comm_device
from .timing import ComputeTimer

# Migration time as a multiple of the predicted transfer time: packing, committing and
# rebuilding DDP and the optimizer come on top (scripts/bench_migration.py: total/transfer
# 1.3-1.8 at TP=4).
REBUILD_FACTOR = 2.0


class Controller:
    def __init__(self, args, state):
        self.policy = args.het_tp_policy
        self.interval = args.het_tp_interval
        self.group = parallel_state.get_tensor_model_parallel_group()
        self.tp_rank = dist.get_rank(self.group)
        self.tp_size = dist.get_world_size(self.group)
        self.dp_group = parallel_state.get_data_parallel_group()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.scenario = (Scenario.parse(args.het_tp_emulate, self.tp_size)
                         if args.het_tp_emulate else None)
        self.timer = ComputeTimer(state.model, args.het_tp_timer, args.het_tp_emulate_dilation)
        self.fit = ComputeFit()
        self.detector = StragglerDetector(self.tp_size, args.het_tp_onset, args.het_tp_end,
                                          args.het_tp_patience, args.het_tp_window,
                                          at_once=args.het_tp_onset_at_once)
        self.unit_work = state.resizer.unit_work if state.resizer is not None else None
        self.planner = None  # none, static and zero with fixed shares only time the ranks
        if state.resizer is not None and args.het_tp_policy != "static" and not (
                args.het_tp_policy == "zero" and args.het_tp_resize_shares is not None):
            self.planner = Planner(self.policy, self.unit_work, args.het_tp_max_resize,
                                   self._migration_seconds)
        self._partition = state.partition
        if self.planner is not None:
            # weights and fp32 master or weights, and two Adam moments: 4 bytes each at most
            self._unit_bytes = {b: n * 4 * 4 for b, n in self.unit_work.items()}
        self._compute, self._wall = [], []

    def close(self) -> None:
        """At teardown: remove the timer's hooks, and the all_reduce patch a wall-clock or
        dilated timer installed (timing.py). Calling it again does nothing."""
        self.timer.remove()

    # ---- per step -------------------------------------------------------------------------

    def begin_step(self, iteration: int) -> None:
        """Before the step that will be `iteration`: arm the timer (and the emulated factor)."""
        factor = self.scenario.factor(self.tp_rank, iteration) if self.scenario else 1.0
        self.timer.reset(factor)

    def end_step(self, iteration: int, state, logger, wall_seconds: float):
        """After the step: record; every interval, report, decide and apply everywhere."""
        self._compute.append(self.timer.read())
        self._wall.append(wall_seconds)
        if iteration % self.interval:
            return None
        # The median step: one slow step (a hiccup, a burst's tail) does not make a report
        # slow, and a straggle shows once it covers most of the interval.
        compute = statistics.median(self._compute)
        wall = statistics.median(self._wall)
        self._compute, self._wall = [], []
        work = self._work(state)
        mine = torch.tensor([compute, work[self.tp_rank], wall], dtype=torch.float64,
                            device=comm_device())
        gathered = [torch.empty_like(mine) for _ in range(self.tp_size)]
        dist.all_gather(gathered, mine, group=self.group)
        table = torch.stack(gathered)  # [tp, (compute, work, wall)]
        if self.dp_size > 1:  # plan for the slowest replica at each TP position
            dist.all_reduce(table, op=dist.ReduceOp.MAX, group=self.dp_group)
        table = table.cpu().tolist()
        computes = [row[0] for row in table]
        works = [row[1] for row in table]
        wall = max(row[2] for row in table)
        factors = self.fit.factors(works, computes)

        decision, detection = None, None
        if self.tp_rank == 0 and self.planner is not None:
            detection = self.detector.update(factors)
            per_unit = self.fit.per_unit(works, computes)
            # Plan on the detector's verdict: measured factors for stragglers, 1 for the rest
            # (their spread is noise; planning on it would shuffle units for nothing).
            known = [f for f in factors if f is not None]
            fastest = min(known) if known else 1.0
            model = StepModel(max(0.0, wall - max(computes)),
                              tuple(max(1.0, (f or max(known)) / fastest)
                                    if r in detection.stragglers else 1.0
                                    for r, f in enumerate(factors)), per_unit * fastest)
            decision = self.planner.decide(iteration, detection, model, state.partition.plan,
                                           state.resizer.shares)
        slow = {r for r, f in enumerate(factors) if f is not None and f >= self.detector.onset}
        self.fit.add(works, computes, slow | (detection.stragglers if detection else set()))
        if self.planner is not None and self.tp_size > 1:
            box = [decision, detection]
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0),
                                       group=self.group)
            decision, detection = box
        logger.timing(iteration, computes, works, factors, wall,
                      detection.slowdown if detection is not None else None)
        if decision is not None:
            self._apply(iteration, state, logger, decision, detection)
            if self.tp_rank == 0:
                self.detector.rebase()
        return decision

    # ---- internals ----------------------------------------------------------------------

    def _apply(self, iteration, state, logger, decision, detection):
        from hettp.exchange import TransferError

        resizer = state.resizer
        before = state.partition.plan
        try:
            if decision.migrates:
                resizer.resize(state, decision.shares)  # the move replaces the resize
                resizer.repartition(state, decision.plan, step=iteration)
            else:
                resizer.resize(state, decision.shares)
        except TransferError as err:  # every rank raises it; all keep their state
            logger.info(f"> het-TP decision at iteration {iteration} not applied: {err}")
            return
        logger.decision(iteration, decision, detection, state.partition.last_transfer
                        if decision.migrates else None, before)

    def _work(self, state):
        if state.resizer is None:  # vanilla or static: every rank the same even share
            return [1.0] * self.tp_size
        return plan_work(state.partition.plan, self.unit_work, state.resizer.shares)

    def _migration_seconds(self, old, new) -> float:
        partition = self._partition
        schedule = plan_transfer(old, new, lambda block: self._unit_bytes[block])
        if not schedule.moves:
            return 0.0
        _, predictions = partition.cost_model.choose(schedule)
        return REBUILD_FACTOR * min(predictions.values())
