"""Online estimate of what an unslowed rank's compute costs: `fixed + per_unit x work`.

A rank's slowdown factor is its measured compute over that cost at its own work, so factors
stay honest after a migration or resize changed the split. The intercept is real: per-call
overheads of the timed blocks and the optimizer's per-tensor work do not shrink with the
units, so a rank left with a quarter of the units computes well over a quarter of the time.
Taken as zero, it reads a recovered rank with few units as still slow (an ended straggle kept
open) and gives a straggler more units than it can finish in time.

How it is found: while every rank has had the same work (before any move), a line cannot be
fitted, and the optimizer step, timed apart, stands in for the intercept. Once the reports of
unslowed ranks span works at least SPREAD apart, the line is fitted robustly (Theil-Sen: the
median of pairwise slopes, the median intercept), so one noisy report moves neither.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

SPREAD = 1.2  # the least ratio of two works whose points give a slope
MIN_PAIRS = 4  # slopes a fitted line needs


@dataclass(frozen=True)
class Line:
    fixed: float  # seconds an unslowed rank computes whatever its units
    per_unit: float  # and per unit of work on top
    # Of `fixed`, the seconds in the region timed apart (the optimizer step's per-tensor
    # work): it runs after the last block, so no split of the blocks' units shortens it.
    apart: float = 0.0


_UNSET = object()


def _zeros(fixed, n):
    return tuple(fixed) if fixed is not None else (0.0,) * n


def theil_sen(points: Sequence[tuple[float, float]], spread: float = SPREAD) -> Line | None:
    """The median slope over pairs whose works are at least `spread` apart and the median
    intercept; None with fewer than MIN_PAIRS such pairs, or a line that is not increasing
    with a non-negative intercept."""
    slopes = [
        (c2 - c1) / (w2 - w1)
        for i, (w1, c1) in enumerate(points)
        for w2, c2 in points[i + 1 :]
        if max(w1, w2) >= spread * min(w1, w2)
    ]
    if len(slopes) < MIN_PAIRS:
        return None
    slope = statistics.median(slopes)
    if slope <= 0:
        return None
    fixed = statistics.median(c - slope * w for w, c in points)
    return Line(fixed, slope) if fixed >= 0 else None


class ComputeFit:
    def __init__(self, history: int = 48):
        self._points = deque(maxlen=history)  # (work, compute, timed fixed) of unslowed ranks
        self._line = None  # the line of the points, while they do not change
        self._fit = _UNSET  # theil_sen of the points, while they do not change

    def line(
        self,
        works: Sequence[float] = (),
        computes: Sequence[float] = (),
        fixed: Sequence[float] | None = None,
    ) -> Line:
        """The cost of an unslowed rank: fitted where the points allow, else the timed fixed
        part and the median compute per unit on top; before any point, this report's fastest
        rank (given by `works`, `computes`, `fixed`)."""
        if self._line is not None:
            return self._line
        if not self._points:
            fixed = _zeros(fixed, len(works))
            ratios = [(c - x) / w for w, c, x in zip(works, computes, fixed) if w > 0 and c > x]
            base = min(fixed) if fixed else 0.0
            return Line(base, min(ratios) if ratios else 1.0, base)
        line = self._theil_sen()
        if line is None:
            base = statistics.median(x for _, _, x in self._points)
            line = Line(base, statistics.median((c - base) / w for w, c, _ in self._points), base)
        else:
            line = Line(line.fixed, line.per_unit, min(line.fixed, self._apart()))
        self._line = line
        return line

    def _apart(self) -> float:
        """What an unslowed rank spends in the region timed apart whatever its units: the
        intercept of that region's seconds against work where they span a line (Adam's
        per-parameter work moves with the units), else their median."""
        timed = theil_sen([(w, x) for w, _, x in self._points])
        if timed is not None:
            return timed.fixed
        return statistics.median(x for _, _, x in self._points)

    @property
    def fitted(self) -> bool:
        """The points span works far enough apart for a line (else a prior stands in)."""
        return bool(self._points) and self._theil_sen() is not None

    def _theil_sen(self) -> Line | None:
        if self._fit is _UNSET:
            self._fit = theil_sen([(w, c) for w, c, _ in self._points])
        return self._fit

    def per_unit(self, works=(), computes=(), fixed=None) -> float:
        return self.line(works, computes, fixed).per_unit

    def factors(
        self,
        works: Sequence[float],
        computes: Sequence[float],
        fixed: Sequence[float] | None = None,
    ) -> list[float | None]:
        """Per rank, measured compute over an unslowed rank's at the same work (None for a
        rank without work, unless a fixed part gives it compute to compare).

        A rank without work is read on the fitted per-call part alone: where that is off
        (noisy reports fitted it 4x too large), the rank reads fast by the same factor and,
        as the fastest, makes every working rank look that much slower, so that units chase
        back and forth between them. It reads no faster than the fastest working rank."""
        line = self.line(works, computes, fixed)
        out = [
            c / (line.fixed + line.per_unit * w) if w > 0 or line.fixed > 0 else None
            for w, c in zip(works, computes)
        ]
        working = [f for f, w in zip(out, works) if w > 0 and f is not None]
        if working:
            floor = min(working)
            out = [f if w > 0 or f is None else max(f, floor) for f, w in zip(out, works)]
        return out

    def add(
        self,
        works: Sequence[float],
        computes: Sequence[float],
        factors: Sequence[float | None],
        fixed: Sequence[float] | None = None,
    ) -> None:
        """Learn from a report: each rank's compute as it would be at the fastest rank's
        speed (its own over its slowdown `factors` against the fastest)."""
        fixed = _zeros(fixed, len(works))
        known = [f for f in factors if f is not None and f > 0]
        if not known:
            return
        fastest = min(known)
        for w, c, x, f in zip(works, computes, fixed, factors):
            if f is not None and f > 0 and w > 0 and c > x:
                scale = fastest / f
                self._points.append((w, c * scale, x * scale))
                self._line, self._fit = None, _UNSET

    def rescale(self, factor: float) -> None:
        """Every step's work was multiplied by `factor` (a batch ramp changed the micro-batch
        count): the seconds learned so far scale with it."""
        points = [(w, c * factor, x * factor) for w, c, x in self._points]
        self._points.clear()
        self._points.extend(points)
        self._line, self._fit = None, _UNSET

    def state_dict(self) -> dict:
        return {"points": [list(p) for p in self._points]}

    def load_state_dict(self, state: dict) -> None:
        self._points.clear()
        self._points.extend(tuple(p) for p in state.get("points", ()))  # absent before 0.2
        self._line, self._fit = None, _UNSET


@dataclass(frozen=True)
class BlockSample:
    """One rank's step, split by block kind: seconds in the attention modules and in the MLP
    ones, and the work each held (attention's GEMMs by their parameters, its core attention
    by its FLOPs in the same terms, hettp.step_model.core_attention_work)."""

    attention_s: float
    mlp_s: float
    attention_gemm: float
    core: float
    mlp: float


CORE_SCALE_RANGE = (0.25, 20.0)  # what a kernel may cost per FLOP against the GEMMs


def core_attention_scale(samples: Sequence[BlockSample]) -> float | None:
    """What core attention costs per FLOP against the GEMMs, from steps timed by block kind:
    each sample's MLP gives its rank's GEMM rate, its attention seconds past its GEMMs at that
    rate are its core attention's. A slowdown stretches both kinds alike, so any rank's step
    will do. The median over the samples, within CORE_SCALE_RANGE; None without a sample that
    held both kinds. On this CPU megatron-core's local attention cost 1.6-2.3x the GEMMs per
    FLOP (sequence 128, head dim 64), a fused GPU kernel runs near their rate: weighed by
    FLOPs alone, a unit's attention was a guess."""
    scales = []
    for s in samples:
        if min(s.mlp, s.core, s.mlp_s, s.attention_s) <= 0:
            continue
        rate = s.mlp_s / s.mlp
        scales.append((s.attention_s - rate * s.attention_gemm) / (rate * s.core))
    if not scales:
        return None
    low, high = CORE_SCALE_RANGE
    return min(high, max(low, statistics.median(scales)))
