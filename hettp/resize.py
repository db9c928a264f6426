"""Resizing: a straggling TP rank computes only its highest-priority units.

Pure data and arithmetic, no process group: how many units a share skips, the cap check, the
priority table and the plan whose local orders follow it. The Megatron side
(megatron/hetero/resize.py) applies them.

A rank's units are kept in priority order, so its active units are a prefix of its shard and
the skipped ones a suffix: the layers slice views, nothing is gathered on the hot path.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .plan import BLOCKS, PartitionPlan


class ResizeError(ValueError):
    """Resize shares that are malformed or exceed the cap."""


@dataclass(frozen=True)
class Scorer:
    """How a unit's priority is measured: an elementwise, non-negative evidence tensor, summed
    over each unit's weights.

    `per_step` scorers are observed after the sampled optimizer steps (one in
    --het-tp-priority-sample-interval) on the units that ran, and a unit's score is its mean
    per observed step since the last refresh; the others are taken at each
    refresh for every unit. `evidence(weight, grad, delta)` gets the weight after the step, the
    gradient the optimizer used, and (when `needs_delta`) the weight change of the step, a
    scratch tensor it may overwrite.
    """

    name: str
    evidence: Callable
    per_step: bool = True
    needs_delta: bool = False
    help: str = ""


SCORERS: dict[str, Scorer] = {}


def register_scorer(scorer: Scorer) -> Scorer:
    """Make `scorer` available to --het-tp-priority (register before parsing arguments)."""
    if scorer.name in SCORERS:
        raise ValueError(f"a priority scorer named '{scorer.name}' is already registered")
    SCORERS[scorer.name] = scorer
    return scorer


register_scorer(
    Scorer(
        "dw",
        lambda weight, grad, delta: delta.abs_(),
        needs_delta=True,
        help="accumulated |weight change| per step (the paper's accumulated |dW|)",
    )
)
register_scorer(
    Scorer(
        "magnitude",
        lambda weight, grad, delta: weight.abs(),
        per_step=False,
        help="|weight| at the refresh",
    )
)
register_scorer(
    Scorer(
        "wg",
        lambda weight, grad, delta: (weight * grad).abs_(),
        help="accumulated |weight x gradient| per step (first-order estimate of "
        "the loss change were the unit dropped)",
    )
)


def skipped_count(num_local_units: int, share: float) -> int:
    """Units a rank with `num_local_units` skips for a resize `share`: never more than the
    share (rounded down), so the realized share never exceeds the cap."""
    return math.floor(num_local_units * share + 1e-9)


def parse_shares(text: str, tp_size: int, cap: float, flag: str = "--het-tp-resize") -> tuple:
    """'0,0.25' -> (0.0, 0.25): per TP rank, the share of its units it skips."""
    try:
        shares = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise ResizeError(
            f"{flag} '{text}': expected one share per TP rank, e.g. "
            f"'{','.join(['0'] * (tp_size - 1) + ['0.5'])}'"
        ) from None
    if len(shares) != tp_size:
        raise ResizeError(f"{flag} '{text}': {len(shares)} shares given, the TP size is {tp_size}")
    check_shares(shares, cap, flag)
    return shares


def check_shares(shares: Sequence[float], cap: float, flag: str = "--het-tp-resize") -> None:
    """Raise ResizeError unless every share is in [0, cap] (the cap is --het-tp-max-resize)."""
    for rank, share in enumerate(shares):
        if not 0.0 <= share <= 1.0 or math.isnan(share):
            raise ResizeError(f"{flag}: rank {rank} share {share} is not within [0, 1]")
        if share > cap + 1e-12:
            raise ResizeError(
                f"{flag}: rank {rank} would skip {share:.0%} of its units, more "
                f"than --het-tp-max-resize {cap:g} allows"
            )


@dataclass
class Priorities:
    """Per (layer, block): one score per global unit, identical on every rank of a TP group.

    None marks a unit that was never measured: it ranks above every measured unit, so a unit
    skipped from the start is tried at the next refresh instead of staying skipped for good.
    """

    scores: dict  # (layer, block) -> list[float | None]

    @classmethod
    def unmeasured(cls, plan: PartitionPlan) -> Priorities:
        return cls(
            {(i, b): [None] * plan.num_units(b) for i in range(plan.num_layers) for b in BLOCKS}
        )

    def updated(self, measured: Mapping) -> Priorities:
        """New scores for the units in `measured` ((layer, block) -> {unit: score}); the others
        keep theirs (a skipped unit keeps the score it had when it last ran).

        Scores are relative: each refresh divides its measurements by their mean, so a score
        kept from an earlier interval (when, say, the learning rate was higher) compares
        fairly with fresh ones instead of always winning.
        """
        scores = {key: list(values) for key, values in self.scores.items()}
        for key, per_unit in measured.items():
            mean = sum(per_unit.values()) / len(per_unit) if per_unit else 0.0
            for unit, score in per_unit.items():
                scores[key][unit] = float(score) / mean if mean > 0 else float(score)
        return Priorities(scores)

    def order(self, key, units: Sequence[int]) -> tuple[int, ...]:
        """`units` from highest to lowest priority; ties keep their current order."""
        scores = self.scores[key]
        return tuple(sorted(units, key=lambda u: (scores[u] is not None, -(scores[u] or 0.0))))

    def ordered_plan(self, plan: PartitionPlan, ranks: Sequence[int]) -> PartitionPlan:
        """`plan` with the local order of `ranks` sorted by priority (owners unchanged)."""
        chosen = set(ranks)
        layers = []
        for index, layer in enumerate(plan.layers):
            layers.append(
                {
                    block: tuple(
                        self.order((index, block), units) if rank in chosen else units
                        for rank, units in enumerate(owners)
                    )
                    for block, owners in layer.items()
                }
            )
        return dataclasses.replace(plan, layers=tuple(layers))


def active_counts(plan: PartitionPlan, shares: Sequence[float]) -> dict:
    """(layer, block) -> per-rank number of active units (the prefix each rank computes)."""
    counts = {}
    for index in range(plan.num_layers):
        for block in BLOCKS:
            counts[(index, block)] = tuple(
                len(units) - skipped_count(len(units), shares[rank])
                for rank, units in enumerate(plan.layers[index][block])
            )
    return counts


def realized_share(
    plan: PartitionPlan,
    shares: Sequence[float],
    rank: int,
    weights: Mapping[str, float] | None = None,
) -> float:
    """The share of `rank`'s unit work skipped, with blocks weighted by `weights` (e.g. work
    per unit; default: one per unit). Differs from the asked share where counts round down."""
    weights = weights or {b: 1.0 for b in BLOCKS}
    counts = active_counts(plan, shares)
    total = skipped = 0.0
    for (index, block), active in counts.items():
        owned = len(plan.layers[index][block][rank])
        total += owned * weights[block]
        skipped += (owned - active[rank]) * weights[block]
    return skipped / total if total else 0.0


def skipped_units(plan: PartitionPlan, shares: Sequence[float]) -> dict:
    """(layer, block, rank) -> the units that rank skips: the suffix of its local order."""
    skipped = {}
    for (index, block), active in active_counts(plan, shares).items():
        for rank, units in enumerate(plan.layers[index][block]):
            skipped[(index, block, rank)] = frozenset(units[active[rank] :])
    return skipped


def swapped_units(old: PartitionPlan, new: PartitionPlan, shares: Sequence[float]) -> int:
    """How many units a re-sort brings back from skipped to active, over the whole group."""
    before, after = skipped_units(old, shares), skipped_units(new, shares)
    return sum(len(units - after[key]) for key, units in before.items())


# ---- frozen units and Adam's bias correction ---------------------------------------------


def resumed_moment_factor(beta: float, frozen_at: int, count: int) -> float:
    """What an Adam moment frozen after optimizer step `frozen_at` (>= 1) is multiplied by when
    its unit resumes at the optimizer's later `count`, so that bias-corrected at `count` it
    reads as it did when frozen: Adam's step count is per tensor (or per group), not per unit,
    and went on while the unit was skipped."""
    if frozen_at < 1 or count < frozen_at:
        raise ValueError(f"a moment frozen at step {frozen_at} cannot resume at step {count}")
    return (1.0 - beta**count) / (1.0 - beta**frozen_at)


def first_moment_factor(beta: float, count: int) -> float:
    """What the moment of a unit that had never been updated (frozen before the optimizer's first
    step: zero moments) is multiplied by after its first update, taken at the optimizer's
    `count`: it then holds (1 - beta) of the gradient (or its square), and times this factor
    it reads, bias-corrected, as a fresh Adam's after one step. The first update itself stays
    up to (1 - beta1) / sqrt(1 - beta2) times a fresh one's (3.2x at 0.9, 0.999, late in
    training): to change it, moments written before the step would have to come from that
    step's gradient, which megatron-core's optimizer unscales and clips inside the step."""
    if count < 1:
        raise ValueError(f"no update has been taken at step {count}")
    return (1.0 - beta**count) / (1.0 - beta)


@dataclass
class FrozenSince:
    """When each skipped unit was frozen: the optimizer's step count then, per key (a block, or
    a layer's K/V replica groups) and unit (or group) id, the same on every rank of the TP
    group. A unit that resumes waits in `resuming` until the optimizer's next step rescales its
    moments, so that a resize put back at the same boundary (a failed move) changes nothing."""

    since: dict = dataclasses.field(default_factory=dict)  # key -> {id: count}
    resuming: dict = dataclasses.field(default_factory=dict)  # key -> {id: count}

    def update(self, skipped: Mapping, count: int) -> None:
        """The units skipped from now on (`skipped`: key -> ids), at the optimizer's `count`.
        A unit skipped already keeps its count; one that resumed at this boundary and is
        skipped again takes back the count it resumed with (its moments are untouched). A
        count past the optimizer's means it started over (a checkpoint loaded without its
        state), and every unit's moments with it: such units count as frozen before any
        update."""
        for table in (self.since, self.resuming):
            for ids in table.values():
                ids.update({u: 0 for u, t in ids.items() if t > count})
        for key in set(self.since) | set(self.resuming) | set(skipped):
            now = set(skipped.get(key, ()))
            old, waiting = self.since.get(key, {}), self.resuming.get(key, {})
            kept = {u: old.get(u, waiting.get(u, count)) for u in sorted(now)}
            waiting = {u: t for u, t in waiting.items() if u not in now}
            # frozen and resumed between the same two steps: nothing to rescale
            waiting.update((u, t) for u, t in old.items() if u not in now and t != count)
            self._set(self.since, key, kept)
            self._set(self.resuming, key, waiting)

    def take_resuming(self) -> dict:
        """key -> {id: count frozen at} of the units that resumed since the last step; cleared."""
        resuming, self.resuming = self.resuming, {}
        return resuming

    def state_dict(self) -> dict:
        return {"since": _copy(self.since), "resuming": _copy(self.resuming)}

    @classmethod
    def from_state_dict(cls, state: Mapping) -> FrozenSince:
        return cls(_copy(state["since"]), _copy(state["resuming"]))

    @staticmethod
    def _set(table: dict, key, value: dict) -> None:
        if value:
            table[key] = value
        else:
            table.pop(key, None)


def _copy(table: Mapping) -> dict:
    return {key: {int(u): int(t) for u, t in ids.items()} for key, ids in table.items()}
