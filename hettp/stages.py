"""Layers per pipeline stage, chosen from measured stage speeds (pure).

A pipeline runs at its slowest stage's pace. Unit moves (hettp.planner) balance the TP ranks
inside a stage; they cannot help a stage whose ranks are all slow, and after them a stage with
one slow rank is still slower than its neighbours. Moving whole layers to the neighbour stages
can: a stage's time is what stays with it whatever its layers (the embedding on the first, the
output layer and loss on the last) plus its layer count times its seconds per layer, and the
split that minimises the largest of these is found by giving each layer, one at a time, to the
stage that would finish it soonest (optimal for per-stage affine costs).

The runtime (megatron/hetero/runtime.py) gathers every stage's report at a report step, calls
`balance_layers` on every rank with the same numbers (so every rank reaches the same split) and
moves the layers (megatron/hetero/layer_moves.py). Where units may move too, units go first:
no layer moves while a stage's TP ranks are uneven by the detector's onset (`tp_imbalance`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# A layer move must shorten the slowest stage by this fraction of its time: below it, timing
# noise would move layers back and forth.
LAYER_MOVE_MIN_GAIN = 0.1
# ... and repay its predicted cost within this many steps of the new pace.
LAYER_MOVE_PAYBACK_STEPS = 100


class StageError(ValueError):
    """A layer split that does not fit the pipeline (raised before anything moves)."""


@dataclass(frozen=True)
class LayerSplit:
    """A proposed split of the layers over the stages, with what it is predicted to do."""

    counts: tuple[int, ...]  # layers per stage, in stage order
    before: tuple[float, ...]  # seconds per step of each stage's layers now
    after: tuple[float, ...]  # the same, predicted for `counts`
    move_seconds: float  # predicted time of moving the layers

    @property
    def gain(self) -> float:
        """The fraction of the slowest stage's time the split saves."""
        return 1.0 - max(self.after) / max(self.before)

    def summary(self) -> str:
        return split_text(self.counts)


def split_text(counts: Sequence[int]) -> str:
    """Counts per pipeline stage (layers) or per data-parallel replica (micro-batches) as the
    logs and reports print them: 3/1."""
    return "/".join(str(n) for n in counts)


def tp_imbalance(layer_compute: Sequence[float]) -> float:
    """How unevenly one stage's TP ranks are loaded: its slowest rank's layer compute over its
    fastest's (1.0 for one rank). Unit moves inside the stage can even this out; while it is
    high, moving layers would act on a pace the units are about to change."""
    low = min(layer_compute)
    return max(layer_compute) / low if low > 0 else float("inf")


def check_split(counts: Sequence[int], num_layers: int, stages: int) -> None:
    if len(counts) != stages:
        raise StageError(f"layer split {list(counts)} names {len(counts)} stages, not {stages}")
    if sum(counts) != num_layers:
        raise StageError(f"layer split {list(counts)} holds {sum(counts)} layers, not {num_layers}")
    if min(counts) < 1:
        raise StageError(f"layer split {list(counts)} leaves a stage without layers")


def stage_of_layers(counts: Sequence[int]) -> list[int]:
    """The stage of every layer, in layer order."""
    return [stage for stage, n in enumerate(counts) for _ in range(n)]


def adjacent(old: Sequence[int], new: Sequence[int]) -> bool:
    """Whether every layer stays or moves to a neighbour stage (what one move can do)."""
    return all(abs(a - b) <= 1 for a, b in zip(stage_of_layers(old), stage_of_layers(new)))


def optimal_split(
    seconds_per_layer: Sequence[float],
    num_layers: int,
    stage_rest: Sequence[float] | None = None,
) -> tuple[int, ...]:
    """The counts (at least one layer a stage) that minimise max(rest + count x seconds per
    layer), `stage_rest` each stage's seconds outside its layers (default none); ties go to
    the earlier stage, so every rank computes the same split."""
    stages = len(seconds_per_layer)
    if num_layers < stages:
        raise StageError(f"{num_layers} layers cannot fill {stages} stages")
    rest = tuple(stage_rest) if stage_rest is not None else (0.0,) * stages
    counts = [1] * stages
    for _ in range(num_layers - stages):
        best = min(
            range(stages), key=lambda s: (rest[s] + (counts[s] + 1) * seconds_per_layer[s], s)
        )
        counts[best] += 1
    return tuple(counts)


def balance_layers(
    counts: Sequence[int],
    stage_seconds: Sequence[float],
    layer_move_seconds: float = 0.0,
    min_gain: float = LAYER_MOVE_MIN_GAIN,
    payback_steps: int = LAYER_MOVE_PAYBACK_STEPS,
    stage_rest: Sequence[float] | None = None,
) -> LayerSplit | None:
    """The split to move to, or None to keep `counts`.

    `stage_seconds[s]`: the measured seconds per step of stage s's layers (its slowest TP
    rank's layer compute, pipeline bubbles and p2p waits left out); `stage_rest[s]`: the same
    rank's seconds outside its layers, which stay whatever moves (default none);
    `layer_move_seconds`: the predicted time of moving one layer between neighbours. A split
    whose layers would skip a stage is reached over several moves: this one moves one layer
    off the slowest stage."""
    counts = tuple(counts)
    if len(stage_seconds) != len(counts):
        raise StageError(f"{len(stage_seconds)} stage timings for {len(counts)} stages")
    rest = tuple(float(r) for r in stage_rest) if stage_rest is not None else (0.0,) * len(counts)
    if len(rest) != len(counts) or min(rest) < 0:
        raise StageError(f"stage rest {list(rest)}: one non-negative time for each stage")
    if any(s <= 0 for s in stage_seconds):
        return None  # a stage without timed compute: nothing to scale by
    per_layer = [s / n for s, n in zip(stage_seconds, counts)]
    target = optimal_split(per_layer, sum(counts), rest)
    if not adjacent(counts, target):
        target = _one_layer_off_the_slowest(counts, per_layer, rest)
    if target is None or target == counts:
        return None
    before = tuple(r + float(s) for r, s in zip(rest, stage_seconds))
    after = tuple(r + n * c for r, n, c in zip(rest, target, per_layer))
    moved = sum(abs(a - b) for a, b in zip(stage_of_layers(counts), stage_of_layers(target)))
    split = LayerSplit(target, before, after, moved * layer_move_seconds)
    saved_per_step = max(before) - max(after)
    if split.gain < min_gain or saved_per_step * payback_steps <= split.move_seconds:
        return None
    return split


def _one_layer_off_the_slowest(counts, per_layer, rest) -> tuple[int, ...] | None:
    slowest = max(range(len(counts)), key=lambda s: (rest[s] + counts[s] * per_layer[s], -s))
    if counts[slowest] == 1:
        return None
    best = None
    for neighbour in (slowest - 1, slowest + 1):
        if 0 <= neighbour < len(counts):
            new = list(counts)
            new[slowest] -= 1
            new[neighbour] += 1
            cost = max(r + n * c for r, n, c in zip(rest, new, per_layer))
            if best is None or cost < best[0]:
                best = (cost, tuple(new))
    return best[1] if best else None
