"""Online fit of what a rank's sharded compute costs as a function of its work.

An unslowed rank spends `intercept + slope * work` seconds per step in its sharded linears: the
slope is the GEMMs, the intercept what does not shrink with the work (per-call costs, the CPU
side of collectives). The fit uses reports of ranks believed unslowed, so it learns the
intercept once decisions have given ranks different amounts of work; until then it is zero and
time is proportional to work. A rank's slowdown factor is its measured compute over the curve
at its own work, which keeps factors honest after a migration or resize changed the split.
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Sequence


class ComputeFit:
    def __init__(self, history: int = 48):
        self._points = deque(maxlen=history)  # (work, compute seconds) of unslowed ranks

    def curve(self, works=(), computes=()) -> tuple[float, float]:
        """(intercept, slope); without history, proportional through this report's fastest."""
        points = list(self._points)
        if len(points) < 2:
            ratios = [c / w for w, c in zip(works, computes) if w > 0]
            if points:
                ratios.append(points[0][1] / points[0][0])
            return 0.0, min(ratios) if ratios else 1.0
        ws = [w for w, _ in points]
        cs = [c for _, c in points]
        mean_w, mean_c = statistics.fmean(ws), statistics.fmean(cs)
        var = sum((w - mean_w) ** 2 for w in ws)
        if var <= (0.05 * mean_w) ** 2 * len(ws):  # one amount of work seen: no intercept
            return 0.0, mean_c / mean_w
        slope = sum((w - mean_w) * (c - mean_c) for w, c in zip(ws, cs)) / var
        intercept = mean_c - slope * mean_w
        floor = min(cs)
        if slope <= 0 or intercept < 0 or intercept >= floor:  # implausible: stay proportional
            return 0.0, mean_c / mean_w
        return intercept, slope

    def factors(self, works: Sequence[float], computes: Sequence[float]) -> list[float | None]:
        """Per rank, measured compute over the fitted curve (None for a rank without work)."""
        intercept, slope = self.curve(works, computes)
        return [c / (intercept + slope * w) if w > 0 else None for w, c in zip(works, computes)]

    def add(self, works: Sequence[float], computes: Sequence[float], slow: set) -> None:
        """Learn from this report's ranks that are not slow."""
        for rank, (w, c) in enumerate(zip(works, computes)):
            if rank not in slow and w > 0 and c > 0:
                self._points.append((float(w), float(c)))
