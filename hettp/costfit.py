"""Online estimate of what one unit of sharded work costs a rank that is not slow.

A rank's slowdown factor is its measured compute per unit of work over that cost, so factors
stay honest after a migration or resize changed the split. The cost is taken as the same at
every share: with ffn widths kept at multiples of 8 neurons (planner.MLP_ALIGN), per-unit GEMM
cost stays flat over a wide range of shares. A fitted per-call intercept (time = a + b x work)
is not used: fitted from single noisy reports, it turns their noise into large factor errors
after a move, which ends persistent straggles early and keeps ended ones open. Far below an
even share, GEMMs do lose efficiency, and this model takes that for slowness (figures:
results/notes.md).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence


class ComputeFit:
    def __init__(self, history: int = 48):
        self._per_unit = deque(maxlen=history)  # compute seconds per unit of unslowed ranks

    def per_unit(self, works: Sequence[float] = (), computes: Sequence[float] = ()) -> float:
        """Seconds per unit of work of an unslowed rank: the median over the reports seen so
        far (one noisy report does not move it), or before any, this report's fastest rank."""
        if self._per_unit:
            return statistics.median(self._per_unit)
        ratios = [c / w for w, c in zip(works, computes) if w > 0 and c > 0]
        return min(ratios) if ratios else 1.0

    def factors(self, works: Sequence[float], computes: Sequence[float]) -> list[float | None]:
        """Per rank, measured compute over an unslowed rank's at the same work (None for a
        rank without work)."""
        unit = self.per_unit(works, computes)
        return [c / (unit * w) if w > 0 else None for w, c in zip(works, computes)]

    def add(self, works: Sequence[float], computes: Sequence[float], slow: set) -> None:
        """Learn from this report's ranks that are not slow."""
        for rank, (w, c) in enumerate(zip(works, computes)):
            if rank not in slow and w > 0 and c > 0:
                self._per_unit.append(c / w)

    def state_dict(self) -> dict:
        return {"per_unit": list(self._per_unit)}

    def load_state_dict(self, state: dict) -> None:
        self._per_unit.clear()
        self._per_unit.extend(state["per_unit"])
