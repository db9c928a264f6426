"""Changing which TP rank owns which units, on a megatron-core GPTModel built with the het spec.

`HetPartition` holds the plan every rank of the TP group agrees on and moves units to a new
plan at a step boundary: weights, and once the optimizer has state, its moments too, so
training continues on exactly the trajectory it was on. Then it rebuilds what megatron-core
sized by shape: the DDP wrapper (its gradient buffers) and the optimizer (its parameter
groups), keeping the optimizer's step count and the learning-rate schedule.

The move is transactional, the rebuild included: the transfer votes (hettp.exchange), and so
does the rebuild, which a failure on any rank undoes everywhere (the new wrapper made inert, the
parameters' DDP fields and the installed shards put back). Either way every rank raises
TransferError and keeps its previous model, optimizer and plan.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import weakref

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.optimizer import get_megatron_optimizer

from hettp.attention_probe import ProbeShape
from hettp.exchange import Migration, TransferError, run_transfer, vote
from hettp.plan import BLOCKS, PartitionPlan, PlanError
from hettp.step_model import core_attention_work, plan_work
from hettp.transfer import KV_REPLICA, CostModel, plan_transfer

from . import cpu_compat
from .ddp import HetDDP, gathered_params
from .layers import InstalledShards, UnitBlock
from .model import unwrap_model
from .portable_optimizer import set_group_values
from .unit_state import (
    OptimizerView,
    carry_group_steps,
    carry_into,
    detach_shard_views,
    held_params,
    permute,
    permuted,
    replica_specs,
    run_payload,
    state_keys,
    unit_specs,
    unit_tensors,
    whole_state,
)


def het_blocks(module) -> dict:
    """{(layer index, block name): block} of a GPTModel (or its DDP / Float16Module wrappers)."""
    model = unwrap_model(module)
    blocks = {}
    for index, layer in enumerate(model.decoder.layers):
        for child in (layer.self_attention, layer.mlp):
            if not isinstance(child, UnitBlock):
                raise TypeError(
                    f"layer {index}: {type(child).__name__} is not a het-TP block; "
                    "build the model with the het-TP layer spec"
                )
            blocks[(index, child.block)] = child
    return blocks


def even_plan(module, tp_size: int) -> PartitionPlan:
    blocks = het_blocks(module)
    attn, mlp = blocks[(0, "attn")], blocks[(0, "mlp")]
    unit_size = mlp.linear_fc2.unit_layouts["weight"].width
    return PartitionPlan.even(
        tp_size, len(blocks) // 2, attn.num_units, mlp.num_units, unit_size, attn.heads
    )


def comm_device():
    """Where tensors for TP-group collectives live: the current GPU, or the CPU (gloo)."""
    return torch.cuda.current_device() if torch.cuda.is_available() else "cpu"


class HetPartition:
    """The agreed plan of one TP group, and the operation that changes it."""

    def __init__(self, module, group=None, cost_model: CostModel | None = None):
        self.group = (
            group if group is not None else parallel_state.get_tensor_model_parallel_group()
        )
        self.rank = dist.get_rank(self.group)
        self.plan = even_plan(module, dist.get_world_size(self.group))
        self.cost_model = cost_model or CostModel()
        blocks = het_blocks(module)
        self._mark_replicas(blocks)
        # Parameters per unit of each block kind: the weight of a unit's share of the work.
        self.unit_work = {
            name: sum(
                math.prod(layout.payload_shape(param.shape))
                for _, _, param, layout in blocks[(0, name)].unit_tensors()
            )
            for name in BLOCKS
        }
        # ... and an attention unit's core attention over its query heads
        config = module.config
        heads_per_unit = (
            self.plan.heads.heads_per_unit
            if self.plan.heads is not None
            else config.num_attention_heads
            // (config.num_query_groups or config.num_attention_heads)
        )
        self._attn_params = self.unit_work["attn"]
        self._core = core_attention_work(
            heads_per_unit, module.max_sequence_length, config.kv_channels
        )
        self._probe_dims = {
            "hidden": config.hidden_size,
            "head_dim": config.kv_channels,
            "heads_per_unit": heads_per_unit,
            "mlp_rows": config.ffn_hidden_size
            // dist.get_world_size(self.group)
            * (2 if config.gated_linear_unit else 1),
            "rope": getattr(module, "position_embedding_type", None) == "rope",
        }
        self.core_scale = 1.0  # core attention's cost per FLOP against the GEMMs'
        self.unit_work["attn"] += self._core
        # head units: one group's K/V replica, which a rank holding any of its heads computes
        self.unit_work["kv"] = sum(
            math.prod(shape) for _, _, shape in blocks[(0, "attn")].replica_tensors()
        )
        # attention's per-call part on a rank holding any head (hettp.attention_probe),
        # priced once the run's micro-batch is known
        self.unit_work["call"] = 0.0

    @property
    def unit_params(self) -> dict[str, float]:
        """One unit's parameters per block, and one group's K/V replica's (key "kv"): what a
        unit's state weighs in memory (hettp.memory)."""
        return {"attn": self._attn_params, "mlp": self.unit_work["mlp"], "kv": self.unit_work["kv"]}

    def price_core_attention(self, scale: float) -> None:
        """Weigh an attention unit's core attention at `scale` times its FLOPs (measured:
        hettp.costfit.core_attention_scale). In place: the planner and the resizer weigh
        units by this same dict."""
        self.core_scale = scale
        self.unit_work["attn"] = self._attn_params + scale * self._core

    def probe_shape(self, seq: int, batch: int, device, dtype) -> ProbeShape:
        """This model's attention and MLP on one rank, at a micro-batch of `seq` x `batch`
        tokens: what hettp.attention_probe times."""
        return ProbeShape(seq, batch, device=device, dtype=dtype, **self._probe_dims)

    def price_attention_call(self, work: float) -> None:
        """Weigh attention's per-call part, paid by a rank holding any of a layer's attention
        units, at `work` (hettp.attention_probe.CallPrice.work). In place, as
        price_core_attention."""
        if not math.isfinite(work) or work < 0:
            raise ValueError(f"attention's per-call work must be finite and >= 0, got {work}")
        self.unit_work["call"] = work

    def block_work(self, plan: PartitionPlan, shares) -> list[tuple[float, float, float]]:
        """Per rank, the work of its active units by kind: attention's GEMMs (its query
        groups' or heads' parameters, its K/V replicas and its per-call part), its core
        attention (FLOPs in parameters' terms, unscaled) and the MLP's."""
        call = self.unit_work["call"]
        kinds = (
            {"attn": self._attn_params, "mlp": 0.0, "kv": self.unit_work["kv"], "call": call},
            {"attn": self._core, "mlp": 0.0, "kv": 0.0},
            {"attn": 0.0, "mlp": self.unit_work["mlp"], "kv": 0.0},
        )
        per_kind = [plan_work(plan, weights, shares) for weights in kinds]
        return list(zip(*per_kind))

    def unit_bytes(self, model, optimizer) -> dict[str, int]:
        """What moving one unit of each block carries now: its weights, and the fp32 masters
        and optimizer moments the optimizer holds for them; with head units also (key
        hettp.transfer.KV_REPLICA) what a group's K/V replica carries to a rank new to it."""
        blocks = het_blocks(model)
        keys = state_keys(OptimizerView(optimizer), blocks)
        out = {name: sum(s.nbytes for s in unit_specs(blocks[(0, name)], keys)) for name in BLOCKS}
        if self.plan.heads is not None:
            out[KV_REPLICA] = sum(s.nbytes for s in replica_specs(blocks[(0, "attn")], keys))
        return out

    def adopt_layers(self, module, plan: PartitionPlan) -> None:
        """The stage's layers changed (moved between pipeline stages, with their units):
        `plan` is this stage's part of the whole plan for the layers it holds now."""
        blocks = het_blocks(module)
        if len(blocks) != 2 * plan.num_layers:
            raise PlanError(
                f"plan has {plan.num_layers} layers, the stage holds {len(blocks) // 2}"
            )
        for (index, name), block in blocks.items():
            if tuple(block.units) != plan.units(index, name, self.rank):
                raise PlanError(f"layer {index} {name}: the plan names other units")
        self.plan = dataclasses.replace(plan, heads=self.plan.heads)
        self._mark_replicas(blocks)

    # ---- K/V replicas (head units) ------------------------------------------------------

    def _mark_replicas(self, blocks) -> None:
        """After every change of owners: which replicas are main, which are replicated, and
        the (layer, group) list whose gradients `sum_replica_grads` adds up."""
        self._replicated = []
        for (index, name), block in sorted(blocks.items()):
            heads = block.heads
            if name != "attn" or heads is None:
                continue
            owners = self.plan.layers[index]["attn"]
            block.linear_qkv.mark_replicas(heads.holders(owners), self.rank)
            self._replicated.extend((index, g) for g in heads.replicated(owners))

    def sum_replica_grads(self, module, attr: str = "main_grad") -> None:
        """Give every replica of a group's K/V the sum of its holders' gradients (`attr`: DDP's
        main_grad, or .grad without DDP): one all-reduce over the TP group of the replicated
        groups' gradients, zeros where a rank holds none. After the data-parallel reduction;
        under the distributed optimizer HetDDP makes these gradients whole first."""
        if not self._replicated:
            return
        blocks = het_blocks(module)
        slots = []  # per replicated (layer, group): the tensors of this rank, or their sizes
        for index, group in self._replicated:
            for _, by_group, shape in blocks[(index, "attn")].replica_tensors():
                slots.append((by_group.get(group), math.prod(shape)))
        flat = torch.zeros(sum(n for _, n in slots), dtype=torch.float32, device=comm_device())
        offset = 0
        for param, n in slots:
            if param is not None:
                flat[offset : offset + n].copy_(getattr(param, attr).reshape(-1))
            offset += n
        dist.all_reduce(flat, group=self.group)
        offset = 0
        for param, n in slots:
            if param is not None:
                grad = getattr(param, attr)
                grad.copy_(flat[offset : offset + n].view(grad.shape))
            offset += n

    def check(self, plan: PartitionPlan) -> PartitionPlan:
        """Raise PlanError if `plan` does not fit this model (before anything moves); returns
        it with this model's head units (plans from JSON or a checkpoint do not say)."""
        p = self.plan
        plan.check_model(p.tp_size, p.num_layers, p.attn_units, p.mlp_units, p.mlp_unit_size)
        return dataclasses.replace(plan, heads=p.heads)

    def install(self, module, plan: PartitionPlan, step=None, fault=None) -> Migration:
        """Move weights of a model that has no optimizer yet (right after it was built)."""
        plan = self.check(plan)
        migration, _, _ = self._move(module, plan, optimizer=None, step=step, fault=fault)
        return migration

    def repartition(self, state, plan: PartitionPlan, step=None, fault=None) -> Migration:
        """Move units, their weights and optimizer state; rebuild DDP and the optimizer.

        `state` holds .model (DDP), .optimizer, .scheduler and .config; they are replaced in place.
        """
        plan = self.check(plan)
        before = self.plan
        with gathered_params(state):
            view = OptimizerView(state.optimizer)
            view.gather()  # whole masters and moments under the distributed optimizer
            # every TP group of the job (data-parallel replicas, pipeline stages) transfers at
            # this boundary: all commit or none, and all rebuild if any moved units, since
            # building an optimizer runs collectives over every rank
            migration, replaced, installed = self._move(
                state.model,
                plan,
                optimizer=view,
                step=step,
                fault=fault,
                agree_over=dist.group.WORLD,
            )
            moved = torch.tensor([migration.units_moved], dtype=torch.int64, device=comm_device())
            dist.all_reduce(moved, op=dist.ReduceOp.MAX)
            if moved.item():
                try:
                    _rebuild(state, *replaced, old=view, step=step, fault=fault)
                except TransferError:  # every rank: the old wrapper and optimizer stay
                    self._put_back(state.model, installed)
                    raise
            else:  # at most a local reorder, done on the gathered copies
                _write_back(view)
                if plan != before:
                    _drop_residues(state)
        return migration

    def reorder(self, state, plan: PartitionPlan) -> None:
        """Adopt `plan`, which only changes local orders: permute weights and optimizer state
        in place (same parameter objects, so DDP and the optimizer stay as they are). Local."""
        plan = self.check(plan)
        for index in range(plan.num_layers):
            for block in BLOCKS:
                for rank in range(plan.tp_size):
                    if set(plan.units(index, block, rank)) != set(
                        self.plan.units(index, block, rank)
                    ):
                        raise PlanError(
                            f"reorder: layer {index} {block} rank {rank} would change "
                            "owners; that is a repartition"
                        )
        optimizer = OptimizerView(state.optimizer)
        optimizer.gather()  # collective over DP under the distributed optimizer
        blocks = het_blocks(state.model)
        keys = state_keys(optimizer, blocks)
        permuted = False
        with gathered_params(state), torch.no_grad(), cpu_compat.suspended():
            for (index, name), block in blocks.items():
                new_units = plan.units(index, name, self.rank)
                if new_units != block.units:
                    permute(unit_tensors(block, optimizer, keys), block.units, new_units)
                    block.reorder(new_units)
                    permuted = True
            _write_back(optimizer)
        if permuted:
            _drop_residues(state)
        self.plan = plan

    # ------------------------------------------------------------------------------------

    def _move(self, module, plan, optimizer, step, fault, agree_over=None):
        """Transfer and commit; returns the Migration, ({old param: (new param, new
        optimizer state)}, {K/V replica new to this rank: (master, optimizer state)}) and
        what the commit replaced (_Installed, for _put_back)."""
        blocks = het_blocks(module)
        keys = state_keys(optimizer, blocks)
        own = {b: unit_specs(blocks[(0, b)], keys) for b in BLOCKS}
        replica = replica_specs(blocks[(0, "attn")], keys)
        sizes = {b: sum(s.nbytes for s in own[b]) for b in BLOCKS}
        sizes[KV_REPLICA] = sum(s.nbytes for s in replica)
        schedule = plan_transfer(self.plan, plan, sizes.__getitem__)
        primitive, predictions = self.cost_model.choose(schedule)
        # what a move sends: its unit's tensors, and its group's K/V where it brings them
        specs = {(b, False): own[b] for b in BLOCKS}
        specs[("attn", True)] = own["attn"] + replica

        pieces = {key: unit_tensors(b, optimizer, keys) for key, b in blocks.items()}
        positions = {key: {u: i for i, u in enumerate(b.units)} for key, b in blocks.items()}

        def run_of_moves(moves):
            key = (moves[0].layer, moves[0].block)
            where = positions[key]
            sent = pieces[key] if moves[0].brings_replica else pieces[key][: len(own[key[1]])]
            return run_payload(sent, len(where), [where[m.unit] for m in moves])

        with cpu_compat.suspended():  # pure torch from here; the CPU device mode only slows it
            result = run_transfer(
                schedule,
                self.group,
                primitive,
                run_of_moves,
                lambda move: specs[(move.block, move.brings_replica)],
                device=comm_device(),
                step=step,
                fault=fault,
                agree_over=agree_over,
            )
            # the new shards are built before the last vote (the memory a move needs is taken
            # here): a rank that cannot build them aborts the move on every rank, each keeping
            # its state; after the vote the commit only installs what was built
            failures, staged = [], None
            try:
                staged = self._prepare(
                    blocks, pieces, positions, plan, keys, result, {b: len(own[b]) for b in BLOCKS}
                )
                if fault:  # for tests: everything built, nothing installed
                    fault("commit")
            except Exception as err:  # noqa: BLE001 - any failure aborts the transaction
                failures.append(f"commit: {type(err).__name__}: {err}")
            vote(failures, self.group, comm_device(), step, agree_over)
            result.received = {}  # the staging buffers: built into the new shards
            installed = _Installed(
                self.plan, [(s.block, s.block.installed(), s.pieces) for s in staged]
            )
            replaced, created = self._install(staged)
        migration = Migration(self.plan, plan, schedule, result, predictions)
        self.plan = plan
        self._mark_replicas(blocks)
        return migration, (replaced, created), installed

    def _put_back(self, module, installed: _Installed) -> None:
        """Undo a committed move here (its rebuild failed on some rank): every changed block's
        old parameters, K/V replicas, order and resize, and the old plan, with every block's
        replica marks."""
        for block, shards, pieces in reversed(installed.blocks):
            for piece in pieces or ():  # an order change, made in place: undone in place, a
                permute([piece], block.units, shards.units)  # tensor's copy at a time
            block.reinstall(shards)
        self.plan = installed.plan
        self._mark_replicas(het_blocks(module))

    def _prepare(self, blocks, pieces, positions, plan, state_keys, result, own) -> list:
        """Build every block's new shards, moments and K/V replicas from what it keeps and
        what it received, changing nothing: the allocations of a move, before its last vote.
        `own`: per block, how many of a unit's tensors are its own (the rest, with head units,
        are its group's K/V, which only the move bringing them carries). Returns _Staged per
        block that changes."""
        incoming = {(m.layer, m.block, m.unit): tensors for m, tensors in result.received.items()}
        staged = []
        for (index, name), block in blocks.items():
            old_units, new_units = block.units, plan.units(index, name, self.rank)
            if old_units == new_units:
                continue
            mine, kept = pieces[(index, name)], positions[(index, name)]
            if set(old_units) == set(new_units):  # order only: copied in place at install
                staged.append(
                    _Staged(
                        (index, name),
                        block,
                        new_units,
                        ordered=permuted(mine, old_units, new_units),
                        pieces=mine,
                    )
                )
                continue
            # per new unit: its position here if kept, else what it brought
            sources = [
                kept[unit] if unit in kept else incoming[(index, name, unit)] for unit in new_units
            ]
            # a head that travelled without its group's K/V gives None for them
            rebuilt = [
                layout.rebuilt(
                    tensor,
                    len(old_units),
                    [s if isinstance(s, int) else s[i] if i < len(s) else None for s in sources],
                )
                for i, (tensor, layout) in enumerate(mine)
            ]
            per_param = len(state_keys) + 1
            old_params, new_shards, moments = [], {}, []
            for i, (linear, param_name, param, _) in enumerate(block.unit_tensors()):
                old_params.append(param)
                new_shards.setdefault(linear, {})[param_name] = rebuilt[i * per_param]
                moments.append(
                    {k: rebuilt[i * per_param + 1 + j] for j, k in enumerate(state_keys)}
                )
            replicas, new_state = _new_replicas(
                block, new_units, rebuilt[len(old_params) * per_param :], state_keys
            )
            staged.append(
                _Staged(
                    (index, name),
                    block,
                    new_units,
                    new_shards=new_shards,
                    moments=moments,
                    replicas=replicas,
                    new_state=new_state,
                    old_params=old_params,
                )
            )
        return staged

    @staticmethod
    def _install(staged):
        """Put the built shards in place (after the last vote: reference swaps, and copies into
        tensors this rank holds, which allocate nothing). Returns {old param: (new param,
        moved state)} and, for K/V replicas new to this rank, {new param: (fp32 master or
        None, optimizer state)}."""
        replaced, created = {}, {}
        for s in staged:
            block = s.block
            if s.ordered is not None:  # order only: in place, same parameters
                for tensor, copy in s.ordered:
                    tensor.copy_(copy)
                block.reorder(s.new_units)
                continue
            if s.replicas:
                block.set_units(s.new_units, s.new_shards, s.replicas)
            else:
                block.set_units(s.new_units, s.new_shards)
            for old, (_, _, new, _), param_moments in zip(
                s.old_params, block.unit_tensors(), s.moments
            ):
                replaced[old] = (new, param_moments)
            for name, by_group, _ in block.replica_tensors() if s.replicas else ():
                for group, param in by_group.items():
                    if (name, group) in s.new_state:
                        created[param] = s.new_state[(name, group)]
        return replaced, created


