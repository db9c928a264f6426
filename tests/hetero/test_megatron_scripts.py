"""Megatron-LM's own example launch scripts at core_v0.16.1, shrunk (model sizes, batch sizes,
parallel sizes for 4 CPU ranks) with their paths replaced: every flag is known to
pretrain_gpt.py, those that need a GPU are refused on CPU one line each naming the flag, those
hettp cannot honour yet are refused by name with the reason, and the rest validate."""

from __future__ import annotations

import re

import pytest

from megatron.hetero.arguments import ArgumentError, build_parser, validate_args
from tests.utils import make_corpus

# examples/gpt3/train_gpt3_175b_distributed.sh (GPT_MODEL_ARGS, TRAINING_ARGS,
# MODEL_PARALLEL_ARGS, DATA_ARGS, EVAL_AND_LOGGING_ARGS); the script names no tokenizer type
# (Megatron-LM's GPT2BPETokenizer reads its --vocab-file/--merge-file), added here.
GPT3 = """
--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32
--max-position-embeddings 32 --attention-backend auto
--micro-batch-size 1 --global-batch-size 8 --rampup-batch-size 2 2 16 --train-iters 20
--weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 --clip-grad 1.0
--fp16 --lr 6.0e-5 --lr-decay-style cosine --min-lr 6.0e-6 --lr-warmup-fraction .001
--lr-decay-iters 18
--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
--data-path {data} --vocab-file {vocab} --merge-file {merges} --split 949,50,1
--tokenizer-type GPT2BPETokenizer
--log-interval 100 --save-interval 10000 --eval-interval 1000 --save {ckpt} --load {ckpt}
--eval-iters 10 --tensorboard-dir {tb}
"""

# examples/llama/train_llama3_8b_h100_fp8.sh with DTYPE=fp8 and its mock-data branch
LLAMA3 = """
--use-mcore-models --num-layers 2 --hidden-size 64 --ffn-hidden-size 224
--num-attention-heads 4 --group-query-attention --num-query-groups 2 --kv-channels 16
--seq-length 32 --max-position-embeddings 32 --position-embedding-type rope
--rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0 --hidden-dropout 0.0
--swiglu --init-method-std 0.0134 --attention-backend fused --apply-layernorm-1p
--untie-embeddings-and-output-weights --disable-bias-linear
--micro-batch-size 1 --global-batch-size 8 --train-samples 160 --lr-decay-samples 150
--lr-warmup-samples 16 --lr 0.00015 --min-lr 0.00001 --decoupled-lr 5.0e-4
--decoupled-min-lr 4.5e-5 --lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1
--adam-beta1 0.9 --adam-beta2 0.95 --bf16 --grad-reduce-in-bf16 --cross-entropy-loss-fusion
--calculate-per-token-loss --manual-gc --empty-unused-memory-level 1
--exit-duration-in-mins 235
--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
--fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-param-gather
--tensor-model-parallel-size 2 --context-parallel-size 1 --sequence-parallel
--mock-data --tokenizer-type NullTokenizer --vocab-size 255 --data-cache-path {cache}
--tiktoken-pattern v2 --split 99,1,0 --no-create-attention-mask-in-dataloader
--no-mmap-bin-files --num-workers 1
--log-interval 1 --eval-iters 32 --eval-interval 100 --save-interval 1000 --log-throughput
--profile --profile-step-start 4 --profile-step-end 6 --ckpt-format torch_dist
--distributed-timeout-minutes 60 --save {ckpt} --load {ckpt} --tensorboard-dir {tb}
"""

# What hettp refuses in each, on a CPU machine, in the order validation meets it; each
# (flags to drop or replace, the error) pair is removed before the next is checked.
GPT3_REFUSALS = [
    # Megatron-LM refuses this pair in its own script too (iteration-based training, no ramp)
    ("--rampup-batch-size 2 2 16", "--rampup-batch-size 2 2 16 goes with --train-samples"),
    ("--fp16", "--fp16 needs CUDA"),
]
LLAMA3_REFUSALS = [
    ("--fp8-param-gather", "--fp8-param-gather: FP8 needs Transformer Engine"),
    ("--fp8-format hybrid", "--fp8-format hybrid: FP8 needs Transformer Engine"),
    ("--attention-backend fused", "--attention-backend fused: Transformer Engine's attention"),
    ("--cross-entropy-loss-fusion", "--cross-entropy-loss-fusion needs CUDA"),
    ("--profile ", "--profile without --use-pytorch-profiler captures nsys ranges"),
]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    folder = tmp_path_factory.mktemp("scripts")
    tokenizer = folder / "tokenizer"
    from megatron.hetero.text_tokenizers import train_byte_level_bpe

    files = train_byte_level_bpe(["def f(x):\n    return x\n" * 50] * 4, 300, str(tokenizer))
    return {
        "data": make_corpus(folder, documents=1000),  # 949,50,1 leaves every split a sequence
        "vocab": files["vocab_file"],
        "merges": files["merge_file"],
        "ckpt": str(folder / "ckpt"),
        "tb": str(folder / "tb"),
        "cache": str(folder / "cache"),
    }


