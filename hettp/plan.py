"""Partition plans: which TP rank owns which units of every layer's attention and MLP.

A unit is the smallest piece of a TP-sharded block that can live on any rank: one query group
(its query heads plus its K and V heads) or, with head units (HeadUnits), a few query heads of a
group for attention, `mlp_unit_size` ffn neurons for the MLP.
A plan lists, per layer and block, the units of each rank in the rank's local order. Ranks may
own different numbers of units, including none, and layers may differ.

Plans are plain data: validated on construction (errors say what is wrong and where), printable
in one line, and serialisable to JSON.
"""

from __future__ import annotations

import dataclasses
import json
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

BLOCKS = ("attn", "mlp")


class PlanError(ValueError):
    """A partition plan does not fit the model or is inconsistent."""


@dataclass(frozen=True)
class HeadUnits:
    """Attention units finer than a query group: `heads_per_unit` query heads each (a divisor of
    the heads per group). A rank holding any head of a group holds that group's K and V rows as
    a replica; the lowest such rank holds the main replica (the one a checkpoint saves and a
    gradient norm counts).

    In megatron-core's canonical QKV weight each group is `heads_per_group + 2` fragments of
    `head_dim` rows: its query heads, then K, then V. Plans name units `0 .. units - 1`, heads
    in order, so a unit's heads are consecutive and never span two groups."""

    heads_per_unit: int
    heads_per_group: int
    groups: int

    def __post_init__(self):
        if self.heads_per_unit < 1 or self.heads_per_group % self.heads_per_unit:
            raise ValueError(
                f"{self.heads_per_unit} query heads per attention unit do not divide the "
                f"{self.heads_per_group} heads of a query group"
            )

    @property
    def units_per_group(self) -> int:
        return self.heads_per_group // self.heads_per_unit

    @property
    def units(self) -> int:
        return self.groups * self.units_per_group

    @property
    def fragments(self) -> int:
        """Head-sized fragments of the canonical QKV weight."""
        return self.groups * (self.heads_per_group + 2)

    def group_of(self, unit: int) -> int:
        return unit * self.heads_per_unit // self.heads_per_group

    def groups_of(self, units: Sequence[int]) -> tuple[int, ...]:
        """The groups whose K and V a rank holding `units` keeps, ascending. (`group_of` per
        unit, inlined: the planner asks for every rank, block and layer of each plan.)"""
        per_group = self.units_per_group
        return tuple(sorted({u // per_group for u in units}))

    def query_fragments(self, unit: int) -> tuple[int, ...]:
        """The canonical fragments of a unit's query heads."""
        first = unit * self.heads_per_unit
        return tuple(
            self.group_of(unit) * (self.heads_per_group + 2) + head % self.heads_per_group
            for head in range(first, first + self.heads_per_unit)
        )

    def kv_fragments(self, group: int) -> tuple[int, int]:
        base = group * (self.heads_per_group + 2) + self.heads_per_group
        return base, base + 1

    def holders(self, owners: Sequence[Sequence[int]]) -> dict[int, tuple[int, ...]]:
        """{group: the ranks holding its K and V, ascending} of one layer's per-rank units."""
        out: dict[int, list[int]] = {}
        for rank, units in enumerate(owners):
            for group in self.groups_of(units):
                out.setdefault(group, []).append(rank)
        return {g: tuple(r) for g, r in sorted(out.items())}

    def replicated(self, owners: Sequence[Sequence[int]]) -> tuple[int, ...]:
        """The groups of one layer held by more than one rank: their K/V gradients are summed."""
        return tuple(g for g, ranks in self.holders(owners).items() if len(ranks) > 1)


@dataclass(frozen=True)
class PartitionPlan:
    tp_size: int
    attn_units: int  # query groups (or head units) per layer
    mlp_units: int  # ffn neurons per layer / mlp_unit_size
    mlp_unit_size: int
    # layers[i][block] = per-rank tuples of unit ids, in each rank's local order
    layers: tuple[dict[str, tuple[tuple[int, ...], ...]], ...]
    # attention units finer than a query group (which groups' K/V a rank's units bring); not
    # part of a plan's identity, which is who owns which unit
    heads: HeadUnits | None = field(default=None, compare=False)

    def __post_init__(self):
        if self.tp_size < 1:
            raise PlanError(f"plan: tensor-parallel size must be >= 1, got {self.tp_size}")
        if self.mlp_unit_size < 1:
            raise PlanError(f"plan: MLP unit size must be >= 1, got {self.mlp_unit_size}")
        if not self.layers:
            raise PlanError("plan: no layers")
        if self.heads is not None and self.heads.units != self.attn_units:
            raise PlanError(
                f"plan: {self.attn_units} attention units, but head units of "
                f"{self.heads.heads_per_unit} heads make {self.heads.units}"
            )
        for index, layer in enumerate(self.layers):
            if set(layer) != set(BLOCKS):
                raise PlanError(f"plan layer {index}: blocks must be {BLOCKS}, got {sorted(layer)}")
            for block in BLOCKS:
                self._check_block(index, block, layer[block])

    def _check_block(self, index, block, owners):
        where = f"plan layer {index} {block}"
        total = self.num_units(block)
        if len(owners) != self.tp_size:
            raise PlanError(f"{where}: {len(owners)} ranks listed, the TP size is {self.tp_size}")
        seen = {}
        for rank, units in enumerate(owners):
            for unit in units:
                if not isinstance(unit, int) or not 0 <= unit < total:
                    raise PlanError(
                        f"{where}: rank {rank} lists unit {unit!r}; units are 0..{total - 1}"
                    )
                if unit in seen:
                    raise PlanError(
                        f"{where}: unit {unit} is owned by ranks {seen[unit]} and {rank}"
                    )
                seen[unit] = rank
        if len(seen) != total:
            missing = sorted(set(range(total)) - set(seen))
            raise PlanError(
                f"{where}: ranks own {len(seen)} of {total} units; unowned: {_ranges(missing)}"
            )

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_counts(
        cls,
        tp_size: int,
        num_layers: int,
        attn_units: int,
        mlp_units: int,
        attn_counts: Sequence[int],
        mlp_counts: Sequence[int],
        mlp_unit_size: int = 1,
        heads: HeadUnits | None = None,
    ) -> PartitionPlan:
        """Every layer alike; rank r owns the r-th contiguous run of `counts[r]` units."""
        layer = {
            "attn": _contiguous(attn_counts, attn_units, "attn", tp_size),
            "mlp": _contiguous(mlp_counts, mlp_units, "mlp", tp_size),
        }
        return cls(
            tp_size,
            attn_units,
            mlp_units,
            mlp_unit_size,
            tuple(layer for _ in range(num_layers)),
            heads,
        )

    @classmethod
    def even(
        cls,
        tp_size: int,
        num_layers: int,
        attn_units: int,
        mlp_units: int,
        mlp_unit_size: int = 1,
        heads: HeadUnits | None = None,
    ) -> PartitionPlan:
        """Megatron's own partition: equal contiguous shares."""
        for name, total in (("attention units", attn_units), ("MLP units", mlp_units)):
            if total % tp_size:
                raise PlanError(
                    f"an even plan needs {name} ({total}) divisible by TP size {tp_size}"
                )
        return cls.from_counts(
            tp_size,
            num_layers,
            attn_units,
            mlp_units,
            [attn_units // tp_size] * tp_size,
            [mlp_units // tp_size] * tp_size,
            mlp_unit_size,
            heads,
        )

    @classmethod
    def parse(
        cls,
        spec: str,
        tp_size: int,
        num_layers: int,
        attn_units: int,
        mlp_units: int,
        mlp_unit_size: int = 1,
        heads: HeadUnits | None = None,
    ) -> PartitionPlan:
        """A JSON file path, or inline per-rank counts for every layer: 'attn=2,1,1;mlp=90,30,8'.

        A block left out of an inline spec stays even. Inline counts always hold '=', so a
        spec without one is a file, whatever its name ends in: its error is the file's.
        """
        if (
            spec.lstrip().startswith("{")
            or spec.endswith(".json")
            or ("=" not in spec and spec.strip(" ;"))
        ):
            text = spec if spec.lstrip().startswith("{") else _read(spec)
            plan = cls.from_json(text)
            plan.check_model(tp_size, num_layers, attn_units, mlp_units, mlp_unit_size)
            return dataclasses.replace(plan, heads=heads)
        counts = {}
        for part in filter(None, (p.strip() for p in spec.split(";"))):
            block, sep, values = part.partition("=")
            block = block.strip()
            if not sep or block not in BLOCKS:
                raise PlanError(
                    f"plan '{spec}': expected 'attn=<counts>;mlp=<counts>', got '{part}'"
                )
            if block in counts:
                raise PlanError(f"plan '{spec}': '{block}' given twice")
            try:
                counts[block] = [int(v) for v in values.split(",")]
            except ValueError:
                raise PlanError(
                    f"plan '{spec}': {block} counts must be integers, got '{values}'"
                ) from None
        if not counts:
            raise PlanError(f"plan '{spec}': no blocks given")
        for block, total in (("attn", attn_units), ("mlp", mlp_units)):
            if block not in counts:
                if total % tp_size:
                    raise PlanError(
                        f"plan '{spec}': {block} not given and {total} units do not "
                        f"split evenly over {tp_size} ranks"
                    )
                counts[block] = [total // tp_size] * tp_size
        return cls.from_counts(
            tp_size,
            num_layers,
            attn_units,
            mlp_units,
            counts["attn"],
            counts["mlp"],
            mlp_unit_size,
            heads,
        )

    def rebalanced(
        self,
        attn_counts: Sequence[int] | None = None,
        mlp_counts: Sequence[int] | None = None,
        layers: Sequence[int] | None = None,
    ) -> PartitionPlan:
        """This plan with new per-rank counts, moving the fewest units.

        Ranks above their count give away the last units of their local order; ranks below
        append what they receive. The moves are exactly the surpluses, so no unit moves that
        need not. `layers` limits the change to some layers (default: all).
        """
        targets = {"attn": attn_counts, "mlp": mlp_counts}
        chosen = range(self.num_layers) if layers is None else layers
        return self.recounted(
            {index: {block: c for block, c in targets.items() if c is not None} for index in chosen}
        )

    def recounted(self, counts: Mapping[int, Mapping[str, Sequence[int]]]) -> PartitionPlan:
        """`rebalanced` with its own counts for each layer (`counts[layer][block]`), built
        and checked once: a planner that sets every layer's counts in turn would otherwise
        check the whole plan once per layer."""
        new_layers = []
        for index, layer in enumerate(self.layers):
            new_layer = dict(layer)
            for block, target in counts.get(index, {}).items():
                owners = [list(u) for u in layer[block]]
                _contiguous(target, self.num_units(block), block, self.tp_size)  # validates
                spare = []
                for rank, units in enumerate(owners):
                    while len(units) > target[rank]:
                        spare.append(units.pop())
                spare.reverse()
                spare = deque(spare)
                for rank, units in enumerate(owners):
                    while len(units) < target[rank]:
                        units.append(spare.popleft())
                new_layer[block] = tuple(tuple(u) for u in owners)
            new_layers.append(new_layer)
        return dataclasses.replace(self, layers=tuple(new_layers))

    # ---- queries ------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def num_units(self, block: str) -> int:
        return self.attn_units if block == "attn" else self.mlp_units

    def units(self, layer: int, block: str, rank: int) -> tuple[int, ...]:
        return self.layers[layer][block][rank]

    def counts(self, layer: int, block: str) -> tuple[int, ...]:
        return tuple(len(u) for u in self.layers[layer][block])

    def owner_map(self, layer: int, block: str) -> dict[int, int]:
        return {u: r for r, units in enumerate(self.layers[layer][block]) for u in units}

    def check_model(
        self, tp_size: int, num_layers: int, attn_units: int, mlp_units: int, mlp_unit_size: int
    ) -> None:
        """Raise PlanError naming the first mismatch between this plan and the model."""
        for what, mine, theirs in (
            ("TP size", self.tp_size, tp_size),
            ("layers", self.num_layers, num_layers),
            ("attention units per layer", self.attn_units, attn_units),
            ("MLP unit size", self.mlp_unit_size, mlp_unit_size),
            ("MLP units per layer", self.mlp_units, mlp_units),
        ):
            if mine != theirs:
                raise PlanError(f"plan has {mine} {what}, the model has {theirs}")

    def stage(self, first: int, count: int) -> PartitionPlan:
        """Layers first..first+count-1: a pipeline stage's part of a whole-model plan."""
        if first < 0 or count < 1 or first + count > self.num_layers:
            raise PlanError(
                f"plan has {self.num_layers} layers, a stage of layers {first}-{first + count - 1} "
                "does not fit"
            )
        return dataclasses.replace(self, layers=self.layers[first : first + count])

    @classmethod
    def joined(cls, stages: Sequence[PartitionPlan]) -> PartitionPlan:
        """The whole-model plan of pipeline stages' plans, in stage order."""
        first = stages[0]
        for other in stages[1:]:
            if (other.tp_size, other.attn_units, other.mlp_units, other.mlp_unit_size) != (
                first.tp_size,
                first.attn_units,
                first.mlp_units,
                first.mlp_unit_size,
            ):
                raise PlanError("plan: pipeline stages disagree on the TP size or unit counts")
        return dataclasses.replace(
            first, layers=tuple(layer for plan in stages for layer in plan.layers)
        )

    def summary(self) -> str:
        """One line: per-rank unit counts, with runs of identical layers merged."""
        runs = []
        for index in range(self.num_layers):
            text = " ".join(f"{b} {'/'.join(map(str, self.counts(index, b)))}" for b in BLOCKS)
            if runs and runs[-1][2] == text:
                runs[-1][1] = index
            else:
                runs.append([index, index, text])
        parts = [
            f"layer{'s' if a != b else ''} {a}{'-' + str(b) if a != b else ''}: {t}"
            for a, b, t in runs
        ]
        return f"TP={self.tp_size} " + "; ".join(parts)

    # ---- serialisation ------------------------------------------------------------------

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": 1,
                "tp_size": self.tp_size,
                "attn_units": self.attn_units,
                "mlp_units": self.mlp_units,
                "mlp_unit_size": self.mlp_unit_size,
                "layers": [
                    {b: [list(u) for u in layer[b]] for b in BLOCKS} for layer in self.layers
                ],
            }
        )

    @classmethod
    def from_json(cls, text: str) -> PartitionPlan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise PlanError(f"plan JSON: {err}") from None
        try:
            if data.get("version") != 1:
                raise PlanError(f"plan JSON: unsupported version {data.get('version')!r}")
            layers = tuple(
                {b: tuple(tuple(u) for u in layer[b]) for b in BLOCKS} for layer in data["layers"]
            )
            return cls(
                data["tp_size"],
                data["attn_units"],
                data["mlp_units"],
                data["mlp_unit_size"],
                layers,
            )
        except (KeyError, TypeError, AttributeError) as err:
            raise PlanError(f"plan JSON: missing or malformed field {err}") from None


def _contiguous(counts, total, block, tp_size):
    if len(counts) != tp_size:
        raise PlanError(f"plan {block}: {len(counts)} counts for {tp_size} ranks")
    if any(c < 0 for c in counts):
        raise PlanError(f"plan {block}: negative unit count in {list(counts)}")
    if sum(counts) != total:
        raise PlanError(
            f"plan {block}: counts {list(counts)} sum to {sum(counts)}, the model has {total} units"
        )
    owners, start = [], 0
    for count in counts:
        owners.append(tuple(range(start, start + count)))
        start += count
    return tuple(owners)


def _ranges(values):
    out, i = [], 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        out.append(str(values[i]) if i == j else f"{values[i]}-{values[j]}")
        i = j + 1
    return ",".join(out)


def _read(path):
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as err:
        raise PlanError(f"plan file {path}: {err.strerror}") from None
