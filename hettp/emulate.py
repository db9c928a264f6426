"""Straggler scenarios for emulation: which rank is how many times slower at which iteration.

    none
    persistent:rank=1,factor=2[,start=20][,stop=80]
    transient:rank=1,factor=4,start=20,length=10,period=50     bursts of `length` every `period`
    persistent:global=3,factor=2  (or transient:global=...)    one process: global rank 3
    persistent:global=0/3,factor=2                              processes 0 and 3
    persistent:stage=1,factor=2   (or transient:stage=...)     every rank of pipeline stage 1
    rotating:factor=2,period=50[,start=0]                       rank (i - start) // period % tp
    multi:factors=8/6/4/2[,start=0]                             ranks 0.. at those factors

`rank=R` slows TP rank R of every TP group (every pipeline stage, every data-parallel
replica); `global=G` slows the one process of global rank G (`global=G/H`: each of them);
`stage=S` every rank of pipeline stage S (a whole slow stage, which moving units inside it
cannot help). Any of them takes
`mode=sharded` (the default) or `mode=device`. A slowed rank waits (factor - 1) x the compute
it just did (megatron/hetero/timing.py), so its injected delay shrinks when its work does, as
a slow GPU's would: in `sharded` mode after each region of the work its units carry (the
attention and MLP blocks and the optimizer step: what het-TP can move), in `device` mode
before each collective and at the end of the step, for all the compute since the last one (the
embedding, norms and loss too, as a slow GPU is slow at everything). Iterations count from 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class ScenarioError(ValueError):
    """A malformed --het-tp-emulate scenario."""


_KEYS = {
    "none": set(),
    "persistent": {"rank", "global", "stage", "factor", "start", "stop", "mode"},
    "transient": {"rank", "global", "stage", "factor", "start", "length", "period", "mode"},
    "rotating": {"factor", "period", "start", "mode"},
    "multi": {"factors", "start", "mode"},
}
MODES = ("sharded", "device")
# who a persistent or transient straggle slows: (what the key names, its name in errors)
_WHO = {
    "rank": ("a TP rank in every group", "TP rank"),
    "global": ("one global rank", "global rank"),
    "stage": ("every rank of one pipeline stage", "pipeline stage"),
}
_REQUIRED = {
    "none": set(),
    "persistent": {"factor"},
    "transient": {"factor", "start", "length", "period"},
    "rotating": {"factor", "period"},
    "multi": {"factors"},
}


@dataclass(frozen=True)
class Scenario:
    kind: str
    tp_size: int
    params: tuple  # sorted (key, value) pairs

    @classmethod
    def parse(cls, text: str, tp_size: int, flag: str = "--het-tp-emulate") -> Scenario:
        kind, _, rest = text.strip().partition(":")
        if kind not in _KEYS:
            raise ScenarioError(
                f"{flag} '{text}': unknown scenario '{kind}'; choose from {', '.join(_KEYS)}"
            )
        params = {}
        for item in filter(None, (p.strip() for p in rest.split(","))):
            key, sep, value = item.partition("=")
            if not sep or key not in _KEYS[kind]:
                raise ScenarioError(
                    f"{flag} '{text}': '{item}' is not one of "
                    f"{sorted(_KEYS[kind]) or 'nothing'} (key=value)"
                )
            if key in params:
                raise ScenarioError(f"{flag} '{text}': {key} is given twice")
            if key == "mode":
                if value not in MODES:
                    raise ScenarioError(
                        f"{flag} '{text}': mode '{value}' is not one of {', '.join(MODES)}"
                    )
                params[key] = value
                continue
            try:
                params[key] = (
                    tuple(float(v) for v in value.split("/"))
                    if key == "factors"
                    else tuple(int(v) for v in value.split("/"))
                    if key == "global"
                    else float(value)
                    if key == "factor"
                    else int(value)
                )
            except ValueError:
                raise ScenarioError(f"{flag} '{text}': bad value for {key}: '{value}'") from None
        missing = _REQUIRED[kind] - set(params)
        if missing:
            raise ScenarioError(f"{flag} '{text}': {kind} needs {', '.join(sorted(missing))}")
        if kind in ("persistent", "transient") and len(set(params) & set(_WHO)) != 1:
            raise ScenarioError(
                f"{flag} '{text}': {kind} needs one of "
                + ", ".join(f"{key}= ({what})" for key, (what, _) in _WHO.items())
            )
        for key in ("global", "stage"):
            if min(_as_tuple(params.get(key, 0))) < 0:
                raise ScenarioError(f"{flag} '{text}': {_WHO[key][1]} must be >= 0")
        factors = params.get("factors", (params.get("factor", 1.0),))
        if not all(1.0 <= f < math.inf for f in factors):  # nan fails both comparisons
            raise ScenarioError(
                f"{flag} '{text}': slowdown factors must be finite numbers >= 1, got "
                f"{'/'.join(f'{f:g}' for f in factors)}"
            )
        if "rank" in params and not 0 <= params["rank"] < tp_size:
            raise ScenarioError(
                f"{flag} '{text}': rank {params['rank']} is not a TP rank (TP size {tp_size})"
            )
        if len(params.get("factors", ())) > tp_size:
            raise ScenarioError(
                f"{flag} '{text}': {len(params['factors'])} factors for {tp_size} TP ranks"
            )
        for key in ("period", "length"):
            if key in params and params[key] < 1:
                raise ScenarioError(f"{flag} '{text}': {key} must be >= 1")
        if params.get("start", 0) < 0:
            raise ScenarioError(f"{flag} '{text}': start must be >= 0")
        if "stop" in params and params["stop"] <= params.get("start", 0):
            raise ScenarioError(
                f"{flag} '{text}': stop ({params['stop']}) must come after start "
                f"({params.get('start', 0)}): the scenario would slow no iteration"
            )
        if kind == "transient" and params["length"] > params["period"]:
            raise ScenarioError(f"{flag} '{text}': length exceeds period")
        return cls(kind, tp_size, tuple(sorted(params.items())))

    @property
    def mode(self) -> str:
        """What a slowed rank's slowdown covers: "sharded" or "device" (module docstring)."""
        return dict(self.params).get("mode", "sharded")

    @property
    def global_ranks(self) -> tuple[int, ...] | None:
        """The global ranks a `global=` scenario slows (None: TP ranks of every group)."""
        return dict(self.params).get("global")

    @property
    def stage(self) -> int | None:
        """The pipeline stage a `stage=` scenario slows (None: it names ranks)."""
        return dict(self.params).get("stage")

    def factor(
        self, rank: int, iteration: int, global_rank: int | None = None, stage: int = 0
    ) -> float:
        """How many times slower TP rank `rank` (global rank `global_rank`, in pipeline stage
        `stage`) computes at `iteration` (1.0: full speed)."""
        p = dict(self.params)
        start = p.get("start", 0)
        if self.kind == "none" or iteration < start:
            return 1.0
        if self.kind in ("persistent", "transient"):
            where = {"rank": rank, "global": global_rank, "stage": stage}
            if not any(where[key] in _as_tuple(p[key]) for key in _WHO if key in p):
                return 1.0
        if self.kind == "persistent":
            stop = p.get("stop")
            return p["factor"] if stop is None or iteration < stop else 1.0
        if self.kind == "transient":
            in_burst = (iteration - start) % p["period"] < p["length"]
            return p["factor"] if in_burst else 1.0
        if self.kind == "rotating":
            return p["factor"] if rank == (iteration - start) // p["period"] % self.tp_size else 1.0
        factors = p["factors"]
        return factors[rank] if rank < len(factors) else 1.0


def _as_tuple(value) -> tuple:
    return value if isinstance(value, tuple) else (value,)
