"""Each rank's slowdown carried across a change of the work split, without a cost model. Between
two changes a rank's work stays the same, so how its compute time moves from step to step is its
speed moving, whatever compute costs per unit; and a change, applied between two steps, does not
change any rank's speed. So after each change the first `window` steps anchor every rank: its
slowdown there is the one it had just before, and each later step scales that by its compute
over the anchor's. A straggle that starts or ends inside the anchor window would spoil a median
over it, so a rank's anchor is the median of the window's steps that stay within `band` of its
first, the step nearest the change, unless that step stands alone. A hiccup there (1.8x on
this VM) read every later step of the rank as a speed-up, and a 3.2x straggler was planned for
as a 5.9x one. Where the window's other steps agree with each other and not with the first, the
first is taken for a hiccup when, read through it, the rank would be faster than full speed by
more than the band, or when the fitted model reads the other steps nearer the slowdown from
before the change than what the first step makes of them. (A straggle that ends right after the
change looks the same; there the model, or continuity alone, keeps the first.) A straggle that
starts or ends right at the change cannot be told from it by continuity: there a fitted cost
model that puts the rank on the other side of the detector's hysteresis band overrules it. A
model of compute against work (hettp/costfit.py) is then
needed only where ranks with different works are compared before any change, and to plan: read
through a model, a rank left with few units and per-call overheads that do not shrink with them
looks slow after it has recovered, or fast while it is slow.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

Factors = tuple[float | None, ...]
REFINE_STEPS = 32  # steps after the anchor window that may sharpen its base


def relative(factors: Factors) -> Factors:
    """Slowdowns against the fastest rank (None stays None)."""
    known = [f for f in factors if f is not None and f > 0]
    fastest = min(known) if known else 1.0
    return tuple(None if f is None else f / fastest for f in factors)


class SlowdownAnchor:
    def __init__(
        self, tp_size: int, window: int, band: float = 1.3, normal: float = 1.15, slow: float = 1.6
    ):
        if window < 1 or band <= 1.0 or not 1.0 <= normal < slow:
            raise ValueError(
                f"need window >= 1, band > 1 and 1 <= normal < slow, got {window}, {band}, "
                f"{normal} and {slow}"
            )
        self.tp_size, self.window, self.band = tp_size, window, band
        self.normal, self.slow = normal, slow
        self._before: Factors | None = None  # slowdowns when the split last changed
        self._base: Factors | None = None  # the anchor window's median compute per rank
        self._pending: list[tuple[float, ...]] = []  # steps since the change, until anchored
        self._modelled: list[Factors] = []  # the cost model's slowdowns of those steps
        self._level: tuple[float, ...] = ()  # the anchor window's base
        self._same_level: list[list[float]] = []  # per rank, the steps the base is made of
        self._refined = 0  # steps since the window that were considered for the base
        # per rank, its latest anchored steps' compute over its base
        self._since_base: list[list] = [[] for _ in range(tp_size)]
        self._keys: list[list[int]] = []  # per rank, the window's steps its base is made of
        self.overruled: frozenset[int] = frozenset()  # ranks the model's reading overruled
        # each rank's compute and work at the level it was at just before the change, and its
        # work after it: what an end at the change must be seen in (_shed)
        self._then: tuple[tuple[float, ...], tuple[float, ...]] | None = None
        self._work: tuple[float, ...] | None = None
        self._modelled_then: Factors | None = None  # the model's reading of that level
        # ranks whose straggle the model ended at the last anchor (of `overruled`)
        self.model_ends: frozenset[int] = frozenset()
        # ranks whose model end at a change was refuted (refute): kept for the run
        self.refuted: frozenset[int] = frozenset()

    @property
    def active(self) -> bool:
        """A change has happened: slowdowns come from the anchor (or wait for it)."""
        return self._before is not None

    @property
    def anchored(self) -> bool:
        return self._base is not None

    def clear(self) -> None:
        """Back to no anchor (the ranks' works are equal again: their ratios need no model, and
        errors carried from anchor to anchor end here)."""
        self._before, self._base, self._pending = None, None, []
        self._modelled, self._same_level = [], []
        self._since_base = [[] for _ in range(self.tp_size)]
        self.overruled = self.model_ends = frozenset()
        self._then = self._work = self._modelled_then = None

    def refute(self, ranks) -> None:
        """The model's end of these ranks' straggles at a change was wrong: they were found
        slow again at the next even split. From now on the model's reading of a rank as
        recovered before a change is no evidence for its end at one (_shed): in a TP=2 run
        (rank 0 at 2.7x, group units) a line whose intercept noisy points had inflated read
        the rank at 1.0x at every split that left it few units, ended its straggle at each
        rebalance, and the plan went back to even and out again every three steps."""
        self.refuted = self.refuted | frozenset(ranks)

    def rebase(
        self,
        slowdown: Sequence[float | None],
        compute: Sequence[float] | None = None,
        work: Sequence[float] | None = None,
        modelled: Factors | None = None,
    ) -> None:
        """The split changed after a step whose slowdowns were `slowdown` (and, where known,
        each rank's `compute` and `work` at that level, and the slowdowns the fitted model
        read there: what the model's end of a straggle at the change is held to, _shed)."""
        if len(slowdown) != self.tp_size:
            raise ValueError(f"{len(slowdown)} slowdowns for a TP group of {self.tp_size}")
        if (compute is None) != (work is None) or any(
            x is not None and len(x) != self.tp_size for x in (compute, work)
        ):
            raise ValueError("compute and work before a change: both or neither, one per rank")
        self._before, self._base, self._pending = tuple(slowdown), None, []
        self._modelled, self._same_level = [], []
        self._since_base = [[] for _ in range(self.tp_size)]
        self.overruled = self.model_ends = frozenset()
        self._then = None if compute is None else (tuple(compute), tuple(work))
        self._work = None
        self._modelled_then = None if modelled is None else relative(modelled)

    def step(
        self,
        compute: Sequence[float],
        modelled: Factors | None = None,
        work: Sequence[float] | None = None,
    ) -> list[Factors]:
        """One step's compute per rank (and where a fitted cost model exists, the slowdowns
        it reads; `work`, each rank's work at the new split); returns the slowdowns of the
        steps now known: none while the anchor window fills, all of its steps when it
        completes, then one a step."""
        if not self.active:
            raise RuntimeError("no change of the split to anchor to: use the cost model")
        if self.anchored:
            self._refine(compute)
            self._no_faster_than_full_speed(compute)
            return [self.factors(compute)]
        if work is not None:
            self._work = tuple(work)
        self._pending.append(tuple(compute))
        if modelled is not None:
            self._modelled.append(relative(modelled))
        if len(self._pending) < self.window:
            return []
        self._keys = [self._key(r) for r in range(self.tp_size)]
        self._base = self._level = tuple(self._anchor(r) for r in range(self.tp_size))
        self._same_level = [
            [self._pending[i][r] for i in self._keys[r]] for r in range(self.tp_size)
        ]
        self._refined = 0
        if len(self._modelled) == len(self._pending):
            self._overrule()
        steps, self._pending, self._modelled = self._pending, [], []
        return [self.factors(c) for c in steps]

    def _overrule(self) -> None:
        """Where continuity and the fitted model put a rank on opposite sides of the detector's
        hysteresis band (one at or below `normal`, the other at or above `slow`), a straggle
        began or ended at the change itself: take the model's slowdown there. A model that is
        merely off (1.4x for a rank with few units, seen on this VM) changes nothing. A level
        inside the band that the model reads at or below `normal` where the change gave the
        rank more work is ended too: a rank whose per-call part is not slowed (as
        --het-tp-emulate slows it) and that recovered after moving units off reads, through
        the whole-compute level carried from more work, inside the band for good (2.1x at the
        even split read 1.28x once recovered at 400 units of 784, the noisy simulation), and
        its replan there gives it the work at which the model reads it best."""
        before = list(self._before)
        ends, onsets = {}, {}
        for r, b in enumerate(before):
            seen = [self._modelled[i][r] for i in self._keys[r] if self._modelled[i][r]]
            if b is None or not seen:
                continue
            model = statistics.median(seen)
            if b >= self.slow and model <= self.normal and self._shed(r):
                ends[r] = model
            elif self.normal < b < self.slow and model <= self.normal and self._at_more_work(r):
                ends[r] = model
            elif b <= self.normal and model >= self.slow:
                onsets[r] = model
        # One rank's end and another's onset at the same change is the model mistaking which
        # rank is slow (its per-call part misread at a small share reads that rank fast, and
        # every other against it slow): continuity stands.
        if not (ends and onsets):
            for r, model in {**ends, **onsets}.items():
                before[r] = model
            self.overruled = frozenset(ends) | frozenset(onsets)
            self.model_ends = frozenset(ends)
        self._before = tuple(before)

    def _shed(self, rank: int) -> bool:
        """Whether the model's end of `rank`'s straggle at the change is evidence, not a
        misreading of a rank left few units. It is where the model read the rank recovered
        before the change too; where it reads the rank at no less work than continuity's level
        was read at (a model misreads a rank most where its units are fewest: a recovered rank
        read 1.31x at 192 units and 1.0x at 448 in the noisy simulation); or where the rank's
        compute fell across the change by `band` more than its work did (a part that does not
        shrink with the units only makes it fall less), as at an end right there. In a
        generalize draw none held: a 1.9x rank moved from 5.06 to 2.13 units of work computed
        0.465 s and then 0.248 s (0.53 of it for 0.42 of the work), the model read 1.11x, and
        the plan went back to even and out again three steps later. Without the compute before
        the change, the model decides alone. A rank whose model end was refuted (refute) is
        not ended for the model's reading before the change."""
        then = self._modelled_then
        if (
            rank not in self.refuted
            and then is not None
            and then[rank] is not None
            and then[rank] <= self.normal
        ):
            return True
        if self._then is None or self._work is None:
            return True
        if self._at_more_work(rank):
            return True  # read at no less work than continuity's level was: the better reading
        compute, work = self._then
        if compute[rank] <= 0:
            return True
        after = self._anchor(rank)
        return after * self.band <= compute[rank] * min(1.0, self._work[rank] / work[rank])

    def _at_more_work(self, rank: int) -> bool:
        """The change gave `rank` no less work than its level was read at."""
        if self._then is None or self._work is None:
            return False
        return self._work[rank] >= self._then[1][rank]

    def _refine(self, compute: Sequence[float]) -> None:
        """The window's few steps fix every later reading, and under per-step noise their
        median is several per cent off: the first REFINE_STEPS steps after it sharpen the base.
        Later steps leave it be, so that a slow drift still reads as one. A step beyond the
        square of `band` from the window's level is a new level or a hiccup and is left out;
        a narrower cut would trim the noise on one side of a window that is off, and keep the
        base off (a new level that a decision acts on re-anchors anyway). Nor is a step
        `slow` apart, which the detector takes for a straggle at once (at the default onset
        and at-once factors, 1.6 where the square of the band is 1.69): at a band of 1.5
        (--het-tp-onset 1.5) a straggler's 3x steps after a window at 6.3x (a spell on top of
        the straggle) were folded into its base, and once the straggle ended it read 2.1x and
        stayed resized. A cut at `band` itself mends that too, but trims heavy per-step noise
        on one side (more false ends in hettp.sim.noisy at 25%)."""
        if self._refined >= REFINE_STEPS:
            return
        self._refined += 1
        base, band = list(self._base), min(self.band**2, self.slow)
        for r, c in enumerate(compute):
            level = self._level[r]
            if level > 0 and c > 0 and max(level, c) < band * min(level, c):
                self._same_level[r].append(c)
                base[r] = statistics.median(self._same_level[r])
        self._base = tuple(base)

    def _no_faster_than_full_speed(self, compute: Sequence[float]) -> None:
        """A rank whose last `window` anchored steps read it faster than full speed by more
        than `slow` (their median), having sped up since the window by `slow` more than the
        other ranks did, was carried too slow: its speed changed inside the anchor window (a
        spell there, on this rank or on a straggler read against it). It is carried at full
        speed from here. Left so, a fast rank whose window fell in a 2x spell read 0.5x after
        it, and the straggler that ended its straggle read 2x against it for good. A speed-up
        of every rank alike (the whole node slow through the window) is the others' too, and
        `relative` reads it right. A spell that began before the change and ended inside the
        window looks the same as one inside it, and is taken for one. At `band` rather than
        `slow`, a window that per-step noise of 25% had put high re-carried fast ranks that
        were not (hettp.sim.noisy's E fell)."""
        ratios = [c / b if b and b > 0 and c > 0 else None for c, b in zip(compute, self._base)]
        for r, ratio in enumerate(ratios):
            self._since_base[r] = [*self._since_base[r], ratio][-self.window :]
        if any(len(recent) < self.window or None in recent for recent in self._since_base):
            return
        sped = [statistics.median(recent) for recent in self._since_base]  # compute now / base
        for r in range(self.tp_size):
            others = [x for i, x in enumerate(sped) if i != r]
            if self._before[r] is None or not others:
                continue
            level = self._before[r] * sped[r]
            if level * self.slow < 1.0 and sped[r] * self.slow < statistics.median(others):
                before = list(self._before)
                before[r] /= level
                self._before = tuple(before)
                self._since_base = [[] for _ in range(self.tp_size)]
                return

    def _same(self, rank: int) -> list[int]:
        """The anchor window's steps within `band` of its first, for `rank`."""
        first = self._pending[0][rank]
        return [
            i
            for i, step in enumerate(self._pending)
            if first > 0 and max(step[rank], first) < self.band * min(step[rank], first)
        ]

    def _key(self, rank: int) -> list[int]:
        """The anchor window's steps that `rank`'s base is made of: those within `band` of
        its first, or the others where the first stands alone as a hiccup."""
        same = self._same(rank)
        before = self._before[rank]
        rest = list(range(1, len(self._pending)))
        if len(same) > 1 or not rest or before is None or before <= 0:
            return same
        others = [self._pending[i][rank] for i in rest]
        if min(others) <= 0 or max(others) >= self.band * min(others):
            return same  # no level among the others either
        through_first = before * statistics.median(others) / self._pending[0][rank]
        if through_first < 1.0 / self.band:
            return rest  # faster than full speed
        modelled = len(self._modelled) == len(self._pending)
        seen = [self._modelled[i][rank] for i in rest if modelled and self._modelled[i][rank]]
        if seen:
            model = statistics.median(seen)
            if abs(math.log(model / before)) < abs(math.log(model / through_first)):
                return rest
        return same

    def _anchor(self, rank: int) -> float:
        key = self._keys[rank]
        return statistics.median(self._pending[i][rank] for i in key) if key else 0.0

    def factors(self, compute: Sequence[float]) -> Factors:
        """Slowdowns for per-rank `compute` measured at the anchored split."""
        return tuple(
            None if b is None or base <= 0 else b * c / base
            for b, base, c in zip(self._before, self._base, compute)
        )

    def state_dict(self) -> dict:
        return {
            "before": None if self._before is None else list(self._before),
            "base": None if self._base is None else list(self._base),
            "pending": [list(step) for step in self._pending],
            "modelled": [list(row) for row in self._modelled],
            "level": list(self._level),
            "same_level": [list(steps) for steps in self._same_level],
            "refined": self._refined,
            "since_base": list(self._since_base),
            "overruled": sorted(self.overruled),
            "then": None if self._then is None else [list(x) for x in self._then],
            "work": None if self._work is None else list(self._work),
            "modelled_then": None if self._modelled_then is None else list(self._modelled_then),
            "model_ends": sorted(self.model_ends),
            "refuted": sorted(self.refuted),
        }

    def load_state_dict(self, state: dict) -> None:
        self._before = None if state["before"] is None else tuple(state["before"])
        self._base = None if state["base"] is None else tuple(state["base"])
        self._pending = [tuple(step) for step in state["pending"]]
        self._modelled = [tuple(row) for row in state.get("modelled", ())]
        # absent from older checkpoints: the base as it was, not refined further
        self._level = tuple(state.get("level", self._base or ()))
        self._same_level = [list(steps) for steps in state.get("same_level", ())]
        self._refined = state.get("refined", REFINE_STEPS)
        # absent from older checkpoints: no readings yet
        self._since_base = [list(x) for x in state.get("since_base", [[]] * self.tp_size)]
        self.overruled = frozenset(state.get("overruled", ()))
        then = state.get("then")  # absent before it: the model decides ends alone
        self._then = None if then is None else (tuple(then[0]), tuple(then[1]))
        work = state.get("work")
        self._work = None if work is None else tuple(work)
        modelled = state.get("modelled_then")
        self._modelled_then = None if modelled is None else tuple(modelled)
        self.model_ends = frozenset(state.get("model_ends", ()))  # absent before: none
        self.refuted = frozenset(state.get("refuted", ()))
