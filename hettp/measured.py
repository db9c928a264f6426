"""What one timing report measured, and what the planner reads from it besides its step model:
each block split anew by the ranks' measured seconds (the model prices a rank's units at one
slowdown and one rate, which a small GEMM's rate, the emulation's overshoot and attention's
per-call part as a run pays it escape), and moves the measurements contradict."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .dealing import proportional_plan, with_block, with_replicas
from .plan import PartitionPlan
from .step_model import block_works, plan_work, unit_counts

# measured_attention_split fits a per-call and a per-unit part to the ranks' attention seconds:
# only where the units a rank holds a layer differ by this ratio between two ranks. The
# per-call part is the intercept of a line through two points at n and k x n units, which
# carries each point's noise times k / (k - 1) and 1 / (k - 1): at 1.5x, 3 and 2 (a 2% jitter
# in a rank's seconds, the 95th percentile between reports, moves it by 7% of them); at 6 : 5
# groups, 6 and 5.
ATTENTION_FIT_SPREAD = 1.5


@dataclass(frozen=True)
class Measured:
    """What one report measured, that the planner judges plans and moves by."""

    step: float  # wall seconds per step
    compute: tuple[float, ...] = ()  # per rank, all of its timed compute (empty: not known)
    fixed: tuple[float, ...] = ()  # per rank, of that, the part no split changes (empty: 0)
    attention: tuple[float, ...] = ()  # per rank, of the blocks, attention's (empty: unknown)

    @property
    def blocks(self) -> tuple[float, ...]:
        """Per rank, seconds per step in the blocks: its timed compute less the fixed part."""
        fixed = self.fixed or (0.0,) * len(self.compute)
        return tuple(max(0.0, c - f) for c, f in zip(self.compute, fixed))

    @property
    def mlp(self) -> tuple[float, ...]:
        """Per rank, seconds per step in the MLP blocks (empty where attention's are unknown)."""
        if len(self.attention) != len(self.compute):
            return ()
        return tuple(max(0.0, b - a) for b, a in zip(self.blocks, self.attention))


@dataclass(frozen=True)
class MeasuredSplit:
    """A plan whose split of one block follows the measured rates, and what it is predicted
    to save."""

    plan: PartitionPlan
    block: str  # the block it splits anew ("attn" or "mlp"); the other is as it was
    measured: tuple[float, ...]  # per rank, that block's seconds a step in the report
    predicted: tuple[float, ...]  # ... and at the new split, at the rates seen
    gain: float  # seconds a step the block's slowest layers shorten by

    def applied(self, plan: PartitionPlan) -> PartitionPlan:
        """`plan` with this split's units of its block (both plans of one model)."""
        return with_block(plan, self.plan, self.block)

    def describe(self) -> str:
        name = "attention" if self.block == "attn" else "MLP"
        now = ", ".join(f"{t:.3f}" for t in self.measured)
        then = ", ".join(f"{t:.3f}" for t in self.predicted)
        return f"the {name} blocks took [{now}] s a step by rank, [{then}] at the rates measured"


def measured_mlp_split(plan: PartitionPlan, seen: Measured) -> MeasuredSplit | None:
    """`plan` with each layer's MLP split in proportion to the ranks' measured MLP speeds (MLP
    units a second, from `seen`'s MLP block seconds over the units held), attention as it is;
    None where a rank holds no MLP unit or attention's seconds are unknown. Every MLP block
    ends in a TP collective, so the slowest rank's MLP seconds are the step's. Read through
    the origin, a rate charges the per-call part to the units: at the new split the rank that
    gave units away is read faster than it will run and the one that took them slower, so the
    move falls short of balance, never past it, and the next report's rates take it further."""
    mlp = seen.mlp
    units = {"attn": 0.0, "mlp": 1.0}  # plan_work in MLP units
    held = plan_work(plan, units)
    if not mlp or min(held) == 0 or min(mlp) <= 0:
        return None
    rates = [t / n for t, n in zip(mlp, held)]  # seconds per MLP unit
    target = with_block(proportional_plan(plan, [1.0 / r for r in rates]), plan, "attn")
    if unit_counts(target) == unit_counts(plan):
        return None
    predicted = tuple(r * n for r, n in zip(rates, plan_work(target, units)))
    return MeasuredSplit(target, "mlp", mlp, predicted, max(mlp) - max(predicted))


def measured_attention_split(
    plan: PartitionPlan, seen: Measured, factors: Sequence[float], kv: float = 0.0
) -> MeasuredSplit | None:
    """`plan` with each layer's attention units dealt by what the report measured, the MLP as
    it is; None where the report cannot tell a unit's cost from the call's. A rank's
    attention seconds are taken as its slowdown (`factors`, the step model's) times a per-call
    part, paid in each layer where it holds a unit, plus a part per unit held; the two are
    fitted (least squares) over the ranks holding units, so they need two ranks whose units
    a layer differ by ATTENTION_FIT_SPREAD (not at an even split). Units are then dealt one by
    one, in each layer, to the rank that would finish first, and the layer's split changes
    only where that shortens its slowest rank. Whole groups are coarse: one group more or less
    is a large share of a rank's attention, and the probe's per-call price, against what a
    run pays, decides which count is the shorter (results/notes.md).

    Head units: a rank's units count each K/V replica it computes at `kv` head units (the
    step model's ratio: a replica's GEMM rows against a head's), in the fit and in the deal.
    Two seconds cannot part three costs; the model's ratio parts the replicas' from the
    heads', and the deal takes a rank's heads from as few groups as they fill."""
    attention, n = seen.attention, plan.tp_size
    if len(attention) != n or len(factors) != n:
        return None
    heads = plan.heads
    kv = kv if heads is not None else 0.0
    layers = range(plan.num_layers)
    held, calls = _held_and_calls(plan, kv)
    if not _spread_fits(held, calls):
        return None
    rows = [(calls[r], held[r], attention[r] / factors[r]) for r in range(n) if held[r]]
    cc = sum(c * c for c, _, _ in rows)
    ch = sum(c * h for c, h, _ in rows)
    hh = sum(h * h for _, h, _ in rows)
    cy = sum(c * y for c, _, y in rows)
    hy = sum(h * y for _, h, y in rows)
    det = cc * hh - ch * ch
    if det <= 1e-9 * cc * hh:
        return None
    call, unit = (cy * hh - hy * ch) / det, (cc * hy - ch * cy) / det
    if call < 0:  # the ranks' seconds are below any per-call part: read through the origin
        call, unit = 0.0, hy / hh
    if unit <= 0:
        return None

    def seconds(r: int, work: float) -> float:
        return factors[r] * (call * (work > 0) + unit * work)

    def dealt(count: int) -> float:  # `count` units, with the fewest replicas they bring
        return with_replicas(count, heads.units_per_group, kv) if kv else count

    dealing = {}
    for index in layers:
        current = plan.counts(index, "attn")
        counts = [0] * n
        for _ in range(sum(current)):  # a tie goes to a rank below its current count
            rank = min(
                range(n),
                key=lambda r: (
                    round(seconds(r, dealt(counts[r] + 1)), 12),
                    counts[r] >= current[r],
                    r,
                ),
            )
            counts[rank] += 1
        if tuple(counts) != current:
            dealing[index] = {"attn": counts}
    candidate = plan.recounted(dealing)  # the heads each rank then holds: its replicas
    changes, gain = {}, 0.0
    for index in dealing:
        now = max(seconds(r, _attention_units(plan, index, r, kv)) for r in range(n))
        then = max(seconds(r, _attention_units(candidate, index, r, kv)) for r in range(n))
        if then < now - 1e-12:
            changes[index], gain = dealing[index], gain + now - then
    if not changes:
        return None
    target = plan.recounted(changes)
    predicted = tuple(
        sum(seconds(r, _attention_units(target, i, r, kv)) for i in layers) for r in range(n)
    )
    return MeasuredSplit(target, "attn", tuple(attention), predicted, gain)


def _attention_units(plan: PartitionPlan, layer: int, rank: int, kv: float) -> float:
    """`rank`'s attention units in `layer`, a K/V replica counted at `kv`."""
    held = plan.units(layer, "attn", rank)
    return len(held) + (kv * len(plan.heads.groups_of(held)) if kv and held else 0.0)


def _held_and_calls(plan: PartitionPlan, kv: float) -> tuple[list[float], list[int]]:
    """Per rank, its attention units over the layers (replicas at `kv`) and the layers in
    which it holds any (each a call)."""
    layers = range(plan.num_layers)
    held = [sum(_attention_units(plan, i, r, kv) for i in layers) for r in range(plan.tp_size)]
    calls = [sum(1 for i in layers if plan.units(i, "attn", r)) for r in range(plan.tp_size)]
    return held, calls


def attention_fits(plan: PartitionPlan, kv: float = 0.0) -> bool:
    """Attention's seconds at `plan` can part a per-call cost from a per-unit one
    (measured_attention_split): two ranks' units a call differ by ATTENTION_FIT_SPREAD."""
    return _spread_fits(*_held_and_calls(plan, kv if plan.heads is not None else 0.0))


def _spread_fits(held: Sequence[float], calls: Sequence[int]) -> bool:
    per_call = [h / c for h, c in zip(held, calls) if h]
    return bool(per_call) and max(per_call) >= ATTENTION_FIT_SPREAD * min(per_call)


def measured_against(
    plan: PartitionPlan, target: PartitionPlan, unit_work: Mapping[str, float], seen: Measured
) -> str | None:
    """Why the move from `plan` to `target` lengthens the step whatever the ranks' speeds, or
    None: `seen` measured every block it changes already at least as long on each rank it
    gives work to as on each rank it takes work from. Then the slowdowns that asked for it are
    misread (a hiccup that continuity carried from anchor to anchor, or a fit off at an uneven
    split, read a 2.3x rank at 4.5x, and the plan moved further from balance:
    results/notes.md). A rank's time in a block is its measured block compute in proportion
    to its work there: its slowdown stretches all of its blocks alike, so no reading enters."""
    if len(seen.blocks) != plan.tp_size:
        return None
    old, new = block_works(plan, unit_work), block_works(target, unit_work)
    totals = [sum(works) for works in zip(*old)]
    changed = False
    for before, after in zip(old, new):
        gains = [r for r in range(plan.tp_size) if after[r] > before[r]]
        takes = [r for r in range(plan.tp_size) if after[r] < before[r]]
        if not gains and not takes:
            continue
        changed = True
        time = [seen.blocks[r] * before[r] / totals[r] if totals[r] else 0.0 for r in gains + takes]
        if not takes or min(time[: len(gains)]) < max(time[len(gains) :]):
            return None  # a block where the move gives work to a rank measured shorter
    if not changed:
        return None
    return (
        f"move to {target.summary()} refused: ranks measured at "
        f"{[round(b, 3) for b in seen.blocks]} s in the blocks; it gives work only to the "
        "longer ones"
    )
