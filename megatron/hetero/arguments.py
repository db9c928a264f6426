"""Megatron-LM's command-line flags (the subset hettp supports), with Megatron's names, defaults
and validation.

Validation runs before any process group or model exists, so a bad flag costs nothing: the
process prints `pretrain_gpt.py: error: <flag>: <why>` and exits with status 2, like argparse.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import json
import math
import os
import re
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hettp.config import ConfigError, HetTPConfig, ModelShape
from megatron.hetero.batch_schedule import BatchSchedule, Rampup
from megatron.hetero.megatron_lm_flags import FLAGS as MEGATRON_LM_FLAGS
from megatron.hetero.megatron_lm_flags import VERSION as MEGATRON_LM_VERSION
from megatron.hetero.stopping import EXIT_SIGNALS

TOKENIZER_TYPES = (
    "NullTokenizer",
    "ByteLevelTokenizer",
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "TikTokenizer",
)
# the ones whose --tokenizer-model is one file (SentencePiece's .model, tiktoken's .json)
_MODEL_FILE_TOKENIZERS = TOKENIZER_TYPES[4:]
BYTE_LEVEL_VOCAB_SIZE = 256  # byte values; byte 0 (NUL) doubles as end-of-document


class ArgumentError(ValueError):
    """A flag has a bad value or contradicts another flag."""


def build_parser(extra_args_provider=None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pretrain_gpt.py",
        description="GPT pretraining on megatron-core with heterogeneous tensor parallelism.",
        allow_abbrev=False,
    )
    _add_network_args(parser)
    _add_regularization_args(parser)
    _add_training_args(parser)
    _add_learning_rate_args(parser)
    _add_distributed_args(parser)
    _add_mixed_precision_args(parser)
    _add_data_args(parser)
    _add_validation_args(parser)
    _add_logging_args(parser)
    _add_checkpointing_args(parser)
    _add_not_supported_args(parser)
    HetTPConfig.add_arguments(parser)
    if extra_args_provider is not None:
        extra_args_provider(parser)
    return parser


@dataclass(frozen=True)
class RefusedFlag:
    """A Megatron-LM flag that launch scripts carry and this trainer cannot honour yet: parsed
    with Megatron-LM's syntax, then refused by name with the reason, never silently ignored."""

    flag: str
    options: dict  # argparse's add_argument keywords
    reason: str
    refused: Callable = bool  # of the parsed value

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")


REFUSED_FLAGS = (
    RefusedFlag(
        "--fp8-param-gather",
        {"action": "store_true"},
        "FP8 needs Transformer Engine, which hettp's layers do not use yet",
    ),
    RefusedFlag(
        "--transformer-impl",
        {"default": "local", "choices": ["local", "transformer_engine"]},
        "Transformer Engine layers are not supported yet (hettp's het-TP layers subclass "
        "megatron-core's local ones); pass --transformer-impl local",
        lambda value: value != "local",
    ),
    RefusedFlag(
        "--fp8-format",
        {"default": None, "choices": ["e4m3", "hybrid"]},
        "FP8 needs Transformer Engine layers, which are not supported yet",
        lambda value: value is not None,
    ),
    RefusedFlag(
        "--spec",
        {"nargs": "*", "default": None},
        "hettp builds megatron-core's local layer spec (het-TP swaps its own modules in)",
        lambda value: value is not None,
    ),
    RefusedFlag(
        "--cuda-graph-impl",
        {"default": "none", "choices": ["none", "local", "transformer_engine"]},
        "CUDA graphs are not supported (a migration replaces the captured layers)",
        lambda value: value != "none",
    ),
)


def _add_not_supported_args(parser):
    g = parser.add_argument_group(
        "Megatron-LM flags not supported yet", "Accepted by name, refused with the reason."
    )
    for refused in REFUSED_FLAGS:
        g.add_argument(refused.flag, **refused.options)


def _check_refused_flags(args) -> None:
    for refused in REFUSED_FLAGS:
        value = getattr(args, refused.dest)
        if refused.refused(value):
            if isinstance(value, bool):
                shown = ""
            elif isinstance(value, list):
                shown = "".join(f" {v}" for v in value)
            else:
                shown = f" {value}"
            raise ArgumentError(f"{refused.flag}{shown}: {refused.reason}")


def _add_network_args(parser):
    g = parser.add_argument_group("network size")
    # the sizes are required (_check_required_flags), unless --use-checkpoint-args gives them
    g.add_argument("--num-layers", type=int, default=None)
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument(
        "--ffn-hidden-size",
        type=int,
        default=None,
        help="Default: 4 x hidden size (or 8/3 x, rounded to 64, with --swiglu).",
    )
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument(
        "--kv-channels",
        type=int,
        default=None,
        help="Projection size per head. Default: hidden size / attention heads.",
    )
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=1)
    g.add_argument("--seq-length", type=int, default=None)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument(
        "--position-embedding-type",
        default="learned_absolute",
        choices=["learned_absolute", "rope", "none"],
    )
    g.add_argument(
        "--no-position-embedding",
        action="store_false",
        dest="add_position_embedding",
        help="Megatron-LM's older spelling: only with --position-embedding-type rope (or "
        "none), which add no position embedding (use --position-embedding-type).",
    )
    g.add_argument(
        "--use-rotary-position-embeddings",
        action="store_true",
        help="Megatron-LM's older spelling of --position-embedding-type rope.",
    )
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument(
        "--rotary-interleaved",
        action="store_true",
        help="Rotate interleaved pairs of channels (GPT-J style) rather than halves.",
    )
    g.add_argument(
        "--rotary-seq-len-interpolation-factor",
        type=int,
        default=None,
        help="Divide rotary positions by this factor (position interpolation).",
    )
    g.add_argument(
        "--use-rope-scaling",
        action="store_true",
        help="Llama 3.x's scaling of the rotary frequencies (by --rope-scaling-factor).",
    )
    g.add_argument(
        "--rope-scaling-factor",
        type=float,
        default=None,
        help="With --use-rope-scaling: the factor (default 8, Llama 3.1's).",
    )
    g.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument(
        "--squared-relu",
        action="store_true",
        help="relu(x)^2 as the MLP's activation instead of GELU (not with --swiglu).",
    )
    g.add_argument(
        "--add-qkv-bias",
        action="store_true",
        help="A bias on the query, key and value projections alone (with "
        "--disable-bias-linear; Qwen2-style); implied by biases on every linear.",
    )
    g.add_argument(
        "--qk-layernorm",
        action="store_true",
        help="Normalise each query and key head (--normalization's kind) before attention.",
    )
    g.add_argument(
        "--qk-l2-norm",
        action="store_true",
        help="Normalise each query and key head by its root mean square, with no weights "
        "(megatron-core's L2Norm; it replaces --qk-layernorm's norms).",
    )
    g.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument(
        "--embedding-init-method-std",
        type=float,
        default=None,
        help="The embeddings' initial standard deviation (default --init-method-std).",
    )
    g.add_argument(
        "--apply-query-key-layer-scaling",
        action="store_true",
        help="Scale attention scores down by the layer number before the fp32 softmax and back "
        "inside it (headroom for --fp16).",
    )
    g.add_argument(
        "--attention-softmax-in-fp32",
        action="store_true",
        help="Accepted for Megatron-LM's scripts: the attention softmax always runs in fp32 "
        "here (the unfused softmax stands in for the fused kernel, which computes in fp32).",
    )
    g.add_argument(
        "--apply-layernorm-1p",
        action="store_true",
        help="Zero-centred norm weights: the norm multiplies by (1 + weight), weights start at 0.",
    )
    g.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "flash", "fused", "unfused", "local"],
        help="Core attention: auto, unfused and local run megatron-core's (and het-TP's) "
        "unfused attention; flash and fused are Transformer Engine's.",
    )
    g.add_argument(
        "--use-mcore-models",
        action="store_true",
        help="Accepted for Megatron-LM's scripts: megatron-core models are the only ones here.",
    )


def _add_regularization_args(parser):
    g = parser.add_argument_group("regularization")
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument(
        "--weight-decay-incr-style",
        default="constant",
        choices=["constant", "linear", "cosine"],
        help="How the weight decay goes from --start-weight-decay to --end-weight-decay over "
        "the run (constant: --weight-decay throughout).",
    )
    g.add_argument("--start-weight-decay", type=float, default=None)
    g.add_argument("--end-weight-decay", type=float, default=None)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)


def _add_training_args(parser):
    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=None)  # required
    g.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="Default: micro batch size x data-parallel size.",
    )
    g.add_argument(
        "--train-iters",
        type=int,
        default=None,
        help="Iterations to train (or --train-samples).",
    )
    g.add_argument(
        "--train-samples",
        type=int,
        default=None,
        help="Samples to train: --train-samples / --global-batch-size iterations; the learning "
        "rate schedule then counts samples (--lr-decay-samples, --lr-warmup-samples).",
    )
    g.add_argument(
        "--rampup-batch-size",
        type=int,
        nargs=3,
        default=None,
        metavar=("START", "INCREMENT", "SAMPLES"),
        help="Grow the global batch from START by INCREMENT, in equal shares of the first SAMPLES "
        "samples, up to --global-batch-size (with --train-samples only, as Megatron-LM). Every "
        "change of the micro-batch count is checkpointed when --save is given.",
    )
    g.add_argument("--optimizer", default="adam", choices=["adam", "sgd"])
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument(
        "--use-cpu-initialization",
        action="store_true",
        default=None,
        help="Build full weights on the CPU, then shard them (always on for CPU runs). "
        "Makes initial weights independent of the TP size.",
    )
    g.add_argument(
        "--recompute-activations",
        action="store_true",
        help="Same as --recompute-granularity selective (Megatron-LM's shorthand).",
    )
    g.add_argument(
        "--recompute-granularity",
        default=None,
        choices=["full", "selective"],
        help="Recompute activations in the backward pass: whole layers (full, with "
        "--recompute-method and --recompute-num-layers) or the core attention (selective).",
    )
    g.add_argument(
        "--recompute-method",
        default=None,
        choices=["uniform", "block"],
        help="With --recompute-granularity full: recompute groups of --recompute-num-layers "
        "layers each (uniform), or the first --recompute-num-layers layers (block).",
    )
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument(
        "--exit-duration-in-mins",
        type=float,
        default=None,
        help="Save (with --save) and exit once training has run this long.",
    )
    g.add_argument(
        "--exit-signal-handler",
        action="store_true",
        help="On --exit-signal (to any rank): finish the step, save (with --save), exit 0.",
    )
    g.add_argument(
        "--exit-signal",
        default="SIGTERM",
        choices=EXIT_SIGNALS,
        help="The signal --exit-signal-handler acts on (Slurm's --signal=USR1@120: SIGUSR1).",
    )
    g.add_argument(
        "--calculate-per-token-loss",
        action="store_true",
        help="Average the loss over all tokens of the global batch (Megatron-LM's), not per "
        "micro-batch.",
    )
    g.add_argument(
        "--cross-entropy-loss-fusion",
        action="store_true",
        help="megatron-core's fused vocab-parallel cross entropy (GPU).",
    )
    for fusion in NEVER_FUSED:  # Megatron-LM's scripts pass these; here they ask for the default
        g.add_argument(
            f"--no-{fusion}",
            action="store_true",
            help="Accepted as Megatron-LM's: this trainer never uses that fused kernel.",
        )
    g.add_argument(
        "--manual-gc",
        action="store_true",
        help="Disable Python's automatic garbage collection; collect every "
        "--manual-gc-interval iterations (0: only around evaluation).",
    )
    g.add_argument("--manual-gc-interval", type=int, default=0)
    g.add_argument(
        "--no-manual-gc-eval",
        "--disable-manual-gc-eval",
        action="store_false",
        dest="manual_gc_eval",
        help="With --manual-gc: do not collect before and after evaluation.",
    )
    g.add_argument(
        "--empty-unused-memory-level",
        type=int,
        default=0,
        choices=[0, 1, 2],
        help="Release cached GPU memory: 1 after each forward-backward and evaluation, 2 also "
        "after each optimizer step (Megatron-LM's levels); nothing to release on CPU.",
    )
    g.add_argument(
        "--no-check-for-nan-in-loss-and-grad",
        action="store_false",
        dest="check_for_nan_in_loss_and_grad",
        help="Train on when the loss or gradient norm is NaN or Inf (by default the run "
        "stops there, non-zero, before anything is saved).",
    )


def _add_learning_rate_args(parser):
    g = parser.add_argument_group("learning rate")
    g.add_argument("--lr", type=float, default=None)  # required
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument(
        "--lr-decay-style",
        default="linear",
        choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
    )
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-decay-samples", type=int, default=None)
    g.add_argument(
        "--lr-wsd-decay-style",
        default="exponential",
        choices=["exponential", "linear", "cosine", "minus_sqrt"],
        help="WSD (warmup, stable, decay): the shape of the final decay to --min-lr.",
    )
    g.add_argument(
        "--lr-wsd-decay-iters",
        type=int,
        default=None,
        help="WSD: iterations of the final decay, which ends with --lr-decay-iters.",
    )
    g.add_argument(
        "--lr-wsd-decay-samples",
        type=int,
        default=None,
        help="WSD: samples of the final decay, which ends with --lr-decay-samples.",
    )
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-samples", type=int, default=0)
    g.add_argument(
        "--lr-warmup-fraction",
        type=float,
        default=None,
        help="Warm-up as a fraction of the decay (instead of --lr-warmup-iters/-samples).",
    )
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument(
        "--override-opt_param-scheduler",
        "--override-opt-param-scheduler",
        action="store_true",
        help="On --load, take the learning-rate and weight-decay schedule from this run's flags "
        "(by default a schedule that differs from the checkpoint's is refused).",
    )
    g.add_argument(
        "--use-checkpoint-opt_param-scheduler",
        "--use-checkpoint-opt-param-scheduler",
        action="store_true",
        help="On --load, keep the checkpoint's learning-rate and weight-decay schedule, "
        "whatever this run's flags say.",
    )
    g.add_argument(
        "--decoupled-lr",
        type=float,
        default=None,
        help="Learning rate of the input embedding and output layer (default: --lr).",
    )
    g.add_argument(
        "--decoupled-min-lr",
        type=float,
        default=None,
        help="Minimum learning rate of those (default: --min-lr).",
    )


# Megatron-LM's seeding: pipeline stage p seeds with --seed + SEED_STRIDE x p (training.set_seed).
SEED_STRIDE = 100

# The fused kernels megatron-core's model runs without here (megatron/hetero/model.py), whose
# --no-* flags Megatron-LM command lines carry.
NEVER_FUSED = (
    "gradient-accumulation-fusion",
    "masked-softmax-fusion",
    "bias-gelu-fusion",
    "bias-swiglu-fusion",
    "bias-dropout-fusion",
    "persist-layer-norm",
    "rope-fusion",
)


def _add_distributed_args(parser):
    g = parser.add_argument_group("distributed")
    g.add_argument(
        "--local-rank",
        type=int,
        default=None,
        help="This process's GPU on its node (torch.distributed.launch passes it); default "
        "the LOCAL_RANK variable torchrun sets, else 0.",
    )
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument(
        "--decoder-first-pipeline-num-layers",
        type=int,
        default=None,
        help="Layers of the first pipeline stage (default: an even split over the stages).",
    )
    g.add_argument(
        "--decoder-last-pipeline-num-layers",
        type=int,
        default=None,
        help="Layers of the last pipeline stage (default: an even split over the stages).",
    )
    g.add_argument(
        "--distributed-backend",
        default=None,
        choices=["nccl", "gloo"],
        help="Default: nccl with CUDA, gloo without.",
    )
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)
    g.add_argument(
        "--context-parallel-size",
        type=int,
        default=1,
        help="Only 1: context parallelism is not supported.",
    )
    g.add_argument(
        "--grad-reduce-in-bf16",
        action="store_true",
        help="With --bf16: reduce gradients over data-parallel ranks in bf16 (default fp32).",
    )
    g.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="Split layernorm, dropout and the residual stream along the sequence over the TP "
        "group (Megatron-LM's): all-gather before the column-parallel GEMMs, reduce-scatter "
        "after the row-parallel ones. Ignored, as in Megatron-LM, at TP size 1.",
    )
    g.add_argument(
        "--overlap-grad-reduce",
        action="store_true",
        help="Start each gradient bucket's data-parallel all-reduce during the backward pass.",
    )
    g.add_argument(
        "--ddp-bucket-size",
        type=int,
        default=None,
        help="Elements per gradient bucket with --overlap-grad-reduce (default: "
        "megatron-core's, max(40M, 1M x data-parallel size)).",
    )
    g.add_argument(
        "--use-distributed-optimizer",
        action="store_true",
        help="Shard the fp32 master weights and optimizer state over the data-parallel ranks "
        "(megatron-core's DistributedOptimizer); gradients are reduce-scattered, parameters "
        "all-gathered.",
    )
    g.add_argument(
        "--overlap-param-gather",
        action="store_true",
        help="Gather the updated parameters during the next forward pass instead of in the "
        "optimizer step (needs --use-distributed-optimizer and --overlap-grad-reduce).",
    )


def _add_mixed_precision_args(parser):
    g = parser.add_argument_group("mixed precision")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None)
    g.add_argument("--initial-loss-scale", type=float, default=2**32)
    g.add_argument(
        "--min-loss-scale",
        type=float,
        default=1.0,
        help="Dynamic loss scaling (--fp16): the scale is never lowered below this.",
    )
    g.add_argument(
        "--loss-scale-window",
        type=float,
        default=1000,
        help="Dynamic loss scaling: steps without an overflow before the scale doubles.",
    )
    g.add_argument(
        "--hysteresis",
        type=int,
        default=2,
        help="Dynamic loss scaling: overflows tolerated before the scale is halved.",
    )
    g.add_argument(
        "--accumulate-allreduce-grads-in-fp32",
        action="store_true",
        help="Accumulate and reduce gradients in fp32 (with --bf16 the default, unless "
        "--grad-reduce-in-bf16; with --fp16 they are fp16 without this flag).",
    )
    g.add_argument(
        "--fp8-amax-history-len",
        type=int,
        default=1,
        help="FP8 recipe (used with --fp8-format, which needs Transformer Engine).",
    )
    g.add_argument(
        "--fp8-amax-compute-algo",
        default="most_recent",
        choices=["most_recent", "max"],
        help="FP8 recipe (used with --fp8-format, which needs Transformer Engine).",
    )


def add_tokenizer_args(group, type_help: str | None = None) -> None:
    """The tokenizer flags, Megatron-LM's names (pretrain_gpt.py and preprocess_data.py)."""
    group.add_argument("--tokenizer-type", default=None, choices=TOKENIZER_TYPES, help=type_help)
    group.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer's vocab.json.")
    group.add_argument("--merge-file", default=None, help="GPT2BPETokenizer's merges.txt.")
    group.add_argument(
        "--tokenizer-model",
        default=None,
        help="HuggingFaceTokenizer: a local folder holding tokenizer.json; SentencePieceTokenizer "
        "(GPTSentencePieceTokenizer, Llama2Tokenizer): a .model file; TikTokenizer: a tiktoken "
        "vocabulary in Megatron's JSON format.",
    )
    group.add_argument(
        "--tiktoken-pattern",
        default=None,
        choices=["v1", "v2"],
        help="TikTokenizer's split pattern (default v2, megatron-core's).",
    )
    group.add_argument(
        "--tiktoken-num-special-tokens",
        type=int,
        default=1000,
        help="TikTokenizer: ids reserved for special tokens, before the vocabulary's.",
    )
    group.add_argument(
        "--tokenizer-special-tokens",
        nargs="+",
        default=None,
        help="TikTokenizer's special tokens (must include <unk> <s> </s> <mask> <pad> <cls> "
        "<sep>; default: those).",
    )


def _add_data_args(parser):
    g = parser.add_argument_group("data and tokenizer")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument(
        "--data-path",
        nargs="*",
        default=None,
        help="Indexed dataset prefixes (.bin/.idx), optionally weighted: "
        "'w1 prefix1 w2 prefix2 ...'.",
    )
    for split in ("train", "valid", "test"):
        g.add_argument(
            f"--{split}-data-path",
            nargs="*",
            default=None,
            help=f"The {split} split's own datasets (instead of --data-path and --split), "
            "as --data-path takes them.",
        )
    g.add_argument(
        "--data-args-path",
        default=None,
        help="A file holding --data-path's list (for blends too long for a command line).",
    )
    g.add_argument(
        "--per-split-data-args-path",
        default=None,
        help='A JSON file {"train": [...], "valid": [...], "test": [...]} holding each '
        "split's --<split>-data-path list (a string is split at whitespace; null: none).",
    )
    g.add_argument("--split", default="969, 30, 1")
    g.add_argument(
        "--num-dataset-builder-threads",
        type=int,
        default=1,
        help="Threads each rank builds its datasets' indexes with (megatron-core's builder).",
    )
    g.add_argument(
        "--mid-level-dataset-surplus",
        type=float,
        default=0.005,
        help="The share of extra samples megatron-core builds for a blend's datasets.",
    )
    g.add_argument("--data-cache-path", default=None)
    add_tokenizer_args(g)
    g.add_argument(
        "--no-mmap-bin-files",
        action="store_false",
        dest="mmap_bin_files",
        help="Read .bin files with file reads instead of memory maps.",
    )
    g.add_argument(
        "--no-create-attention-mask-in-dataloader",
        action="store_false",
        dest="create_attention_mask_in_dataloader",
        help="Leave the causal mask to the attention (no mask tensor per sample).",
    )
    g.add_argument("--vocab-size", type=int, default=None)
    g.add_argument(
        "--num-workers",
        type=int,
        default=0,
        help="DataLoader processes per rank. Default 0, not Megatron-LM's 2: on CPU ranks "
        "(tests, emulation) workers take cores from the compute; pass 2 on GPUs.",
    )
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument(
        "--reset-position-ids",
        action="store_true",
        help="Restart position ids after each end-of-document token in a sample.",
    )
    g.add_argument(
        "--reset-attention-mask",
        action="store_true",
        help="Keep attention within each document of a sample (a mask per sample: not with "
        "--no-create-attention-mask-in-dataloader).",
    )
    g.add_argument(
        "--dataloader-type",
        default=None,
        choices=["single", "cyclic", "external"],
        help="single (the default): the dataset's samples in order, each once; this trainer "
        "has no other (megatron-core's GPT dataset shuffles its samples already).",
    )


def _add_validation_args(parser):
    g = parser.add_argument_group("validation")
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)


def _add_logging_args(parser):
    g = parser.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument(
        "--logging-level",
        type=int,
        default=None,
        help="Python logging level for megatron-core's and this trainer's loggers (10 debug, "
        "20 info, ...; else $MEGATRON_LOGGING_LEVEL; default: warnings only).",
    )
    g.add_argument(
        "--timing-log-level",
        type=int,
        default=0,
        choices=[0, 1, 2],
        help="megatron-core's timers, printed (and with --log-timers-to-tensorboard written) "
        "at each --log-interval: 0 none, 1 the step's phases (forward-backward, gradient sync, "
        "optimizer, each behind a barrier unless --no-barrier-with-level-1-timing), 2 also "
        "per micro-batch (forward/backward compute, batch generator).",
    )
    g.add_argument(
        "--timing-log-option",
        default="minmax",
        choices=["max", "minmax", "all"],
        help="Which ranks' times the timers print: the max, the min and max, or every rank's.",
    )
    g.add_argument(
        "--log-timers-to-tensorboard",
        action="store_true",
        help="Write the timers' max over ranks (seconds a step) as <name>-time scalars.",
    )
    g.add_argument(
        "--no-barrier-with-level-1-timing",
        action="store_false",
        dest="barrier_with_L1_time",
        help="Time level-1 phases without a barrier first (they then include waits).",
    )
    g.add_argument(
        "--wandb-project",
        default="",
        help="Log the scalars TensorBoard gets to this Weights & Biases project too (rank 0; "
        "needs the wandb package and --wandb-exp-name).",
    )
    g.add_argument("--wandb-exp-name", default="", help="The Weights & Biases run's name.")
    g.add_argument(
        "--wandb-save-dir",
        default="",
        help="Where wandb keeps its local files (default: <--save>/wandb).",
    )
    g.add_argument("--wandb-entity", default="", help="The Weights & Biases team or user.")
    g.add_argument(
        "--tensorboard-log-interval",
        type=int,
        default=1,
        help="Iterations between the training scalars written to TensorBoard.",
    )
    g.add_argument(
        "--tensorboard-queue-size",
        type=int,
        default=1000,
        help="Events TensorBoard's writer holds before one of them forces a flush to disk.",
    )
    g.add_argument(
        "--no-log-loss-scale-to-tensorboard",
        "--disable-log-loss-scale-to-tensorboard",
        action="store_false",
        dest="log_loss_scale_to_tensorboard",
        help="Leave the loss scale out of TensorBoard.",
    )
    g.add_argument(
        "--log-validation-ppl-to-tensorboard",
        action="store_true",
        help="Also the validation (and test) perplexity in TensorBoard.",
    )
    g.add_argument(
        "--log-world-size-to-tensorboard",
        action="store_true",
        help="Also the world size in TensorBoard, every logged iteration.",
    )
    g.add_argument(
        "--log-params-norm",
        action="store_true",
        help="The L2 norm of the weights in the iteration line (params norm), as Megatron-LM: "
        "the optimizer's fp32 copy (also under --fp16, where Megatron-LM reads the fp16 "
        "weights), each element counted once.",
    )
    g.add_argument(
        "--log-num-zeros-in-grad",
        action="store_true",
        help="How many gradient elements are zero, in the iteration line (num zeros), as "
        "Megatron-LM (megatron-core's count, each element once).",
    )
    g.add_argument(
        "--log-progress",
        action="store_true",
        help="Append a line to <save>/progress.txt at each job start, saved and retired "
        "checkpoint: job and cumulative model TFLOP/s per GPU, FLOPs and tokens so far "
        "(Megatron-LM's file and format).",
    )
    g.add_argument(
        "--log-throughput",
        action="store_true",
        help="Model TFLOP/s per GPU (or CPU rank) in the iteration line, Megatron-LM's formula.",
    )
    g.add_argument(
        "--profile",
        action="store_true",
        help="Profile iterations --profile-step-start to --profile-step-end: with "
        "--use-pytorch-profiler torch.profiler traces into --tensorboard-dir, else nsys "
        "capture ranges (CUDA).",
    )
    g.add_argument("--profile-step-start", type=int, default=10)
    g.add_argument("--profile-step-end", type=int, default=12)
    g.add_argument("--use-pytorch-profiler", action="store_true")
    g.add_argument(
        "--profile-ranks", nargs="+", type=int, default=[0], help="Global ranks to profile."
    )
    g.add_argument(
        "--metrics-file",
        default=None,
        help="JSONL file with one record per iteration and evaluation (hettp). "
        "Default: <save>/metrics.jsonl, or logs/metrics-<time>.jsonl without --save.",
    )


def _add_checkpointing_args(parser):
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument("--save-interval", "--persistent-save-interval", type=int, default=None)
    g.add_argument(
        "--save-retain-interval",
        type=int,
        default=None,
        help="Keep only the checkpoints at multiples of this (a multiple of --save-interval) "
        "and the newest: each save deletes the one it succeeds otherwise.",
    )
    g.add_argument("--load", default=None)
    g.add_argument(
        "--no-save-optim",
        action="store_true",
        help="Do not save the optimizer state (moments, fp32 masters) nor the learning-rate "
        "schedule; loading such a checkpoint takes --no-load-optim (or --finetune).",
    )
    g.add_argument("--no-save-rng", action="store_true", help="Do not save the RNG states.")
    g.add_argument(
        "--no-load-optim",
        action="store_true",
        help="On --load, do not load the optimizer state nor the learning-rate schedule "
        "(as Megatron-LM: both start over; the iteration and data position carry on).",
    )
    g.add_argument(
        "--no-load-rng", action="store_true", help="On --load, do not load the RNG states."
    )
    g.add_argument(
        "--finetune",
        action="store_true",
        help="Load the model only: no optimizer, schedule, RNG or het-TP state, and start at "
        "iteration 0 in this run's plan.",
    )
    g.add_argument(
        "--pretrained-checkpoint",
        default=None,
        help="Folder of a checkpoint to finetune from (as --finetune) when --load holds none "
        "yet; once a run has saved into --load, its next job resumes from there.",
    )
    g.add_argument(
        "--disable-use-tokenizer-model-from-checkpoint-args",
        "--no-use-tokenizer-model-from-checkpoint-args",
        action="store_false",
        dest="use_tokenizer_model_from_checkpoint_args",
        help="Accepted for Megatron-LM's scripts: --use-checkpoint-args never takes the "
        "tokenizer here.",
    )
    g.add_argument(
        "--use-checkpoint-args",
        action="store_true",
        help="Take the model's flags from the checkpoint this run starts from (--load's, else "
        "--pretrained-checkpoint's): the sizes where the command line gives none, the rest "
        "over it. The tokenizer stays this run's (its vocabulary is checked at load).",
    )
    g.add_argument(
        "--ckpt-step",
        type=int,
        default=None,
        help="On --load, the iteration to load (default: the tracker's latest).",
    )
    g.add_argument(
        "--exit-on-missing-checkpoint",
        action="store_true",
        help="With --load, exit with an error when it holds no checkpoint rather than start "
        "from scratch.",
    )
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument(
        "--no-ckpt-fully-parallel-save",
        "--disable-ckpt-fully-parallel-save",
        action="store_false",
        dest="ckpt_fully_parallel_save",
        help="Write each tensor the data-parallel replicas share from its main replica (data-"
        "parallel rank 0) instead of spreading the writes over the replicas (the default, as "
        "Megatron-LM's).",
    )
    g.add_argument(
        "--ckpt-fully-parallel-load",
        action="store_true",
        help="Read what the data-parallel replicas hold alike once, a share by each replica, "
        "and exchange it over the data-parallel group (megatron-core's), instead of every "
        "replica reading all of it.",
    )
    for flag, what in DEPRECATED_CHECKPOINT_FLAGS.items():
        g.add_argument(
            flag,
            action="store_true",
            dest=_deprecated_dest(flag),
            help=f"Deprecated, as in Megatron-LM: {what}.",
        )
    g.add_argument(
        "--dist-ckpt-format",
        dest="dist_ckpt_format_deprecated",
        default=None,
        help="Deprecated, as in Megatron-LM: see --ckpt-format.",
    )
    g.add_argument(
        "--ckpt-format",
        default="torch_dist",
        choices=["torch", "torch_dist", "zarr", "torch_dcp", "fsdp_dtensor"],
        help="Only torch_dist: a checkpoint loads under any plan, TP size, or vanilla.",
    )


# Megatron-LM's checkpoint flags that no longer do anything there, accepted with its warning
DEPRECATED_CHECKPOINT_FLAGS = {
    "--ckpt-fully-parallel-save": "parallel saving is the default (--no-ckpt-fully-parallel-save "
    "disables it)",
    "--use-dist-ckpt": "see --ckpt-format (torch_dist, the default)",
}


def _deprecated_dest(flag: str) -> str:
    return flag[2:].replace("-", "_") + "_deprecated"


def parse_args(argv=None, extra_args_provider=None, world_size=None) -> argparse.Namespace:
    """Parse and validate; on a bad flag print a one-line error and exit with status 2."""
    parser = build_parser(extra_args_provider)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        parser.exit(2, f"{parser.prog}: error: {unknown_flags_message(parser, unknown)}\n")
    try:
        why = _take_checkpoint_args(args) if args.use_checkpoint_args else ""
        _check_required_flags(args, why)
    except ArgumentError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        validate_args(args, world_size)
    except ArgumentError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    return args


