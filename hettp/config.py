"""The het-TP flags as one typed config: field docstrings are the flags' help, the argparse group
is generated from the fields, and `validated()` is the only place the flags are checked.

Both the project's trainer and the upstream Megatron-LM glue build their `--het-tp` group with
`add_arguments` and read it back with `HetTPConfig.from_args(args).validated(shape, cuda)`; the
validated config is what the runtime is built from. Nothing is written back into `args`.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import math
import textwrap
from dataclasses import dataclass, field
from functools import cache

from .emulate import Scenario, ScenarioError
from .plan import PartitionPlan, PlanError
from .policy import POLICIES, Policy, policy
from .resize import SCORERS, ResizeError, parse_shares


class ConfigError(ValueError):
    """A het-TP flag has a bad value or contradicts another flag (the message names it)."""


@dataclass(frozen=True)
class ModelShape:
    """What the flags are checked against: the TP size and the model's unit counts."""

    tp_size: int
    num_layers: int
    query_groups: int
    ffn_hidden_size: int
    pipeline_stages: int = 1  # whole layers can move between them
    data_parallel: int = 1  # replicas a global batch is split over
    attention_heads: int = 0  # 0: as many as query groups (MHA)

    @property
    def heads(self) -> int:
        return self.attention_heads or self.query_groups

    @property
    def world_size(self) -> int:
        """Processes of the run: het-TP runs without context or expert parallelism."""
        return self.tp_size * self.pipeline_stages * self.data_parallel


def _flag(default, **argparse_kwargs):
    return field(default=default, metadata={"argparse": argparse_kwargs})


_DERIVED = {"derived": True}


