"""Per-unit tensors and the optimizer state that travels with them.

A unit's share of a sharded parameter never goes anywhere alone: its fp32 master copy (under
--bf16/--fp16) and its optimizer moments must move, be reordered or be frozen with it, or
training would leave the trajectory it was on. Migration (partition.py) moves and permutes
them; resizing (resize.py) freezes a skipped suffix of them. Both see megatron-core's optimizer
and a block's units the same way, through this module.
"""

from __future__ import annotations

import torch
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer

from hettp.exchange import TensorSpec


class OptimizerView:
    """What megatron-core's (possibly chained) optimizer holds per model parameter: the tensor
    it updates (the parameter itself, or its fp32 master copy under --bf16/--fp16) and that
    tensor's state (Adam's moments, step).

    Under --use-distributed-optimizer each data-parallel rank holds a contiguous range of every
    parameter's flattened master and moments. Units move along a weight's rows or columns, and
    the new buffer layout changes every range, so a migration works on whole tensors:
    `gather()` (collective over each DP group) assembles them, `scatter()` writes whole
    tensors back into a distributed optimizer's ranges. Until `gather()`, `main` and `state`
    hold only the parameters of the optimizers that are not distributed.
    """

    def __init__(self, optimizer):
        self.subs = list(getattr(optimizer, "chained_optimizers", [optimizer]))
        self.main = {}  # model parameter -> the tensor the optimizer updates
        self.state = {}  # model parameter -> its optimizer state, whole-tensor shaped
        self.sharded = [sub for sub in self.subs if isinstance(sub, DistributedOptimizer)]
        # id(sub) -> the parameters it updates (looked up once per parameter in scatter)
        self._held = {id(sub): set(held_params(sub)) for sub in self.sharded}
        self.gathered = not self.sharded
        for sub in self.subs:
            if isinstance(sub, DistributedOptimizer):
                continue
            if isinstance(sub, FP32Optimizer):
                main = {p: p for g in sub.optimizer.param_groups for p in g["params"]}
            elif isinstance(sub, Float16OptimizerWithFloat16Params):
                main = {}
                for model_group, main_group in zip(
                    sub.float16_groups, sub.fp32_from_float16_groups
                ):
                    main.update(zip(model_group, main_group))
                main.update((p, p) for g in sub.fp32_from_fp32_groups for p in g)
            else:
                raise NotImplementedError(
                    f"het-TP migration supports megatron-core's FP32Optimizer, "
                    f"Float16OptimizerWithFloat16Params and DistributedOptimizer, not "
                    f"{type(sub).__name__}"
                )
            self.main.update(main)
            states = sub.optimizer.state
            self.state.update((p, states.get(m, {})) for p, m in main.items())

    def master(self, param):
        """The fp32 master copy of `param`, or None when the optimizer updates `param` itself."""
        main = self.main[param]
        return None if main is param else main

    def moment_keys(self, param) -> list[str]:
        """Names of `param`'s optimizer state tensors shaped like it (Adam: exp_avg,
        exp_avg_sq), without gathering anything."""
        for sub in self.sharded:
            if param in self._held[id(sub)]:
                shard = _shard(sub, param)
                if shard is None:  # this DP rank holds none of it: ask another parameter
                    continue
                main, _, _ = shard
                return sorted(
                    k
                    for k, v in sub.optimizer.state.get(main, {}).items()
                    if isinstance(v, torch.Tensor) and v.numel() == main.numel() and v.dim()
                )
        if param in self.state:
            return sorted(
                k
                for k, v in self.state[param].items()
                if isinstance(v, torch.Tensor) and v.shape == param.shape
            )
        # a sharded parameter of which this DP rank holds nothing: every rank's moments exist
        # from the same step on, so any parameter this rank holds a range of tells
        for sub in self.sharded:
            for other in sub.model_param_group_index_map:
                return self.moment_keys(other)
        return []

    def has_master(self, param) -> bool:
        """Whether the optimizer updates an fp32 copy of `param` rather than `param` itself."""
        if any(param in self._held[id(sub)] for sub in self.sharded):
            return param.dtype != torch.float32
        return self.master(param) is not None

    def shard_of(self, param, key):
        """(tensor, start) when `key` ("master" or a moment) of `param` lives in a distributed
        optimizer's range: the tensor holds flattened elements [start, start + numel); (None,
        0) when this DP rank holds none of it; None when the whole tensor is local."""
        for sub in self.sharded:
            if param in self._held[id(sub)]:
                shard = _shard(sub, param)
                if shard is None:
                    return None, 0
                main, start, _ = shard
                return (main if key == "master" else sub.optimizer.state[main][key]), start
        return None

    def gather(self) -> None:
        """Whole-tensor masters and moments of the distributed optimizers' parameters, on every
        DP rank (one all-reduce per state key and DP group: each element is held by one rank
        and zero elsewhere)."""
        if self.gathered:
            return
        for sub in self.sharded:
            params = held_params(sub)
            sample = next(iter(sub.model_param_group_index_map), params[0])
            keys = self.moment_keys(sample)
            masters = [p for p in params if p.dtype != torch.float32]
            step = _step(sub)
            fulls = {}
            for key, owners in [("master", masters)] + [(k, params) for k in keys]:
                flat = torch.zeros(
                    sum(p.numel() for p in owners), dtype=torch.float32, device=params[0].device
                )
                offset = 0
                for p in owners:
                    full = flat[offset : offset + p.numel()]
                    offset += p.numel()
                    fulls[(p, key)] = full.view(p.shape)
                    shard = _shard(sub, p)
                    if shard is not None:
                        main, start, end = shard
                        tensor = main if key == "master" else sub.optimizer.state[main][key]
                        full[start:end].copy_(tensor.detach().view(-1))
                if flat.numel():
                    torch.distributed.all_reduce(flat, group=sub.data_parallel_group)
            for p in params:
                self.main[p] = fulls[(p, "master")] if p.dtype != torch.float32 else p
                state = {k: fulls[(p, k)] for k in keys}
                if step is not None and keys:
                    state["step"] = step
                self.state[p] = state
        self.gathered = True

    def scatter(self, param, master, state) -> None:
        """Write `param`'s whole-tensor fp32 master (None: the parameter is its own master) and
        optimizer state into this DP rank's range of the distributed optimizer holding it."""
        for sub in self.sharded:
            if param not in self._held[id(sub)]:
                continue
            shard = _shard(sub, param)
            if shard is None:
                return
            main, start, end = shard
            with torch.no_grad():
                if master is not None:
                    main.copy_(master.reshape(-1)[start:end])
                if state:
                    sub.optimizer.state[main] = {
                        k: _range_of(v, param, start, end) for k, v in state.items()
                    }
            return
        raise KeyError("scatter: the parameter is not held by a distributed optimizer")


