"""Model FLOPs of a dense GPT step, Megatron-LM's count (--log-throughput).

Per token: forward and backward (3x) of every GEMM at 2 FLOPs per multiply-add: the MLP, the
attention projections, the attention scores and their use on the values (half of them, under
the causal mask), and the logits. Norms, softmax and element-wise work are left out, as
Megatron-LM does, so figures compare with its logs.
"""

from __future__ import annotations


def model_flops_per_sample(args, vocab_size: int) -> float:
    """flops_per_sample of the tokenizer's `vocab_size`, padded as the model pads it."""
    from .arguments import padded_vocab_size

    return flops_per_sample(
        args,
        padded_vocab_size(
            vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size
        ),
    )


def flops_per_sample(args, padded_vocab_size: int) -> float:
    """FLOPs of one sample (sequence) through forward and backward."""
    h, s, layers = args.hidden_size, args.seq_length, args.num_layers
    groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
    query = args.kv_channels * args.num_attention_heads
    key_value = 2 * args.kv_channels * groups
    mlp = h * args.ffn_hidden_size * (3 if args.swiglu else 2)
    attention = h * (query + key_value) + query * s + query * h  # scores: s/2 twice
    logits = h * padded_vocab_size
    return 3 * 2 * s * (layers * (mlp + attention) + logits)
