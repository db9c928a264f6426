"""The het-TP layer spec: megatron-core's local GPT layer spec with the TP modules swapped for
their unit-sharded subclasses (megatron-core's own way to extend a model)."""

from __future__ import annotations

import copy
import logging

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec

from .layers import (
    HetColumnParallelLinear,
    HetMLP,
    HetRowParallelLinear,
    HetSelfAttention,
    SDPACoreAttention,
)


class _KnownMLPFilter(logging.Filter):
    """TransformerLayer warns about any MLP class it does not know by name; HetMLP is an MLP
    and takes MLP's arguments, so that warning is noise."""

    def filter(self, record):
        return "Unknown MLP type" not in record.getMessage()


logging.getLogger("megatron.core.transformer.transformer_layer").addFilter(_KnownMLPFilter())


def get_het_gpt_layer_spec(normalization: str = "LayerNorm", mlp_unit_size: int = 1) -> ModuleSpec:
    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization=normalization))
    attention = spec.submodules.self_attention
    attention.module = HetSelfAttention
    attention.submodules.linear_qkv = HetColumnParallelLinear
    attention.submodules.core_attention = SDPACoreAttention
    attention.submodules.linear_proj = HetRowParallelLinear
    mlp = spec.submodules.mlp
    mlp.module = HetMLP
    mlp.params = {**(mlp.params or {}), "unit_size": mlp_unit_size}
    mlp.submodules.linear_fc1 = HetColumnParallelLinear
    mlp.submodules.linear_fc2 = HetRowParallelLinear
    return spec