@dataclasses.dataclass
class _Staged:
    """One block's part of a move, built and not yet installed (`ordered`: its units only
    change order, and these are its tensors' copies in the new order, for install to copy
    into `pieces`, its (tensor, layout) list)."""

    key: tuple
    block: object
    new_units: tuple
    ordered: list | None = None
    pieces: list | None = None
    new_shards: dict | None = None
    moments: list | None = None
    replicas: dict | None = None
    new_state: dict | None = None
    old_params: list | None = None


@dataclasses.dataclass(frozen=True)
class _Installed:
    """What a move's commit replaced on this rank: the plan before and, per changed block, the
    block, its shards before (UnitBlock.installed) and, where only its order changed, its
    (tensor, layout) pieces, permuted in place. References only: the staged copies go."""

    plan: PartitionPlan
    blocks: list[tuple[UnitBlock, InstalledShards, list | None]]


def _new_replicas(block, new_units, per_unit, state_keys):
    """The K/V replicas a head-unit block holds under `new_units`: its own Parameter where it
    held the group already, else what the one head of the group that brought them carried
    (weights, and the master and moments: every replica's are equal). `per_unit`: the assembled
    ReplicaLayout entries of unit_tensors, per tensor a list over the new units (None for a
    head that came without them). Returns ({} with group units) {name: {group: Parameter or
    tensor}} and {(name, group): (master, state)} of the new ones."""
    if not block.replica_tensors():
        return {}, {}
    heads, per_tensor = block.heads, len(state_keys) + 1
    brought = {}  # group -> the position of the head that brought its K/V
    for position, unit in enumerate(new_units):
        if per_unit[0][position] is not None:
            brought.setdefault(heads.group_of(unit), position)
    replicas, new_state = {}, {}
    for t, (name, held, _) in enumerate(block.replica_tensors()):
        out = replicas.setdefault(name, {})
        for group in heads.groups_of(new_units):
            position = brought.get(group)
            if group in held:
                out[group] = held[group]
                continue
            if position is None:  # hettp.transfer.plan_transfer sends it with one of its heads
                raise RuntimeError(f"no moved head brought query group {group}'s K/V")
            columns = [per_unit[t * per_tensor + j][position].clone() for j in range(per_tensor)]
            out[group] = columns[0]
            state = dict(zip(state_keys, columns[1:]))
            new_state[(name, group)] = (state.pop("master", None), state)
    return replicas, new_state


