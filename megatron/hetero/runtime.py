"""The het-TP runtime: everything het-TP does to a Megatron training job, behind one object with
an explicit lifecycle that this project's trainer (training.py) and the upstream Megatron-LM
glue (upstream.py) drive the same way:

    runtime = HetTPRuntime.from_args(args)        # None when no het-TP flag asks for anything
    spec = runtime.layer_spec()                   # the het-TP layer spec (None: keep yours)
    model = GPTModel(..., spec)
    runtime.install(model, saved)                 # own the units; start in the saved or given plan
    ... Float16Module, DDP, optimizer, scheduler, checkpoint load (runtime.load_state_dict) ...
    runtime.attach(TrainState(...), iteration, events)
    each step: runtime.begin_step(i); forward/backward;
               runtime.before_optimizer_step(); optimizer.step(); runtime.after_optimizer_step()
               end = runtime.end_step(i, seconds)  # a migration rebuilds end.model, end.optimizer
    checkpoints: runtime.checkpoint_plan() (common) and runtime.state_dict() (per TP rank)
    runtime.close()

The runtime owns the partition (which rank holds which units), the resizer (skipped units and
their priorities) and the controller (timing, detection, decisions); what each policy needs is
read from hettp.policy.POLICIES through the validated config.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from hettp.config import HetTPConfig
from hettp.exchange import Migration, TransferError
from hettp.loop import TimingReport, work_of
from hettp.memory import MemoryCap, OverCapError
from hettp.plan import PartitionPlan, PlanError
from hettp.planner import Decision
from hettp.resize import ResizeError, check_shares

from .arguments import het_tp_config
from .log import EventLog, StageMove
from .model import unwrap_model
from .partition import comm_device

# Why a resumed run starts in its checkpoint's plan (the `plan` record's `why`).
RESUMED = "resumed from the checkpoint"

# The attribute of the GPTModel that points back to its runtime: upstream's train() finds the
# runtime through the model chunks it already holds, so the glue needs no module globals.
RUNTIME_ATTR = "het_tp_runtime"


@dataclasses.dataclass
class TrainState:
    """What a step boundary may replace: a migration rebuilds the DDP wrapper and optimizer."""

    model: object  # megatron-core DDP around (Float16Module around) the GPTModel
    optimizer: object
    scheduler: object  # OptimizerParamScheduler
    config: object  # the TransformerConfig the schedule reads its hooks from


@dataclasses.dataclass(frozen=True)
class SavedPlan:
    """The partition a checkpoint was saved in (its common, plan-wide part)."""

    plan: PartitionPlan
    shares: tuple[float, ...]  # resize shares per TP rank (with pipeline stages: stage 0's)
    stage_layers: tuple[int, ...] | None = None  # layers per stage, where layers moved
    stage_shares: tuple[tuple[float, ...], ...] | None = None  # each pipeline stage's shares

    def to_dict(self) -> dict:
        out = {"plan": self.plan.to_json(), "shares": list(self.shares)}
        if self.stage_layers is not None:
            out["stage_layers"] = list(self.stage_layers)
        if self.stage_shares is not None:
            out["stage_shares"] = [list(s) for s in self.stage_shares]
        return out

    @classmethod
    def from_dict(cls, data: dict | None) -> SavedPlan | None:
        if not data:
            return None
        layers, stage_shares = data.get("stage_layers"), data.get("stage_shares")
        return cls(
            PartitionPlan.from_json(data["plan"]),
            tuple(data["shares"]),
            tuple(layers) if layers is not None else None,
            tuple(tuple(s) for s in stage_shares) if stage_shares is not None else None,
        )

    def shares_of(self, stage: int | None, stages: int) -> tuple[float, ...]:
        """The resize shares a TP group resumes with: its own stage's where the checkpoint has
        as many stages, else the checkpoint's `shares`."""
        if stage is not None and self.stage_shares is not None and len(self.stage_shares) == stages:
            return self.stage_shares[stage]
        return self.shares


@dataclasses.dataclass(frozen=True)
class StageVerdict:
    """One TP group's report and verdict at a step boundary; `stage` is its pipeline stage
    (None without pipelining)."""

    stage: int | None
    report: object  # hettp.loop.TimingReport
    verdict: object  # hettp.loop.Verdict

    @property
    def decision(self) -> Decision | None:
        return self.verdict.decision


@dataclasses.dataclass(frozen=True)
class DataSplit:
    """Under --het-dp, the coming step's micro-batches: every replica's count, this replica's,
    and the weight its losses take so that the update is the even split's."""

    counts: tuple[int, ...]
    here: int
    loss_weight: float


@dataclasses.dataclass(frozen=True)
class StepEnd:
    """What a step boundary left: the model chunk and optimizer to use from now on."""

    model: object
    optimizer: object
    rebuilt: bool  # a migration replaced both


