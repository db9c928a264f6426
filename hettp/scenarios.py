"""Comparison scenarios: what slows which rank during a run, emulated or for real.

A scenario is either an emulation (`--het-tp-emulate` spec, hettp/emulate.py) or real
contention (a busy neighbour process on one rank's core, scripts/noisy_neighbor.py). Built-in
ones scale with the run's length; users add their own in a JSON file:

    [{"name": "slow-rank-0", "emulate": "persistent:rank=0,factor=3",
      "about": "rank 0 three times slower"},
     {"name": "contended-1", "noisy_neighbor": {"rank": 1}}]
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from .emulate import Scenario, ScenarioError


@dataclass(frozen=True)
class ScenarioSpec:
    name: str
    emulate: str | None = None  # --het-tp-emulate spec; None: nothing emulated
    neighbor_rank: int | None = None  # TP rank whose core gets a busy neighbour
    about: str = ""

    @property
    def real(self) -> bool:
        return self.neighbor_rank is not None

    def device(self, tp_size: int) -> bool:
        """Emulated in device mode: all of a slowed rank's compute is slowed."""
        emulation = self.emulation(tp_size)
        return emulation is not None and emulation.mode == "device"

    def emulation(self, tp_size: int) -> Scenario | None:
        return (
            Scenario.parse(self.emulate, tp_size, f"scenario '{self.name}'")
            if self.emulate
            else None
        )

    def factors(
        self, tp_size: int, iterations: int, stages: int = 1, replicas: int = 1
    ) -> list[tuple[float, ...]]:
        """Emulated slowdown per rank for iterations 1..n (all 1.0 for real contention: that
        is measured, not known). With pipeline stages or data-parallel replicas, per global
        rank in megatron-core's order: TP ranks, then replicas, then stages."""
        emulation = self.emulation(tp_size)
        ranks = range(tp_size * stages * replicas)
        return [
            tuple(
                emulation.factor(g % tp_size, i, g, g // (tp_size * replicas)) if emulation else 1.0
                for g in ranks
            )
            for i in range(1, iterations + 1)
        ]

    def varying(self, tp_size: int, iterations: int, stages: int = 1, replicas: int = 1) -> bool:
        """Does who is slow change during the run (after the first iteration)? Then its step
        time is the mean over the run, not the steady state of its second half."""
        return len(set(self.factors(tp_size, iterations, stages, replicas)[1:])) > 1

    def check(self, tp_size: int, stages: int = 1, replicas: int = 1) -> None:
        """A comparison of `stages` pipeline stages of `replicas` data-parallel replicas of TP
        groups of `tp_size` can run it (and report its bound)."""
        if self.emulate and self.real:
            raise ScenarioError(f"scenario '{self.name}': give emulate or noisy_neighbor, not both")
        emulation = self.emulation(tp_size)
        if emulation is not None and emulation.global_ranks is not None:
            world = tp_size * stages * replicas
            if max(emulation.global_ranks) >= world:
                raise ScenarioError(
                    f"scenario '{self.name}': global rank {max(emulation.global_ranks)} is not "
                    f"below the world size ({world})"
                )
        if emulation is not None and emulation.stage is not None and emulation.stage >= stages:
            raise ScenarioError(
                f"scenario '{self.name}': stage {emulation.stage} is not a pipeline stage "
                f"({stages} stages)"
            )
        if self.real and not 0 <= self.neighbor_rank < tp_size:
            raise ScenarioError(
                f"scenario '{self.name}': noisy_neighbor rank "
                f"{self.neighbor_rank} is not a TP rank (TP size {tp_size})"
            )


def builtin(
    tp_size: int, iterations: int, stages: int = 1, replicas: int = 1
) -> dict[str, ScenarioSpec]:
    """The built-in scenarios for a run of `iterations` steps at this TP size (and these
    pipeline stages: then also one slow rank in a stage, and a whole slow stage; and these
    data-parallel replicas: then also a straggler in one replica, and stragglers at different
    TP positions of two replicas)."""
    n = iterations
    half = max(1, tp_size // 2)
    multi = "/".join(f"{f:g}" for f in (8, 6, 4, 2)[:half])
    burst, period = max(2, n // 6), max(4, n // 2)
    specs = [
        ScenarioSpec("none", about="no straggler"),
        ScenarioSpec(
            "persistent-2x", "persistent:rank=1,factor=2", about="rank 1 2x slower from the start"
        ),
        ScenarioSpec(
            "persistent-4x", "persistent:rank=1,factor=4", about="rank 1 4x slower from the start"
        ),
        ScenarioSpec(
            "transient",
            f"transient:rank=1,factor=4,start={n // 4},length={burst},period={period}",
            about=f"rank 1 4x slower for {burst} of every "
            f"{period} iterations from iteration {n // 4}",
        ),
        ScenarioSpec(
            "rotating",
            f"rotating:factor=2,period={max(1, n // 3)}",
            about=f"one rank 2x slower, a different one every {max(1, n // 3)} iterations",
        ),
        ScenarioSpec(
            "multi",
            f"multi:factors={multi}",
            about=f"ranks 0..{half - 1} at {multi}x (half the ranks)",
        ),
        ScenarioSpec(
            "noisy", neighbor_rank=1, about="real contention: a busy process shares rank 1's core"
        ),
        # Shaped on production studies (ByteDance, OSDI'25: most slowed jobs see mild,
        # persistent slowdowns; a few single workers are ~3x slow; episodes come and go).
        ScenarioSpec(
            "mild",
            "persistent:rank=1,factor=1.3",
            about="rank 1 1.3x slower from the start (the common case)",
        ),
        ScenarioSpec(
            "rare-3x",
            f"persistent:rank={tp_size - 1},factor=3",
            about=f"one worker (rank {tp_size - 1}) 3x slower from the start",
        ),
        ScenarioSpec(
            "episode",
            f"persistent:rank=1,factor=2.5,start={n // 3},stop={2 * n // 3}",
            about=f"rank 1 2.5x slower from iteration {n // 3} to {2 * n // 3}, then well",
        ),
        ScenarioSpec(
            "slow-rank-0",
            "persistent:rank=0,factor=2",
            about="rank 0 (the rank that decides) 2x slower from the start",
        ),
        ScenarioSpec(
            "several",
            "multi:factors=2/1.5",
            about="ranks 0 and 1 slow at once, 2x and 1.5x",
        ),
        ScenarioSpec(
            "device-3x",
            "persistent:rank=1,factor=3,mode=device",
            about="rank 1 3x slower at all of its compute, as a slow GPU (needs a core per rank)",
        ),
    ]
    if stages > 1:
        last = stages - 1
        slow = last * tp_size + tp_size - 1  # the last stage's last TP rank, one replica
        specs += [
            ScenarioSpec(
                "stage-rank-2x",
                f"persistent:global={slow},factor=2",
                about=f"global rank {slow} (TP rank {tp_size - 1} of stage {last}) 2x slower",
            ),
            ScenarioSpec(
                "stage-2x",
                f"persistent:stage={last},factor=2",
                about=f"every rank of stage {last} 2x slower (a slow stage)",
            ),
        ]
    if replicas > 1 and stages == 1:
        last = (replicas - 1) * tp_size + tp_size - 1  # the last replica's last TP rank
        specs.append(
            ScenarioSpec(
                "replica-3x",
                f"persistent:global={last},factor=3",
                about=f"global rank {last} (TP rank {tp_size - 1} of replica {replicas - 1}) "
                "3x slower: one replica slow",
            )
        )
    if replicas > 1 and stages == 1 and tp_size > 1:
        other = (replicas - 1) * tp_size  # the last replica's TP rank 0
        specs += [
            ScenarioSpec(
                "crossed-3x",
                f"persistent:global={tp_size - 1}/{other},factor=3",
                about=f"TP rank {tp_size - 1} of replica 0 and TP rank 0 of replica "
                f"{replicas - 1} 3x slower: no shared plan balances both",
            ),
        ]
    return {s.name: s for s in specs}


def from_dict(item: dict, where: str) -> ScenarioSpec:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        raise ScenarioError(f'{where}: each scenario needs a "name" string')
    unknown = set(item) - {"name", "emulate", "noisy_neighbor", "about"}
    if unknown:
        raise ScenarioError(
            f"{where}: scenario '{item['name']}' has unknown keys "
            f"{sorted(unknown)} (known: name, emulate, noisy_neighbor, about)"
        )
    if not isinstance(item.get("emulate", ""), str):
        raise ScenarioError(
            f"{where}: scenario '{item['name']}': emulate must be a "
            '--het-tp-emulate string, e.g. "persistent:rank=1,factor=2"'
        )
    neighbor = item.get("noisy_neighbor")
    if neighbor is not None and not (
        isinstance(neighbor, dict) and isinstance(neighbor.get("rank"), int)
    ):
        raise ScenarioError(
            f"{where}: scenario '{item['name']}': noisy_neighbor must be {{\"rank\": N}}"
        )
    return ScenarioSpec(
        item["name"],
        item.get("emulate"),
        neighbor["rank"] if neighbor else None,
        item.get("about", ""),
    )


def resolve(
    names: str,
    tp_size: int,
    iterations: int,
    flag: str = "--scenarios",
    stages: int = 1,
    replicas: int = 1,
) -> list[ScenarioSpec]:
    """Comma-separated built-in names and/or JSON files (a list of scenarios each), checked."""
    known = builtin(tp_size, iterations, stages, replicas)
    out: list[ScenarioSpec] = []
    for name in filter(None, (n.strip() for n in names.split(","))):
        if name == "all":
            out.extend(known.values())
        elif name in known:
            out.append(known[name])
        elif name.endswith(".json") or os.path.exists(name):
            try:
                with open(name, encoding="utf-8") as f:
                    items = json.load(f)
            except (OSError, json.JSONDecodeError) as err:
                raise ScenarioError(f"{flag}: cannot read scenario file {name}: {err}") from None
            if not isinstance(items, list):
                raise ScenarioError(f"{flag}: {name} must hold a JSON list of scenarios")
            out.extend(from_dict(item, name) for item in items)
        else:
            raise ScenarioError(
                f"{flag}: unknown scenario '{name}'; choose from "
                f"{', '.join(known)}, all, or a .json file"
            )
    names_seen = [s.name for s in out]
    duplicates = sorted({n for n in names_seen if names_seen.count(n) > 1})
    if duplicates:
        raise ScenarioError(f"{flag}: scenario names repeat: {', '.join(duplicates)}")
    if not out:
        raise ScenarioError(f"{flag}: no scenario given")
    for spec in out:
        spec.check(tp_size, stages, replicas)
    return out