def _drop_residues(state) -> None:
    """Units changed places in the gradient buffers: the compressed reduction's rounding
    residues (--het-dp-compress, by buffer position) would land on other units' gradients.
    Dropped, as a rebuild drops them: at most one step's rounding is lost."""
    reducer = getattr(state.model, "reducer", None)
    if reducer is not None:
        reducer.reset()


def _write_back(view) -> None:
    """Put a gathered view's whole masters and moments back into the distributed optimizer's
    ranges (after they were permuted in place); nothing to do for the other optimizers, whose
    view holds the live tensors."""
    for sub in view.sharded:
        for param in held_params(sub):
            view.scatter(param, view.master(param), view.state[param])


def _rebuild(state, replaced, extra=None, *, old, step=None, fault=None):
    """New DDP wrapper and optimizer around the re-shaped parameters, same training state:
    fp32 masters, moments, step count, loss scaler and learning-rate schedule carry over.
    `old` is the gathered view of the old optimizer; `extra` gives parameters new to the
    model (a layer moved in from another stage, a K/V replica a head brought) their
    {param: (master, state)}. Every rank of the job calls it; a failure on any rank raises
    TransferError on every rank with the old wrapper and optimizer in place (_build), and
    the caller puts back what it installed. Past the build, only references are swapped."""
    old_ddp = state.model
    model, optimizer, new = _build(state, replaced, extra, old, step, fault)
    for old_sub, new_sub in zip(old.subs, new.subs):
        if getattr(old_sub, "grad_scaler", None) is not None:
            new_sub.grad_scaler = old_sub.grad_scaler
    state.scheduler.optimizer = optimizer
    state.scheduler.step(increment=0)  # current lr / wd onto the new parameter groups
    _rebind_hooks(state.config, old_ddp, model)
    if state.config.grad_scale_func is not None:
        state.config.grad_scale_func = optimizer.scale_loss
    state.model, state.optimizer = model, optimizer
    _release(old_ddp)
    _rehook(model)
    # nor may the old wrapper's buffers stay alive through the replaced parameters (their
    # main_grad and, under the distributed optimizer, their data and main_param are views)
    live = set(model.module.parameters())  # replaced ones, and K/V replicas given up
    for old_param in [p for p in whole_state(old) if p not in live]:
        for key in ("main_grad", "main_param", "main_param_sharded"):
            old_param.__dict__.pop(key, None)
    for param in model.module.parameters():
        param.grad = None  # the last step's, a view of the old buffer (FP32Optimizer sets it)


