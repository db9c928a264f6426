"""Where a unit lives inside a rank's local shard of a TP-sharded tensor.

A local shard is laid out along one axis as `parts` consecutive sections (2 for SwiGLU's fc1:
the gate rows of all local units, then their up rows; 1 otherwise); inside each section the
local units follow each other in the rank's order, `width` elements each. This is exactly
Megatron's even layout when a rank owns a contiguous run of units, so an even plan needs no
data movement.

A unit's payload is its slices of every part, concatenated along the axis.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class UnitLayout:
    axis: int
    width: int
    parts: int = 1

    def local_size(self, num_local_units: int) -> int:
        return num_local_units * self.width * self.parts

    def payload(self, local: torch.Tensor, num_local_units: int, position: int) -> torch.Tensor:
        """The unit at `position` of a rank's local order, as one tensor."""
        pieces = [
            local.narrow(self.axis, (part * num_local_units + position) * self.width, self.width)
            for part in range(self.parts)
        ]
        return pieces[0] if self.parts == 1 else torch.cat(pieces, dim=self.axis)

    def run(
        self, local: torch.Tensor, num_local_units: int, positions: Sequence[int]
    ) -> torch.Tensor:
        """The units at `positions` as one tensor, their payloads joined along the axis: a view
        of `local` when they are consecutive and the layout has one part, else one gather."""
        first = positions[0] if positions else 0
        if self.parts == 1 and list(positions) == list(range(first, first + len(positions))):
            return local.narrow(self.axis, first * self.width, len(positions) * self.width)
        starts = self._starts(num_local_units, positions).t()  # payload order: unit, then part
        return local.index_select(self.axis, self._spread(starts, local.device))

    def rebuilt(
        self,
        local: torch.Tensor,
        num_local_units: int,
        sources: Sequence[int | torch.Tensor],
    ) -> torch.Tensor:
        """A new local shard whose units are `sources` in order: an int is the position of a
        unit kept from `local`, a tensor a received payload. One gather over `local` and the
        received payloads joined, where a copy per unit would cost a receiver of thousands of
        MLP units more than the transfer (results/notes.md)."""
        received = [s for s in sources if not isinstance(s, int)]
        joined = torch.cat([local, *received], dim=self.axis) if received else local
        # vectorised: a Python list per unit would also wake the garbage collector, which in
        # a trainer's process walks millions of objects
        position = torch.tensor(
            [s if isinstance(s, int) else -1 for s in sources], dtype=torch.long
        )
        arrived = position < 0
        nth = torch.cumsum(arrived, 0) - 1  # a received payload's place among them
        part = torch.arange(self.parts).unsqueeze(1)
        kept = (part * num_local_units + position) * self.width
        brought = local.shape[self.axis] + (nth * self.parts + part) * self.width
        index = torch.where(arrived, brought, kept)  # (parts, units): the local layout
        return joined.index_select(self.axis, self._spread(index, local.device))

    def part_indices(
        self, num_local_units: int, positions: Sequence[int], part: int, device=None
    ) -> torch.Tensor:
        """The element indices along the axis of one part of the units at `positions`, in
        their order."""
        return self._spread(self._starts(num_local_units, positions)[part], device)

    def _starts(self, num_local_units: int, positions: Sequence[int]) -> torch.Tensor:
        """(parts, len(positions)): where each part of the units at `positions` begins."""
        parts = torch.arange(self.parts).unsqueeze(1) * num_local_units
        return (parts + torch.as_tensor(list(positions), dtype=torch.long)) * self.width

    def _spread(self, starts: torch.Tensor, device) -> torch.Tensor:
        """Every index of `width` elements from each start, in the order of `starts`."""
        return (starts.reshape(-1, 1) + torch.arange(self.width)).reshape(-1).to(device)

    def assemble(self, payloads: Sequence[torch.Tensor], template: torch.Tensor) -> torch.Tensor:
        """A local shard from unit payloads in local order; `template` gives the other dims."""
        if not payloads:
            shape = list(template.shape)
            shape[self.axis] = 0
            return template.new_empty(shape)
        if self.parts == 1:
            return torch.cat(list(payloads), dim=self.axis).contiguous()
        sections = [
            torch.cat(
                [p.narrow(self.axis, part * self.width, self.width) for p in payloads],
                dim=self.axis,
            )
            for part in range(self.parts)
        ]
        return torch.cat(sections, dim=self.axis).contiguous()

    def global_fragment(self, unit: int, part: int, num_units: int) -> tuple[int, int]:
        """(fragment index, number of fragments) of a unit's part in the canonical full tensor,
        which holds part 0 of all units in unit order, then part 1, ..."""
        return part * num_units + unit, self.parts * num_units

    def payload_shape(self, template_shape: Sequence[int]) -> tuple[int, ...]:
        shape = list(template_shape)
        shape[self.axis] = self.width * self.parts
        return tuple(shape)

    def prefix(self, local: torch.Tensor, num_local_units: int, count: int) -> list[torch.Tensor]:
        """Views of the first `count` local units, one per part (no copy)."""
        return [
            local.narrow(self.axis, part * num_local_units * self.width, count * self.width)
            for part in range(self.parts)
        ]

    def suffix(self, local: torch.Tensor, num_local_units: int, count: int) -> list[torch.Tensor]:
        """Views of the local units from position `count` on, one per part (no copy)."""
        rest = (num_local_units - count) * self.width
        return [
            local.narrow(self.axis, (part * num_local_units + count) * self.width, rest)
            for part in range(self.parts)
        ]

    def per_unit(
        self, values: torch.Tensor, shape: Sequence[int], num_local_units: int
    ) -> torch.Tensor:
        """A tensor of a local shard's `shape` holding values[p] on every element of the unit
        at position p (e.g. a factor per unit, to multiply the shard by)."""
        dims = [1] * (len(shape) + 2)
        dims[self.axis + 1] = num_local_units
        grid = (*shape[: self.axis], self.parts, num_local_units, self.width)
        grid += tuple(shape[self.axis + 1 :])
        return values.reshape(dims).expand(grid).reshape(tuple(shape))

    def unit_sums(self, local: torch.Tensor, num_local_units: int) -> torch.Tensor:
        """Per local unit, the sum of `local`'s elements over all of the unit's parts (float64).
        Empty for a rank that holds none of the block's units (a migration can leave it so)."""
        if num_local_units == 0:
            return torch.zeros(0, dtype=torch.float64, device=local.device)
        # A view, not a copy (a movedim of a column-split weight would copy it), summed at fp32
        # or better: the sums' shape is a few numbers per unit, the input the whole shard.
        shape = local.shape
        units = local.reshape(
            *shape[: self.axis], self.parts, num_local_units, self.width, *shape[self.axis + 1 :]
        )
        dims = tuple(d for d in range(units.dim()) if d != self.axis + 1)
        wide = torch.promote_types(local.dtype, torch.float32)
        return units.sum(dim=dims, dtype=wide).to(torch.float64)

    def permuted(
        self, local: torch.Tensor, num_local_units: int, positions: Sequence[int]
    ) -> torch.Tensor:
        """A copy of `local` whose units are those at `positions` of the current order."""
        index = self._spread(self._starts(num_local_units, positions), local.device)
        return local.index_select(self.axis, index)
