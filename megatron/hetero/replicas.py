"""Heterogeneous data parallelism (--het-dp): the data-parallel replicas' micro-batch counts,
their measured paces, and the step boundaries where the counts change.

The counts split each global batch's micro-batches (hettp/rebatch.py deals them and weights
the losses, so the update is the even split's). Every step the controller's timings of every
replica (already gathered over the data-parallel group for the TP loop) give each replica's
seconds per micro-batch; with pipeline stages a replica goes at its slowest stage's pace (one
small all-reduce over the pipeline group). Every `--het-tp-interval` steps since the last
change, the medians are a `ReplicaReport`; the runtime decides on it (global rank 0, sent to
every rank) and `set`s the counts everywhere at the same boundary.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from hettp import rebatch
from hettp.loop import WARMUP_STEPS, TimingReport

from .partition import comm_device


@dataclass(frozen=True)
class ReplicaReport:
    """The medians of a report interval, per data-parallel replica."""

    iteration: int
    counts: tuple[int, ...]  # micro-batches each replica ran
    seconds: tuple[float, ...]  # seconds per micro-batch (its slowest TP rank's, and stage's)
    fixed: tuple[float, ...]  # seconds per step that do not scale with micro-batches
    timings: tuple[TimingReport, ...]  # each replica's TP group, as measured (this stage's)
    steps: int  # steps in the interval
    wall: float  # their wall seconds in all


class ReplicaBatches:
    def __init__(self, dp_size: int, interval: int, dp_rank: int | None = None):
        self.dp_size, self.interval = dp_size, interval
        self.dp_rank = parallel_state.get_data_parallel_rank() if dp_rank is None else dp_rank
        self.counts: tuple[int, ...] | None = None  # None: the even split
        self._paces = None  # (seconds, fixed) per replica of the report the counts came from
        self._steps: list[tuple[int, tuple, tuple, tuple, float]] = []
        self._seen = 0  # steps observed since this run started (or resumed)

    # ---- the split ----------------------------------------------------------------------

    def split(self, per_replica: int) -> tuple[int, ...]:
        """Every replica's count for a global batch of `per_replica` micro-batches a replica
        (the even split's): the counts in force, scaled when a batch ramp changed the total."""
        total = per_replica * self.dp_size
        if self.counts is None:
            return rebatch.even_counts(total, self.dp_size)
        if sum(self.counts) != total:  # a batch ramp: the split of the paces the counts came from
            if self._paces is not None and total >= self.dp_size:
                self.counts = rebatch.split(total, *self._paces)
            else:
                self.counts = rebatch.rescaled(self.counts, total)
        return self.counts

    @property
    def paced(self) -> bool:
        """Whether a batch ramp re-splits the counts by the paces they were decided on (else
        in proportion to them)."""
        return self._paces is not None

    def loss_weight(self, counts, per_token_loss: bool) -> float:
        """What this replica's micro-batch losses are multiplied by (1 under per-token loss:
        megatron-core then divides the gradients by the tokens of every replica)."""
        return 1.0 if per_token_loss else rebatch.loss_weight(counts, self.dp_rank)

    def set(self, counts, report: ReplicaReport | None = None) -> None:
        """New counts from this step boundary on (every rank), decided on `report`; the
        interval starts over."""
        self.counts = rebatch.check_counts(counts, sum(counts))
        self._paces = (report.seconds, report.fixed) if report is not None else None
        self._steps = []

    def restart(self) -> None:
        """The ranks' work changed (a TP decision): paces measured before it are stale, and a
        batch ramp re-splits the counts in proportion, not by them."""
        self._steps = []
        self._paces = None

    # ---- timing -------------------------------------------------------------------------

    def observe(self, iteration: int, counts, timings, wall: float) -> ReplicaReport | None:
        """One step: `timings`, every replica's TP group as the controller gathered them (the
        same on every rank of a stage). Returns the interval's report when it is complete.
        The first steps of a run (allocations, the optimizer's lazy state) are left out."""
        self._seen += 1
        if self._seen <= WARMUP_STEPS:
            return None
        seconds, fixed = [], []
        for report, n in zip(timings, counts):
            rows = report.fixed or (0.0,) * len(report.compute)
            busy = report.busy or report.compute
            # a dilated run's stretched GEMMs are in compute, not in the CPU time of busy
            seconds.append(max(max(b, c) - f for b, c, f in zip(busy, report.compute, rows)) / n)
            fixed.append(max(rows))
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            both = torch.tensor(seconds + fixed, dtype=torch.float64, device=comm_device())
            dist.all_reduce(
                both,
                op=dist.ReduceOp.MAX,
                group=parallel_state.get_pipeline_model_parallel_group(),
            )
            values = both.cpu().tolist()
            seconds, fixed = values[: self.dp_size], values[self.dp_size :]
        self._steps.append((iteration, tuple(seconds), tuple(fixed), tuple(timings), wall))
        if len(self._steps) < self.interval:
            return None
        steps, self._steps = self._steps, []
        per_replica = range(self.dp_size)
        return ReplicaReport(
            iteration,
            tuple(counts),
            tuple(max(1e-9, statistics.median(s[1][r] for s in steps)) for r in per_replica),
            tuple(statistics.median(s[2][r] for s in steps) for r in per_replica),
            tuple(TimingReport.median([s[3][r] for s in steps]) for r in per_replica),
            len(steps),
            sum(s[4] for s in steps),
        )

    # ---- checkpoints --------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The counts and the paces they came from: a batch ramp after a resume re-splits by
        them as the run would have (the checkpoint at a ramp's change is saved before it)."""
        paces = None if self._paces is None else [list(x) for x in self._paces]
        return {"counts": list(self.counts) if self.counts is not None else None, "paces": paces}

    def load_state_dict(self, state: dict | None) -> str | None:
        """Take up a checkpoint's counts where they fit this run; else why not."""
        counts = (state or {}).get("counts")
        if counts is None:
            return None
        if len(counts) != self.dp_size:
            return f"its micro-batch counts {counts} are for {len(counts)} data-parallel replicas"
        try:
            self.counts = rebatch.check_counts(counts, sum(counts))
        except rebatch.RebatchError as err:
            return str(err)
        paces = state.get("paces")  # absent from older checkpoints: re-split in proportion
        self._paces = None if paces is None else (tuple(paces[0]), tuple(paces[1]))
        return None