def _build(state, replaced, extra, old, step, fault):
    """(wrapper, optimizer, OptimizerView of it), new, agreed on by every rank of the job.

    Both builds allocate (gradient buffers; masters and moments), so the job agrees after
    each (_agree). A failure on any rank (`fault(stage)`, for tests: "wrapper" after the
    wrapper's build, "param groups" between the optimizer build's collectives, "optimizer"
    after it) releases the new wrapper and gives the parameters back their data, grad and DDP
    fields on every rank, which then raises TransferError. What was built is let go first,
    so that a build that ran out of memory leaves the put-back the memory it needs."""
    old_ddp = state.model
    fields = {p: (p.data, p.grad, dict(vars(p))) for p in old_ddp.module.parameters()}
    built, failures, aborted = {}, [], False
    detach_shard_views(state.optimizer)  # or, set aside, it keeps the accumulators alive

    def let_go():
        if built:
            _discard(built.pop("wrapper", None), fields)
            built.clear()
            _rehook(old_ddp)

    def agree(stage, aborted=False):
        if failures or aborted:  # aborted whatever the others vote: let go before voting
            let_go()
        failed = _agree(failures, aborted)
        if failed is not None:
            let_go()
            where = f" at iteration {step}" if step is not None else ""
            detail = f"; this rank: {'; '.join(failures)}" if failures else ""
            raise TransferError(
                f"rebuild of the {stage}{where} aborted: rank(s) {failed} failed{detail}. "
                "Every rank keeps its previous partition and state."
            )

    try:
        built["wrapper"] = _wrapper_like(old_ddp, fault)
    except _HalfBuilt as err:
        failures.append(f"DDP wrapper: {err}")
        built["wrapper"] = err.wrapper
    agree("DDP wrapper")
    try:
        with _build_collectives(fault):
            built["optimizer"], built["view"] = _new_optimizer(
                built["wrapper"], state.optimizer, replaced, extra, old
            )
        if fault is not None:
            fault("optimizer")
    except _PeerFailed:  # another rank failed between the build's collectives
        aborted = True
    except Exception as err:  # noqa: BLE001 - any failure aborts the rebuild everywhere
        failures.append(f"optimizer: {type(err).__name__}: {err}")
    agree("optimizer", aborted)
    return built["wrapper"], built["optimizer"], built["view"]


