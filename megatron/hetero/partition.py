"""Changing which TP rank owns which units, on a megatron-core GPTModel built with the het spec.

`HetPartition` holds the plan every rank of the TP group agrees on and moves units to a new
plan at a step boundary: weights, and once the optimizer has state, its moments too, so
training continues on exactly the trajectory it was on. Then it rebuilds what megatron-core
sized by shape: the DDP wrapper (its gradient buffers) and the optimizer (its parameter
groups), keeping the optimizer's step count and the learning-rate schedule.

The transfer is transactional (hettp.exchange): if any rank fails, every rank raises
TransferError and keeps its previous model, optimizer and plan.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel as DDP
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer.optimizer import FP32Optimizer

from hettp.exchange import TensorSpec, payload_nbytes, run_transfer
from hettp.plan import BLOCKS, PartitionPlan
from hettp.transfer import CostModel, plan_transfer

from . import cpu_compat
from .layers import UnitBlock


def het_blocks(module) -> dict:
    """{(layer index, block name): block} of a GPTModel (or its DDP wrapper)."""
    model = getattr(module, "module", module)
    blocks = {}
    for index, layer in enumerate(model.decoder.layers):
        for child in (layer.self_attention, layer.mlp):
            if not isinstance(child, UnitBlock):
                raise TypeError(f"layer {index}: {type(child).__name__} is not a het-TP block; "
                                "build the model with the het-TP layer spec")
            blocks[(index, child.block)] = child
    return blocks


def even_plan(module, tp_size: int) -> PartitionPlan:
    blocks = het_blocks(module)
    attn, mlp = blocks[(0, "attn")], blocks[(0, "mlp")]
    unit_size = mlp.linear_fc2.unit_layouts["weight"].width
    return PartitionPlan.even(tp_size, len(blocks) // 2, attn.num_units, mlp.num_units, unit_size)


def _device():
    return torch.cuda.current_device() if torch.cuda.is_available() else "cpu"


class HetPartition:
    """The agreed plan of one TP group, and the operation that changes it."""

    def __init__(self, module, group=None, cost_model: CostModel | None = None):
        self.group = group if group is not None else parallel_state.get_tensor_model_parallel_group()
        self.rank = dist.get_rank(self.group)
        self.plan = even_plan(module, dist.get_world_size(self.group))
        self.cost_model = cost_model or CostModel()
        self.last_transfer = None  # (schedule, result, predictions) of the latest change

    def check(self, plan: PartitionPlan) -> None:
        """Raise PlanError if `plan` does not fit this model (before anything moves)."""
        p = self.plan
        plan.check_model(p.tp_size, p.num_layers, p.attn_units, p.mlp_units, p.mlp_unit_size)

    def install(self, module, plan: PartitionPlan, step=None, fault=None):
        """Move weights of a model that has no optimizer yet (right after it was built)."""
        self.check(plan)
        self._move(module, plan, optimizer=None, step=step, fault=fault)

    def repartition(self, state, plan: PartitionPlan, step=None, fault=None):
        """Move units, their weights and optimizer state; rebuild DDP and the optimizer.

        `state` holds .model (DDP), .optimizer, .scheduler and .config; they are replaced in place.
        """
        self.check(plan)
        replaced = self._move(state.model, plan, optimizer=_ParamStates(state.optimizer),
                              step=step, fault=fault)
        if self.last_transfer[0].moves:
            # Every rank rebuilds, also one whose units did not change: building the optimizer
            # runs collectives.
            _rebuild(state, replaced)

    # ------------------------------------------------------------------------------------

    def _move(self, module, plan, optimizer, step, fault):
        """Transfer and commit; returns {old param: (new param, new optimizer state)}."""
        blocks = het_blocks(module)
        state_keys = _state_keys(optimizer, blocks)
        specs = {b: _unit_specs(blocks[(0, b)], state_keys) for b in BLOCKS}
        schedule = plan_transfer(self.plan, plan, lambda b: sum(s.nbytes for s in specs[b]))
        primitive, predictions = self.cost_model.choose(schedule)

        positions = {key: {u: i for i, u in enumerate(b.units)} for key, b in blocks.items()}

        def payload(move):
            block = blocks[(move.layer, move.block)]
            position = positions[(move.layer, move.block)][move.unit]
            return [layout.payload(tensor, len(block.units), position)
                    for tensor, layout in _unit_tensors(block, optimizer, state_keys)]

        with cpu_compat.suspended():  # pure torch from here; the CPU device mode only slows it
            result = run_transfer(schedule, self.group, primitive, payload,
                                  lambda move: specs[move.block], device=_device(), step=step,
                                  fault=fault)
            replaced = self._commit(blocks, plan, optimizer, state_keys, result)
        self.plan = plan
        self.last_transfer = (schedule, result, predictions)
        return replaced

    def _commit(self, blocks, plan, optimizer, state_keys, result):
        """Install the new shards; local only, so it cannot leave ranks disagreeing."""
        incoming = {(m.layer, m.block, m.unit): tensors for m, tensors in result.received.items()}
        replaced = {}
        for (index, name), block in blocks.items():
            old_units, new_units = block.units, plan.units(index, name, self.rank)
            if old_units == new_units:
                continue
            pieces = _unit_tensors(block, optimizer, state_keys)
            kept = {u: i for i, u in enumerate(old_units)}
            columns = []
            for unit in new_units:
                if unit in kept:
                    columns.append([layout.payload(t, len(old_units), kept[unit])
                                    for t, layout in pieces])
                else:
                    columns.append(incoming[(index, name, unit)])
            rebuilt = [layout.assemble([col[i] for col in columns], tensor)
                       for i, (tensor, layout) in enumerate(pieces)]
            per_param = len(state_keys) + 1
            old_params, new_shards, moments = [], {}, []
            for i, (linear, param_name, param, _) in enumerate(block.unit_tensors()):
                old_params.append(param)
                new_shards.setdefault(linear, {})[param_name] = rebuilt[i * per_param]
                moments.append({k: rebuilt[i * per_param + 1 + j] for j, k in enumerate(state_keys)})
            block.set_units(new_units, new_shards)
            for old, (_, _, new, _), param_moments in zip(old_params, block.unit_tensors(), moments):
                replaced[old] = (new, param_moments)
        return replaced


class _ParamStates:
    """Per-parameter optimizer state across megatron-core's (possibly chained) optimizers."""

    def __init__(self, optimizer):
        subs = getattr(optimizer, "chained_optimizers", [optimizer])
        for sub in subs:
            if not isinstance(sub, FP32Optimizer):
                raise NotImplementedError(
                    f"het-TP migration supports fp32 training (FP32Optimizer), not "
                    f"{type(sub).__name__}: moving fp32 master weights under --bf16/--fp16 is "
                    "not implemented yet")
        self.inner = [sub.optimizer for sub in subs]
        self.state = {p: s for opt in self.inner for p, s in opt.state.items()}


