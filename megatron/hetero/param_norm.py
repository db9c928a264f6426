"""Megatron-LM's --log-params-norm: the L2 norm of the weights, each element counted once.

The optimizer's copy is measured (fp32 masters under --bf16/--fp16; under the distributed
optimizer each data-parallel rank's range of them, summed over the replicas), as Megatron-LM
measures it. Each element is counted once over the model-parallel group: tensor-parallel
duplicates count on TP rank 0 (megatron-core's mark), and a K/V replica that is not its
group's main one (head units) is marked shared, as for the gradient norm.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared

from .partition import comm_device
from .unit_state import OptimizerView, held_params


def params_l2_norm(optimizer) -> float:
    """The norm over the whole model, the same on every rank (collective over the
    data-parallel groups of distributed optimizers, then over the model-parallel group)."""
    view = OptimizerView(optimizer)
    device = comm_device()
    total = torch.zeros(1, dtype=torch.float64, device=device)
    for param, main in view.main.items():  # optimizers that hold whole tensors
        if _counted(param):
            total += _squares(main)
    for sub in view.sharded:  # each element is in one data-parallel rank's range
        ranges = torch.zeros(1, dtype=torch.float64, device=device)
        for param in held_params(sub):
            tensor, _ = view.shard_of(param, "master")
            if tensor is not None and _counted(param):
                ranges += _squares(tensor)
        dist.all_reduce(ranges, group=sub.data_parallel_group)
        total += ranges
    dist.all_reduce(total, group=parallel_state.get_model_parallel_group())
    return math.sqrt(total.item())


def _counted(param) -> bool:
    return param_is_not_tensor_parallel_duplicate(param) and param_is_not_shared(param)


def _squares(tensor) -> torch.Tensor:
    return tensor.detach().double().square().sum()
