"""Straggler detection from per-rank compute timings, with hysteresis.

Input, every step: each TP rank's seconds of compute per unit of work (its own compute only,
never wall time: collectives make every rank wait for the slowest, so wall times look equal).
Output: each rank's slowdown against the fastest rank, smoothed as the median of the last
`window` steps, and which ranks are straggling. A rank starts straggling after its smoothed
slowdown stays at or above `onset` for `patience` steps, or at once when it reaches `at_once`,
and stops after it stays at or below `end` for `end_patience` steps; `changed` asks the planner
to act. A rank's state changes only once its window is full, so the median of 3 needs two slow
(or two normal) steps in a row: a step boundary after the second, the planner acts on a large
slowdown and on an end, which is fast enough to follow a straggle that starts or ends mid-run,
while one noisy step never flips the state. A mild slowdown (below `at_once`) must last
`patience` smoothed steps: on a shared machine, ranks drift 20% apart for a few steps now and
then (figures: results/notes.md). So must a straggler's rise to a slower level; its easing to a
milder one is acted on once its window agrees, as an end is.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass


class DetectError(ValueError):
    """Bad detector thresholds or timings."""


@dataclass(frozen=True)
class Detection:
    slowdown: tuple[float, ...]  # smoothed time per unit / the fastest rank's (1.0 = fastest)
    stragglers: frozenset  # ranks currently straggling
    changed: bool  # the straggler set changed, or a straggler's slowdown moved by a factor
    # beyond 1 + `replan` either way (2x -> 3x or 3x -> 2x at the default 0.5)
    onsets: frozenset  # ranks that started straggling at this report
    ends: frozenset  # ranks that stopped at this report


# Steps since the last change that `level` reads a rank's level from (those at the window's
# level). A level read from the window's 3 steps is carried across the change with its noise
# into every later reading of the rank (hettp/anchor.py).
LEVEL_STEPS = 16


class StragglerDetector:
    def __init__(
        self,
        tp_size: int,
        onset: float = 1.3,
        end: float = 1.15,
        patience: int = 3,
        window: int = 3,
        replan: float = 0.5,
        at_once: float = 1.6,
        end_patience: int = 1,
    ):
        if not 1.0 <= end < onset:
            raise DetectError(f"thresholds: need 1 <= end ({end}) < onset ({onset})")
        if not at_once >= onset:
            raise DetectError(f"thresholds: need at_once ({at_once}) >= onset ({onset})")
        if min(patience, window, end_patience) < 1:
            raise DetectError(
                f"patience ({patience}), end patience ({end_patience}) and window ({window}) "
                "must be >= 1"
            )
        self.tp_size, self.onset, self.end, self.at_once = tp_size, onset, end, at_once
        self.patience, self.replan, self.window = patience, replan, window
        self.end_patience = end_patience
        self._slowdown = (1.0,) * tp_size  # the last update's
        self._history = [deque(maxlen=window) for _ in range(tp_size)]
        self._since = [deque(maxlen=LEVEL_STEPS) for _ in range(tp_size)]  # since the change
        self._above = [0] * tp_size
        self._below = [0] * tp_size
        self._rising = [0] * tp_size  # smoothed steps in a row a straggler read a slower level
        self.stragglers: frozenset = frozenset()
        self._planned_for: dict = {}  # straggler -> slowdown the last decision used
        self._planned_own: dict = {}  # straggler -> its own smoothed value then
        self._rebased = False

    def rebase(self) -> None:
        """After a decision changed the work split: forget the smoothing history and take the
        first full window after it as the new reference for drift, so timing-model error after
        a move cannot trigger another move. Onsets and ends still need their thresholds
        crossed."""
        for history in (*self._history, *self._since):
            history.clear()
        self._rebased = True

    def current(self) -> Detection:
        """The state after the last update, as a detection that changes nothing."""
        return Detection(self._slowdown, self.stragglers, False, frozenset(), frozenset())

    def level(self) -> tuple[float, ...]:
        """Each rank's slowdown at the level its latest step is at: the median of its steps
        since the last change (the latest LEVEL_STEPS) within `onset` of the window's level
        (the median of the window's steps within `onset` of the latest). The
        smoothed slowdown decides whether a straggle began (one noisy step must not); this
        says how slow it is. At an onset the window still holds the steps before it, so its
        median is half way ([1.0, 1.7, 2.3] reads 1.7 for a rank that is now 2.3x), and a
        plan or anchor taken from it is too; read from the window's 3 steps alone, a level
        kept their noise (a 2.5x rank carried at 2.78x read 1.2x once it had recovered, and
        stayed planned for)."""
        latest = []
        for window, since in zip(self._history, self._since):
            if not window:
                latest.append(None)
                continue
            # the window's level, then the steps since the change at it: picked around one
            # noisy latest step, the longer history leaned its way
            level = statistics.median(self._near(window, window[-1]))
            latest.append(statistics.median(self._near(since, level)))
        known = [v for v in latest if v is not None]
        if not known:
            return self._slowdown
        fastest = min(known)
        return tuple(1.0 if v is None else v / fastest for v in latest)

    def _near(self, values, at: float) -> list[float]:
        """`values` within `onset` of `at`."""
        return [v for v in values if max(v, at) < self.onset * min(v, at)]

    def update(self, per_unit_seconds: Sequence[float | None]) -> Detection:
        """One step: seconds per unit of work per rank (None: the rank ran no units)."""
        if len(per_unit_seconds) != self.tp_size:
            raise DetectError(f"{len(per_unit_seconds)} timings for a TP group of {self.tp_size}")
        for rank, value in enumerate(per_unit_seconds):
            if value is not None:
                if not value > 0:
                    raise DetectError(f"rank {rank}: time per unit must be positive, got {value}")
                self._history[rank].append(float(value))
                self._since[rank].append(float(value))
        smoothed = [statistics.median(h) if h else None for h in self._history]
        known = [v for v in smoothed if v is not None]
        if not known:
            return Detection(
                (1.0,) * self.tp_size, self.stragglers, False, frozenset(), frozenset()
            )
        fastest = min(known)
        slowdown = tuple(1.0 if v is None else v / fastest for v in smoothed)
        self._slowdown = slowdown
        onsets, ends = set(), set()
        for rank, factor in enumerate(slowdown):
            if len(self._history[rank]) < self._history[rank].maxlen:
                self._above[rank] = self._below[rank] = 0
                continue  # too few steps since the start or a rebase to judge
            self._above[rank] = self._above[rank] + 1 if factor >= self.onset else 0
            self._below[rank] = self._below[rank] + 1 if factor <= self.end else 0
            if rank not in self.stragglers and (
                self._above[rank] >= self.patience or factor >= self.at_once
            ):
                onsets.add(rank)
            elif (
                rank in self.stragglers
                and self._below[rank] >= self.end_patience
                and self._sped_up(rank, smoothed[rank])
            ):
                ends.add(rank)
        self.stragglers = (self.stragglers | onsets) - ends
        # A straggler whose slowdown moved a lot (2x -> 4x) and settled there needs a new plan.
        # So does one that shed most of it and settled inside the hysteresis band (3x -> 1.25x:
        # a rank still warming up after a straggle, on a shared machine): waiting for it to
        # read `end` would keep the 3x plan for as long as that takes.
        if self._rebased and all(len(h) in (0, h.maxlen) for h in self._history):
            self._rebased = False
            self._planned_for = {r: slowdown[r] for r in self.stragglers}
            self._planned_own = {r: smoothed[r] for r in self.stragglers}
        drifted = False
        for r in range(self.tp_size):
            level = (
                not self._rebased
                and r in self.stragglers
                and (slowdown[r] >= self.onset or self._sped_up(r, smoothed[r]))
                and self._steady(r)
                and abs(math.log(slowdown[r] / self._planned_for.get(r, slowdown[r])))
                > math.log1p(self.replan)
                and self._moved_itself(r, smoothed[r], slowdown[r])
            )
            slower = level and slowdown[r] > self._planned_for.get(r, slowdown[r])
            self._rising[r] = self._rising[r] + 1 if slower else 0
            # a slower level must last `patience` smoothed steps, as a mild onset must: the
            # straggler is planned for already, and a few slower steps of its own (2x its time
            # for a report on this VM) read as 3.5x a 2.3x rank, and the plan followed them
            drifted = drifted or (level and (not slower or self._rising[r] >= self.patience))
        changed = bool(onsets or ends or drifted)
        if changed:
            self._rising = [0] * self.tp_size
            self._planned_for = {r: slowdown[r] for r in self.stragglers}
            self._planned_own = {r: smoothed[r] for r in self.stragglers}
        return Detection(slowdown, self.stragglers, changed, frozenset(onsets), frozenset(ends))

    def _sped_up(self, rank: int, own: float | None) -> bool:
        """An end needs the straggler itself to have shed at least half its planned slowdown,
        not only the others to have slowed down to it (a rank descheduled for a few steps)."""
        planned, then = self._planned_for.get(rank), self._planned_own.get(rank)
        if own is None or planned is None or then is None or planned < self.onset:
            return True  # nothing to go by, or nothing slow to shed (recovered at a re-base)
        return own <= then / (1.0 + (planned - 1.0) / 2.0)

    def _moved_itself(self, rank: int, own: float | None, slowdown: float) -> bool:
        """A straggler's new level is its own doing: its own smoothed value moved from where it
        was when last planned for, the way its slowdown against the fastest rank did, by at
        least half the replan band (in log terms). A fast rank's hiccup (1.5x for a few steps)
        read a steady 3x straggler at 2x, the plan moved units back to it as to a recovering
        rank, and it then ran 20-40% over the fast rank (results/notes.md)."""
        planned, then = self._planned_for.get(rank), self._planned_own.get(rank)
        if own is None or planned is None or then is None or then <= 0:
            return True  # nothing to go by
        moved, need = math.log(own / then), 0.5 * math.log1p(self.replan)
        return moved > need if slowdown > planned else moved < -need

    def _steady(self, rank: int) -> bool:
        """The rank's window agrees within the replan band: a slowdown on its way from one
        level to another (a straggle ending over two steps) is not yet a new level."""
        history = self._history[rank]
        return bool(history) and max(history) <= (1 + self.replan) * min(history)

    def state_dict(self) -> dict:
        """Everything a resumed run needs to detect as this one would (plain data)."""
        return {
            "history": [list(h) for h in self._history],
            "since": [list(h) for h in self._since],
            "above": list(self._above),
            "below": list(self._below),
            "rising": list(self._rising),
            "stragglers": sorted(self.stragglers),
            "planned_for": {str(r): v for r, v in self._planned_for.items()},
            "planned_own": {str(r): v for r, v in self._planned_own.items()},
            "rebased": self._rebased,
            "slowdown": list(self._slowdown),
        }

    def load_state_dict(self, state: dict) -> None:
        if len(state["history"]) != self.tp_size:
            raise DetectError(
                f"saved detector state is for a TP group of "
                f"{len(state['history'])}, not {self.tp_size}"
            )
        for history, saved in zip(self._history, state["history"]):
            history.clear()
            history.extend(saved)
        # absent before it: the window's steps are all that is known since the change
        for since, saved in zip(self._since, state.get("since", state["history"])):
            since.clear()
            since.extend(saved)
        self._above, self._below = list(state["above"]), list(state["below"])
        self._rising = list(state.get("rising", [0] * self.tp_size))  # absent before it
        self.stragglers = frozenset(state["stragglers"])
        self._planned_for = {int(r): v for r, v in state["planned_for"].items()}
        self._planned_own = {int(r): v for r, v in state.get("planned_own", {}).items()}
        self._rebased = state["rebased"]
        self._slowdown = tuple(state.get("slowdown", (1.0,) * self.tp_size))
