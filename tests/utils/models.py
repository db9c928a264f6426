"""Model flags the tests share, and the tolerance numerics are compared with."""

from __future__ import annotations

import torch

# The smallest valid model for flag parsing and validation
BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--micro-batch-size 2 --train-iters 10 --lr 1e-3 --mock-data --vocab-size 255"
    " --eval-iters 0"  # as Megatron-LM, a finished run evaluates: tests that check it say so
)

COMMON = (
    "--num-layers 2 --hidden-size 64 --seq-length 32 --micro-batch-size 2 "
    "--mock-data --vocab-size 255 --make-vocab-size-divisible-by 64 "
    "--hidden-dropout 0 --attention-dropout 0 --lr 1e-3 --train-iters 1 --eval-iters 0"
)
# MHA, GELU, biases: 4 query groups of 1 head; 256 ffn neurons
MHA = COMMON + " --num-attention-heads 4"
# GQA (8 heads in 4 groups), SwiGLU, no biases, RoPE, RMSNorm; ffn 128 in units of 2
GQA = (
    COMMON + " --num-attention-heads 8 --group-query-attention --num-query-groups 4 --swiglu"
    " --ffn-hidden-size 128 --disable-bias-linear --position-embedding-type rope"
    " --normalization RMSNorm --het-tp-granularity 2"
)

# The autograd node of megatron-core's column-parallel GEMM (its input-gradient all-reduce runs
# while the weight gradient's GEMM does)
GEMM_BACKWARD = "LinearWithGradAccumulationAndAsyncCommunicationBackward"


def close(got, want, what):
    scale = want.abs().max().item() or 1.0
    torch.testing.assert_close(
        got, want, rtol=1e-5, atol=1e-5 * scale, msg=lambda m: f"{what}: {m}"
    )