# Why a family of Megatron-LM's flags is not supported here: the first family whose prefix a
# flag starts with; any other is refused with the README's pointer.
UNSUPPORTED_FAMILIES = (
    (
        ("--num-experts", "--moe-", "--expert-"),
        "mixture of experts: het-TP partitions dense attention heads and MLP units",
    ),
    (
        ("--multi-latent-attention", "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim"),
        "multi-latent attention is not built here",
    ),
    (("--qk-pos-emb-head-dim", "--v-head-dim", "--dsa-", "--mtp-"), "DeepSeek's layers"),
    (
        ("--fp8", "--fp4", "--tp-comm-", "--te-", "--use-flash-attn"),
        "needs Transformer Engine layers; het-TP's subclass megatron-core's local ones",
    ),
    (
        ("--cuda-graph", "--enable-cuda-graph", "--external-cuda-graph"),
        "CUDA graphs: a migration replaces the captured layers",
    ),
    (
        (
            "--num-layers-per-virtual-pipeline-stage",
            "--num-virtual-stages-per-pipeline-rank",
            "--microbatch-group-size-per-virtual-pipeline-stage",
        ),
        "interleaved pipeline schedules: het-TP runs one model chunk a stage",
    ),
    (
        ("--cp-comm-type", "--hierarchical-context-parallel-sizes", "--hybrid-context-parallel"),
        "context parallelism (--context-parallel-size 1 only)",
    ),
    (
        (
            "--async-save",
            "--use-persistent-ckpt-worker",
            "--non-persistent-",
        ),
        "checkpoints are written synchronously, staged until every rank finished",
    ),
    (
        ("--ckpt-assume-constant-structure",),
        "each save works out its own distribution: a het-TP plan changes the layout between saves",
    ),
    (
        (
            "--use-torch-fsdp2",
            "--use-megatron-fsdp",
            "--data-parallel-sharding-strategy",
            "--fsdp-",
        ),
        "FSDP: data parallelism here is megatron-core's DDP and distributed optimizer",
    ),
    (("--mamba-", "--hybrid-", "--is-hybrid-model"), "hybrid Mamba models"),
    (("--inference-", "--rl-", "--grpo-", "--langrl-"), "inference and RL loops"),
)


def _why_unsupported(flag: str) -> str:
    for prefixes, why in UNSUPPORTED_FAMILIES:
        if flag.startswith(prefixes):
            return why
    return "README.md: Flags"


