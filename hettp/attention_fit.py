"""Attention's per-call part as a run's own timings price it, once its ranks hold different
attention work.

hettp.attention_probe prices the call before any move, in plain torch at the run's shapes,
because until a move every rank holds the same heads and a per-call cost and a per-unit one read
the same. After a move they do not: an unslowed rank that computed attention at two works gives
two points of a line, seconds per layer against work per layer, whose intercept is what a call
costs whatever the rank holds. The run's call includes what the probe leaves out (megatron-core's
modules and autograd nodes, the timer's marks), so the two can differ.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .costfit import theil_sen
from .plan import PartitionPlan
from .step_model import block_works

# A rank is read as unslowed below this slowdown: a straggler's seconds over its factor carry the
# factor's error, in proportion to all it computes.
UNSLOWED = 1.15


@dataclass(frozen=True)
class AttentionSample:
    """One rank's attention over one report interval, at full speed."""

    seconds: float  # its attention modules' seconds a step, over its slowdown factor
    work: float  # its attention units' work (with head units, their K/V replicas'), no call
    calls: int  # layers in which it computes any attention unit


@dataclass(frozen=True)
class MeasuredCall:
    """The line through the samples, per layer: `call_s + per_work_s x work`."""

    call_s: float  # seconds a step of one layer's call
    per_work_s: float  # seconds a step per unit of work
    samples: int

    @property
    def work(self) -> float:
        """The call in the planner's unit of work (what `unit_work["call"]` holds)."""
        return self.call_s / self.per_work_s


def attention_samples(
    plan: PartitionPlan,
    unit_work: Mapping[str, float],
    attention_s: Sequence[float],
    factors: Sequence[float],
    unslowed: float = UNSLOWED,
) -> list[AttentionSample]:
    """The samples of one report: each unslowed rank's attention seconds under `plan` (which
    must be the plan of the whole interval) against its work in `unit_work`."""
    if len(attention_s) != plan.tp_size or len(factors) != plan.tp_size:
        raise ValueError(
            f"{len(attention_s)} attention times and {len(factors)} factors for "
            f"{plan.tp_size} TP ranks"
        )
    attn = block_works(plan, {**unit_work, "call": 0.0})[0::2]  # attention, then MLP, per layer
    out = []
    for rank, (seconds, factor) in enumerate(zip(attention_s, factors)):
        if factor is None or not 0.0 < factor < unslowed:
            continue
        works = [layer[rank] for layer in attn]
        calls = sum(w > 0 for w in works)
        if calls:
            out.append(AttentionSample(seconds / factor, sum(works), calls))
    return out


def measured_call(samples: Sequence[AttentionSample]) -> MeasuredCall | None:
    """The call from `samples` (hettp.costfit.theil_sen over seconds and work per layer): None
    where their works do not spread far enough for a line (no move yet), or the line they give
    has no positive slope or a negative call."""
    points = [(s.work / s.calls, s.seconds / s.calls) for s in samples if s.calls > 0]
    line = theil_sen(points)
    if line is None:
        return None
    return MeasuredCall(line.fixed, line.per_unit, len(points))
