"""Builds megatron-core's GPTModel (local layer spec) from Megatron-LM style arguments."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_block import get_num_layers_to_build

from .arguments import padded_vocab_size
from .spec import get_local_gpt_layer_spec, gpt_block_spec


def transformer_config(args) -> TransformerConfig:
    """The TransformerConfig Megatron-LM would derive from the same flags.

    Fusions that need apex or Transformer Engine are off, so CPU and GPU runs take the same
    code path (the path het-TP layers subclass).
    """
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        layernorm_epsilon=args.norm_epsilon,
        normalization=args.normalization,
        qk_layernorm=args.qk_layernorm,
        qk_l2_norm=args.qk_l2_norm,
        add_bias_linear=args.add_bias_linear,
        add_qkv_bias=args.add_qkv_bias,
        gated_linear_unit=args.swiglu,
        activation_func=_activation(args),
        rotary_interleaved=args.rotary_interleaved,
        init_method_std=args.init_method_std,
        embedding_init_method_std=args.embedding_init_method_std,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        sequence_parallel=args.sequence_parallel,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        params_dtype=args.params_dtype,
        pipeline_dtype=args.params_dtype,
        fp16=args.fp16,
        bf16=args.bf16,
        use_cpu_initialization=args.use_cpu_initialization,
        perform_initialization=True,
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        layernorm_zero_centered_gamma=args.apply_layernorm_1p,
        apply_query_key_layer_scaling=args.apply_query_key_layer_scaling,
        # Always: the unfused softmax stands in for the fused kernel, which computes in fp32
        # (--attention-softmax-in-fp32 is accepted, and changes nothing).
        attention_softmax_in_fp32=True,
        calculate_per_token_loss=args.calculate_per_token_loss,
        cross_entropy_loss_fusion=args.cross_entropy_loss_fusion,
        cuda_graph_scope=[],  # the default ("full") only triggers a deprecation warning
    )


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """megatron-core's squared ReLU without its torch.compile: a migration changes a rank's MLP
    width, and each new width would compile again inside the step the control loop times."""
    return torch.pow(F.relu(x), 2)


def _activation(args):
    if args.swiglu:
        return F.silu
    return squared_relu if args.squared_relu else F.gelu


def build_gpt_model(args, config: TransformerConfig, vocab_size: int, layer_spec=None) -> GPTModel:
    """GPTModel on the current device; `layer_spec` defaults to megatron-core's local spec
    (with norms that handle sequence parallelism, spec.TorchNorm).

    `vocab_size` is the tokenizer's; it is padded as Megatron-LM pads it.
    """
    if layer_spec is None:
        layer_spec = get_local_gpt_layer_spec(
            args.normalization, args.qk_layernorm, args.qk_l2_norm
        )
    model = GPTModel(
        config=config,
        # this pipeline stage's layers (megatron-core numbers them from the stage's offset)
        transformer_layer_spec=gpt_block_spec(layer_spec, get_num_layers_to_build(config)),
        vocab_size=padded_vocab_size(
            vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size
        ),
        max_sequence_length=args.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor or 8.0,  # megatron-core's default
        seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


def unwrap_model(module):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(module, "module"):
        module = module.module
    return module