@dataclass(frozen=True)
class HetTPConfig:
    """Heterogeneous tensor parallelism (hettp)."""

    het_tp: bool = False
    """Use unit-sharded TP layers that can own uneven, changeable shares."""

    plan: str | None = _flag(None, metavar="PLAN")
    """Initial partition: a JSON plan file, or per-rank unit counts for every layer, e.g.
    'attn=3,1;mlp=768,256' (implies --het-tp). Under --het-tp-policy static it is the plan of
    the whole run; other policies start from it, and a resumed run continues in its
    checkpoint's plan."""

    granularity: int = 1
    """ffn neurons per MLP unit."""

    attn_granularity: int = 0
    """Query heads per attention unit, a divisor of the heads per query group (0: whole query
    groups, their heads with their K and V). Finer units let a model with few groups (one per
    rank) be re-partitioned; a rank holding any head of a group keeps the group's K and V rows
    as a replica, whose gradients are summed over their holders once per step."""

    policy: str = _flag("static", choices=lambda: tuple(POLICIES))
    """What to do about slow ranks."""

    interval: int = 10
    """Iterations between timing reports, the medians of their steps: the cost fit learns from
    them and the planner revisits its plan (detection runs every step)."""

    onset: float = 1.3
    """A rank straggles once its compute per unit is this many times the fastest rank's ..."""

    end: float = 1.15
    """... and stops once it is back at or below this (hysteresis)."""

    onset_at_once: float = 1.6
    """... at once when its smoothed slowdown reaches this (>= --het-tp-onset), else after
    --het-tp-patience steps."""

    patience: int = 3
    """Consecutive smoothed steps at or above --het-tp-onset (and below --het-tp-onset-at-once)
    before a rank straggles, and at a slower level before a straggler is replanned for it."""

    end_patience: int = 1
    """Consecutive smoothed steps at or below --het-tp-end before a straggle ends."""

    window: int = 3
    """Steps whose median smooths each rank's timing; a rank's state changes only on a full
    window, so the default 3 acts on the second slow (or normal) step in a row."""

    timer: str = _flag("cpu", choices=("cpu", "wall"))
    """CPU runs: time the work the rank's units carry (each layer's attention and MLP blocks)
    by thread CPU time (blind to waits and to time-sharing) or by wall time minus TP
    collective waits (sees real contention; no more ranks than cores). GPUs use CUDA
    events."""

    pipeline_moves: str = _flag("both", choices=("units", "layers", "both"))
    """With pipeline stages, what a migrating policy may move: TP units inside a stage (a slow
    rank's work to its stage's other ranks), whole layers between neighbouring stages (from a
    slow stage to faster ones, decided on every stage's measured layer compute), or both.
    Under resizing policies layers stay in their stages."""

    emulate: str | None = _flag(None, metavar="SCENARIO")
    """Emulated stragglers (CPU): none (nothing slowed, as without the flag),
    persistent:rank=R,factor=F[,start=I][,stop=I],
    transient:rank=R,factor=F,start=I,length=N,period=P, rotating:factor=F,period=P,
    multi:factors=8/6/4/2; each takes mode=sharded (default: the work the rank's units carry
    is slowed) or mode=device (all of its compute, as a slow GPU)."""

    emulate_dilation: float = _flag(1.0, metavar="D")
    """CPU runs with more ranks than cores: stretch every timed block to D x its CPU time (x
    its emulated slowdown) by sleeping, so ranks no longer take turns on a core and each
    behaves as if it had its own device. D must exceed ranks per core; needs --het-tp-timer
    cpu."""

    resize: str | None = _flag(None, metavar="SHARES")
    """Per TP rank, the share of its units it skips (resizing), e.g. '0,0.5' (implies
    --het-tp)."""

    max_resize: float = 0.5
    """Cap on the share of its units any rank may skip at any step."""

    memory_cap: float | None = _flag(None, metavar="F")
    """Migrating policies: no rank holds more than F times the even split's unit state (the
    weights, gradients and optimizer state of its attention and MLP units, K/V replicas
    included), so a fast rank's device does not run out of memory as it takes a slow rank's
    units. Moves are planned within it; hybrid resizes a straggler for what the cap keeps on
    it. Default: no cap."""

    priority: str = _flag("dw", choices=lambda: tuple(sorted(SCORERS)))
    """Unit priority for resizing."""

    priority_interval: int = 50
    """Iterations between priority refreshes (re-sorting resized ranks)."""

    priority_sample_interval: int | None = None
    """Per-step scorers (dw, wg) observe the optimizer steps of iterations divisible by this
    (default: 8, or --het-tp-priority-interval when smaller). Observing a step costs a pass
    over the sharded weights (dw also copies them)."""

    het_dp: bool = False
    """Heterogeneous data parallelism: each data-parallel replica runs its own number of
    micro-batches of every global batch (the same samples, the same update: losses are weighted
    to the even split's), rebatched at report boundaries to the replicas' measured speeds.
    Implied by --het-tp-policy rebatch and joint; with migrate, hybrid or resize the TP groups
    still re-partition their shared plan on their own."""

    migration_budget: float | None = _flag(None, metavar="F")
    """--het-tp-policy joint: at most this share of training time spent moving state, on
    average (a virtual queue in drift-plus-penalty form weighs it at each decision; rebatches
    and resizes move nothing). Default 0.05."""

    dp_compress: str = _flag("none", choices=lambda: DP_COMPRESSION)
    """Compress the data-parallel gradient reduction, for replicas joined by a slow link (a
    group that spans clusters): bf16 sends half the bytes, int8 a quarter; each rank keeps
    what rounding took from its gradient and adds it to its next one (error feedback), so
    updates are delayed, not lost. Needs DP > 1 and fp32 gradient buffers; not with
    --use-distributed-optimizer or --overlap-grad-reduce. Checkpoints keep the residues."""

    # ---- derived by validated() -------------------------------------------------------------
    partition_plan: PartitionPlan | None = field(default=None, metadata=_DERIVED)
    resize_shares: tuple[float, ...] | None = field(default=None, metadata=_DERIVED)
    scenario: Scenario | None = field(default=None, metadata=_DERIVED)
    validated_for: ModelShape | None = field(default=None, metadata=_DERIVED)

    def head_units(self, shape: ModelShape) -> int:
        """Query heads per attention unit when units are finer than a group, else 0."""
        per_group = shape.heads // shape.query_groups
        return self.attn_granularity if 0 < self.attn_granularity < per_group else 0

    def attention_units(self, shape: ModelShape) -> int:
        heads = self.head_units(shape)
        return shape.heads // heads if heads else shape.query_groups

    # ---- flags ------------------------------------------------------------------------------

    @staticmethod
    def flag(name: str) -> str:
        if name in _OWN_FLAGS:
            return _OWN_FLAGS[name]
        return "--het-tp-" + name.replace("_", "-")

    @staticmethod
    def dest(name: str) -> str:
        """The attribute argparse stores a field's flag in (Megatron style: het_tp_<field>)."""
        if name in _OWN_FLAGS:
            return _OWN_FLAGS[name][2:].replace("-", "_")
        return f"het_tp_{name}"

    @classmethod
    def flag_fields(cls) -> list[dataclasses.Field]:
        return [f for f in dataclasses.fields(cls) if not f.metadata.get("derived")]

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser):
        """The --het-tp argument group, generated from the fields."""
        group = parser.add_argument_group(cls.__doc__.strip().rstrip("."))
        docs = _field_docs(cls)
        for f in cls.flag_fields():
            kwargs = dict(f.metadata.get("argparse", {}))
            if callable(kwargs.get("choices")):
                kwargs["choices"] = kwargs["choices"]()
            help_text = " ".join(filter(None, (docs.get(f.name), _help_suffix(f.name))))
            kwargs["help"] = help_text.replace("%", "%%")
            if f.type in ("bool", bool):
                group.add_argument(
                    cls.flag(f.name), dest=cls.dest(f.name), action="store_true", **kwargs
                )
                continue
            kwargs.setdefault("type", _scalar_type(f.type))
            group.add_argument(cls.flag(f.name), dest=cls.dest(f.name), default=f.default, **kwargs)
        return group

    @classmethod
    def from_args(cls, args) -> HetTPConfig:
        """The flags as parsed into `args` (unvalidated). Missing attributes keep defaults."""
        values = {
            f.name: getattr(args, cls.dest(f.name))
            for f in cls.flag_fields()
            if hasattr(args, cls.dest(f.name))
        }
        return cls(**values)

    # ---- what the policy needs --------------------------------------------------------------

    @property
    def policy_spec(self) -> Policy:
        return policy(self.policy)

    @property
    def decides(self) -> bool:
        """A planner acts on detected stragglers (fixed shares replace it)."""
        p = self.policy_spec
        return p.decides and not (p.fixed_shares and self.resize_shares is not None)

    @property
    def migrates(self) -> bool:
        """The planner may move units (their cost is predicted from the bytes they carry)."""
        return self.decides and self.policy_spec.migrates

    @property
    def keeps_given_plan(self) -> bool:
        """--het-tp-plan is the plan of the whole run (nothing decides), so it also wins over
        a checkpoint's plan; otherwise it is where a fresh run starts."""
        return self.partition_plan is not None and not self.decides

    @property
    def emulated(self) -> bool:
        return self.scenario is not None or self.emulate_dilation > 1.0

    @property
    def timed(self) -> bool:
        """Ranks are timed: to decide, to rebatch, to emulate a slowdown, or for a baseline's
        timings."""
        return self.decides or self.policy_spec.times or self.emulated or self.rebatches

    @property
    def resizes(self) -> bool:
        """Units may be skipped: a Resizer keeps priorities and frozen skipped units."""
        return self.het_tp and (self.resize_shares is not None or self.policy_spec.resizes)

    def moves_layers(self, shape: ModelShape) -> bool:
        """Whole layers may move between pipeline stages, changing a stage's layer count (not
        under resizing, whose priorities are kept per layer of a stage)."""
        return (
            shape.pipeline_stages > 1
            and self.migrates
            and not self.resizes
            and self.pipeline_moves != "units"
        )

    def ignored(self, run: HetTPConfig) -> tuple[str, ...]:
        """Of these flags as given, those set away from their defaults that `run` (this config
        validated) never reads, each with why: as Megatron-LM warns of an ignored flag rather
        than refusing it, since launch scripts share one flag set across runs."""
        default = HetTPConfig()
        changed = [
            name
            for name in _IGNORABLE
            if getattr(self, name) is not None and getattr(self, name) != getattr(default, name)
        ]
        out = []
        for name in changed:
            if name in ("granularity", "attn_granularity") and not run.het_tp:
                why = (
                    f"--het-tp-policy {run.policy} runs megatron-core's own layers (add "
                    "--het-tp for het-TP layers)"
                )
            elif name in _RESIZE_FLAGS and not run.resizes:
                why = f"no rank skips units under --het-tp-policy {run.policy}"
            elif name in _TIMING_FLAGS and not run.timed:
                why = f"nothing is timed under --het-tp-policy {run.policy}"
            else:
                continue
            out.append(f"{self.flag(name)} is ignored: {why}")
        return tuple(out)

    @property
    def active(self) -> bool:
        """Anything for the het-TP runtime to do at all."""
        return self.het_tp or self.timed

    @property
    def rebatches(self) -> bool:
        """Data-parallel replicas may run uneven micro-batch counts."""
        return self.het_dp or self.policy_spec.rebatches

    @property
    def budget(self) -> float:
        """The joint policy's migration budget (share of training time)."""
        return DEFAULT_MIGRATION_BUDGET if self.migration_budget is None else self.migration_budget

    @property
    def sample_interval(self) -> int:
        return (
            self.priority_sample_interval
            if self.priority_sample_interval is not None
            else min(8, self.priority_interval)
        )

    # ---- validation -------------------------------------------------------------------------

    def _check_data_parallel(self, shape: ModelShape) -> None:
        p = self.policy_spec
        why = f"--het-tp-policy {self.policy}" if p.rebatches else "--het-dp"
        if self.rebatches:
            _require(
                shape.data_parallel > 1,
                f"{why} splits each global batch unevenly over data-parallel replicas, and "
                "the data-parallel size is 1 (world size / (tensor x pipeline parallel size))",
            )
            _require(
                p.decides or p.rebatches,
                f"--het-dp rebatches the replicas on their timings; --het-tp-policy "
                f"{self.policy} decides nothing: use rebatch, joint, migrate, hybrid or resize",
            )
        if p.name == "joint":
            _require(
                shape.tp_size > 1,
                "--het-tp-policy joint weighs TP moves against rebatches, and "
                "--tensor-model-parallel-size 1 has nothing to move: use --het-tp-policy rebatch",
            )
            _require(
                shape.pipeline_stages == 1,
                "--het-tp-policy joint is not built for pipeline stages: use --het-dp with "
                "--het-tp-policy migrate (each stage moves its units, the replicas rebatch)",
            )
        if self.dp_compress != "none":
            _require(
                shape.data_parallel > 1,
                f"--het-dp-compress {self.dp_compress} compresses the data-parallel gradient "
                "reduction, and the data-parallel size is 1",
            )
            most = DP_COMPRESSION_MAX_REPLICAS[self.dp_compress]
            _require(
                shape.data_parallel <= most,
                f"--het-dp-compress {self.dp_compress} all-gathers every replica's compressed "
                f"gradient, which moves more bytes than the plain all-reduce beyond {most} "
                f"replicas; the data-parallel size is {shape.data_parallel}",
            )
        if self.migration_budget is not None:
            _require(
                p.name == "joint",
                f"--het-migration-budget budgets --het-tp-policy joint's moves; "
                f"--het-tp-policy {self.policy} does not read it",
            )
            _require(
                0.0 <= self.migration_budget <= 1.0,
                f"--het-migration-budget must be within [0, 1], got {self.migration_budget}",
            )

    def validated(self, shape: ModelShape, cuda_available: bool = False) -> HetTPConfig:
        """Every check of the het-TP flags, before anything is built; returns the config with
        implied and parsed values filled in. Raises ConfigError naming the flag."""
        p = self.policy_spec
        tp = shape.tp_size
        _require(
            self.granularity > 0, f"--het-tp-granularity must be positive, got {self.granularity}"
        )
        per_group = shape.heads // shape.query_groups
        _require(
            self.attn_granularity >= 0,
            f"--het-tp-attn-granularity must be >= 0 (0: whole query groups), got "
            f"{self.attn_granularity}",
        )
        _require(
            self.attn_granularity == 0 or per_group % self.attn_granularity == 0,
            f"--het-tp-attn-granularity {self.attn_granularity} must divide the "
            + (
                f"{per_group} query heads per group (--num-attention-heads {shape.heads} / "
                f"--num-query-groups {shape.query_groups}), or be 0 for whole groups"
                if per_group > 1
                else f"1 query head per group ({shape.heads} heads, as many groups): use 0 or 1"
            ),
        )
        if p.vanilla:
            for name in ("het_tp", "plan", "resize"):
                _require(
                    not getattr(self, name),
                    f"--het-tp-policy {self.policy} runs vanilla "
                    f"megatron-core layers; drop {self.flag(name)}",
                )
        het_tp = bool(
            self.het_tp or self.plan is not None or self.resize is not None or p.layers == "het"
        )
        self._check_data_parallel(shape)
        for name in ("interval", "patience", "end_patience", "window"):
            _require(
                getattr(self, name) > 0,
                f"{self.flag(name)} must be positive, got {getattr(self, name)}",
            )
        _require(
            1.0 <= self.end < self.onset,
            f"--het-tp-end ({self.end}) must be >= 1 and below --het-tp-onset ({self.onset})",
        )
        _require(
            self.onset_at_once >= self.onset,
            f"--het-tp-onset-at-once ({self.onset_at_once}) must be >= --het-tp-onset "
            f"({self.onset})",
        )
        # at TP=1 a migrating policy can still move layers between pipeline stages
        moves_layers = (
            shape.pipeline_stages > 1
            and p.migrates
            and not p.resizes
            and self.pipeline_moves != "units"
        )
        _require(
            tp > 1 or not moves_layers or shape.num_layers > shape.pipeline_stages,
            f"--het-tp-policy {self.policy} at --tensor-model-parallel-size 1 can only move "
            f"layers between pipeline stages, and --num-layers {shape.num_layers} over "
            f"--pipeline-model-parallel-size {shape.pipeline_stages} leaves every stage its one "
            "layer: nothing can move",
        )
        _require(
            tp > 1 or not (p.decides and self.resize is None) or moves_layers,
            f"--het-tp-policy {self.policy} decides how units are split over the TP group, "
            "and --tensor-model-parallel-size 1 has nothing to split: use TP > 1 or drop the "
            "policy"
            + (
                " (with pipeline stages, --het-tp-policy migrate moves layers between them)"
                if shape.pipeline_stages > 1
                else ""
            ),
        )
        scenario = None
        if self.emulate is not None:
            try:
                scenario = Scenario.parse(self.emulate, tp)
            except ScenarioError as err:
                raise ConfigError(str(err)) from None
            if scenario.kind == "none":  # slows nothing: as if not given (a launcher's default)
                scenario = None
        if scenario is not None:
            _require(
                not cuda_available,
                "--het-tp-emulate is implemented for CPU runs; on GPUs "
                "create real contention (scripts/noisy_neighbor.py)",
            )
            # a rank or stage the run does not have would slow nothing, silently
            slowed = max(scenario.global_ranks or (-1,))
            _require(
                slowed < shape.world_size,
                f"--het-tp-emulate {self.emulate}: global rank {slowed} is not below the world "
                f"size ({shape.world_size})",
            )
            _require(
                scenario.stage is None or scenario.stage < shape.pipeline_stages,
                f"--het-tp-emulate {self.emulate}: stage {scenario.stage} is not a pipeline "
                f"stage (--pipeline-model-parallel-size {shape.pipeline_stages})",
            )
        _require(
            1.0 <= self.emulate_dilation < math.inf,
            f"--het-tp-emulate-dilation must be a finite number >= 1, got {self.emulate_dilation}",
        )
        if scenario is not None and scenario.mode == "device":
            _require(
                self.timer == "cpu" and self.emulate_dilation == 1.0,
                f"--het-tp-emulate '{self.emulate}': mode=device slows each rank between its "
                "collectives by its own CPU time; it needs --het-tp-timer cpu and no "
                "--het-tp-emulate-dilation (a core per rank)",
            )
        if self.emulate_dilation > 1.0:
            _require(
                not cuda_available,
                "--het-tp-emulate-dilation emulates a device per rank on CPU; drop it on GPUs",
            )
            _require(
                self.timer == "cpu",
                "--het-tp-emulate-dilation stretches the CPU time of "
                f"each GEMM; it needs --het-tp-timer cpu, got {self.timer}",
            )
        _require(
            0.0 <= self.max_resize <= 1.0,
            f"--het-tp-max-resize must be within [0, 1], got {self.max_resize}",
        )
        if self.memory_cap is not None:
            _require(
                1.0 <= self.memory_cap < math.inf,
                f"--het-tp-memory-cap must be a finite number >= 1 (the even split's unit "
                f"state), got {self.memory_cap}",
            )
            _require(
                p.migrates and p.decides,
                f"--het-tp-memory-cap limits the units a migrating policy moves onto a rank; "
                f"--het-tp-policy {self.policy} moves none",
            )
            _require(
                shape.pipeline_stages == 1 or self.pipeline_moves == "units",
                "--het-tp-memory-cap bounds the TP units a rank holds; with pipeline stages "
                "whole layers would move past it: add --het-tp-pipeline-moves units",
            )
        _require(
            self.priority_interval > 0,
            f"--het-tp-priority-interval must be positive, got {self.priority_interval}",
        )
        sample = self.sample_interval
        _require(
            0 < sample <= self.priority_interval,
            "--het-tp-priority-sample-interval must be within [1, --het-tp-priority-interval "
            f"{self.priority_interval}], got {sample}",
        )
        _require(
            self.resize is None or p.fixed_shares,
            f"--het-tp-resize sets fixed shares; --het-tp-policy {self.policy} decides them itself",
        )
        if p.scorer is not None:
            _require(
                self.priority == p.scorer,
                f"--het-tp-policy {self.policy} ranks units by --het-tp-priority "
                f"{p.scorer}; drop --het-tp-priority {self.priority}",
            )
        if p.cut is not None:
            _require(
                p.cut <= self.max_resize,
                f"--het-tp-policy {self.policy} cuts a straggler's units by a fixed {p.cut:.0%}, "
                f"above --het-tp-max-resize {self.max_resize:g}: raise the cap to {p.cut:g} or "
                "choose another policy",
            )
        shares = None
        if self.resize is not None:
            try:
                shares = parse_shares(self.resize, tp, self.max_resize)
            except ResizeError as err:
                raise ConfigError(str(err)) from None
            if p.cut is not None:
                _require(
                    all(s in (0.0, p.cut) for s in shares),
                    f"--het-tp-policy {self.policy} cuts a fixed {p.cut:.0%}: --het-tp-resize "
                    f"shares must be 0 or {p.cut:g}, got '{self.resize}'",
                )
        plan = None
        if het_tp:
            gran, ffn = self.granularity, shape.ffn_hidden_size
            _require(
                ffn % gran == 0,
                f"--het-tp-granularity {gran} does not divide --ffn-hidden-size {ffn}",
            )
            _require(
                (ffn // gran) % tp == 0,
                f"--ffn-hidden-size / --het-tp-granularity = {ffn // gran} MLP units must "
                f"split evenly over --tensor-model-parallel-size {tp} at start",
            )
            if self.plan is not None:
                try:
                    plan = PartitionPlan.parse(
                        self.plan,
                        tp,
                        shape.num_layers,
                        self.attention_units(shape),
                        ffn // gran,
                        gran,
                    )
                except PlanError as err:
                    raise ConfigError(f"--het-tp-plan: {err}") from None
        return dataclasses.replace(
            self,
            het_tp=het_tp,
            priority_sample_interval=sample,
            partition_plan=plan,
            resize_shares=shares,
            scenario=scenario,
            validated_for=shape,
        )


# Flags a run may not read (HetTPConfig.ignored): how units are cut, without het-TP layers;
# priorities, without resizing; timing and detection, without timers.
_RESIZE_FLAGS = ("priority", "priority_interval", "priority_sample_interval", "max_resize")
_TIMING_FLAGS = (
    "interval",
    "onset",
    "end",
    "onset_at_once",
    "patience",
    "end_patience",
    "window",
    "timer",
    "emulate_dilation",
)
_IGNORABLE = ("granularity", "attn_granularity", *_RESIZE_FLAGS, *_TIMING_FLAGS)

# Fields whose flags are not --het-tp-<field> (the data-parallel ones).
_OWN_FLAGS = {
    "het_tp": "--het-tp",
    "het_dp": "--het-dp",
    "migration_budget": "--het-migration-budget",
    "dp_compress": "--het-dp-compress",
}
DEFAULT_MIGRATION_BUDGET = 0.05
DP_COMPRESSION = ("none", "bf16", "int8")  # --het-dp-compress (hettp/compress.py)
# where an all-gather of n - 1 compressed copies stops undercutting a ring all-reduce's
# 2 (n - 1) / n fp32 ones: n / 2 copies of a half (bf16) or a quarter (int8)
DP_COMPRESSION_MAX_REPLICAS = {"bf16": 4, "int8": 8}


def _require(cond, message):
    if not cond:
        raise ConfigError(message)


def _scalar_type(annotation):
    text = str(annotation)
    for name, kind in (("int", int), ("float", float), ("str", str)):
        if text.startswith(name):
            return kind
    raise TypeError(f"no argparse type for a field annotated {annotation}")


def _help_suffix(name: str) -> str:
    """Help generated from the tables the flag chooses from."""
    if name == "policy":
        return "; ".join(f"{p.name}: {p.help}" for p in POLICIES.values()) + "."
    if name == "priority":
        return "; ".join(f"{s.name}: {s.help}" for s in SCORERS.values()) + "."
    return ""


@cache
def _field_docs(cls) -> dict[str, str]:
    """The docstring under each field of a dataclass, from its source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs
