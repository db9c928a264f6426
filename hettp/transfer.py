"""Migration schedules: which units move where, bundled per (source, destination), and which
collective primitive moves them cheapest under an alpha-beta cost model.

Pure: no process group. A unit whose owner does not change stays put; every other unit moves
once, straight from its old owner to its new one, so the bytes moved are the minimum the plan
change requires. With query heads as units, a group's K/V replica travels once to each rank
that comes to hold the group, with the first of its heads that moves there.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .plan import BLOCKS, PartitionPlan

PRIMITIVES = ("p2p", "all_to_all", "scatter", "broadcast")

# The unit_nbytes key of one query group's K/V replica (weights, masters, moments): what a head
# unit brings to a rank that held none of its group's heads.
KV_REPLICA = "kv"


@dataclass(frozen=True, order=True)
class UnitMove:
    layer: int
    block: str
    unit: int
    src: int
    dst: int
    nbytes: int = field(compare=False)  # the unit's, plus replica_nbytes
    replica_nbytes: int = field(default=0, compare=False)  # > 0: it brings its group's K/V

    @property
    def brings_replica(self) -> bool:
        return self.replica_nbytes > 0


@dataclass(frozen=True)
class TransferSchedule:
    tp_size: int
    moves: tuple[UnitMove, ...]  # canonical order: (layer, block, unit)

    @property
    def total_bytes(self) -> int:
        return sum(m.nbytes for m in self.moves)

    def bundles(self) -> dict[tuple[int, int], tuple[UnitMove, ...]]:
        """Moves grouped per (src, dst) pair, each in canonical order: one buffer each."""
        out: dict[tuple[int, int], list[UnitMove]] = {}
        for move in self.moves:
            out.setdefault((move.src, move.dst), []).append(move)
        return {pair: tuple(moves) for pair, moves in sorted(out.items())}

    def bundle_bytes(self) -> dict[tuple[int, int], int]:
        return {pair: sum(m.nbytes for m in moves) for pair, moves in self.bundles().items()}

    def sources(self) -> set[int]:
        return {m.src for m in self.moves}

    def rank_traffic(self, rank: int) -> tuple[int, int]:
        """(messages, bytes) that `rank` sends plus receives under batched point-to-point."""
        pairs = [(pair, size) for pair, size in self.bundle_bytes().items() if rank in pair]
        return len(pairs), sum(size for _, size in pairs)


def plan_transfer(
    old: PartitionPlan, new: PartitionPlan, unit_nbytes: Callable[[str], int]
) -> TransferSchedule:
    """Moves that take `old` to `new`; unit_nbytes(block) is one unit's payload size. With head
    units (`new.heads`), unit_nbytes(KV_REPLICA) is a group's K/V replica: the first head of a
    group that moves to a rank holding none of the group's heads brings it (canonical order,
    so every rank agrees which); the others travel without."""
    if (old.tp_size, old.num_layers, old.attn_units, old.mlp_units, old.mlp_unit_size) != (
        new.tp_size,
        new.num_layers,
        new.attn_units,
        new.mlp_units,
        new.mlp_unit_size,
    ):
        raise ValueError(
            f"plans describe different models or TP sizes: {old.summary()} vs {new.summary()}"
        )
    heads = new.heads
    replica = unit_nbytes(KV_REPLICA) if heads is not None else 0
    moves = []
    for layer in range(old.num_layers):
        for block in BLOCKS:
            before, after = old.owner_map(layer, block), new.owner_map(layer, block)
            size = unit_nbytes(block)
            held = _holders(old, layer) if heads is not None and block == "attn" else None
            for unit in sorted(before):
                src, dst = before[unit], after[unit]
                if src == dst:
                    continue
                extra = 0
                if held is not None:
                    group = heads.group_of(unit)
                    if dst not in held.setdefault(group, set()):
                        held[group].add(dst)  # on its way: the group's next heads go without
                        extra = replica
                moves.append(UnitMove(layer, block, unit, src, dst, size + extra, extra))
    return TransferSchedule(old.tp_size, tuple(sorted(moves)))


def _holders(plan: PartitionPlan, layer: int) -> dict[int, set[int]]:
    held = plan.heads.holders(plan.layers[layer]["attn"])
    return {group: set(ranks) for group, ranks in held.items()}


def minimum_bytes(old: PartitionPlan, new: PartitionPlan, unit_nbytes: Callable[[str], int]) -> int:
    """The fewest bytes any transfer from `old`'s counts to `new`'s can move: per layer and
    block, each rank that gains k units must receive k of them; with head units, each rank
    that comes to hold a group must receive its K/V once."""
    units = sum(
        max(0, b - a) * unit_nbytes(block)
        for layer in range(old.num_layers)
        for block in BLOCKS
        for a, b in zip(old.counts(layer, block), new.counts(layer, block))
    )
    if new.heads is None:
        return units
    replicas = 0
    for layer in range(old.num_layers):
        before = _holders(old, layer)
        for group, ranks in new.heads.holders(new.layers[layer]["attn"]).items():
            replicas += len(set(ranks) - before.get(group, set()))
    return units + replicas * unit_nbytes(KV_REPLICA)


@dataclass(frozen=True)
class PrimitiveCost:
    """T = call + alpha * messages + bytes / beta, on the busiest rank's critical path."""

    call: float  # seconds per call
    alpha: float  # seconds per message
    beta: float  # bytes per second


