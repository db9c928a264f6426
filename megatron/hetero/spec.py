"""Layer specs: megatron-core's local GPT layer spec with its torch norms made sequence-parallel
capable (vanilla and het-TP alike), and the het-TP spec, which also swaps the TP modules for
their unit-sharded subclasses (megatron-core's own way to extend a model)."""

from __future__ import annotations

import copy
import logging

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import transformer_block
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from .layers import (
    HetColumnParallelLinear,
    HetDotProductAttention,
    HetMLP,
    HetQKVLinear,
    HetRowParallelLinear,
    HetSelfAttention,
)


class _KnownMLPFilter(logging.Filter):
    """TransformerLayer warns about any MLP class it does not know by name; HetMLP is an MLP
    and takes MLP's arguments, so that warning is noise."""

    def filter(self, record):
        return "Unknown MLP type" not in record.getMessage()


logging.getLogger("megatron.core.transformer.transformer_layer").addFilter(_KnownMLPFilter())


class LayerNorm1P(torch.nn.LayerNorm):
    """--apply-layernorm-1p: the weight is stored zero-centred (it starts at 0 and scales by
    1 + weight), as Megatron-LM's LayerNorm1P."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.weight is not None:
            torch.nn.init.zeros_(self.weight)

    def forward(self, x):
        return torch.nn.functional.layer_norm(
            x, self.normalized_shape, self.weight + 1, self.bias, self.eps
        )


class RMSNorm1P(torch.nn.RMSNorm):
    """RMSNorm with a zero-centred weight (--apply-layernorm-1p with --normalization RMSNorm)."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.weight is not None:
            torch.nn.init.zeros_(self.weight)

    def forward(self, x):
        return torch.nn.functional.rms_norm(x, self.normalized_shape, self.weight + 1, self.eps)


class TorchNorm:
    """megatron-core's WrappedTorchNorm (torch's LayerNorm or RMSNorm, same parameters and
    initialisation), also under sequence parallelism, which WrappedTorchNorm refuses: there each
    TP rank normalises its part of the sequence with replicated weights, so the weights are
    marked `sequence_parallel` and finalize_model_grads all-reduces their gradients over the TP
    group, as apex's FusedLayerNorm marks its own."""

    def __new__(
        cls,
        config,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ):
        if getattr(config, "persist_layer_norm", False):
            raise ValueError("persist_layer_norm is not supported by torch's norms")
        if config.layernorm_zero_centered_gamma:
            norms = {"LayerNorm": LayerNorm1P, "RMSNorm": RMSNorm1P}
        else:
            norms = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in norms:
            raise ValueError(f"normalization {config.normalization!r}: LayerNorm or RMSNorm")
        norm = norms[config.normalization](normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


_NORMS = ("input_layernorm", "pre_mlp_layernorm")
# --qk-layernorm: per-head norms of the queries and keys, over the head dimension. Their
# weights are replicated over the TP group and each rank's gradient covers its own heads:
# finalize_model_grads sums them over the group by name (megatron-core's rule, which stays
# right when the ranks hold unequal numbers of heads).
_QK_NORMS = ("q_layernorm", "k_layernorm")


def _with_torch_norms(spec: ModuleSpec) -> ModuleSpec:
    """`spec` with megatron-core's WrappedTorchNorm (used where apex is absent) replaced by
    TorchNorm; apex's and Transformer Engine's norms already handle sequence parallelism."""
    spec = copy.deepcopy(spec)
    attention = spec.submodules.self_attention.submodules
    for owner, names in ((spec.submodules, _NORMS), (attention, _QK_NORMS)):
        for name in names:
            if getattr(owner, name, None) is WrappedTorchNorm:
                setattr(owner, name, TorchNorm)
    return spec


def get_local_gpt_layer_spec(
    normalization: str = "LayerNorm", qk_layernorm: bool = False, qk_l2_norm: bool = False
) -> ModuleSpec:
    """megatron-core's local GPT layer spec, sequence-parallel capable (`qk_l2_norm`: the
    query/key norm is megatron-core's parameter-free L2Norm, ahead of `qk_layernorm`'s)."""
    return _with_torch_norms(
        get_gpt_layer_local_spec(
            normalization=normalization, qk_layernorm=qk_layernorm, qk_l2_norm=qk_l2_norm
        )
    )


def gpt_block_spec(layer_spec: ModuleSpec, num_layers: int) -> TransformerBlockSubmodules:
    """The decoder block GPTModel builds from `layer_spec`, with the final layernorm made
    sequence-parallel capable like the layers' (GPTModel builds the same from a layer spec
    alone, with megatron-core's default norm)."""
    final = transformer_block.LayerNormImpl
    return TransformerBlockSubmodules(
        layer_specs=[layer_spec] * num_layers,
        layer_norm=TorchNorm if final is WrappedTorchNorm else final,
    )


def get_het_gpt_layer_spec(
    normalization: str = "LayerNorm",
    mlp_unit_size: int = 1,
    attn_head_units: int = 0,
    qk_layernorm: bool = False,
    qk_l2_norm: bool = False,
) -> ModuleSpec:
    """`attn_head_units`: query heads per attention unit (0: a whole query group)."""
    spec = get_local_gpt_layer_spec(normalization, qk_layernorm, qk_l2_norm)
    attention = spec.submodules.self_attention
    attention.module = HetSelfAttention
    attention.params = {**(attention.params or {}), "head_units": attn_head_units}
    attention.submodules.linear_qkv = HetQKVLinear
    attention.submodules.core_attention = HetDotProductAttention
    attention.submodules.linear_proj = HetRowParallelLinear
    mlp = spec.submodules.mlp
    mlp.module = HetMLP
    mlp.params = {**(mlp.params or {}), "unit_size": mlp_unit_size}
    mlp.submodules.linear_fc1 = HetColumnParallelLinear
    mlp.submodules.linear_fc2 = HetRowParallelLinear
    return spec
