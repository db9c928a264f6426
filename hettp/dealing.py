"""Plans that deal units to ranks by their speeds: in proportion, each block as short as whole
units allow (head units with the K/V replicas they bring), or head units kept in whole query
groups; MLP counts in chunks of aligned widths. The planner's migration targets and the
measured splits are built from these."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from .plan import BLOCKS, PartitionPlan

# GEMM widths that are multiples of 8 run at full speed; unaligned widths cost more per neuron
# (CPU kernels block by 8 or more, GPU tensor cores want multiples of 8), which would make a rank
# that took units look slower than it is (results/notes.md). Query groups are whole heads,
# already wide enough.
MLP_ALIGN = 8


def mlp_chunk(plan: PartitionPlan, align: int = MLP_ALIGN) -> int:
    """MLP units the planner moves together so that the ffn widths it plans are multiples of
    `align` neurons; 1 where the units cannot be cut into such chunks, or into at least 4 per
    rank (coarser, whole layers would go unevenly to few ranks)."""
    chunk = align // math.gcd(align, plan.mlp_unit_size)
    if plan.mlp_units % chunk or plan.mlp_units // chunk < 4 * plan.tp_size:
        return 1
    return chunk


def proportional_plan(
    plan: PartitionPlan,
    speeds: Sequence[float],
    align: int = MLP_ALIGN,
    kv: float = 0.0,
    call: float = 0.0,
) -> PartitionPlan:
    """Unit counts proportional to `speeds`, moving the fewest units from `plan`.

    Every block ends in a TP collective, so each block of each layer waits for its slowest
    rank: a block's spare units (its target rounded down leaves them) go one by one to the
    rank that would finish it first, which makes each block as short as whole units allow
    (e.g. 4 query groups at speeds 2:1 give 3/1 in every layer: 1.5 units of time, where 3/1
    and 2/2 in turn would track the 2.67/1.33 target over layers at 1.75 a layer). Among
    equally fast choices, the rank furthest behind its target over the layers so far.
    MLP counts are rounded in chunks of `mlp_chunk(plan, align)` units; a layer already
    within one chunk of its target keeps its counts, aligned or not. Where a layer has at
    least 4 chunks a rank, every rank keeps one, even a rank too slow to be given any: a
    rank with no units reads no speed, so neither its recovery nor its next slowdown could
    be seen (its per-call costs are paid either way, so the chunk costs it little).

    `kv` (head units): a K/V replica's work in attention units. Attention is then dealt unit by
    unit to whoever would finish first with the replicas its units bring (a rank's units taken
    from as few groups as they fill): dealt by count, a slow rank given two heads of a group
    paid that group's K and V too, and ran its attention 25-30% over the fast rank's. `call`:
    attention's per-call part in attention units, which a rank's first unit brings."""
    total = sum(speeds)
    if total <= 0 or any(s < 0 for s in speeds):
        raise ValueError(f"speeds must be non-negative with a positive sum, got {list(speeds)}")
    changes: dict[int, dict[str, list[int]]] = {}
    for block in BLOCKS:
        chunk = mlp_chunk(plan, align) if block == "mlp" else 1
        n = plan.num_units(block) // chunk
        target = [n * s / total for s in speeds]  # in chunks
        assigned = [0.0] * plan.tp_size
        finish = None
        for index in range(plan.num_layers):
            current = [c / chunk for c in plan.counts(index, block)]
            floor = 1 if block == "mlp" and n >= 4 * plan.tp_size else 0
            if (
                chunk > 1
                and all(abs(c - t) < 1 for c, t in zip(current, target))
                and min(current) >= floor
            ):
                assigned = [a + c for a, c in zip(assigned, current)]  # below the resolution
                continue
            if block == "attn" and kv and plan.heads is not None:
                if finish is None:  # per rank, when it would finish its first c units
                    per_group = plan.heads.units_per_group
                    finish = [
                        [
                            _finish(with_replicas(c, per_group, kv, call), s, total)
                            for c in range(n + 1)
                        ]
                        for s in speeds
                    ]
                counts = [0] * plan.tp_size
                for _ in range(n):
                    behind = [(index + 1) * t - a - c for t, a, c in zip(target, assigned, counts)]
                    rank = min(
                        range(plan.tp_size),
                        key=lambda r: (finish[r][counts[r] + 1], -behind[r], r),
                    )
                    counts[rank] += 1
                assigned = [a + c for a, c in zip(assigned, counts)]
                changes.setdefault(index, {})[block] = counts
                continue
            counts = [max(floor, math.floor(t)) for t in target]  # within one chunk of target
            while sum(counts) > n:  # the floors' chunks: from whoever would finish last
                rank = max(
                    (r for r in range(plan.tp_size) if counts[r] > floor),
                    key=lambda r: (_finish(counts[r], speeds[r], total), r),
                )
                counts[rank] -= 1
            for _ in range(n - sum(counts)):  # the spare ones: whoever would finish first
                behind = [(index + 1) * t - a - c for t, a, c in zip(target, assigned, counts)]
                rank = min(
                    range(plan.tp_size),
                    key=lambda r: (_finish(counts[r] + 1, speeds[r], total), -behind[r], r),
                )
                counts[rank] += 1
            assigned = [a + c for a, c in zip(assigned, counts)]
            changes.setdefault(index, {})[block] = [c * chunk for c in counts]
    return plan.recounted(changes)


def grouped_plan(
    plan: PartitionPlan, speeds: Sequence[float], proportional: PartitionPlan | None = None
) -> PartitionPlan:
    """Head units kept in whole query groups (no K/V replicas): each rank takes the groups
    dealt one by one to whoever would finish them first at `speeds`, a group staying with the
    rank holding most of its heads where it fits (few units move); the MLP as `proportional`
    (proportional_plan's at `speeds`) splits it. Each block ends in a TP collective, so an
    MLP that made up for attention (more neurons to the rank holding fewer groups) balanced
    the ranks' totals and neither block: the slow rank waited in attention and the fast one
    in the MLP."""
    heads, n = plan.heads, plan.tp_size
    total = sum(speeds)
    share = [s / total for s in speeds]
    fits = [0] * n
    for _ in range(heads.groups):
        rank = min(range(n), key=lambda r: ((fits[r] + 1) / max(share[r], 1e-12), r))
        fits[rank] += 1
    proportional = proportional or proportional_plan(plan, speeds)
    layers = []
    for index, layer in enumerate(plan.layers):
        room = list(fits)
        held = [[0] * heads.groups for _ in range(n)]
        for rank, units in enumerate(layer["attn"]):
            for unit in units:
                held[rank][heads.group_of(unit)] += 1
        owner = {}
        for _, group, rank in sorted(
            (-held[r][g], g, r) for r in range(n) for g in range(heads.groups) if held[r][g]
        ):
            if group not in owner and room[rank]:
                owner[group], room[rank] = rank, room[rank] - 1
        for group in range(heads.groups):
            if group not in owner:
                rank = min(
                    (r for r in range(n) if room[r]),
                    key=lambda r: ((fits[r] - room[r] + 1) / max(share[r], 1e-12), r),
                )
                owner[group], room[rank] = rank, room[rank] - 1
        attn = []
        for rank, units in enumerate(layer["attn"]):
            kept = [u for u in units if owner[heads.group_of(u)] == rank]
            had = set(kept)
            gained = [
                u
                for u in range(plan.attn_units)
                if owner[heads.group_of(u)] == rank and u not in had
            ]
            attn.append(tuple(kept + gained))
        mlp = list(proportional.counts(index, "mlp"))
        layers.append((dict(layer, attn=tuple(attn)), mlp))
    grouped = dataclasses.replace(plan, layers=tuple(layer for layer, _ in layers))
    return grouped.recounted({i: {"mlp": mlp} for i, (_, mlp) in enumerate(layers)})


def with_block(plan: PartitionPlan, other: PartitionPlan, block: str) -> PartitionPlan:
    """`plan` with `other`'s units of `block` in every layer (both of one model)."""
    layers = tuple(
        {**mine, block: theirs[block]} for mine, theirs in zip(plan.layers, other.layers)
    )
    return dataclasses.replace(plan, layers=layers)


def groups_filled(units: int, per_group: int) -> int:
    """The query groups (K/V replicas) `units` head units bring at fewest, `per_group` units a
    group."""
    return -(-units // per_group)


def with_replicas(units: int, per_group: int, kv: float, call: float = 0.0) -> float:
    """Attention work of `units` head units taken from as few query groups as they fill, with
    the per-call part where there is any."""
    return units + kv * groups_filled(units, per_group) + (call if units else 0.0)


def _finish(units: float, speed: float, total: float) -> float:
    """When a rank of `speed` (of `total`) finishes `units`, rounded so that ranks of one
    speed tie exactly."""
    return math.inf if speed <= 0 else round(units * total / speed, 9)