def detach_shard_views(optimizer) -> None:
    """megatron-core's distributed optimizer updates an fp32 parameter in place through a view
    of its range (`param.view(-1)[start:end]`). Once the optimizer has stepped (it sets the
    view's .grad), such a view keeps autograd's link to the parameter, and with it the
    parameter's gradient accumulator, alive: set aside, the optimizer lives on in reference
    cycles until a collection, and through it the accumulator, with the hook of every DDP
    wrapper that hooked it (partition._rehook). Each view becomes a detached view of the same
    memory, with its attributes (tensor-parallel marks), in the optimizer's groups and state.
    Idempotent."""
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(sub, DistributedOptimizer):
            continue
        plain = {}  # id(attached view) -> its detached twin
        for group in sub.shard_fp32_groups:
            for i, shard in enumerate(group):
                if shard._base is None or not shard.requires_grad:
                    continue  # not a view that autograd links to its parameter
                twin = shard.detach()
                twin.__dict__.update(shard.__dict__)  # (its last .grad: zeroed before use)
                plain[id(shard)] = twin
                group[i] = twin
        if not plain:
            continue
        states = sub.optimizer.state
        for group in sub.optimizer.param_groups:
            params = group["params"]
            for i, param in enumerate(params):
                twin = plain.get(id(param))
                if twin is not None:
                    if param in states:
                        states[twin] = states.pop(param)
                    params[i] = twin


def whole_state(view) -> dict:
    """{model parameter: (whole fp32 master or None, optimizer state)} of a gathered view."""
    if not view.gathered:
        raise RuntimeError("whole_state needs a gathered view (OptimizerView.gather)")
    return {p: (view.master(p), state) for p, state in view.state.items()}


def carry_into(optimizer, carried: dict) -> None:
    """Give a freshly built `optimizer` the training state in `carried` (as whole_state
    returns it, keyed by the new optimizer's model parameters): fp32 masters, moments and step
    counts, into the tensors it updates or, under the distributed optimizer, into this DP
    rank's ranges. Parameters missing from `carried` keep what the optimizer made."""
    view = OptimizerView(optimizer)
    step = next(
        (s["step"] for _, s in carried.values() if isinstance(s, dict) and "step" in s), None
    )
    for sub in view.sharded:
        for param in held_params(sub):
            if param in carried:
                master, param_state = carried[param]
                if param_state and step is not None and "step" not in param_state:
                    param_state = {**param_state, "step": _copied(step)}
                view.scatter(param, master, param_state)
    with torch.no_grad():
        for sub in view.subs:
            if sub in view.sharded:
                continue
            updated = {p for g in sub.optimizer.param_groups for p in g["params"]}
            for param, main in view.main.items():
                if param not in carried or main not in updated:
                    continue
                master, param_state = carried[param]
                if master is not None:
                    main.data.copy_(master)  # the new optimizer made it from the bf16 weights
                if param_state:
                    sub.optimizer.state[main] = dict(param_state)
                if step is not None and "step" not in sub.optimizer.state[main]:
                    sub.optimizer.state[main]["step"] = _copied(step)


def carry_group_steps(source, target) -> None:
    """Transformer Engine's and apex's fused Adams (megatron-core's choice wherever either is
    installed) count steps per parameter group, not per parameter: a freshly built optimizer
    would restart Adam's bias correction on warm moments. Every group of `target` gets the
    count of `source`'s groups that hold parameters: all of those step together, while an
    empty one (a DP rank's share of a group under the distributed optimizer can be none)
    counts no steps and may hold any stale value (megatron-core reads the count the same way)."""
    steps = [group["step"] for group in source.param_groups if group["params"] and "step" in group]
    if not steps:
        return  # per-parameter counts (torch's Adam): carried with the state
    step = max(steps)
    for group in target.param_groups:
        group["step"] = _copied(step)


def held_params(sub) -> list:
    """Every model parameter distributed optimizer `sub` updates, in its buffers' order (the
    same on every DP rank; megatron-core's own maps keep only the parameters a rank holds a
    range of)."""
    return [p for buffer in sub.buffers for p in buffer.params]


def _shard(sub, param):
    """(main tensor, start, end) of `param`'s range on this DP rank of distributed optimizer
    `sub`, or None when the rank holds none of it."""
    index = sub.model_param_group_index_map.get(param)
    if index is None:
        return None
    group, order = index
    main = sub.optimizer.param_groups[group]["params"][order]
    param_range = sub._get_model_param_range_map(param)["param"]
    return main, param_range.start, param_range.end


def _range_of(value, param, start, end):
    """A state entry for one DP rank's range: a whole-parameter tensor sliced, anything else
    (Adam's step) copied."""
    if isinstance(value, torch.Tensor) and value.shape == param.shape:
        return value.reshape(-1)[start:end].clone()
    return _copied(value)


def _copied(value):
    """Adam updates a tensor step count in place: no two parameters may share one."""
    return value.clone() if isinstance(value, torch.Tensor) else value


def _step(sub):
    """The optimizer's step count (every parameter of a step shares it), or None before one."""
    for state in sub.optimizer.state.values():
        if "step" in state:
            return state["step"]
    return None


def step_count(view) -> int:
    """How many steps the optimizer has taken (0 before its first): torch's Adam counts per
    parameter, Transformer Engine's and apex's fused Adams per group; all count together."""
    for sub in view.subs:
        count = next(
            (g["step"] for g in sub.optimizer.param_groups if g["params"] and "step" in g),
            _step(sub),  # None before the first step (or where this DP rank holds nothing)
        )
        if count is not None:
            return int(count.item() if isinstance(count, torch.Tensor) else count)
    return 0


def adam_betas(view) -> dict[str, float]:
    """{moment key: its beta} of an Adam (exp_avg: beta1, exp_avg_sq: beta2); empty for an
    optimizer without betas."""
    for sub in view.subs:
        for group in sub.optimizer.param_groups:
            if "betas" in group:
                beta1, beta2 = group["betas"]
                return {"exp_avg": float(beta1), "exp_avg_sq": float(beta2)}
    return {}


