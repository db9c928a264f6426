"""Heterogeneous data parallelism, pure: how many micro-batches of each global batch every
data-parallel replica runs, which ones, and when to change the split.

A global batch is `total` micro-batch slots. Megatron-LM hands slot k * D + r to replica r
(D replicas, n = total / D each). With uneven counts the slots are dealt the same way, round
after round, skipping replicas that have their count, so even counts reproduce Megatron-LM's
assignment exactly and any counts cover the same samples. The update stays the even split's
when each replica weights its micro-batch losses by `loss_weight` (the schedule divides by the
replica's own count, the DP reduce by D); exactly so at dropout 0 (a micro-batch that changes
replica draws its dropout masks from that replica's RNG stream).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass


class RebatchError(ValueError):
    """Micro-batch counts that cannot split a global batch."""


def check_counts(counts: Sequence[int], total: int) -> tuple[int, ...]:
    counts = tuple(int(n) for n in counts)
    if not counts or any(n < 1 for n in counts) or sum(counts) != total:
        raise RebatchError(
            f"micro-batch counts {list(counts)} must be >= 1 each and sum to the global "
            f"batch's {total} micro-batches"
        )
    return counts


def even_counts(total: int, replicas: int) -> tuple[int, ...]:
    if replicas < 1 or total % replicas:
        raise RebatchError(f"{total} micro-batches do not split evenly over {replicas} replicas")
    return (total // replicas,) * replicas


def slots(counts: Sequence[int], replica: int) -> list[int]:
    """The global batch's micro-batch slots `replica` runs, in order (module docstring)."""
    left = list(counts)
    mine, slot = [], 0
    while any(left):
        for r, n in enumerate(left):
            if n:
                if r == replica:
                    mine.append(slot)
                left[r] -= 1
                slot += 1
    return mine


def loss_weight(counts: Sequence[int], replica: int) -> float:
    """What `replica` multiplies its micro-batch losses by so that the update equals the even
    split's: each of the `total` micro-batches then weighs 1 / total after the schedule's
    division by the replica's count and the reduce's by the replica count."""
    return counts[replica] * len(counts) / sum(counts)


def split(total: int, seconds: Sequence[float], fixed: Sequence[float] | None = None):
    """Counts (>= 1 each, summing to `total`) that minimise the slowest replica's step,
    `fixed[r] + counts[r] * seconds[r]` (seconds per micro-batch; fixed: per step, e.g. the
    optimizer step). Greedy by the next micro-batch's finish time: exact for this min-max."""
    replicas = len(seconds)
    if total < replicas:
        raise RebatchError(f"{total} micro-batches cannot give each of {replicas} replicas one")
    if any(not s > 0 for s in seconds):
        raise RebatchError(f"seconds per micro-batch must be positive, got {list(seconds)}")
    fixed = tuple(fixed) if fixed is not None else (0.0,) * replicas
    counts = [1] * replicas
    heap = [(fixed[r] + 2 * seconds[r], r) for r in range(replicas)]
    heapq.heapify(heap)
    for _ in range(total - replicas):
        _, r = heapq.heappop(heap)
        counts[r] += 1
        heapq.heappush(heap, (fixed[r] + (counts[r] + 1) * seconds[r], r))
    return tuple(counts)


def step_seconds(counts, seconds, fixed=None) -> float:
    fixed = fixed if fixed is not None else (0.0,) * len(counts)
    return max(f + n * s for n, s, f in zip(counts, seconds, fixed))


def rescaled(counts: Sequence[int], total: int) -> tuple[int, ...]:
    """`counts` scaled to a global batch of `total` micro-batches (a batch-size ramp), keeping
    their proportions (largest remainders), >= 1 each."""
    replicas = len(counts)
    if total < replicas:
        raise RebatchError(f"{total} micro-batches cannot give each of {replicas} replicas one")
    whole = sum(counts)
    exact = [total * n / whole for n in counts]
    out = [max(1, int(e)) for e in exact]
    while sum(out) > total:
        r = max((r for r in range(replicas) if out[r] > 1), key=lambda r: out[r] - exact[r])
        out[r] -= 1
    while sum(out) < total:
        r = max(range(replicas), key=lambda r: exact[r] - out[r])
        out[r] += 1
    return tuple(out)


# A rebatch must shorten the predicted step by this share: timing noise between reports stays
# below it, so a steady cluster keeps its split.
REBATCH_MIN_GAIN = 0.05


@dataclass(frozen=True)
class Rebatch:
    """A change of the replicas' micro-batch counts (the JSONL `decision` record's)."""

    before: tuple[int, ...]
    after: tuple[int, ...]
    seconds: tuple[float, ...]  # measured seconds per micro-batch, per replica
    predicted_before: float  # seconds per step of the slowest replica
    predicted_after: float
    reason: str


def decide(
    counts: Sequence[int],
    seconds: Sequence[float],
    fixed: Sequence[float] | None = None,
    min_gain: float = REBATCH_MIN_GAIN,
) -> Rebatch | None:
    """The counts that balance the replicas' measured paces, where they gain `min_gain`."""
    counts = tuple(counts)
    new = split(sum(counts), seconds, fixed)
    before = step_seconds(counts, seconds, fixed)
    after = step_seconds(new, seconds, fixed)
    if new == counts or before - after <= min_gain * before:
        return None
    fastest = min(seconds)
    paces = ", ".join(f"{s / fastest:.2f}x" for s in seconds)
    return Rebatch(
        counts,
        new,
        tuple(seconds),
        before,
        after,
        f"replicas' seconds per micro-batch at {paces} of the fastest",
    )
