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
        of `local` when they are consecutive and the layout has one part."""
        first = positions[0] if positions else 0
        if self.parts == 1 and list(positions) == list(range(first, first + len(positions))):
            return local.narrow(self.axis, first * self.width, len(positions) * self.width)
        return torch.cat(
            [self.payload(local, num_local_units, p) for p in positions], dim=self.axis
        )

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

    def unit_sums(self, local: torch.Tensor, num_local_units: int) -> torch.Tensor:
        """Per local unit, the sum of `local`'s elements over all of the unit's parts (float64)."""
        moved = local.movedim(self.axis, 0).reshape(self.parts, num_local_units, -1)
        return moved.sum(dim=(0, 2), dtype=torch.float64)

    def permuted(
        self, local: torch.Tensor, num_local_units: int, positions: Sequence[int]
    ) -> torch.Tensor:
        """A copy of `local` whose units are those at `positions` of the current order."""
        index = torch.tensor(
            [
                (part * num_local_units + p) * self.width + i
                for part in range(self.parts)
                for p in positions
                for i in range(self.width)
            ],
            dtype=torch.long,
            device=local.device,
        )
        return local.index_select(self.axis, index)