class HetTPRuntime:
    def __init__(
        self,
        config: HetTPConfig,
        normalization: str = "LayerNorm",
        qk_layernorm: bool = False,
        qk_l2_norm: bool = False,
    ):
        if config.validated_for is None:
            raise ValueError("HetTPRuntime needs a validated HetTPConfig (config.validated())")
        self.config = config
        self.normalization = normalization
        self.qk_layernorm, self.qk_l2_norm = qk_layernorm, qk_l2_norm
        self.events = EventLog()
        self.partition = None  # HetPartition with --het-tp
        self.resizer = None  # Resizer when units may be skipped
        self.controller = None  # Controller when the ranks are timed
        self.state: TrainState | None = None
        self._module = None
        self._plan_why = None
        self._saved_shares = None
        self._pending = None  # per-rank state loaded before attach()
        self._microbatches = None  # per step, as last seen (a batch ramp changes it)
        self._layers = None  # layers per pipeline stage (pipelined runs)
        self._flag_layers = None  # ... as the flags split them
        self._resumed_layers = None  # ... as a checkpoint had them, where the run took it up
        self._fresh = {}  # stage -> its latest report since the last change of any split
        self.replicas = None  # ReplicaBatches under --het-dp
        self.split: DataSplit | None = None  # ... the split of the step last begun
        self.joint = None  # hettp.joint.JointController under --het-tp-policy joint
        self._moved = 0.0  # seconds spent moving state since the last replica report
        self._priced_logged = False  # core attention's price was said in the log

    @classmethod
    def from_args(cls, args, cuda_available: bool | None = None) -> HetTPRuntime | None:
        """The runtime for Megatron-LM style args, or None when het-TP has nothing to do.
        Raises ArgumentError naming the flag."""
        config = het_tp_config(args, cuda_available)
        if not config.active:
            return None
        return cls(
            config,
            args.normalization,
            bool(getattr(args, "qk_layernorm", False)),
            bool(getattr(args, "qk_l2_norm", False)),
        )

    # ---- build ------------------------------------------------------------------------------

    def layer_spec(self):
        """megatron-core's local GPT layer spec with het-TP's unit-sharded modules, or None
        (vanilla layers) when only timing is asked for."""
        if not self.config.het_tp:
            return None
        from .spec import get_het_gpt_layer_spec

        return get_het_gpt_layer_spec(
            self.normalization,
            self.config.granularity,
            self.config.head_units(self.config.validated_for),
            self.qk_layernorm,
            self.qk_l2_norm,
        )

    def configure(self, config, saved: SavedPlan | None = None) -> None:
        """Before the model is built: with pipeline stages, a checkpoint saved after layer moves
        starts in its layer split (megatron-core reads it from the config), as a resumed run
        starts in its checkpoint's unit plan; said in the log."""
        from .layer_moves import set_split, split_of

        if not self.config.het_tp or config.pipeline_model_parallel_size == 1:
            return
        self._flag_layers = split_of(config)  # what the flags give: saved only if it differs
        layers = saved.stage_layers if saved is not None else None
        if (
            layers is not None
            and len(layers) == config.pipeline_model_parallel_size
            and sum(layers) == config.num_layers
            and min(layers) >= 1
        ):
            set_split(config, layers)
            self._resumed_layers = tuple(layers)

    def install(self, module, saved: SavedPlan | None = None) -> None:
        """Right after the GPTModel is built (before Float16Module, DDP and the optimizer):
        own its units and move them to the starting plan: the checkpoint's (`saved`) when it
        fits, unless --het-tp-policy static was given its own --het-tp-plan; else
        --het-tp-plan; else Megatron's even split."""
        setattr(module, RUNTIME_ATTR, self)
        self._module = module
        if not self.config.het_tp:
            return
        from .partition import HetPartition

        self.partition = HetPartition(module)
        plan, self._plan_why = self.partition.plan, "initial"
        # plans name every layer of the model; a pipeline stage takes its own layers
        given = self._stage_of(self.config.partition_plan)
        saved_plan = self._stage_of(saved.plan) if saved is not None else None
        if saved_plan is not None and not self.config.keeps_given_plan and self._fits(saved_plan):
            self._check_memory(saved.plan, "the checkpoint's plan")
            plan, self._plan_why = saved_plan, RESUMED
            stages = parallel_state.get_pipeline_model_parallel_world_size()
            self._saved_shares = saved.shares_of(self._pipeline_stage(), stages)
        elif given is not None:
            self._check_memory(self.config.partition_plan, "--het-tp-plan")
            plan = given
        if plan != self.partition.plan:
            self.partition.install(module, plan)
        if _pipelined():
            from .layer_moves import split_of

            self._layers = split_of(module.config)  # the flags' split, or configure()'s

    def _stage_of(self, plan: PartitionPlan | None) -> PartitionPlan | None:
        """This pipeline stage's layers of a whole-model plan; None for a plan of another
        layer count (it does not fit)."""
        if plan is None or not _pipelined():
            return plan
        layers = unwrap_model(self._module).decoder.layers
        if plan.num_layers != self._module.config.num_layers:
            return None
        return plan.stage(layers[0].layer_number - 1, len(layers))  # numbered from 1, globally

    def whole_plan(self) -> PartitionPlan | None:
        """Every layer's partition: the pipeline stages' plans joined (collective over the
        pipeline group; this stage's alone without pipelining)."""
        if self.partition is None:
            return None
        if not _pipelined():
            return self.partition.plan
        return PartitionPlan.joined(self._stage_plans())

    def load_state_dict(self, state: dict | None) -> None:
        """This TP rank's saved runtime state (priorities, detector); taken up by attach()."""
        self._pending = state

    def attach(self, state: TrainState, iteration: int = 0, events: EventLog | None = None):
        """Once the model is wrapped, the optimizer built and any checkpoint loaded: start the
        resizer and the control loop, and resume the saved (or apply the fixed) resize."""
        self.state = state
        if events is not None:
            self.events = events
        config = self.config
        if config.resizes:
            from .resize import Resizer

            self.resizer = Resizer(
                self.partition,
                state.model,
                config.priority,
                config.priority_interval,
                config.max_resize,
                config.policy_spec.impute,
                sample=config.sample_interval,
            )
        if config.timed:
            from .control import Controller

            unit_work = self.partition.unit_work if self.partition is not None else None
            cost_model = self.partition.cost_model if self.partition is not None else None
            single = config.validated_for.tp_size == 1
            if _pipelined() and (config.pipeline_moves == "layers" or single):
                unit_work = None  # the stages are timed; no unit moves are planned in them
            partition = self.partition if unit_work is not None else None
            self.controller = Controller(config, state.model, unit_work, cost_model, partition)
        if config.rebatches:
            from .replicas import ReplicaBatches

            self.replicas = ReplicaBatches(
                parallel_state.get_data_parallel_world_size(), config.interval
            )
            if config.policy == "joint":
                from hettp.joint import JointController

                self.joint = JointController(config.budget)
        if self.partition is not None:
            self.events.plan(iteration, self.whole_plan(), self._plan_why)
        if self._resumed_layers is not None:
            from hettp.stages import split_text

            self.events.info(
                f"> het-TP layers per pipeline stage at iteration {iteration} ({RESUMED}, "
                f"not the flags' split): {split_text(self._resumed_layers)}"
            )
        self._resume(state, iteration)

    def _resume(self, state: TrainState, iteration: int) -> None:
        """Take up the checkpoint's state where it still describes this run: saved under the
        same het-TP flags (policy, layers, granularity), in the plan this run starts in, with
        shares this run may use. Otherwise priorities and detector start afresh (said once),
        so a straggle the saved run had handled is detected and handled again. Priorities
        come back before any resize, which orders the units by them."""
        pending, self._pending = self._pending, None
        config = self.config
        saved_shares = None
        if pending is not None and self.replicas is not None:  # data, whatever the plan
            why = self.replicas.load_state_dict(pending.get("replicas"))
            if why is not None:
                self.events.info(
                    f"> het-DP micro-batch counts of the checkpoint not resumed: {why}"
                )
            elif self.replicas.counts is not None:
                from hettp.stages import split_text

                self.events.info(
                    f"> het-DP micro-batches per replica at iteration {iteration} ({RESUMED}): "
                    + split_text(self.replicas.counts)
                )
        if pending is not None:
            why = None
            saved_flags = {"het_dp": False, **(pending.get("config") or {})}  # older checkpoints
            if saved_flags != self._fingerprint():
                why = f"it was saved under other het-TP flags ({pending.get('config')})"
            elif self.partition is not None and self._plan_why != RESUMED:
                why = "this run does not start in the checkpoint's plan"
            elif config.resize_shares is None and self._saved_shares and any(self._saved_shares):
                saved_shares = self._saved_shares
                why = self._unusable_shares(saved_shares)
            if why is not None:
                self.events.info(f"> het-TP state of the checkpoint not resumed: {why}")
                saved_shares = None
            else:
                if self.joint is not None and pending.get("joint") is not None:
                    self.joint.load_state_dict(pending["joint"])
                    self._moved = pending["joint"].get("moved_since_report", 0.0)
                if self.resizer is not None and pending.get("resizer") is not None:
                    self.resizer.load_state_dict(pending["resizer"])
                if self.controller is not None and pending.get("controller") is not None:
                    self.controller.load_state_dict(pending["controller"])
                    self._microbatches = pending.get("microbatches")
        if config.resize_shares is not None:  # fixed shares; after loading, they freeze units
            self.resizer.resize(state, config.resize_shares)
            self.events.resize(iteration, self.resizer, "initial")
        elif saved_shares is not None:
            self.resizer.resize(state, saved_shares)
            self.events.resize(iteration, self.resizer, RESUMED)

    def _fingerprint(self) -> dict:
        """The flags a checkpoint's runtime state is only valid under."""
        c = self.config
        return {
            "policy": c.policy,
            "het_tp": c.het_tp,
            "granularity": c.granularity,
            "het_dp": c.rebatches,
        }

    def _unusable_shares(self, shares) -> str | None:
        """Why saved resize shares cannot be taken up by this run (None: they can)."""
        if self.resizer is None:
            return f"its resize shares {list(shares)} need a policy that resizes"
        cut = self.config.policy_spec.cut
        if cut is not None and any(s not in (0.0, cut) for s in shares):
            return f"its resize shares {list(shares)} are not the policy's fixed cut {cut:g}"
        try:
            check_shares(shares, self.config.max_resize)
        except ResizeError as err:
            return f"its resize shares {list(shares)}: {err}"
        return None

    # ---- every step ---------------------------------------------------------------------

    def data_split(
        self, per_replica: int, per_token_loss: bool = False, iteration: int | None = None
    ) -> DataSplit | None:
        """Under --het-dp, before each step on every rank (after `iteration`): the
        micro-batches of a global batch of `per_replica` a replica (the even split's) each
        replica runs. None without it. A batch ramp that re-splits decided counts is logged
        as a decision ("ramp"), so the records' counts chain."""
        if self.replicas is None:
            return None
        before, paced = self.replicas.counts, self.replicas.paced
        counts = self.replicas.split(per_replica)
        if iteration is not None and before is not None and counts != before:
            self.events.data_resplit(iteration, before, counts, paced)
        if self.controller is not None:
            self.controller.counts = counts
        here = counts[self.replicas.dp_rank]
        self.split = DataSplit(counts, here, self.replicas.loss_weight(counts, per_token_loss))
        return self.split

    def begin_step(self, iteration: int, num_microbatches: int | None = None) -> None:
        """Before the step that will be `iteration`, on every rank: arm the timers, and tell the
        resizer whether its scorer observes this step. `num_microbatches`: the step's (it
        changes under --rampup-batch-size, and the control loop's seconds scale with it)."""
        if num_microbatches is not None:
            last, self._microbatches = self._microbatches, num_microbatches
            if self.controller is not None and last is not None and num_microbatches != last:
                self.controller.work_scaled(num_microbatches / last)
        if self.resizer is not None:
            self.resizer.begin_step(iteration)
        if self.controller is not None:
            self.controller.begin_step(iteration)

    def before_optimizer_step(self) -> None:
        """After backward, before optimizer.step(): K/V replicas get their summed gradients
        (head units), resized ranks impute or score gradients."""
        if self.partition is not None:
            self.partition.sum_replica_grads(self.state.model)
        if self.resizer is not None:
            self.resizer.before_step(self.state)
        if self.controller is not None:
            # Timed, as a rank's own compute, but apart: its cost hardly depends on the units.
            self.controller.timer.start(fixed=True)

    def after_optimizer_step(self) -> None:
        """After optimizer.step(): skipped units are put back, the update is scored."""
        if self.controller is not None:
            self.controller.timer.stop()
        if self.resizer is not None:
            self.resizer.after_step(self.state)

    def end_step(self, iteration: int, seconds: float) -> StepEnd:
        """At the step boundary after `iteration`, on every rank: refresh priorities, then
        report, decide and apply. `seconds`: the step's wall time."""
        state = self.state
        rebuilt_from = (state.model, state.optimizer)
        if self.resizer is not None:
            swapped = self.resizer.step_end(iteration, state)
            if swapped is not None:
                self.events.priorities(iteration, self.resizer, swapped)
        if self.controller is not None:
            plan = self.partition.plan if self.partition is not None else None
            shares = self.shares
            unit_work = self.partition.unit_work if self.partition else None
            failed = None
            try:
                out = self.controller.end_step(
                    iteration,
                    seconds,
                    lambda: work_of(plan, unit_work, shares, self.controller.tp_size),
                    plan,
                    shares,
                    lambda: self.partition.unit_bytes(state.model, state.optimizer),
                )
            except Exception as err:  # noqa: BLE001 - the other stages learn of it, then all raise
                if not _pipelined():
                    raise
                out, failed = None, f"{type(err).__name__}: {err}"
            if self.controller.priced is not None and not self._priced_logged:
                self._priced_logged = True
                self.events.priced(
                    iteration,
                    *self.controller.priced,
                    self.partition.unit_work,
                    self.controller.call_price,
                )
            verdicts = self._over_pipeline(out, failed)
            for v in verdicts:
                self.events.timing(v.report, v.verdict, v.stage)
            decided = [v for v in verdicts if v.decision is not None]
            if decided:
                self._apply(iteration, decided)
            elif verdicts and self._moves_layers():
                self._balance_layers(iteration, verdicts)
            if self.replicas is not None:
                changed = bool(decided) or (state.model, state.optimizer) != rebuilt_from
                self._observe_replicas(iteration, seconds, changed)
        rebuilt = (state.model, state.optimizer) != rebuilt_from
        return StepEnd(state.model, state.optimizer, rebuilt)

    def _over_pipeline(self, out, failed: str | None = None) -> list[StageVerdict]:
        """The reports and verdicts of this step boundary, of every pipeline stage (each stage's
        TP group times, detects and decides on its own; every rank of the job learns them all,
        so that a stage's migration is applied everywhere at once). Without pipelining, this
        group's. One small all-reduce over the pipeline group per step; the verdicts are
        gathered only at steps where some stage has one. `failed`: this stage's control
        failed (every rank of it raised alike): every stage then raises it, none waits."""
        from .control import DecisionFailed

        if not _pipelined():
            return [StageVerdict(None, *out)] if out is not None else []
        flag = 2 if failed is not None else int(out is not None)
        most = torch.tensor([flag], dtype=torch.int32, device=comm_device())
        dist.all_reduce(
            most, op=dist.ReduceOp.MAX, group=parallel_state.get_pipeline_model_parallel_group()
        )
        if not most.item():
            return []
        gathered = _over_stages(DecisionFailed(failed) if failed is not None else out)
        for stage, o in enumerate(gathered):
            if isinstance(o, DecisionFailed):
                raise RuntimeError(f"het-TP's control of pipeline stage {stage} failed: {o}")
        return [StageVerdict(stage, *o) for stage, o in enumerate(gathered) if o is not None]

    # ---- actions (every rank, same step boundary) -------------------------------------------

    @property
    def shares(self) -> tuple[float, ...]:
        tp = self.config.validated_for.tp_size
        return self.resizer.shares if self.resizer is not None else (0.0,) * tp

    def repartition(self, plan: PartitionPlan, iteration: int, fault=None) -> Migration:
        """Move to `plan`, a whole-model plan: each pipeline stage moves its own layers, and
        every rank of the job calls this at the same boundary (resized ranks keep their
        priority order); logs the `repartition` record. A failed transfer anywhere raises
        TransferError on every rank, with every rank's state intact. Returns this stage's
        migration."""
        return self._repartition(plan, iteration, fault)[0]

    def _repartition(self, plan, iteration, fault=None) -> tuple[Migration, list, bool]:
        """repartition(), also returning what each pipeline stage moved (StageMove) and
        whether this stage's split changed. Where it did, this is the decision's one re-base of
        the detector: a second would find the steps before the change gone, and carry the
        window's median rather than the level, with no compute or work to hold the cost
        model's readings to."""
        mine = self._stage_of(plan)
        if mine is None:
            raise PlanError(
                f"plan has {plan.num_layers} layers, the model has {self._module.config.num_layers}"
            )
        before = self.partition.plan
        if self.resizer is not None:
            migration = self.resizer.repartition(self.state, mine, step=iteration, fault=fault)
        else:
            migration = self.partition.repartition(self.state, mine, step=iteration, fault=fault)
        moves = self._moves_over_stages(migration)
        self.events.repartition(iteration, plan, moves)
        rebased = mine != before  # the stages whose split stayed keep their detectors' reference
        if rebased:
            self._rebase()
        return migration, moves, rebased

    def _moves_over_stages(self, migration: Migration) -> list[StageMove]:
        """What each pipeline stage's part of a re-partition moved (collective over the
        pipeline group; this stage's alone without one)."""
        mine = StageMove.of(migration)
        return _over_stages(mine) if _pipelined() else [mine]

    def resize(self, shares, iteration: int, why: str) -> None:
        self.resizer.resize(self.state, shares)
        self.events.resize(iteration, self.resizer, why)
        self._rebase()

    def _apply(self, iteration: int, decided: list[StageVerdict]) -> None:
        """Apply this boundary's decisions, on every rank: the stages that migrate move in one
        whole-model re-partition (the other stages keep their layers' plans), this stage's
        resize (if it decided one) is applied here."""
        self._fresh = {}  # every rank: the stages' reports predate this boundary's moves
        here = self._pipeline_stage()
        own = next((v.decision for v in decided if v.stage == here), None)
        moving = {v.stage: v.decision.plan for v in decided if v.decision.migrates}
        plan = None
        if moving:
            if here is None:
                plan = moving[None]
            else:  # the stages that do not move keep their plans
                plan = PartitionPlan.joined(
                    [moving.get(stage, now) for stage, now in enumerate(self._stage_plans())]
                )
        done = self._resize_and_move(
            iteration,
            own.shares if own is not None else None,  # a move replaces the resize
            plan,
            learns=own is not None and own.migrates,
        )
        if done is None:
            return
        moves = done.moves
        for v in decided:
            moved = moves[v.stage or 0] if moves is not None and v.decision.migrates else None
            self.events.decision(iteration, v.decision, v.verdict.detection, moved, v.stage)
        if own is not None and not done.rebased:  # a resize alone
            self._rebase()

    def _resize_and_move(self, iteration: int, shares, plan, learns: bool) -> _Moved | None:
        """A decision's resize to `shares` (None: none), then its move to the whole-model `plan`
        (None: none), on every rank. A failed transfer raises TransferError on every rank, each
        keeping its state: the resize the move was to replace is put back, the failure logged,
        and None returned. `learns`: the move's whole time teaches the migration cost."""
        before = self.shares
        try:
            if shares is not None and self.resizer is not None:
                self.resizer.resize(self.state, shares)
            if plan is None:
                return _Moved(None, 0.0, rebased=False)
            start = time.perf_counter()
            migration, moves, rebased = self._repartition(plan, iteration)
            seconds = time.perf_counter() - start
        except TransferError as err:
            if self.resizer is not None and self.resizer.shares != before:
                self.resizer.resize(self.state, before)
            self.events.info(f"> het-TP decision at iteration {iteration} not applied: {err}")
            return None
        if learns and self.controller is not None and migration.predictions:
            self.controller.loop.migrated(seconds, min(migration.predictions.values()))
        return _Moved(moves, seconds, rebased)

    # ---- the data split over replicas (--het-dp) -----------------------------------------------

    def _observe_replicas(self, iteration: int, seconds: float, changed: bool) -> None:
        """Every rank, every step: the replicas' paces; at a replica report, global rank 0
        decides (a rebatch, or the joint policy's choice) and every rank applies it."""
        steps = self.controller.replica_steps
        if steps is None:
            return
        report = self.replicas.observe(iteration, self.controller.counts, steps, seconds)
        if changed:  # a TP decision here: the paces measured before it are stale
            self.replicas.restart()
            return
        if report is None:
            return
        if self.joint is not None:
            self.joint.account(self._moved, report.wall + self._moved)
            self._moved = 0.0
        from .control import DecisionFailed, raise_if_failed

        choice = None
        if dist.get_rank() == 0:
            try:
                choice = (
                    self._joint_choice(report) if self.joint is not None else self._rebatch(report)
                )
            except Exception as err:  # noqa: BLE001 - every rank raises it, none waits
                choice = DecisionFailed(f"{type(err).__name__}: {err}")
        box = [choice]
        dist.broadcast_object_list(box, src=0)
        raise_if_failed(box[0], f"het-DP's decision at iteration {iteration}")
        if box[0] is not None:
            self._apply_data_decision(iteration, report, box[0])

    def _rebatch(self, report):
        from hettp import rebatch

        return rebatch.decide(report.counts, report.seconds, report.fixed)

    def _joint_choice(self, report):
        """The joint policy's choice at a replica report (the deciding rank only)."""
        from hettp.joint import JointState, ReplicaPace, options

        from .control import _per_microbatches

        loop = self.controller.loop
        counts = report.counts
        even = sum(counts) / len(counts)
        scaled = [_per_microbatches(t, even / n) for t, n in zip(report.timings, counts)]
        rows = []
        for t in scaled:
            factors = loop.factors(t)
            known = [f for f in factors if f is not None]  # a rank without work: its peers'
            rows.append(tuple(f if f is not None else max(known, default=1.0) for f in factors))
        fastest = min(min(r) for r in rows)
        paces = []
        for t, n, row in zip(report.timings, counts, rows):
            busy = t.busy or t.compute
            rest = max(0.0, max(busy) - max(t.compute)) / n
            paces.append(ReplicaPace(rest, tuple(f / fastest for f in row)))
        composite = TimingReport.slowest_replica(scaled)
        line = loop.fit.line(composite.work, composite.compute, composite.fixed)
        slope, fixed = line.per_unit * fastest, line.fixed
        state = JointState(
            self.partition.plan,
            tuple(self.shares),
            counts,
            tuple(paces),
            slope / even,
            fixed * fastest,
        )
        cost = loop.migration_cost
        cost.unit_bytes = dict(self.partition.unit_bytes(self.state.model, self.state.optimizer))
        slow = frozenset(
            (r, p)
            for r, pace in enumerate(paces)
            for p, f in enumerate(pace.factors)
            if f >= self.config.onset
        )
        horizon = self.joint.hold(report.iteration, slow, self.config.interval)
        found = options(
            state,
            self.partition.unit_work,
            self.config.max_resize,
            cost.seconds,
            resizes=True,
            memory=loop.planner.memory,
        )
        choice = self.joint.choose(found, horizon)
        return choice if choice.option.action != "none" else None

    def _apply_data_decision(self, iteration: int, report, choice) -> None:
        """Every rank, at the same boundary: a rebatch (hettp.rebatch.Rebatch) or the joint
        policy's choice (hettp.joint.Choice): its TP part first, then the counts."""
        from hettp.rebatch import Rebatch

        if isinstance(choice, Rebatch):
            self.replicas.set(choice.after, report)
            self.events.data_decision(
                iteration,
                "rebatch",
                choice.reason,
                choice.before,
                choice.after,
                choice.predicted_before,
                choice.predicted_after,
                {"seconds_per_microbatch": list(choice.seconds)},
            )
            return
        option = choice.option
        plan = option.plan if option.plan != self.partition.plan else None
        shares = option.shares if option.shares != tuple(self.shares) else None
        done = self._resize_and_move(iteration, shares, plan, learns=True)
        if done is None:
            return
        self._moved += done.seconds
        changed = plan is not None or shares is not None
        if changed and not done.rebased:  # a resize alone
            self._rebase()
        # paces measured before a move or resize are not the ranks' now
        self.replicas.set(option.counts, None if changed else report)
        self.events.data_decision(
            iteration,
            option.action,
            f"joint: predicted over {choice.horizon} steps, migration budget "
            f"{self.config.budget:g}, queue {choice.queue:.2f} s",
            report.counts,
            option.counts,
            choice.step_before,
            option.step_seconds,
            {"terms": choice.terms, "queue": choice.queue, "horizon": choice.horizon},
            plan=plan,
            shares=option.shares,
            moved=StageMove.total(done.moves) if done.moves is not None else None,
        )

    # ---- layers between pipeline stages ------------------------------------------------------

    def _moves_layers(self) -> bool:
        return (
            _pipelined()
            and self.controller is not None
            and self.config.migrates
            and not self.config.resizes  # resize priorities are kept per layer of a stage
            and self.config.pipeline_moves in ("layers", "both")
        )

    def _balance_layers(self, iteration: int, verdicts: list[StageVerdict]) -> None:
        """With every stage's report since the last change of any split (the same on every
        rank), move layers off a slow stage where hettp.stages predicts it pays."""
        from hettp.stages import balance_layers, tp_imbalance

        for v in verdicts:
            self._fresh[v.stage] = v.report
        if len(self._fresh) < len(self._layers):
            return
        rows = [_layer_compute(self._fresh[s]) for s in range(len(self._layers))]
        units_first = self.config.pipeline_moves == "both" and self.controller.decides
        if units_first and max(tp_imbalance(row) for row in rows) >= self.config.onset:
            return  # a stage's units are to move first: its pace is about to change
        paces = [_stage_pace(self._fresh[s]) for s in range(len(self._layers))]
        split = balance_layers(
            self._layers,
            [p.layers for p in paces],
            self._layer_move_seconds(),
            stage_rest=[p.rest for p in paces],
        )
        if split is None:
            return
        try:
            self.move_layers(split.counts, iteration, split)
        except TransferError as err:  # every rank raises it; all keep their state
            self._fresh = {}  # wait for new reports rather than retry at the next one
            self.events.info(f"> het-TP layer move at iteration {iteration} not applied: {err}")

    def _layer_move_seconds(self) -> float:
        """Predicted seconds of moving one layer between neighbour stages: each TP rank sends
        its share of the layer's units (weights, masters, moments) point to point, and every
        rank rebuilds DDP and the optimizer (the same on every rank: shapes only). Every rank
        must reach the same figure, or stages would decide different splits and the move wait
        forever: with head units, the K/V replicas are those of the whole model's most
        replicated layer, not of this stage's first (collective over the pipeline group)."""
        from hettp.transfer import KV_REPLICA, REBUILD_FACTOR

        plan = self.whole_plan()
        per_unit = self.partition.unit_bytes(self.state.model, self.state.optimizer)
        layer_bytes = plan.attn_units * per_unit["attn"] + plan.mlp_units * per_unit["mlp"]
        if plan.heads is not None:  # and every rank its K/V replicas
            replicas = max(
                sum(len(ranks) for ranks in plan.heads.holders(layer["attn"]).values())
                for layer in plan.layers
            )
            layer_bytes += replicas * per_unit[KV_REPLICA]
        p2p = self.partition.cost_model.p2p
        return REBUILD_FACTOR * (p2p.call + p2p.alpha + layer_bytes / plan.tp_size / p2p.beta)

    def move_layers(self, counts, iteration: int, split=None, fault=None):
        """Every rank of the job at one step boundary: move whole layers between neighbouring
        pipeline stages so that stage s holds counts[s] (layer_moves.move_layers), and take up
        the new layers in the partition, timers and checkpoints; logs the `layers` record
        (`split`: the hettp.stages.LayerSplit that chose it, if one did). A failed move raises
        TransferError on every rank, with every rank's state intact. Returns this stage's
        LayerMigration."""
        from hettp.stages import StageError

        from .layer_moves import move_layers

        if not _pipelined() or self.partition is None:
            raise StageError("layer moves need --het-tp and pipeline stages")
        whole = self.whole_plan()
        counts = tuple(int(n) for n in counts)
        mine = move_layers(self.state, self._module, self._layers, counts, whole, fault)
        stage = self._pipeline_stage()
        self._layers = counts
        self.partition.adopt_layers(self._module, whole.stage(sum(counts[:stage]), counts[stage]))
        if self.controller is not None:
            self.controller.layers_changed(self.state.model)
        self.events.layers(iteration, _over_stages(mine), split)
        self._fresh = {}
        self._rebase()
        return mine

    def _stage_plans(self) -> list[PartitionPlan]:
        """Every pipeline stage's plan (collective over the pipeline group)."""
        return _over_stages(self.partition.plan)

    def _pipeline_stage(self) -> int | None:
        if not _pipelined():
            return None
        return parallel_state.get_pipeline_model_parallel_rank()

    def _rebase(self) -> None:
        """The work split changed: the detector's reference starts over from the next report."""
        if self.controller is not None:
            self.controller.applied()

    # ---- checkpoints ------------------------------------------------------------------------

    def checkpoint_plan(self) -> SavedPlan | None:
        """The plan-wide part of a checkpoint (the same on every rank; collective over the
        pipeline group)."""
        if self.partition is None:
            return None
        whole = self.whole_plan()
        if not _pipelined():
            return SavedPlan(whole, tuple(self.shares))
        moved = self._layers if self._layers != self._flag_layers else None
        stage_shares = tuple(_over_stages(tuple(self.shares)))
        return SavedPlan(whole, stage_shares[0], moved, stage_shares)

    def state_dict(self) -> dict:
        """This TP rank's part: priorities and evidence since the last refresh, the detector,
        cost fit and planner, and the timings of the report interval in progress."""
        return {
            "config": self._fingerprint(),
            "microbatches": self._microbatches,  # what the controller's seconds were taken at
            "resizer": self.resizer.state_dict() if self.resizer is not None else None,
            "replicas": self.replicas.state_dict() if self.replicas is not None else None,
            "joint": (
                {**self.joint.state_dict(), "moved_since_report": self._moved}
                if self.joint is not None
                else None
            ),
            "controller": (self.controller.state_dict() if self.controller is not None else None),
        }

    # ---- end --------------------------------------------------------------------------------

    def close(self) -> None:
        """Remove the timers' hooks and the model's pointer back to the runtime."""
        if self.controller is not None:
            self.controller.close()
            self.controller = None
        if self._module is not None and getattr(self._module, RUNTIME_ATTR, None) is self:
            delattr(self._module, RUNTIME_ATTR)
        self._module = None

    def _check_memory(self, plan: PartitionPlan | None, what: str) -> None:
        """A starting plan (the whole model's, alike on every rank) that puts a rank over
        --het-tp-memory-cap is refused before anything moves: with pipeline stages, layer by
        layer (within the cap in every layer, every stage is)."""
        cap = self.config.memory_cap
        if cap is None or plan is None or plan.num_layers != self._module.config.num_layers:
            return
        memory = MemoryCap(cap, self.partition.unit_params)
        layers = range(plan.num_layers) if _pipelined() else (None,)
        for layer in layers:
            part = plan if layer is None else plan.stage(layer, 1)
            if memory.fits(part):
                continue
            held = memory.of_even(part)
            rank = max(range(len(held)), key=held.__getitem__)
            where = "" if layer is None else f" in layer {layer}"
            raise OverCapError(
                f"{what} puts {held[rank]:.2f}x the even split's unit state on TP rank "
                f"{rank}{where}, over --het-tp-memory-cap {cap:g}"
            )

    def _fits(self, plan: PartitionPlan) -> bool:
        try:
            self.partition.check(plan)
        except PlanError:
            return False
        return True


@dataclasses.dataclass(frozen=True)
class _Moved:
    """What a decision's move did: each pipeline stage's StageMove (None: no move), and the
    seconds it took."""

    moves: list | None
    seconds: float
    rebased: bool  # the move changed this stage's split, and re-based its detector there


@dataclasses.dataclass(frozen=True)
class _StagePace:
    """A stage's seconds per step at its slowest rank: in its layers, and in what stays with
    the stage whatever layers it holds (embedding, output layer, loss)."""

    layers: float
    rest: float


def _stage_pace(report) -> _StagePace:
    """The rank with the most layer compute sets the pace. The rest is the same work on every
    TP rank of the stage (replicated or evenly split), so it is read as the least busy time
    past the timed compute of any of them: one rank's spell (a collection, a loaded core) does
    not move layers. 0 where busy is not known, or, on GPU, covers the timed regions only."""
    layers = _layer_compute(report)
    slowest = max(range(len(layers)), key=lambda r: (layers[r], -r))
    rest = 0.0
    if report.busy is not None:
        rest = max(0.0, min(b - c for b, c in zip(report.busy, report.compute)))
    return _StagePace(layers[slowest], rest)


def _layer_compute(report) -> list[float]:
    """A stage's layer compute per step, per TP rank: its timed compute, the optimizer step
    (the report's fixed part) left out. The stage's pace is its slowest rank's."""
    fixed = report.fixed or (0.0,) * len(report.compute)
    return [c - f for c, f in zip(report.compute, fixed)]


def _pipelined() -> bool:
    return parallel_state.get_pipeline_model_parallel_world_size() > 1


def _over_stages(obj) -> list:
    """`obj` of every pipeline stage, in stage order (collective over the pipeline group)."""
    group = parallel_state.get_pipeline_model_parallel_group()
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def runtime_of(model) -> HetTPRuntime | None:
    """The runtime installed on a model chunk (or a list of them, or their wrappers)."""
    if isinstance(model, (list, tuple)):
        model = model[0] if model else None
    if model is None:
        return None
    return getattr(unwrap_model(model), RUNTIME_ATTR, None)
