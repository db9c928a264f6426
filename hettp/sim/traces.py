"""Straggler traces: which GPU is how many times slower over which steps.

Built from the scenarios scripts/compare.py runs (hettp.scenarios), or drawn from the shapes
production studies report: persistent 1.2-1.5x slowdowns on a few percent of GPUs
(the common case in ByteDance's study of 3,079 jobs), a rare single worker at ~3x, and
transient episodes minutes long with onsets mid-run."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from ..scenarios import ScenarioSpec


@dataclass(frozen=True)
class Episode:
    gpu: int
    start: int  # first slow step (steps count from 1)
    stop: int | None  # first step at full speed again; None: to the end
    factor: float

    def covers(self, step: int) -> bool:
        return self.start <= step and (self.stop is None or step < self.stop)


class Trace:
    """Episodes over `gpus` GPUs; a GPU in several at once runs at the largest factor."""

    def __init__(self, gpus: int, episodes: Sequence[Episode], name: str = "trace"):
        for e in episodes:
            if not 0 <= e.gpu < gpus or e.factor < 1.0 or e.start < 1:
                raise ValueError(f"{name}: bad episode {e} for {gpus} GPUs")
        self.gpus, self.name = gpus, name
        self.episodes = tuple(episodes)
        self._by_gpu: dict[int, list[Episode]] = {}
        for e in self.episodes:
            self._by_gpu.setdefault(e.gpu, []).append(e)

    @property
    def touched(self) -> frozenset:
        """GPUs that are slow at some step: every other GPU runs at full speed throughout."""
        return frozenset(self._by_gpu)

    def factor(self, gpu: int, step: int) -> float:
        return max((e.factor for e in self._by_gpu.get(gpu, ()) if e.covers(step)), default=1.0)

    def changes(self) -> dict[int, set[int]]:
        """step -> GPUs whose factor may change at that step."""
        out: dict[int, set[int]] = {}
        for e in self.episodes:
            out.setdefault(e.start, set()).add(e.gpu)
            if e.stop is not None:
                out.setdefault(e.stop, set()).add(e.gpu)
        return out

    def speeds(self, step: int) -> list[float]:
        return [1.0 / self.factor(g, step) for g in range(self.gpus)]


def from_scenario(spec: ScenarioSpec, tp: int, stages: int, replicas: int, steps: int) -> Trace:
    """A compare.py scenario as a trace over the job's global ranks (megatron-core's order)."""
    factors = spec.factors(tp, steps, stages, replicas)
    return from_factors(factors, spec.name)


def from_factors(factors: Sequence[Sequence[float]], name: str = "trace") -> Trace:
    """Per-step factors of every GPU (steps 1..n) as episodes: runs of one factor."""
    gpus = len(factors[0]) if factors else 0
    episodes = []
    for gpu in range(gpus):
        run_start, run_factor = None, 1.0
        for step, row in enumerate(factors, start=1):
            f = float(row[gpu])
            if f != run_factor:
                if run_factor != 1.0:
                    episodes.append(Episode(gpu, run_start, step, run_factor))
                run_start, run_factor = step, f
        if run_factor != 1.0:
            episodes.append(Episode(gpu, run_start, None, run_factor))
    return Trace(gpus, episodes, name)


def production(
    gpus: int,
    steps: int,
    seed: int = 0,
    persistent_share: float = 0.02,
    persistent_factors: tuple[float, float] = (1.2, 1.5),
    rare_factor: float = 3.0,
    transient_per_1k_gpus: float = 2.0,
    transient_factor: tuple[float, float] = (1.5, 2.5),
    transient_steps: tuple[int, int] = (50, 200),
) -> Trace:
    """A draw of the straggler mix production studies report (module docstring): persistent
    mild stragglers from the start, one worker at `rare_factor` from a random step, and
    transient episodes of `transient_steps` (minutes at a few seconds a step)."""
    rng = random.Random(seed)
    episodes = []
    slow = rng.sample(range(gpus), max(1, round(persistent_share * gpus)))
    for gpu in slow:
        episodes.append(Episode(gpu, 1, None, round(rng.uniform(*persistent_factors), 3)))
    rare = rng.randrange(gpus)
    episodes.append(Episode(rare, rng.randint(1, max(1, steps // 2)), None, rare_factor))
    for _ in range(max(1, round(transient_per_1k_gpus * gpus / 1000))):
        start = rng.randint(1, max(1, steps - 1))
        length = rng.randint(*transient_steps)
        episodes.append(
            Episode(
                rng.randrange(gpus), start, start + length, round(rng.uniform(*transient_factor), 3)
            )
        )
    return Trace(gpus, episodes, f"production(seed={seed})")


def persistent(gpus: int, slow: dict[int, float], name: str = "persistent") -> Trace:
    return Trace(gpus, [Episode(g, 1, None, f) for g, f in sorted(slow.items())], name)