def _new_optimizer(model, old_opt, replaced, extra, old):
    """megatron-core's optimizer around `model`, given the old one's state: (optimizer, its
    OptimizerView)."""
    # Upstream Megatron-LM under --disable-gloo-process-groups has none, and megatron-core
    # asserts on them unless told (this trainer always creates them).
    gloo = getattr(parallel_state, "_DATA_PARALLEL_GROUP_GLOO", None) is not None
    optimizer = get_megatron_optimizer(old_opt.config, [model], use_gloo_process_groups=gloo)
    detach_shard_views(optimizer)
    if len(optimizer.param_groups) == len(old_opt.param_groups):  # built from the flags: a
        set_group_values(optimizer, old_opt.param_groups)  # resumed run's rates may differ
    carried = {}  # new model parameter -> (fp32 master or None, optimizer state)
    for old_param, (master, param_state) in whole_state(old).items():
        new_param, moved = replaced.get(old_param, (old_param, {}))
        carried[new_param] = (
            moved.get("master", master),
            {**param_state, **{k: v for k, v in moved.items() if k != "master"}},
        )
    carried.update(extra or {})
    carry_into(optimizer, carried)
    carry_group_steps(old_opt, optimizer)
    return optimizer, OptimizerView(optimizer)


# The job's agreement on a rebuild rides on all_gather_object over the world, the collective
# megatron-core's optimizer build itself runs between its allocations (once per kind of
# parameter group, to align the groups over ranks): a rank that fails between them sends its
# vote where its peers expect a group list, and they learn of the failure there.