def unknown_flags_message(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    """What argparse left over, named apart: Megatron-LM flags this trainer does not support
    (a launch script's), grouped by why (UNSUPPORTED_FAMILIES), and the rest (a typo gets the
    nearest of our flags). Values are shown after their flag, as argparse shows them; a value
    with no flag before it is unrecognized."""
    ours = [name for action in parser._actions for name in action.option_strings]
    megatron: dict[str, list] = {}  # why -> the flags refused for it, in order
    other = []
    words: list[str] | None = None  # the flag being read and its values
    for token in unknown:
        if token.startswith("-") and not _is_number(token):
            words = [token]
            name = token.split("=", 1)[0]
            if name in MEGATRON_LM_FLAGS:
                megatron.setdefault(_why_unsupported(name), []).append(words)
            else:
                other.append(words)
        elif words is not None:
            words.append(token)
        else:
            other.append([token])

    def unrecognized(words) -> str:
        name = words[0].split("=", 1)[0]
        near = difflib.get_close_matches(name, ours, n=1) if name.startswith("-") else []
        return " ".join(words) + (f" (did you mean {near[0]}?)" if near and name != "--" else "")

    parts = []
    if megatron:
        groups = "; ".join(
            f"{', '.join(map(' '.join, flags))} ({why})" for why, flags in megatron.items()
        )
        parts.append(
            f"Megatron-LM flags ({MEGATRON_LM_VERSION}) this trainer does not support: {groups}"
        )
    if other:
        parts.append(f"unrecognized arguments: {', '.join(map(unrecognized, other))}")
    return "; ".join(parts)


# The model's sizes, which --use-checkpoint-args may take from a checkpoint, and the other
# flags every run needs
MODEL_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")
REQUIRED_FLAGS = (*MODEL_FLAGS, "micro_batch_size", "lr")


def _check_required_flags(args, why_missing: str = "") -> None:
    """Every required flag given (or taken from a checkpoint), named together as argparse
    words it; `why_missing`: why --use-checkpoint-args left a size out."""
    missing = [f"--{n.replace('_', '-')}" for n in REQUIRED_FLAGS if getattr(args, n) is None]
    if missing:
        sizes = any(getattr(args, n) is None for n in MODEL_FLAGS)
        raise ArgumentError(
            "the following arguments are required: "
            + ", ".join(missing)
            + (f" (--use-checkpoint-args: {why_missing})" if why_missing and sizes else "")
        )


def _take_checkpoint_args(args) -> str:
    """--use-checkpoint-args, as Megatron-LM's: the model flags recorded in the checkpoint
    training will start from replace the command line's (the sizes only where it gives none);
    one line on rank 0 names what changed and what the checkpoint did not record. Without a
    checkpoint yet (the auto-resume pattern's first run) the command line's stand. Returns why
    a size may still be missing."""
    from megatron.hetero import checkpointing

    _require(
        args.load or args.pretrained_checkpoint,
        "--use-checkpoint-args needs --load (or --pretrained-checkpoint)",
    )
    try:
        found = checkpointing.saved_model_args(args)
    except checkpointing.CheckpointError as err:
        raise ArgumentError(f"--use-checkpoint-args: {err}") from None
    if found is None:
        return "no checkpoint to take them from yet"
    saved = found.values
    changed = []
    for name, value in saved.items():
        if name in checkpointing.COMMAND_LINE_FIRST and getattr(args, name) is not None:
            continue
        if name == "add_qkv_bias" and saved.get("add_bias_linear"):
            continue  # implied by biases on every linear (validate_args derives it)
        if getattr(args, name) != value:
            changed.append(f"--{name.replace('_', '-')} {value}")
            setattr(args, name, value)
    older = ""
    if found.missing:
        flags = ", ".join(f"--{name.replace('_', '-')}" for name in found.missing)
        older = f"; not recorded in it (an older checkpoint), as given: {flags}"
    if int(os.environ.get("RANK", "0")) == 0:
        print(
            f"model flags from checkpoint {found.path} (--use-checkpoint-args): "
            + (", ".join(changed) or "as given")
            + older,
            flush=True,
        )
    return f"{found.path} predates recording them" if found.missing else ""


def local_rank(args) -> int:
    """This process's GPU on its node: --local-rank, else torchrun's LOCAL_RANK, else 0."""
    if args.local_rank is not None:
        return args.local_rank
    return int(os.environ.get("LOCAL_RANK", "0"))


def _require(cond, msg):
    if not cond:
        raise ArgumentError(msg)


def _validate_stage_layers(args, pp: int) -> list[int]:
    """Layers per pipeline stage, as megatron-core splits them: --decoder-first/last-pipeline-
    num-layers for the end stages, the rest evenly over the middle ones; every stage holds at
    least one layer (het-TP partitions each stage's layers). Returns each stage's count."""
    ends = {
        "--decoder-first-pipeline-num-layers": args.decoder_first_pipeline_num_layers,
        "--decoder-last-pipeline-num-layers": args.decoder_last_pipeline_num_layers,
    }
    given = {flag: n for flag, n in ends.items() if n is not None}
    for flag, n in given.items():
        _require(pp > 1, f"{flag} needs --pipeline-model-parallel-size > 1")
        _require(n > 0, f"{flag} must be positive, got {n}")
    middle_stages = pp - len(given)
    middle_layers = args.num_layers - sum(given.values())
    if not given:
        _require(
            args.num_layers % pp == 0,
            f"--num-layers ({args.num_layers}) must be divisible by "
            f"--pipeline-model-parallel-size ({pp}) (or set --decoder-first/last-pipeline-num-"
            "layers)",
        )
    elif middle_stages == 0:
        _require(
            middle_layers == 0,
            f"{' and '.join(f'{f} {n}' for f, n in given.items())} must add up to --num-layers "
            f"({args.num_layers}) with {pp} pipeline stages",
        )
    else:
        _require(
            middle_layers >= middle_stages and middle_layers % middle_stages == 0,
            f"--num-layers ({args.num_layers}) minus "
            f"{' and '.join(f'{f} ({n})' for f, n in given.items())} must split evenly over the "
            f"other {middle_stages} pipeline stage(s), at least one layer each",
        )
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    middle = [middle_layers // middle_stages] * middle_stages if middle_stages else []
    return [n for n in (first,) if n is not None] + middle + [n for n in (last,) if n is not None]


def _validate_uniform_recompute(args, het_tp: HetTPConfig, stage_layers: list[int]) -> None:
    """megatron-core recomputes `--recompute-method uniform` in chunks of
    --recompute-num-layers layers from a stage's first, and indexes past its last layer where
    the chunks do not divide the stage (an IndexError at the first forward)."""
    chunk = args.recompute_num_layers
    if args.recompute_granularity != "full" or args.recompute_method != "uniform" or chunk == 1:
        return
    for stage, layers in enumerate(stage_layers):
        _require(
            layers % chunk == 0,
            f"--recompute-method uniform --recompute-num-layers {chunk} must divide every "
            f"pipeline stage's layers, and stage {stage} has {layers} (use a divisor, or "
            "--recompute-method block)",
        )
    _require(
        not het_tp.moves_layers(model_shape(args)),
        f"--recompute-method uniform --recompute-num-layers {chunk} must divide every pipeline "
        f"stage's layers, and --het-tp-policy {het_tp.policy} moves layers between stages "
        f"(--het-tp-pipeline-moves {het_tp.pipeline_moves}): use --recompute-num-layers 1, "
        "--recompute-method block, or --het-tp-pipeline-moves units",
    )


def _refuse_other_unit(args, unit: str, other: str) -> None:
    """With --train-<unit>, the schedule's --lr-decay-<other> and --lr-warmup-<other> are
    refused (Megatron-LM: a run counts in iterations or in samples, not both)."""
    for kind in ("decay", "warmup"):
        _require(
            not getattr(args, f"lr_{kind}_{other}"),
            f"--lr-{kind}-{other} goes with --train-{other}; with --train-{unit} use "
            f"--lr-{kind}-{unit}",
        )


SPLITS = ("train", "valid", "test")


@dataclass(frozen=True)
class DataPaths:
    """The corpus as the flags give it: one blend cut by --split (--data-path, or the file
    --data-args-path names), or each split's own (--train-/--valid-/--test-data-path, or the
    JSON file --per-split-data-args-path names). Lists as --data-path takes them."""

    blend: list[str] | None
    blend_flag: str  # what names the blend in messages
    splits: dict  # split -> (what names it, its list), the splits given

    @property
    def given(self) -> bool:
        return bool(self.blend or self.splits)

    def to_json(self) -> str:  # as the run's config records it (log.py)
        return json.dumps(
            {"blend": self.blend, "splits": {k: v[1] for k, v in self.splits.items()}}
        )


def data_paths(args) -> DataPaths:
    """DataPaths of `args`, the files read (Megatron-LM's --data-args-path: the list split at
    whitespace; --per-split-data-args-path: {"train": ..., "valid": ..., "test": ...}, each
    a list or a string split at whitespace, or null). Raises ArgumentError naming the flag."""
    blend, blend_flag = args.data_path or None, "--data-path"
    splits = {
        split: (f"--{split}-data-path", getattr(args, f"{split}_data_path"))
        for split in SPLITS
        if getattr(args, f"{split}_data_path")
    }
    if args.data_args_path is not None:
        _require(not args.data_path, "--data-path and --data-args-path are exclusive: give one")
        blend_flag = f"--data-args-path {args.data_args_path}:"
        blend = _read_file(args.data_args_path, "--data-args-path").split()
        _require(blend, f"{blend_flag} no datasets in it")
    if args.per_split_data_args_path is not None:
        path = args.per_split_data_args_path
        _require(
            not splits,
            "--per-split-data-args-path and --train-/--valid-/--test-data-path are exclusive: "
            "give one",
        )
        try:
            saved = json.loads(_read_file(path, "--per-split-data-args-path"))
        except ValueError as err:
            raise ArgumentError(f"--per-split-data-args-path {path}: not JSON ({err})") from None
        _require(
            isinstance(saved, dict) and set(saved) <= set(SPLITS),
            f"--per-split-data-args-path {path}: expected an object with train, valid and test "
            "entries",
        )
        for split in SPLITS:
            value = saved.get(split)
            if isinstance(value, str):
                value = value.split()
            _require(
                value is None
                or (isinstance(value, list) and all(isinstance(v, str) for v in value)),
                f"--per-split-data-args-path {path}: its {split} entry must be a list of strings, "
                "a string or null",
            )
            if value:
                splits[split] = (f"--per-split-data-args-path {path} ({split}):", value)
        _require(splits, f"--per-split-data-args-path {path}: no datasets in it")
    return DataPaths(blend, blend_flag, splits)


def _read_file(path: str, flag: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError as err:
        raise ArgumentError(f"{flag} {path}: {err.strerror or err}") from None


def _checked_prefixes(paths, flag: str, args, vocab: int | None) -> dict:
    """{prefix: its sequences' lengths} of a --data-path style list, each checked to be an
    intact indexed dataset whose sampled token ids this run's tokenizer (`vocab` entries)
    has."""
    from .dataset_files import (
        DatasetFileError,
        check_indexed_dataset,
        sampled_token_range,
        sequence_lengths,
    )

    lengths = {}
    prefixes, _ = parse_data_path(paths, flag)
    for prefix in prefixes:
        missing = [ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
        _require(
            not missing,
            f"{flag} {prefix}: no {' or '.join(prefix + e for e in missing)} "
            "(build one with scripts/preprocess_data.py)",
        )
        try:
            indexed = check_indexed_dataset(prefix)
            lengths[prefix] = sequence_lengths(prefix)
        except DatasetFileError as err:
            raise ArgumentError(f"{flag} {prefix}: {err}") from None
        if vocab is not None:
            low, top = sampled_token_range(prefix, indexed)
            size = (
                f" --vocab-size {args.vocab_size}" if args.tokenizer_type == "NullTokenizer" else ""
            )
            rows = padded_vocab_size(
                vocab, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size
            )
            what = (
                f"{flag} {prefix}: holds token id {top if low >= 0 else low}, and "
                f"--tokenizer-type {args.tokenizer_type}{size} has {vocab} entries"
            )
            _require(  # past the embedding's rows: an error at TP=1, zeros at TP > 1
                0 <= low and top < rows,
                f"{what} ({rows} embedding rows, padded): the data was tokenized with another "
                "tokenizer (give that one's flags, or preprocess the text again)",
            )
            if top >= vocab:  # padding rows: they train, but no text of this tokenizer maps there
                warnings.warn(
                    f"{what}: ids from {vocab} train the padding rows of the embedding",
                    stacklevel=2,
                )
    return lengths


def _check_split_sizes(args, blend_weights, lengths: dict) -> None:
    """Every split megatron-core will build holds enough tokens of every dataset.

    The builder cuts each dataset's sequences at the --split bounds (its own arithmetic, used
    here) and builds every split of non-zero weight, asked for samples or not. A split with no
    tokens loops forever (0 tokens per epoch never reach the samples asked); in an unweighted
    blend, where each dataset is built once through, one with less than a sample
    (--seq-length + 1 tokens) fails an assert. Both are refused here, naming the split."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(args.split))
    once_through = len(lengths) > 1 and blend_weights is None
    need = args.seq_length + 1 if once_through else 1
    for bounds, name in zip(matrix, ("training", "validation", "test")):
        if bounds is None:
            continue  # weight 0: not built
        for prefix, sizes in lengths.items():
            first = int(round(bounds[0] * float(len(sizes))))
            last = int(round(bounds[1] * float(len(sizes))))
            tokens = int(sizes[first:last].sum())
            _require(
                tokens >= need,
                f"--split '{args.split}': the {name} split of {prefix} gets "
                + (f"{tokens} tokens of its" if last > first else "none of its")
                + f" {len(sizes)} sequences"
                + (f" (an unweighted blend needs --seq-length + 1 = {need})" if need > 1 else "")
                + "; megatron-core cannot build it: give the split weight 0 or a larger one, or "
                "more data",
            )


def _validate_schedule(args) -> None:
    """Training length and the learning-rate schedule, in iterations or in samples, as
    Megatron-LM: either way the scheduler counts samples (lr_*_steps below), so a checkpoint
    resumes the schedule exactly."""
    gbs = args.global_batch_size
    _require(
        (args.train_iters is None) != (args.train_samples is None),
        "give exactly one of --train-iters and --train-samples",
    )
    unit = "iters" if args.train_iters is not None else "samples"
    if args.train_iters is not None:
        _require(args.train_iters > 0, f"--train-iters must be positive, got {args.train_iters}")
        _refuse_other_unit(args, unit="iters", other="samples")
        ramp = args.rampup_batch_size
        _require(
            ramp is None,
            f"--rampup-batch-size{''.join(f' {v}' for v in ramp or ())} goes with --train-samples "
            "(Megatron-LM ramps the batch in sample-based training only)",
        )
        if args.lr_decay_iters is None:
            args.lr_decay_iters = args.train_iters
        _require(
            args.lr_decay_iters > 0,
            f"--lr-decay-iters must be positive, got {args.lr_decay_iters}",
        )
        args.train_samples_total = args.train_iters * gbs
        args.lr_decay_steps = args.lr_decay_iters * gbs
        warmup, warmup_flag = args.lr_warmup_iters * gbs, "--lr-warmup-iters"
        shown = (f"{args.lr_warmup_iters}", f"--lr-decay-iters ({args.lr_decay_iters})")
    else:
        _require(
            args.train_samples > 0, f"--train-samples must be positive, got {args.train_samples}"
        )
        _refuse_other_unit(args, unit="samples", other="iters")
        if args.rampup_batch_size is None:
            args.train_iters = args.train_samples // gbs
        else:
            ramp = Rampup(*args.rampup_batch_size)
            problems = ramp.problems(gbs, args.micro_batch_size * args.data_parallel_size)
            _require(not problems, "; ".join(problems))
            args.train_iters = BatchSchedule.from_args(args).iterations(args.train_samples)
        _require(
            args.train_iters > 0,
            f"--train-samples ({args.train_samples}) is less than one --global-batch-size ({gbs})",
        )
        if args.lr_decay_samples is None:
            args.lr_decay_samples = args.train_samples
        _require(
            args.lr_decay_samples > 0,
            f"--lr-decay-samples must be positive, got {args.lr_decay_samples}",
        )
        args.train_samples_total = args.train_samples
        args.lr_decay_steps = args.lr_decay_samples
        warmup, warmup_flag = args.lr_warmup_samples, "--lr-warmup-samples"
        shown = (f"{warmup}", f"--lr-decay-samples ({args.lr_decay_samples})")
        _require(warmup >= 0, f"--lr-warmup-samples must be >= 0, got {warmup}")
    if args.lr_warmup_fraction is not None:
        _require(
            0.0 <= args.lr_warmup_fraction < 1.0,
            f"--lr-warmup-fraction must be in [0, 1), got {args.lr_warmup_fraction}",
        )
        _require(
            not warmup,
            f"--lr-warmup-fraction and {warmup_flag} are mutually exclusive",
        )
        warmup = args.lr_warmup_fraction * args.lr_decay_steps  # a float, as Megatron-LM
        warmup_flag = "--lr-warmup-fraction"
        shown = (f"{args.lr_warmup_fraction}", "1")
    args.lr_warmup_steps = warmup
    _require(
        warmup < args.lr_decay_steps,
        f"{warmup_flag} ({shown[0]}) must be smaller than {shown[1]}",
    )
    _validate_schedule_shapes(args, unit)
    for flag in ("decoupled_lr", "decoupled_min_lr"):
        value = getattr(args, flag)
        _require(
            value is None or value >= 0.0,
            f"--{flag.replace('_', '-')} must be >= 0, got {value}",
        )


def _validate_schedule_shapes(args, unit: str) -> None:
    """WSD's decay length and the weight-decay ramp, as Megatron-LM takes them (its asserts,
    here errors naming the flags). Sets args.wsd_decay_steps (in samples, as the schedule)
    and args.start_wd / end_wd (the flags themselves stay as given: validation may run again
    on the same args)."""
    other = "samples" if unit == "iters" else "iters"
    _require(
        getattr(args, f"lr_wsd_decay_{other}") is None,
        f"--lr-wsd-decay-{other} goes with --train-{other}; with --train-{unit} use "
        f"--lr-wsd-decay-{unit}",
    )
    length = getattr(args, f"lr_wsd_decay_{unit}")
    args.wsd_decay_steps = None
    if args.lr_decay_style == "WSD":
        _require(length is not None, f"--lr-decay-style WSD needs --lr-wsd-decay-{unit}")
        steps = length * args.global_batch_size if unit == "iters" else length
        _require(
            0 < steps <= args.lr_decay_steps,
            f"--lr-wsd-decay-{unit} must be positive and at most the decay's length "
            f"(--lr-decay-{unit}), got {length}",
        )
        args.wsd_decay_steps = steps
    else:
        _require(
            length is None,
            f"--lr-wsd-decay-{unit} applies to --lr-decay-style WSD (this run: "
            f"{args.lr_decay_style})",
        )
    ramp = (args.start_weight_decay, args.end_weight_decay)
    if args.weight_decay_incr_style == "constant":
        _require(
            ramp == (None, None),
            "--start-weight-decay and --end-weight-decay go with --weight-decay-incr-style "
            "linear or cosine (constant: --weight-decay)",
        )
        args.start_wd = args.end_wd = args.weight_decay
    else:
        _require(
            None not in ramp,
            f"--weight-decay-incr-style {args.weight_decay_incr_style} needs "
            "--start-weight-decay and --end-weight-decay",
        )
        _require(
            min(ramp) >= 0.0,
            f"--start-weight-decay and --end-weight-decay must be >= 0, got {ramp[0]}, {ramp[1]}",
        )
        _require(
            ramp[1] >= ramp[0],
            f"--end-weight-decay ({ramp[1]}) must be at least --start-weight-decay ({ramp[0]}): "
            "the weight decay ramps up",
        )
        args.start_wd, args.end_wd = ramp


def _validate_device_features(args, cuda_available: bool) -> None:
    """Flags of Megatron-LM's scripts that need a GPU, Transformer Engine or a feature hettp
    does not have: refused by name, before anything starts."""
    _require(
        args.context_parallel_size == 1,
        f"--context-parallel-size {args.context_parallel_size}: context parallelism is not "
        "supported (use 1)",
    )
    _require(
        args.attention_backend in ("auto", "unfused", "local"),
        f"--attention-backend {args.attention_backend}: Transformer Engine's attention; "
        "hettp builds megatron-core's local layers (use auto, unfused or local)",
    )
    _require(
        args.ckpt_format == "torch_dist",
        f"--ckpt-format {args.ckpt_format}: hettp saves torch_dist checkpoints only (they load "
        "under any plan, TP size, or vanilla)",
    )
    given = [f for f in DEPRECATED_CHECKPOINT_FLAGS if getattr(args, _deprecated_dest(f))]
    if args.dist_ckpt_format_deprecated is not None:
        given.append("--dist-ckpt-format")
    for flag in given:
        what = DEPRECATED_CHECKPOINT_FLAGS.get(flag, "see --ckpt-format")
        warnings.warn(f"{flag} is deprecated and has no effect: {what}", stacklevel=2)
    if not cuda_available:
        _require(
            not args.cross_entropy_loss_fusion,
            "--cross-entropy-loss-fusion needs CUDA (megatron-core's fused kernel); drop it on CPU",
        )
        _require(
            not (args.profile and not args.use_pytorch_profiler),
            "--profile without --use-pytorch-profiler captures nsys ranges, which needs CUDA; "
            "add --use-pytorch-profiler on CPU",
        )
    if args.profile:
        _require(
            0 <= args.profile_step_start < args.profile_step_end,
            f"--profile-step-start ({args.profile_step_start}) must be below "
            f"--profile-step-end ({args.profile_step_end})",
        )
    _require(
        not args.grad_reduce_in_bf16 or args.bf16,
        "--grad-reduce-in-bf16 needs --bf16",
    )
    _require(
        not (args.grad_reduce_in_bf16 and args.accumulate_allreduce_grads_in_fp32),
        "--grad-reduce-in-bf16 and --accumulate-allreduce-grads-in-fp32 ask for two gradient "
        "dtypes: give one",
    )
    _require(
        args.min_loss_scale > 0, f"--min-loss-scale must be positive, got {args.min_loss_scale}"
    )
    # megatron-core's grad scalers assert these without a message; --loss-scale 0 (or none)
    # is a dynamic scale, as in Megatron-LM
    _require(
        args.loss_scale is None or args.loss_scale >= 0,
        f"--loss-scale must be >= 0 (0 or left out: a dynamic scale), got {args.loss_scale}",
    )
    _require(
        not args.fp16 or args.loss_scale or args.initial_loss_scale >= args.min_loss_scale,
        f"--initial-loss-scale ({args.initial_loss_scale}) must be >= --min-loss-scale "
        f"({args.min_loss_scale})",
    )
    _require(
        args.loss_scale_window > 0,
        f"--loss-scale-window must be positive, got {args.loss_scale_window}",
    )
    _require(args.hysteresis >= 1, f"--hysteresis must be >= 1, got {args.hysteresis}")
    _require(
        args.num_dataset_builder_threads > 0,
        f"--num-dataset-builder-threads must be positive, got {args.num_dataset_builder_threads}",
    )
    _require(
        args.mid_level_dataset_surplus >= 0,
        f"--mid-level-dataset-surplus must be >= 0, got {args.mid_level_dataset_surplus}",
    )
    env_local = os.environ.get("LOCAL_RANK")
    _require(
        args.local_rank is None or env_local is None or args.local_rank == int(env_local),
        f"--local-rank {args.local_rank} disagrees with LOCAL_RANK={env_local} in the environment",
    )
    _require(
        args.manual_gc_interval >= 0,
        f"--manual-gc-interval must be >= 0, got {args.manual_gc_interval}",
    )


def _validate_parallel_features(args, tp: int) -> None:
    """Sequence parallelism, overlapped gradient reduction and recomputation, as Megatron-LM
    checks them."""
    if args.sequence_parallel and tp == 1:
        warnings.warn(
            "Disabling sequence parallelism because tensor model parallelism is disabled",
            stacklevel=2,
        )
        args.sequence_parallel = False
    if args.sequence_parallel:
        _require(
            args.seq_length % tp == 0,
            f"--seq-length ({args.seq_length}) must be divisible by --tensor-model-parallel-size "
            f"({tp}) with --sequence-parallel",
        )
    if args.ddp_bucket_size is not None:
        _require(
            args.ddp_bucket_size > 0,
            f"--ddp-bucket-size must be positive, got {args.ddp_bucket_size}",
        )
        if not args.overlap_grad_reduce:  # as Megatron-LM: one reduce after backward, no buckets
            warnings.warn(
                "--ddp-bucket-size is ignored without --overlap-grad-reduce", stacklevel=2
            )
    if args.overlap_param_gather:
        _require(
            args.use_distributed_optimizer,
            "--overlap-param-gather is only supported with --use-distributed-optimizer",
        )
        _require(
            args.overlap_grad_reduce,
            "--overlap-param-gather needs --overlap-grad-reduce",
        )
    if args.recompute_activations:
        _require(
            args.recompute_granularity in (None, "selective"),
            "--recompute-activations means --recompute-granularity selective, "
            f"not {args.recompute_granularity}",
        )
        args.recompute_granularity = "selective"
    granularity, method, layers = (
        args.recompute_granularity,
        args.recompute_method,
        args.recompute_num_layers,
    )
    if granularity == "full":
        _require(
            method is not None,
            "--recompute-granularity full needs --recompute-method uniform|block",
        )
        _require(
            layers is not None and 1 <= layers <= args.num_layers,
            f"--recompute-granularity full needs --recompute-num-layers between 1 and "
            f"--num-layers ({args.num_layers}), got {layers}",
        )
    else:
        for flag, value in (("--recompute-method", method), ("--recompute-num-layers", layers)):
            _require(
                value is None,
                f"{flag} applies to --recompute-granularity full only"
                + (f" (not {granularity})" if granularity else ""),
            )


def validate_args(args, world_size: int, cuda_available: bool | None = None) -> HetTPConfig:
    """Megatron-style checks and derived values (data_parallel_size, padded vocab, ...); returns
    the validated het-TP config (nothing of it is written into `args`)."""
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    args.world_size = world_size
    _check_refused_flags(args)
    _check_required_flags(args)

    for flag in (
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "seq_length",
        "micro_batch_size",
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "log_interval",
        "eval_interval",
        "make_vocab_size_divisible_by",
        "tensorboard_log_interval",
    ):
        value = getattr(args, flag)
        _require(value > 0, f"--{flag.replace('_', '-')} must be positive, got {value}")
    # --tensorboard-queue-size 0: unbounded, as Python's queues take it
    for flag in ("eval_iters", "lr_warmup_iters", "num_workers", "tensorboard_queue_size"):
        value = getattr(args, flag)
        _require(value >= 0, f"--{flag.replace('_', '-')} must be >= 0, got {value}")
    for flag in ("attention_dropout", "hidden_dropout", "adam_beta1", "adam_beta2"):
        value = getattr(args, flag)
        _require(0.0 <= value < 1.0, f"--{flag.replace('_', '-')} must be in [0, 1), got {value}")

    # Parallel layout.
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    _require(
        world_size % (tp * pp) == 0,
        f"world size ({world_size}) is not divisible by --tensor-model-parallel-size ({tp}) x "
        f"--pipeline-model-parallel-size ({pp})",
    )
    stage_layers = _validate_stage_layers(args, pp)
    args.data_parallel_size = world_size // (tp * pp)

    # Model shape.
    heads = args.num_attention_heads
    _require(
        heads % tp == 0,
        f"--num-attention-heads ({heads}) must be divisible by --tensor-model-parallel-size ({tp})",
    )
    _require(
        args.kv_channels is None or args.kv_channels > 0,
        f"--kv-channels must be positive, got {args.kv_channels}",
    )
    if args.kv_channels is None:
        _require(
            args.hidden_size % heads == 0,
            f"--hidden-size ({args.hidden_size}) must be divisible by "
            f"--num-attention-heads ({heads}) unless --kv-channels is given",
        )
        args.kv_channels = args.hidden_size // heads
    if args.group_query_attention:
        groups = args.num_query_groups
        _require(groups > 0, f"--num-query-groups must be positive, got {groups}")
        _require(
            heads % groups == 0,
            f"--num-attention-heads ({heads}) must be divisible by --num-query-groups ({groups})",
        )
        _require(
            groups % tp == 0,
            f"--num-query-groups ({groups}) must be divisible by "
            f"--tensor-model-parallel-size ({tp})",
        )
    else:
        args.num_query_groups = heads
    if args.ffn_hidden_size is None:
        if args.swiglu:
            args.ffn_hidden_size = int((4 * args.hidden_size * 2 / 3) / 64) * 64 or 64
        else:
            args.ffn_hidden_size = 4 * args.hidden_size
    _require(
        args.ffn_hidden_size > 0, f"--ffn-hidden-size must be positive, got {args.ffn_hidden_size}"
    )
    _require(
        args.ffn_hidden_size % tp == 0,
        f"--ffn-hidden-size ({args.ffn_hidden_size}) must be divisible by "
        f"--tensor-model-parallel-size ({tp})",
    )
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    _require(
        not (args.squared_relu and args.swiglu),
        "--squared-relu and --swiglu are two activations: give one",
    )
    if args.add_bias_linear:  # as Megatron-LM: biases on every linear, the QKV one included
        args.add_qkv_bias = True
    if args.use_rotary_position_embeddings:  # Megatron-LM's older spelling
        args.position_embedding_type = "rope"
    _require(
        args.add_position_embedding or args.position_embedding_type in ("rope", "none"),
        "--no-position-embedding is Megatron-LM's older spelling for rope models: give "
        f"--position-embedding-type (this run: {args.position_embedding_type})",
    )
    if args.position_embedding_type != "rope":
        for flag, given in (
            ("--rotary-interleaved", args.rotary_interleaved),
            ("--rotary-seq-len-interpolation-factor", args.rotary_seq_len_interpolation_factor),
            ("--use-rope-scaling", args.use_rope_scaling),
        ):
            _require(
                not given,
                f"{flag} applies to --position-embedding-type rope (this run: "
                f"{args.position_embedding_type})",
            )
    _require(
        args.rope_scaling_factor is None or args.use_rope_scaling,
        "--rope-scaling-factor applies with --use-rope-scaling",
    )
    if args.rotary_seq_len_interpolation_factor is not None:
        _require(
            args.rotary_seq_len_interpolation_factor > 0,
            "--rotary-seq-len-interpolation-factor must be positive, got "
            f"{args.rotary_seq_len_interpolation_factor}",
        )
    if args.position_embedding_type == "learned_absolute":
        _require(
            args.seq_length <= args.max_position_embeddings,
            f"--seq-length ({args.seq_length}) exceeds --max-position-embeddings "
            f"({args.max_position_embeddings})",
        )

    _validate_parallel_features(args, tp)
    _validate_device_features(args, cuda_available)

    # Batch.
    dp, mbs = args.data_parallel_size, args.micro_batch_size
    if args.global_batch_size is None:
        args.global_batch_size = mbs * dp
    _require(
        args.global_batch_size > 0,
        f"--global-batch-size must be positive, got {args.global_batch_size}",
    )
    _require(
        args.global_batch_size % (mbs * dp) == 0,
        f"--global-batch-size ({args.global_batch_size}) is not a multiple of "
        f"--micro-batch-size ({mbs}) x data-parallel size ({dp})",
    )
    args.num_microbatches = args.global_batch_size // (mbs * dp)

    # Learning rate.
    _require(args.lr >= 0.0, f"--lr must be >= 0, got {args.lr}")
    _require(
        0.0 <= args.min_lr <= args.lr,
        f"--min-lr ({args.min_lr}) must be between 0 and --lr ({args.lr})",
    )
    _require(
        0.0 <= args.lr_warmup_init <= args.lr,
        f"--lr-warmup-init ({args.lr_warmup_init}) must be between 0 and --lr ({args.lr})",
    )
    _validate_schedule(args)
    _require(
        not (args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler),
        "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler are mutually "
        "exclusive",
    )
    _require(args.clip_grad >= 0.0, f"--clip-grad must be >= 0, got {args.clip_grad}")
    _require(args.weight_decay >= 0.0, f"--weight-decay must be >= 0, got {args.weight_decay}")
    _require(args.adam_eps > 0.0, f"--adam-eps must be positive, got {args.adam_eps}")
    _require(
        args.optimizer != "sgd" or args.sgd_momentum >= 0.0,
        f"--sgd-momentum must be >= 0, got {args.sgd_momentum}",
    )
    for flag in ("init_method_std", "embedding_init_method_std"):
        value = getattr(args, flag)
        _require(
            value is None or value >= 0.0, f"--{flag.replace('_', '-')} must be >= 0, got {value}"
        )
    # as Megatron-LM; and numpy's generator takes seeds below 2**32, every stage's included
    _require(
        0 < args.seed and args.seed + SEED_STRIDE * (args.pipeline_model_parallel_size - 1) < 2**32,
        f"--seed must be positive and below 2**32 - 100 x (pipeline stages - 1), got {args.seed}",
    )

    # Precision and device.
    _require(not (args.fp16 and args.bf16), "--fp16 and --bf16 are mutually exclusive")
    if args.fp16 and not cuda_available:
        raise ArgumentError("--fp16 needs CUDA; CPU runs train in fp32 or --bf16")
    args.params_dtype = (
        torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    )
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if cuda_available else "gloo"
    _require(
        args.distributed_backend != "nccl" or cuda_available,
        "--distributed-backend nccl needs CUDA; use gloo on CPU",
    )
    if args.use_cpu_initialization is None:
        args.use_cpu_initialization = not cuda_available

    # Data.
    _require(
        args.dataloader_type in (None, "single"),
        f"--dataloader-type {args.dataloader_type}: this trainer reads the samples in order "
        "(single); megatron-core's GPT dataset shuffles them already",
    )
    _require(
        not args.reset_attention_mask or args.create_attention_mask_in_dataloader,
        "--reset-attention-mask needs the dataloader's masks: drop "
        "--no-create-attention-mask-in-dataloader",
    )
    # The lists the checks below read, kept for the datasets' build: a data-list file edited
    # after the start is not read again, so the run trains on the lists it checked.
    corpus = args.data_corpus = data_paths(args)
    _require(
        not (corpus.blend and corpus.splits),
        f"{'--data-path' if args.data_path else '--data-args-path'} and "
        + (
            "--train-/--valid-/--test-data-path"
            if args.per_split_data_args_path is None
            else "--per-split-data-args-path"
        )
        + " are exclusive: give one or the other",
    )
    _require(
        not corpus.splits or "train" in corpus.splits,
        "--valid-data-path/--test-data-path need --train-data-path"
        if args.per_split_data_args_path is None
        else f"--per-split-data-args-path {args.per_split_data_args_path}: no train datasets",
    )
    _require(
        args.mock_data != corpus.given,
        "give exactly one of --mock-data and --data-path (or --train-data-path)",
    )
    if args.tokenizer_type is None:
        _require(
            not (args.vocab_file or args.merge_file or args.tokenizer_model),
            "--vocab-file/--merge-file/--tokenizer-model given without --tokenizer-type: add "
            "--tokenizer-type GPT2BPETokenizer (vocab and merges), HuggingFaceTokenizer (a "
            "folder), SentencePieceTokenizer (a .model) or TikTokenizer (a .json)",
        )
        # As Megatron-LM: a corpus's ids mean nothing without the tokenizer that made them (a
        # GPT-2 corpus read with 256 byte ids trains on zeroed embeddings, silently at TP > 1)
        named = corpus.splits.get("train", ("--train-data-path",))[0]
        _require(
            args.mock_data,
            f"{corpus.blend_flag if corpus.blend else named} needs "
            "--tokenizer-type: "
            "the tokenizer its corpus was preprocessed with (scripts/preprocess_data.py's "
            "default is ByteLevelTokenizer)",
        )
        args.tokenizer_type = "NullTokenizer"
    if args.tokenizer_type == "GPT2BPETokenizer":
        for flag, path in (("--vocab-file", args.vocab_file), ("--merge-file", args.merge_file)):
            _require(
                path is not None and os.path.isfile(path),
                f"--tokenizer-type GPT2BPETokenizer needs {flag} (a file), got {path}",
            )
    elif args.tokenizer_type == "HuggingFaceTokenizer":
        _require(
            args.tokenizer_model is not None
            and (
                os.path.isfile(os.path.join(args.tokenizer_model, "tokenizer.json"))
                or os.path.isfile(args.tokenizer_model)
            ),
            "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model: a local folder with "
            f"tokenizer.json, got {args.tokenizer_model}",
        )
    elif args.tokenizer_type in _MODEL_FILE_TOKENIZERS:
        from .text_tokenizers import TokenizerFileError, tiktoken_vocab_size

        _require(
            args.tokenizer_model is not None and os.path.isfile(args.tokenizer_model),
            f"--tokenizer-type {args.tokenizer_type} needs --tokenizer-model: a file, got "
            f"{args.tokenizer_model}",
        )
        _require(
            args.tokenizer_type == "TikTokenizer" or not args.tokenizer_special_tokens,
            f"--tokenizer-special-tokens: {args.tokenizer_type} takes its special tokens from "
            "the model file",
        )
        if args.tokenizer_type == "TikTokenizer":
            try:
                tiktoken_vocab_size(
                    args.tokenizer_model,
                    args.vocab_size,
                    args.tiktoken_num_special_tokens,
                    args.tokenizer_special_tokens,
                )
            except TokenizerFileError as err:
                raise ArgumentError(str(err)) from None
    if args.tokenizer_type == "NullTokenizer":
        _require(
            args.vocab_size is not None and args.vocab_size > 0,
            "--tokenizer-type NullTokenizer needs a positive --vocab-size",
        )
    elif args.tokenizer_type == "ByteLevelTokenizer":
        _require(
            args.vocab_size in (None, BYTE_LEVEL_VOCAB_SIZE),
            f"--vocab-size {args.vocab_size} contradicts --tokenizer-type ByteLevelTokenizer "
            f"(its vocabulary has {BYTE_LEVEL_VOCAB_SIZE} entries; omit --vocab-size)",
        )
    elif args.tokenizer_type != "TikTokenizer" and args.vocab_size is not None:
        # Megatron-LM's scripts pass it; the files decide (TikTokenizer's is checked above)
        warnings.warn(
            f"--vocab-size is ignored with --tokenizer-type {args.tokenizer_type} (its "
            "files define the vocabulary)",
            stacklevel=2,
        )
    vocab = None  # the tokenizer's entries, which every token id of the data must be below
    if corpus.given or args.tokenizer_type not in ("NullTokenizer", "ByteLevelTokenizer"):
        # its files' contents too (the wrong kind of model file, no end-of-document token):
        # found at start, before any process group, as their existence is
        from .data import tokenizer_from_args
        from .text_tokenizers import TokenizerFileError

        try:
            vocab = tokenizer_from_args(args).vocab_size
        except TokenizerFileError as err:
            raise ArgumentError(str(err)) from None
    for flag, paths in corpus.splits.values():
        # each dataset is built whole for its split: it needs one sample
        for prefix, lengths in _checked_prefixes(paths, flag, args, vocab).items():
            _require(
                int(lengths.sum()) >= args.seq_length + 1,
                f"{flag} {prefix}: {int(lengths.sum())} tokens, less than one sample "
                f"(--seq-length + 1 = {args.seq_length + 1})",
            )
    if corpus.blend:
        lengths = _checked_prefixes(corpus.blend, corpus.blend_flag, args, vocab)
        _, blend_weights = parse_data_path(corpus.blend, corpus.blend_flag)
        split = [s for s in args.split.replace(" ", "").replace("/", ",").split(",") if s]
        _require(
            len(split) <= 3
            and all(re.fullmatch(r"[.0-9]+", s) and _is_number(s) for s in split)
            and sum(map(float, split)) > 0,
            f"--split '{args.split}' must be up to three non-negative weights in plain decimals "
            "(digits and a point), e.g. 969,30,1",
        )
        _check_split_sizes(args, blend_weights, lengths)

    if args.tensorboard_dir is not None and importlib.util.find_spec("tensorboard") is None:
        raise ArgumentError(
            "--tensorboard-dir needs the tensorboard package "
            "(pip install tensorboard, or the project's [tensorboard] extra)"
        )
    if args.wandb_project:
        _require(args.wandb_exp_name, "--wandb-project needs --wandb-exp-name (the run's name)")
        _require(
            args.wandb_save_dir or args.save,
            "--wandb-project needs --wandb-save-dir (or --save, whose wandb/ it then uses)",
        )
        _require(
            importlib.util.find_spec("wandb") is not None,
            "--wandb-project needs the wandb package (pip install wandb)",
        )

    het_tp = het_tp_config(args, cuda_available)
    _validate_uniform_recompute(args, het_tp, stage_layers)
    if het_tp.rebatches and het_tp.policy != "joint":  # joint also moves and resizes units
        dp = model_shape(args).data_parallel
        micro = args.micro_batch_size * dp
        _require(
            args.global_batch_size >= 2 * micro,
            f"{'--het-tp-policy rebatch' if het_tp.policy == 'rebatch' else '--het-dp'} moves "
            f"micro-batches between data-parallel replicas, and --global-batch-size "
            f"{args.global_batch_size} gives each of the {dp} replicas one: nothing can move "
            f"(at least {2 * micro}: two micro-batches a replica)",
        )
    _require(
        pp > 1 or args.het_tp_pipeline_moves == "both",
        f"--het-tp-pipeline-moves {args.het_tp_pipeline_moves} needs pipeline stages "
        "(--pipeline-model-parallel-size > 1)",
    )
    _require(
        args.het_tp_pipeline_moves != "layers" or not het_tp.resizes,
        f"--het-tp-pipeline-moves {args.het_tp_pipeline_moves}: "
        + (
            f"--het-tp-resize {args.het_tp_resize}"
            if args.het_tp_resize
            else f"--het-tp-policy {args.het_tp_policy}"
        )
        + " resizes, and layers stay in their stages under resizing (its priorities are kept "
        "per layer of a stage): use units, or a policy that only migrates",
    )

    # Checkpointing.
    if args.save_interval is not None:
        _require(
            args.save_interval > 0, f"--save-interval must be positive, got {args.save_interval}"
        )
        _require(args.save is not None, "--save-interval needs --save")
    _require(
        not args.log_progress or args.save is not None,
        "--log-progress writes <save>/progress.txt: it needs --save",
    )
    if args.save_retain_interval is not None:
        retain, every = args.save_retain_interval, args.save_interval
        _require(
            every is not None and retain > 0 and retain % every == 0,
            f"--save-retain-interval ({retain}) must be a positive multiple of --save-interval "
            f"({every})",
        )
    if args.exit_interval is not None:
        _require(
            args.exit_interval > 0, f"--exit-interval must be positive, got {args.exit_interval}"
        )
    if args.exit_duration_in_mins is not None:
        _require(
            0 < args.exit_duration_in_mins < math.inf,
            f"--exit-duration-in-mins must be a positive number, got {args.exit_duration_in_mins}",
        )
    _require(not args.finetune or args.load is not None, "--finetune loads a model: give --load")
    _require(
        not (args.finetune and args.pretrained_checkpoint),
        "--finetune with --pretrained-checkpoint would finetune from --load's own checkpoints "
        "at every restart: drop --finetune (--pretrained-checkpoint finetunes while --load "
        "holds none)",
    )
    if args.ckpt_step is not None:
        _require(
            args.load is not None or args.pretrained_checkpoint is not None,
            "--ckpt-step needs --load (or --pretrained-checkpoint)",
        )
        _require(args.ckpt_step > 0, f"--ckpt-step must be positive, got {args.ckpt_step}")
    _require(
        not args.exit_on_missing_checkpoint or args.load is not None,
        "--exit-on-missing-checkpoint needs --load",
    )
    if args.pretrained_checkpoint is not None:
        _require(
            os.path.isdir(args.pretrained_checkpoint),
            f"--pretrained-checkpoint {args.pretrained_checkpoint}: no such directory",
        )
    if args.load is not None and not os.path.isdir(args.load):
        # A missing --load is a typo that would silently start from scratch, except in
        # Megatron's auto-resume pattern (--load and --save the same folder), whose first run
        # finds nothing yet.
        _require(
            args.save is not None and same_folder(args.save, args.load),
            f"--load {args.load}: no such directory (to start from scratch, drop --load)",
        )
    # last: these create the folders, which nothing refused above should leave behind
    if args.save is not None:
        _check_writable(args.save, "--save")
    if args.metrics_file is not None and int(os.environ.get("RANK", "0")) == 0:  # its writer
        _check_writable(os.path.dirname(os.path.abspath(args.metrics_file)), "--metrics-file")
    if int(os.environ.get("RANK", "0")) == 0:  # the scalar writers' rank
        if args.tensorboard_dir is not None:
            _check_writable(args.tensorboard_dir, "--tensorboard-dir")
        if args.wandb_project:
            folder = args.wandb_save_dir or os.path.join(args.save, "wandb")
            _check_writable(
                folder, "--wandb-save-dir" if args.wandb_save_dir else "--save (wandb/ under it)"
            )
    if corpus.given and int(os.environ.get("RANK", "0")) == 0:  # its writer
        _check_dataset_cache(args, corpus)
    return het_tp


def _check_dataset_cache(args, corpus: DataPaths) -> None:
    """megatron-core writes each dataset's sample index on first use, after the model is built
    and a checkpoint loaded, into --data-cache-path (default: a cache/ folder under each
    --data-path prefix); a folder it cannot write stopped rank 0 there with an error naming
    neither. Checked without creating anything; a cache already built is only read."""
    if args.data_cache_path is not None:
        folders = [(args.data_cache_path, "")]
    else:
        prefixes = [
            prefix
            for paths in [corpus.blend or [], *(p for _, p in corpus.splits.values())]
            if paths
            for prefix in parse_data_path(paths)[0]
        ]
        folders = [
            (os.path.join(p, "cache", "GPTDataset_indices"), f" (the default under {p})")
            for p in prefixes
        ]
    for folder, where in folders:
        if os.path.isdir(folder) and os.listdir(folder):
            continue  # built by an earlier run: megatron-core reads it
        existing = os.path.abspath(folder)
        while not os.path.exists(existing):
            existing = os.path.dirname(existing)
        _require(
            os.path.isdir(existing) and os.access(existing, os.W_OK | os.X_OK),
            f"--data-cache-path {folder}{where}: not writable ({existing} is "
            f"{'not a folder' if not os.path.isdir(existing) else 'read-only'}): give "
            "--data-cache-path a writable folder",
        )


def same_folder(a: str, b: str) -> bool:
    """Whether two folder flags name one folder (links resolved), e.g. --load and --save in
    Megatron's auto-resume pattern. One test for the start-time check and the training loop."""
    return os.path.realpath(a) == os.path.realpath(b)


def _check_writable(folder: str, flag: str) -> None:
    """A folder the run writes must take files now, not fail at the first save hours into the
    run (or after the model was built)."""
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-check-"):
            pass
    except OSError as err:
        raise ArgumentError(f"{flag} {folder}: not writable ({err.strerror or err})") from None


# Megatron-LM features the het-TP layers do not implement: (args attribute, what it is).
_UNSUPPORTED_WITH_HET_TP = (
    ("num_experts", "mixture of experts layers"),
    ("mtp_num_layers", "multi-token prediction layers"),
    ("multi_latent_attention", "multi-latent attention layers"),
)


def model_shape(args) -> ModelShape:
    """The shape het-TP flags are checked against, from Megatron-LM style args (ours or
    upstream's, which keeps --num-query-groups at 1 unless --group-query-attention)."""
    groups = args.num_query_groups
    if not getattr(args, "group_query_attention", True) or groups is None:
        groups = args.num_attention_heads
    return ModelShape(
        args.tensor_model_parallel_size,
        args.num_layers,
        groups,
        args.ffn_hidden_size,
        getattr(args, "pipeline_model_parallel_size", 1) or 1,
        getattr(args, "data_parallel_size", 1) or 1,
        args.num_attention_heads,
    )


def het_tp_config(args, cuda_available: bool | None = None) -> HetTPConfig:
    """The validated het-TP config of Megatron-LM style args (this trainer's or an upstream
    checkout's); raises ArgumentError naming the flag. Reads `args`, never writes to it."""
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    given = HetTPConfig.from_args(args)
    try:
        config = given.validated(model_shape(args), cuda_available)
    except ConfigError as err:
        raise ArgumentError(str(err)) from None
    for why in given.ignored(config):
        warnings.warn(why, stacklevel=1)  # once a process, whoever asks
    if config.dp_compress != "none":
        for attr, why in (
            ("use_distributed_optimizer", "reduce-scatters into shards it owns"),
            ("overlap_grad_reduce", "reduces buckets asynchronously during backward"),
            ("grad_reduce_in_bf16", "keeps bf16 gradient buffers (compression takes fp32)"),
            ("fp16", "scales the loss (an overflow would poison the residues kept between steps)"),
        ):
            if getattr(args, attr, False):
                raise ArgumentError(
                    f"--het-dp-compress {config.dp_compress} replaces the plain all-reduce of "
                    f"fp32 gradients; --{attr.replace('_', '-')} {why}: drop one of them"
                )
    if config.het_tp:
        if getattr(args, "virtual_pipeline_model_parallel_size", None):
            raise ArgumentError(
                "--het-tp supports one model chunk: drop --num-layers-per-virtual-pipeline-stage "
                "(or --num-virtual-stages-per-pipeline-rank)"
            )
        for attr, what in _UNSUPPORTED_WITH_HET_TP:
            if getattr(args, attr, None):
                raise ArgumentError(f"--het-tp has no {what}: drop --{attr.replace('_', '-')}")
    return config


def _is_number(text):
    try:
        float(text)
    except ValueError:
        return False
    return True


def parse_data_path(data_path, flag: str = "--data-path"):
    """Megatron's blend syntax: either 'prefix ...' or 'weight prefix weight prefix ...'."""
    if len(data_path) == 1 or not _is_number(data_path[0]):
        _require(
            not any(_is_number(p) for p in data_path),
            f"{flag} {' '.join(data_path)}: mixes weights and prefixes",
        )
        return list(data_path), None
    _require(
        len(data_path) % 2 == 0 and all(_is_number(w) for w in data_path[0::2]),
        f"{flag} {' '.join(data_path)}: expected 'weight prefix' pairs",
    )
    weights = [float(w) for w in data_path[0::2]]
    _require(
        all(w >= 0 for w in weights) and sum(weights) > 0,
        f"{flag} weights must be non-negative and not all zero, got {weights}",
    )
    return list(data_path[1::2]), weights


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron pads the vocabulary so every TP rank holds an equal, aligned slice."""
    multiple = divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple
