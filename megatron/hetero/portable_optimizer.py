"""Checkpoints of the distributed optimizer in the plain optimizer's layout.

megatron-core saves a DistributedOptimizer's state as flattened DP ranges of each parameter
('fully_sharded_model_space'); het-TP's unit-sharded weights are saved as a piece per stretch
of unit ids a rank holds, which a flat range of a rank's uneven shard does not map onto. So
this trainer saves what the non-distributed optimizer would: whole fp32 masters and moments
per parameter, sharded like the weights. A checkpoint then loads under any plan, TP size or
DP size, with or without --use-distributed-optimizer, het-TP or vanilla. The cost: while
saving or loading, each rank holds the whole optimizer state of its TP shard once more (the
memory the distributed optimizer saves otherwise), and one all-reduce over the DP group
gathers it.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

from megatron.core.optimizer import get_megatron_optimizer

from .unit_state import OptimizerView, carry_group_steps, carry_into, whole_state

# Parameter-group values the flags set (the rates --lr and --decoupled-lr give each group, Adam's
# constants); the scheduler derives each group's lr and weight decay from them every step.
FLAG_GROUP_KEYS = ("max_lr", "min_lr", "betas", "eps")


def saved_param_groups(state) -> list | None:
    """The parameter groups in a checkpoint's (common) optimizer state, wherever megatron-core's
    wrapper put them: at the top (fp32), under "optimizer" (half precision), per optimizer of a
    chain (a dict by index). None where they are not found."""
    if not isinstance(state, dict):
        return None
    if isinstance(state.get("param_groups"), list):
        return state["param_groups"]
    if isinstance(state.get("optimizer"), dict):
        return saved_param_groups(state["optimizer"])
    chained = [state[k] for k in sorted(k for k in state if isinstance(k, int))]
    found = [saved_param_groups(s) for s in chained]
    if not found or any(f is None for f in found):
        return None
    return [group for groups in found for group in groups]


def set_group_values(optimizer, groups) -> None:
    """`groups`' flag-set values (FLAG_GROUP_KEYS) onto `optimizer`'s parameter groups, in
    order: the same model and code build them alike."""
    live = optimizer.param_groups
    if len(live) != len(groups):
        raise ValueError(f"{len(groups)} parameter groups to take values from, {len(live)} here")
    for group, values in zip(live, groups):
        group.update({k: values[k] for k in FLAG_GROUP_KEYS if k in values})


def is_distributed(optimizer) -> bool:
    return bool(OptimizerView(optimizer).sharded)


def checkpoint_optimizer(optimizer, model, *, is_loading: bool):
    """The optimizer whose sharded_state_dict a checkpoint holds: `optimizer` itself, or under
    the distributed optimizer a non-distributed twin over the same model, carrying `optimizer`'s
    whole state when saving (collective over each DP group)."""
    if not is_distributed(optimizer):
        return optimizer
    config = dataclasses.replace(optimizer.config, use_distributed_optimizer=False)
    with _handles_kept(model):
        twin = get_megatron_optimizer(config, [model])
    if not is_loading:
        # built from the flags, the twin's groups must take the rates training used (a run
        # resumed with --use-checkpoint-opt_param-scheduler took its checkpoint's)
        if len(twin.param_groups) == len(optimizer.param_groups):  # one model, one code
            set_group_values(twin, optimizer.param_groups)
        view = OptimizerView(optimizer)
        view.gather()
        carry_into(twin, whole_state(view))
        carry_group_steps(optimizer, twin)
        _copy_scalers(optimizer, twin)
    return twin


# What megatron-core's optimizers hang on the model parameters: building the twin would replace
# the distributed optimizer's handles with its own (whole fp32 copies that would then outlive
# the twin, undoing the memory the distributed optimizer saves).
_HANDLES = ("main_param", "main_param_sharded")


@contextmanager
def _handles_kept(model):
    params = list(model.parameters())
    kept = [{k: p.__dict__[k] for k in _HANDLES if k in p.__dict__} for p in params]
    try:
        yield
    finally:
        for param, handles in zip(params, kept):
            for key in _HANDLES:
                param.__dict__.pop(key, None)
            param.__dict__.update(handles)


def restore_from(twin, optimizer) -> None:
    """After `twin` (from checkpoint_optimizer) loaded a checkpoint: its state into this DP
    rank's ranges of the distributed `optimizer`."""
    if twin is optimizer:
        return
    carry_into(optimizer, whole_state(OptimizerView(twin)))
    carry_group_steps(twin, optimizer)
    _copy_scalers(twin, optimizer)


def _copy_scalers(source, target) -> None:
    """The loss scaler (fp16) travels with the optimizer state."""
    for src, dst in zip(
        getattr(source, "chained_optimizers", [source]),
        getattr(target, "chained_optimizers", [target]),
    ):
        if getattr(src, "grad_scaler", None) is not None:
            dst.grad_scaler = src.grad_scaler