@dataclass(frozen=True)
class CostModel:
    """Per-primitive alpha-beta costs of hettp.exchange.run_transfer (its votes included).

    Defaults: fitted by hettp.exchange.measure_costs (scripts/bench_migration.py) over gloo on
    a CPU machine (results/notes.md). Refit them on the cluster at hand.
    """

    p2p: PrimitiveCost = PrimitiveCost(call=6.6e-3, alpha=1.5e-3, beta=1.3e9)
    all_to_all: PrimitiveCost = PrimitiveCost(call=1.2e-2, alpha=0.0, beta=7.1e8)
    scatter: PrimitiveCost = PrimitiveCost(call=1.1e-2, alpha=0.0, beta=6.4e8)
    broadcast: PrimitiveCost = PrimitiveCost(call=1.2e-2, alpha=0.0, beta=7.5e8)

    def predict(self, schedule: TransferSchedule) -> dict[str, float]:
        """Predicted seconds per applicable primitive (scatter/broadcast need one source)."""
        n = schedule.tp_size
        if not schedule.moves:
            return {}
        traffic = [schedule.rank_traffic(r) for r in range(n)]
        busiest_bytes = max(b for _, b in traffic)
        out = {
            "p2p": self.p2p.call + max(m * self.p2p.alpha + b / self.p2p.beta for m, b in traffic),
            "all_to_all": (
                self.all_to_all.call
                + (n - 1) * self.all_to_all.alpha
                + busiest_bytes / self.all_to_all.beta
            ),
        }
        if len(schedule.sources()) == 1:
            sizes = schedule.bundle_bytes().values()
            padded = (n - 1) * max(sizes)  # gloo scatters equal chunks
            out["scatter"] = (
                self.scatter.call + (n - 1) * self.scatter.alpha + padded / self.scatter.beta
            )
            hops = math.ceil(math.log2(n))  # tree broadcast of every bundle to every rank
            out["broadcast"] = self.broadcast.call + hops * (
                self.broadcast.alpha + schedule.total_bytes / self.broadcast.beta
            )
        return out

    def choose(self, schedule: TransferSchedule) -> tuple[str, dict[str, float]]:
        """The cheapest primitive (ties go to the earlier one in PRIMITIVES) and all predictions."""
        predictions = self.predict(schedule)
        if not predictions:
            return "none", predictions
        best = min(predictions, key=lambda p: (predictions[p], PRIMITIVES.index(p)))
        return best, predictions


# A migration's time as a multiple of its predicted transfer: packing, committing and
# rebuilding DDP and the optimizer come on top (measured ratios: results/migration_tp4.txt).
REBUILD_FACTOR = 2.0


class MigrationCost:
    """Predicted seconds of a plan change: the cheapest primitive's transfer of the units that
    move, times a factor for what comes on top (packing, committing, rebuilding DDP and the
    optimizer): `rebuild_factor` until a migration was applied here, then the median ratio of
    the applied ones' whole time to their predicted transfer, so the planner weighs moves at
    what they cost on this machine and model. `unit_bytes` (block -> one unit's payload:
    weights, fp32 masters and optimizer moments) is set by whoever knows the model's
    tensors."""

    def __init__(
        self,
        cost_model: CostModel | None = None,
        unit_bytes: dict[str, int] | None = None,
        rebuild_factor: float = REBUILD_FACTOR,
        history: int = 8,
    ):
        self.cost_model = cost_model or CostModel()
        self.unit_bytes = dict(unit_bytes or {})
        self.rebuild_factor = rebuild_factor
        self._ratios = deque(maxlen=history)  # applied migrations: seconds / predicted

    @property
    def factor(self) -> float:
        return statistics.median(self._ratios) if self._ratios else self.rebuild_factor

    def learn(self, predicted_transfer: float, seconds: float) -> None:
        """An applied migration took `seconds` in all, its transfer predicted at
        `predicted_transfer`."""
        if predicted_transfer > 0 and seconds > 0:
            self._ratios.append(seconds / predicted_transfer)

    def seconds(self, old: PartitionPlan, new: PartitionPlan) -> float:
        schedule = plan_transfer(old, new, lambda block: self.unit_bytes[block])
        if not schedule.moves:
            return 0.0
        _, predictions = self.cost_model.choose(schedule)
        return self.factor * min(predictions.values())

    def state_dict(self) -> dict:
        return {"ratios": list(self._ratios)}

    def load_state_dict(self, state: dict) -> None:
        self._ratios.clear()
        self._ratios.extend(state["ratios"])