def _state_keys(optimizer, blocks) -> list[str]:
    """Optimizer state tensors shaped like the parameters (e.g. exp_avg, exp_avg_sq)."""
    if optimizer is None:
        return []
    param = next(iter(blocks.values())).unit_tensors().__next__()[2]
    state = optimizer.state.get(param, {})
    return sorted(k for k, v in state.items()
                  if isinstance(v, torch.Tensor) and v.shape == param.shape)


def _unit_tensors(block, optimizer, state_keys):
    """(tensor, layout) per unit-sharded parameter, each followed by its optimizer states."""
    out = []
    for _, _, param, layout in block.unit_tensors():
        out.append((param.data, layout))
        state = optimizer.state[param] if state_keys else {}
        out.extend((state[k], layout) for k in state_keys)
    return out


def _unit_specs(block, state_keys) -> list[TensorSpec]:
    specs = []
    for _, _, param, layout in block.unit_tensors():
        shape = layout.payload_shape(param.shape)
        specs.append(TensorSpec(shape, param.dtype))
        specs.extend(TensorSpec(shape, torch.float32) for _ in state_keys)
    return specs


def unit_nbytes(module, block: str, with_optimizer_state: int = 0) -> int:
    """Bytes of one unit of `block`, plus `with_optimizer_state` fp32 copies of it."""
    blocks = het_blocks(module)
    return payload_nbytes(_unit_specs(blocks[(0, block)], ["s"] * with_optimizer_state))


def _rebuild(state, replaced):
    """New DDP wrapper and optimizer around the re-shaped parameters, same training state."""
    old_ddp, old_opt = state.model, state.optimizer
    old_states = _ParamStates(old_opt).state
    step = next((s["step"] for s in old_states.values() if "step" in s), None)

    # The old wrapper's backward hooks stay on unchanged parameters: make them no-ops.
    old_ddp.param_to_bucket_group = {}
    model = DDP(old_ddp.config, old_ddp.ddp_config, old_ddp.module)
    optimizer = get_megatron_optimizer(old_opt.config, [model])
    new_of_old = {old: new for old, (new, _) in replaced.items()}
    moments = {new: m for _, (new, m) in replaced.items()}
    carried = {}
    for old_param, param_state in old_states.items():
        param = new_of_old.get(old_param, old_param)
        carried[param] = {**param_state, **moments.get(param, {})}
    for inner in _ParamStates(optimizer).inner:
        for group in inner.param_groups:
            for param in group["params"]:
                if param in carried:
                    inner.state[param] = carried[param]
                if step is not None:
                    inner.state[param].setdefault("step", step)
    state.scheduler.optimizer = optimizer
    state.scheduler.step(increment=0)  # current lr / wd onto the new parameter groups
    state.config.no_sync_func = model.no_sync
    if state.config.grad_scale_func is not None:
        state.config.grad_scale_func = optimizer.scale_loss
    state.model, state.optimizer = model, optimizer