@dataclasses.dataclass(frozen=True)
class _Vote:
    ok: bool
    failed: bool  # this rank failed (not: it stopped because another did)


class _PeerFailed(RuntimeError):
    """Another rank's vote arrived inside the optimizer build's collective."""


def _agree(failures, aborted: bool) -> list[int] | None:
    """Every rank of the job: None if every rank built, else the ranks that failed. Votes go
    round until every rank has voted: a rank still inside the build receives the votes in its
    own collective (_build_collectives raises _PeerFailed there) and votes in the next
    round."""
    mine = _Vote(ok=not failures and not aborted, failed=bool(failures))
    while True:
        votes = [None] * dist.get_world_size()
        dist.all_gather_object(votes, mine)  # outside the build: not _build_collectives's
        if all(isinstance(v, _Vote) for v in votes):
            if all(v.ok for v in votes):
                return None
            return [rank for rank, v in enumerate(votes) if v.failed]


@contextlib.contextmanager
def _build_collectives(fault=None):
    """While megatron-core builds an optimizer: each of its all_gather_object calls over the
    job raises _PeerFailed if a vote came in with the group lists (`fault`, for tests, may
    fail this rank at "param groups" after the first). Put back on exit, unless someone
    replaced it meanwhile."""
    calls, before = [], dist.all_gather_object

    def gather(object_list, obj, group=None):
        before(object_list, obj, group=group)
        if group not in (None, dist.group.WORLD):
            return
        if any(isinstance(o, _Vote) for o in object_list):
            raise _PeerFailed("another rank failed to build its optimizer")
        calls.append(1)
        if fault is not None and len(calls) == 1:
            fault("param groups")

    dist.all_gather_object = gather
    try:
        yield
    finally:
        if dist.all_gather_object is gather:
            dist.all_gather_object = before


class _HalfBuilt(RuntimeError):
    """A DDP wrapper's construction failed; `wrapper` is the half-built one, whose hooks may
    already be on the parameters and the modules."""

    def __init__(self, wrapper, cause):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.wrapper = wrapper


def _wrapper_like(old_ddp, fault=None):
    """A new DDP wrapper around `old_ddp`'s module (its parameters re-shaped), configured and
    reducing as `old_ddp` does; a failure while constructing it raises _HalfBuilt (`fault`,
    for tests, fails it at "wrapper": built, its hooks on the parameters)."""
    cls = type(old_ddp)
    kwargs = old_ddp.rebuild_kwargs() if isinstance(old_ddp, HetDDP) else {}
    wrapper = cls.__new__(cls)
    try:
        wrapper.__init__(old_ddp.config, old_ddp.ddp_config, old_ddp.module, **kwargs)
        if fault is not None:
            fault("wrapper")
    except Exception as err:  # noqa: BLE001 - the caller votes on it
        raise _HalfBuilt(wrapper, err) from err
    return wrapper


def _release(wrapper) -> None:
    """A DDP wrapper set aside (the old one after a rebuild, or a new one whose rebuild failed,
    maybe half-built) may stay reachable through its backward hooks on the parameters (until
    _rehook drops them with their accumulators): it must act on none (the hooks find no
    bucket; its forward pre-hooks are lifted, with no parameter gather) and keep none of its
    buffers alive (its buckets, grad accumulators and parameter lists hold them)."""
    fields = wrapper.__dict__  # as set: a half-built one may lack nn.Module's own fields
    fields["param_to_bucket_group"] = {}
    for handle in fields.get("remove_forward_pre_hook_handles", {}).values():
        handle.remove()
    fields["remove_forward_pre_hook_handles"] = {}
    for name in (
        "buffers",
        "bucket_groups",
        "expert_parallel_buffers",
        "expert_parallel_bucket_groups",
        "grad_accs",
        "params_with_grad",
    ):
        fields[name] = []


class _Mark:
    """Put in an accumulator's metadata: alive exactly as long as that accumulator."""


def _rehook(wrapper) -> None:
    """Every gradient accumulator `wrapper` hooked, anew and carrying its hook alone.

    megatron-core keeps no handle to take a hook off, so the wrappers set aside before it left
    theirs (inert) on the accumulators of the parameters no move re-shaped: a call each, every
    backward, for the rest of the run. Autograd holds an accumulator weakly; once `wrapper`
    lets go of its own (a set-aside wrapper holds none), each is dropped with its hooks, and
    its parameter gets a new one with `wrapper`'s hook. One held elsewhere too (a mark in its
    metadata outlives the drop) is kept as it is, `wrapper`'s hook on it: the distributed
    optimizer's views of fp32 weights held them until unit_state.detach_shard_views."""
    params, marks = [], []
    for accumulator in wrapper.grad_accs:
        mark = _Mark()
        accumulator.metadata[_Mark] = mark
        params.append(accumulator.variable)
        marks.append(weakref.ref(mark))
        del accumulator, mark
    wrapper.grad_accs = []
    hooked = []
    for param, mark in zip(params, marks):
        accumulator = param.expand_as(param).grad_fn.next_functions[0][0]
        if mark() is not None and accumulator.metadata.get(_Mark) is mark():
            del accumulator.metadata[_Mark]  # the same one, held elsewhere: hooked already
        else:  # a new one (the old is gone, or no longer the parameter's)
            accumulator.register_hook(wrapper._make_backward_post_hook(param))
        hooked.append(accumulator)
    wrapper.grad_accs = hooked


def _discard(wrapper, fields) -> None:
    """Undo a rebuild that will not be committed: `wrapper` (new, maybe half-built) is
    released, and every parameter gets back its data, grad and DDP fields (`fields`, taken
    before the build: the new wrapper re-pointed them at its buffers)."""
    if wrapper is not None:
        _release(wrapper)
    with torch.no_grad():
        for param, (data, grad, attrs) in fields.items():
            param.data = data
            param.grad = grad
            param.__dict__.clear()
            param.__dict__.update(attrs)


# The config's hooks the schedule calls on the DDP wrapper (set by whoever built it: this
# trainer sets no_sync_func, upstream's train() the grad/param sync ones with overlap).
SYNC_HOOKS = ("no_sync_func", "grad_sync_func", "param_sync_func")


def _rebind_hooks(config, old_ddp, new_ddp) -> None:
    """Each hook that is a method of the old wrapper (alone or in a per-chunk list) becomes the
    same method of the new one; a hook left unset stays unset."""

    def rebound(hook):
        if isinstance(hook, list):
            return [rebound(h) for h in hook]
        if getattr(hook, "__self__", None) is old_ddp:
            return getattr(new_ddp, hook.__name__)
        return hook

    for name in SYNC_HOOKS:
        setattr(config, name, rebound(getattr(config, name, None)))