def state_keys(optimizer, blocks) -> list[str]:
    """What moves with a unit besides the weights: "master" (fp32 copy under mixed precision)
    and the optimizer state tensors shaped like the parameter (e.g. exp_avg, exp_avg_sq)."""
    if optimizer is None:
        return []
    param = next(iter(blocks.values())).unit_tensors().__next__()[2]
    keys = ["master"] if optimizer.has_master(param) else []
    return keys + optimizer.moment_keys(param)


def unit_tensors(block, optimizer, state_keys):
    """(tensor, layout) per unit-sharded parameter, each followed by its `state_keys` tensors.

    With head units, then per K/V replica tensor (and each of its state tensors) the list of
    every local unit's group replica, under a ReplicaLayout: what a moved head carries so that
    its receiver can hold the group's K/V. Views, so nothing is copied but what is sent."""
    out = []
    for _, _, param, layout in block.unit_tensors():
        out.append((param.data, layout))
        for key in state_keys:
            out.append((_state_of(optimizer, param, key), layout))
    for _, by_group, _ in block.replica_tensors():
        per_unit = [by_group[block.heads.group_of(u)] for u in block.units]
        for key in [None, *state_keys]:
            out.append(
                (
                    [p.data if key is None else _state_of(optimizer, p, key) for p in per_unit],
                    REPLICA,
                )
            )
    return out


class ReplicaLayout:
    """The layout of a per-unit list of K/V replicas (unit_tensors): a unit's payload is its
    group's whole replica; a run joins them along rows; assembling keeps the list (partition.py
    keeps one replica per group), as does rebuilding; a local reorder leaves replicas as they
    are."""

    axis = 0

    def payload(self, per_unit, num_local_units, position):
        return per_unit[position]

    def run(self, per_unit, num_local_units, positions):
        return torch.cat([per_unit[p] for p in positions])

    def assemble(self, payloads, template):
        return list(payloads)

    def rebuilt(self, per_unit, num_local_units, sources):
        return [per_unit[s] if isinstance(s, int) else s for s in sources]


REPLICA = ReplicaLayout()


def _state_of(optimizer, param, key):
    return optimizer.master(param).data if key == "master" else optimizer.state[param][key]


def payload(pieces, num_local_units, position):
    """A unit's slice of every (tensor, layout) in `pieces`."""
    return [layout.payload(tensor, num_local_units, position) for tensor, layout in pieces]


def run_payload(pieces, num_local_units, positions):
    """The units at `positions` of every (tensor, layout) in `pieces`, joined along each
    layout's axis (views where they are consecutive): what hettp.exchange sends for a run."""
    return [layout.run(tensor, num_local_units, positions) for tensor, layout in pieces]


def permute(pieces, old_units, new_units):
    """Put every (tensor, layout) of `pieces` into the order `new_units`, in place."""
    for tensor, copy in permuted(pieces, old_units, new_units):
        tensor.copy_(copy)


def permuted(pieces, old_units, new_units) -> list:
    """(tensor, its copy in the order `new_units`) for every (tensor, layout) of `pieces`
    that the order changes: what permute writes, built apart (a move builds it before its
    last vote, so that what follows the vote allocates nothing)."""
    position = {u: i for i, u in enumerate(old_units)}
    order = [position[u] for u in new_units]
    return [
        (tensor, layout.permuted(tensor, len(old_units), order))
        for tensor, layout in pieces
        if layout is not REPLICA  # a group's replica does not depend on its heads' order
    ]


def unit_specs(block, state_keys) -> list[TensorSpec]:
    """Shape and dtype of what one unit of `block` sends: per parameter its slice, then one
    fp32 slice per `state_keys` entry (the order of payload(unit_tensors(...)), which with head
    units continues with replica_specs)."""
    specs = []
    for _, _, param, layout in block.unit_tensors():
        shape = layout.payload_shape(param.shape)
        specs.append(TensorSpec(shape, param.dtype, layout.axis))
        specs.extend(TensorSpec(shape, torch.float32, layout.axis) for _ in state_keys)
    return specs


def replica_specs(block, state_keys) -> list[TensorSpec]:
    """With head units, what a head that brings its group's K/V replica sends besides its own
    unit_specs: each replica tensor, then its `state_keys` entries. Empty with group units."""
    specs = []
    dtype = next(iter(block.unit_tensors()))[2].dtype
    for _, _, shape in block.replica_tensors():
        specs.append(TensorSpec(tuple(shape), dtype, 0))
        specs.extend(TensorSpec(tuple(shape), torch.float32, 0) for _ in state_keys)
    return specs