def _flags(template, paths):
    return " ".join(template.format(**paths).split())


def _check(flags, cuda=False):
    args = build_parser().parse_args(flags.split())
    validate_args(args, 4, cuda_available=cuda)
    return args


@pytest.mark.parametrize("template", [GPT3, LLAMA3], ids=["gpt3-175b", "llama3-8b-fp8"])
def test_every_flag_of_the_example_scripts_is_known(template, paths):
    known = set(build_parser()._option_string_actions)
    flags = re.findall(r"(?<!\S)--[a-z0-9-]+", template)
    assert [f for f in flags if f not in known] == []
    build_parser().parse_args(_flags(template, paths).split())  # and every value parses


@pytest.mark.parametrize(
    "template,refusals",
    [(GPT3, GPT3_REFUSALS), (LLAMA3, LLAMA3_REFUSALS)],
    ids=["gpt3-175b", "llama3-8b-fp8"],
)
def test_what_cannot_run_here_is_refused_by_name_and_the_rest_validates(template, refusals, paths):
    flags = _flags(template, paths)
    for drop, message in refusals:
        with pytest.raises(ArgumentError) as err:
            _check(flags)
        assert str(err.value).startswith(message) or message in str(err.value), str(err.value)
        assert drop in flags + " "
        flags = (flags + " ").replace(drop if drop.endswith(" ") else drop + " ", " ", 1)
        flags = " ".join(flags.split())
    args = _check(flags)
    assert args.tensor_model_parallel_size == 2
    assert args.pipeline_model_parallel_size * args.data_parallel_size == 2  # gpt3: PP=2


def test_the_llama_scripts_settings_reach_the_run(paths):
    """What the llama script asks for and this machine can do arrives where it applies."""
    flags = _flags(LLAMA3, paths)
    for drop, _ in LLAMA3_REFUSALS:
        flags = " ".join((flags + " ").replace(drop.strip() + " ", " ", 1).split())
    args = _check(flags)
    assert args.train_iters == 160 // 8 and args.lr_decay_steps == 150
    assert args.lr_warmup_steps == 16
    assert args.apply_layernorm_1p and args.calculate_per_token_loss and args.manual_gc
    assert not args.create_attention_mask_in_dataloader and not args.mmap_bin_files
    assert args.use_distributed_optimizer and args.overlap_param_gather
    assert args.decoupled_lr == 5.0e-4 and args.grad_reduce_in_bf16


def test_the_gpt3_scripts_ramp_runs_once_its_schedule_counts_samples(paths):
    flags = _flags(GPT3, paths)
    for old, new in [
        ("--train-iters 20", "--train-samples 160"),
        ("--lr-decay-iters 18", "--lr-decay-samples 144"),
        ("--fp16", ""),
    ]:
        flags = flags.replace(old, new)
    args = _check(flags)
    # 4 ranks at TP=2 x PP=2: DP 1, micro-batch 1; batches 2, 2, 2, 4, 4, 6 reach sample
    # 20 > 16, then (160 - 20) // 8 = 17 full steps
    assert args.rampup_batch_size == [2, 2, 16] and args.train_iters == 23
    assert args.lr_decay_steps == 144


def test_on_a_gpu_host_only_what_needs_transformer_engine_or_new_features_is_refused(paths):
    """cuda_available=True: --fp16, the fused cross entropy and nsys profiling pass; FP8 and
    Transformer Engine's attention are refused (hettp's layers are megatron-core's local ones),
    as is ramp-up with --train-iters (Megatron-LM's own rule)."""
    llama = _flags(LLAMA3, paths)
    for drop in ("--fp8-param-gather", "--fp8-format hybrid", "--attention-backend fused"):
        with pytest.raises(ArgumentError, match=re.escape(drop)):
            _check(llama, cuda=True)
        llama = " ".join((llama + " ").replace(drop + " ", " ", 1).split())
    args = _check(llama, cuda=True)
    assert args.cross_entropy_loss_fusion and args.profile and not args.use_pytorch_profiler
    gpt3 = _flags(GPT3, paths)
    drop = "--rampup-batch-size 2 2 16"
    with pytest.raises(ArgumentError, match=re.escape(drop)):
        _check(gpt3, cuda=True)
    gpt3 = " ".join((gpt3 + " ").replace(drop + " ", " ", 1).split())
    args = _check(gpt3, cuda=True)
    assert args.fp16 and args.pipeline_model_parallel_size == 2
