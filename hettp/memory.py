"""How much unit state each rank of a plan holds, and a cap on it for migrating policies.

A migration hands a slow rank's units to the fast ranks, with their weights, gradients and
optimizer state: a fast rank given twice its even share of the units needs twice the memory
for them, which a device already filled by the even split may not have. Counted in
parameters: gradients, fp32 masters and optimizer moments follow a unit's parameters in a
fixed ratio, so a cap relative to the even split reads the same in bytes. A resized unit
keeps its state (resizing skips compute, not memory), so shares do not enter.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .plan import BLOCKS, PartitionPlan, PlanError
from .transfer import KV_REPLICA


class OverCapError(PlanError):
    """A plan a run is asked to start from (--het-tp-plan, or the checkpoint's) puts a rank
    over --het-tp-memory-cap: bad input, refused before anything moves."""


def held_params(plan: PartitionPlan, unit_params: Mapping[str, float]) -> tuple[float, ...]:
    """Per rank, the parameters of the units it holds in every layer, with head units also
    one K/V per query group it holds any head of."""
    kv = unit_params.get(KV_REPLICA, 0.0) if plan.heads is not None else 0.0
    held = [0.0] * plan.tp_size
    for layer in plan.layers:
        for block in BLOCKS:
            for rank, units in enumerate(layer[block]):
                held[rank] += len(units) * unit_params[block]
                if block == "attn" and kv:
                    held[rank] += kv * len(plan.heads.groups_of(units))
    return tuple(held)


def canonical_params(plan: PartitionPlan, unit_params: Mapping[str, float]) -> float:
    """The parameters of all of the plan's units, every K/V once (no replicas)."""
    per_layer = plan.attn_units * unit_params["attn"] + plan.mlp_units * unit_params["mlp"]
    if plan.heads is not None:
        per_layer += plan.heads.groups * unit_params.get(KV_REPLICA, 0.0)
    return plan.num_layers * per_layer


@dataclass(frozen=True)
class MemoryCap:
    """No rank may hold more than `factor` times the even split's unit state.

    `unit_params`: one unit's parameters per block, and with head units (key KV_REPLICA) one
    group's K/V rows, which a rank holding any of the group's heads keeps as a replica."""

    factor: float
    unit_params: Mapping[str, float]

    def __post_init__(self):
        if self.factor < 1.0:
            raise ValueError(
                f"a memory cap of {self.factor} times the even split's unit state leaves no "
                f"plan (the even split itself needs 1.0)"
            )

    def limit(self, plan: PartitionPlan) -> float:
        """The most parameters a rank of `plan`'s shape may hold."""
        return self.factor * canonical_params(plan, self.unit_params) / plan.tp_size

    def ratios(self, plan: PartitionPlan) -> tuple[float, ...]:
        """Per rank, what it holds against the limit (above 1: over the cap)."""
        limit = self.limit(plan)
        return tuple(h / limit for h in held_params(plan, self.unit_params))

    def fits(self, plan: PartitionPlan) -> bool:
        return max(self.ratios(plan)) <= 1.0 + 1e-9

    def of_even(self, plan: PartitionPlan) -> tuple[float, ...]:
        """Per rank, what it holds in multiples of the even split's share (what is logged)."""
        return tuple(r * self.factor for r in self.ratios(plan))


def water_filled(speeds: Sequence[float], ceilings: Sequence[float]) -> list[float]:
    """Shares of the work in proportion to `speeds`, none above its rank's ceiling (a share
    of the whole): a capped rank's excess goes to the others, again in proportion to their
    speeds. The ceilings must leave room for everything (sum >= 1)."""
    if sum(ceilings) < 1.0 - 1e-12:
        raise ValueError(f"ceilings {list(ceilings)} leave no room for all of the work")
    capped: dict[int, float] = {}
    while True:
        free = [r for r in range(len(speeds)) if r not in capped]
        rest = 1.0 - sum(capped.values())
        pace = sum(speeds[r] for r in free)
        if pace <= 0:  # only idle ranks left: the rest goes evenly to them
            shares = {r: rest / len(free) for r in free} if free else {}
        else:
            shares = {r: rest * speeds[r] / pace for r in free}
        over = [r for r in free if shares[r] > ceilings[r]]
        if not over:
            return [capped.get(r, shares.get(r, 0.0)) for r in range(len(speeds))]
        for r in over:
            capped[r] = ceilings[r]
