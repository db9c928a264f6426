"""Per-unit tensors and the optimizer state that travels with them.

A unit's share of a sharded parameter never goes anywhere alone: its fp32 master copy (under
--bf16/--fp16) and its optimizer moments must move, be reordered or be frozen with it, or
training would leave the trajectory it was on. Migration (partition.py) moves and permutes
them; resizing (resize.py) freezes a skipped suffix of them. Both see megatron-core's optimizer
and a block's units the same way, through this module.
"""

from __future__ import annotations

import torch
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer

from hettp.exchange import TensorSpec


class OptimizerView:
    """What megatron-core's (possibly chained) optimizer holds per model parameter: the tensor
    it updates (the parameter itself, or its fp32 master copy under --bf16/--fp16) and that
    tensor's state (Adam's moments, step)."""

    def __init__(self, optimizer):
        self.subs = list(getattr(optimizer, "chained_optimizers", [optimizer]))
        self.main = {}  # model parameter -> the tensor the optimizer updates
        for sub in self.subs:
            if isinstance(sub, FP32Optimizer):
                self.main.update((p, p) for g in sub.optimizer.param_groups for p in g["params"])
            elif isinstance(sub, Float16OptimizerWithFloat16Params):
                for model_group, main_group in zip(
                    sub.float16_groups, sub.fp32_from_float16_groups
                ):
                    self.main.update(zip(model_group, main_group))
                self.main.update((p, p) for g in sub.fp32_from_fp32_groups for p in g)
            else:
                raise NotImplementedError(
                    f"het-TP migration supports megatron-core's FP32Optimizer and "
                    f"Float16OptimizerWithFloat16Params, not {type(sub).__name__} "
                    "(e.g. the distributed optimizer)"
                )
        states = {m: s for sub in self.subs for m, s in sub.optimizer.state.items()}
        self.state = {p: states.get(m, {}) for p, m in self.main.items()}

    def master(self, param):
        """The fp32 master copy of `param`, or None when the optimizer updates `param` itself."""
        main = self.main[param]
        return None if main is param else main


def state_keys(optimizer, blocks) -> list[str]:
    """What moves with a unit besides the weights: "master" (fp32 copy under mixed precision)
    and the optimizer state tensors shaped like the parameter (e.g. exp_avg, exp_avg_sq)."""
    if optimizer is None:
        return []
    param = next(iter(blocks.values())).unit_tensors().__next__()[2]
    keys = ["master"] if optimizer.master(param) is not None else []
    return keys + sorted(
        k
        for k, v in optimizer.state[param].items()
        if isinstance(v, torch.Tensor) and v.shape == param.shape
    )


def unit_tensors(block, optimizer, state_keys):
    """(tensor, layout) per unit-sharded parameter, each followed by its `state_keys` tensors."""
    out = []
    for _, _, param, layout in block.unit_tensors():
        out.append((param.data, layout))
        for key in state_keys:
            extra = optimizer.master(param) if key == "master" else optimizer.state[param][key]
            out.append((extra.data if key == "master" else extra, layout))
    return out


def payload(pieces, num_local_units, position):
    """A unit's slice of every (tensor, layout) in `pieces`."""
    return [layout.payload(tensor, num_local_units, position) for tensor, layout in pieces]


def run_payload(pieces, num_local_units, positions):
    """The units at `positions` of every (tensor, layout) in `pieces`, joined along each
    layout's axis (views where they are consecutive): what hettp.exchange sends for a run."""
    return [layout.run(tensor, num_local_units, positions) for tensor, layout in pieces]


def permute(pieces, old_units, new_units):
    """Put every (tensor, layout) of `pieces` into the order `new_units`, in place."""
    position = {u: i for i, u in enumerate(old_units)}
    order = [position[u] for u in new_units]
    for tensor, layout in pieces:
        tensor.copy_(layout.permuted(tensor, len(old_units), order))


def unit_specs(block, state_keys) -> list[TensorSpec]:
    """Shape and dtype of what one unit of `block` sends: per parameter its slice, then one
    fp32 slice per `state_keys` entry (the order of payload(unit_tensors(...)))."""
    specs = []
    for _, _, param, layout in block.unit_tensors():
        shape = layout.payload_shape(param.shape)
        specs.append(TensorSpec(shape, param.dtype, layout.axis))
        specs.extend(TensorSpec(shape, torch.float32, layout.axis) for _ in state_keys)
    return specs
