"""Megatron-LM flag parsing and validation: derived values, and clear errors for bad input."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from megatron.hetero.arguments import (
    ArgumentError,
    build_parser,
    padded_vocab_size,
    parse_data_path,
    validate_args,
)
from tests.utils import BASE, ROOT, damage, make_corpus


def _args(extra="", world_size=1, cuda=False):
    args = build_parser().parse_args((BASE + " " + extra).split())
    validate_args(args, world_size, cuda_available=cuda)
    return args


def test_derived_values_follow_megatron():
    args = _args("--tensor-model-parallel-size 2 --global-batch-size 16", world_size=4)
    assert args.data_parallel_size == 2
    assert args.num_microbatches == 16 // (2 * 2)
    assert args.ffn_hidden_size == 4 * 64
    assert args.kv_channels == 16
    assert args.num_query_groups == 4  # no GQA: one group per head
    assert args.max_position_embeddings == 32
    assert args.lr_decay_iters == 10
    assert args.distributed_backend == "gloo"
    assert args.use_cpu_initialization is True
    assert args.params_dtype == torch.float32
    assert args.add_bias_linear is True


def test_defaults_fill_global_batch_and_swiglu_ffn():
    args = _args("--swiglu --group-query-attention --num-query-groups 2", world_size=2)
    assert args.global_batch_size == 2 * 2
    assert args.ffn_hidden_size == int((4 * 64 * 2 / 3) / 64) * 64
    assert args.num_query_groups == 2
    args = _args("--disable-bias-linear --untie-embeddings-and-output-weights")
    assert args.add_bias_linear is False and args.untie_embeddings_and_output_weights


def test_gpu_defaults_and_precision():
    args = _args("--bf16", cuda=True)
    assert args.params_dtype == torch.bfloat16 and args.distributed_backend == "nccl"
    assert args.use_cpu_initialization is False


@pytest.mark.parametrize(
    "extra,world,message",
    [
        (
            "--tensor-model-parallel-size 3",
            4,
            "world size (4) is not divisible by --tensor-model-parallel-size (3)",
        ),
        (
            "--tensor-model-parallel-size 8",
            8,
            "--num-attention-heads (4) must be divisible by --tensor-model-parallel-size (8)",
        ),
        (
            "--global-batch-size 6",
            2,
            "--global-batch-size (6) is not a multiple of --micro-batch-size (2) x data-parallel "
            "size (2)",
        ),
        (
            "--group-query-attention --num-query-groups 3",
            1,
            "--num-attention-heads (4) must be divisible by --num-query-groups (3)",
        ),
        (
            "--group-query-attention --num-query-groups 2 --tensor-model-parallel-size 4",
            4,
            "--num-query-groups (2) must be divisible",
        ),
        ("--fp16 --bf16", 1, "--fp16 and --bf16 are mutually exclusive"),
        ("--fp16", 1, "--fp16 needs CUDA"),
        ("--distributed-backend nccl", 1, "--distributed-backend nccl needs CUDA"),
        ("--min-lr 1.0", 1, "--min-lr (1.0) must be between 0 and --lr"),
        (
            "--lr-warmup-iters 10",
            1,
            "--lr-warmup-iters (10) must be smaller than --lr-decay-iters (10)",
        ),
        ("--save-interval 5", 1, "--save-interval needs --save"),
        ("--log-progress", 1, "--log-progress writes <save>/progress.txt: it needs --save"),
        (
            "--tensor-model-parallel-size 2 --het-tp-policy migrate --het-tp-pipeline-moves layers",
            2,
            "--het-tp-pipeline-moves layers needs pipeline stages "
            "(--pipeline-model-parallel-size > 1)",
        ),
        (
            "--tensor-model-parallel-size 2 --het-tp-policy migrate "
            "--het-tp-emulate persistent:global=0/4,factor=2",
            4,
            "persistent:global=0/4,factor=2: global rank 4 is not below the world size (4)",
        ),
        (
            "--pipeline-model-parallel-size 2 --het-tp-emulate persistent:stage=2,factor=2",
            2,
            "persistent:stage=2,factor=2: stage 2 is not a pipeline stage "
            "(--pipeline-model-parallel-size 2)",
        ),
        (
            "--pipeline-model-parallel-size 2 --tensor-model-parallel-size 2 --het-tp-resize 0,0.5"
            " --het-tp-pipeline-moves layers",
            4,
            "--het-tp-pipeline-moves layers: --het-tp-resize 0,0.5 resizes, and layers stay",
        ),
        (
            "--pipeline-model-parallel-size 3",
            3,
            "--num-layers (2) must be divisible by --pipeline-model-parallel-size (3)",
        ),
        (
            "--decoder-first-pipeline-num-layers 1",
            1,
            "--decoder-first-pipeline-num-layers needs --pipeline-model-parallel-size > 1",
        ),
        (
            "--pipeline-model-parallel-size 2 --decoder-last-pipeline-num-layers 2",
            2,
            "--num-layers (2) minus --decoder-last-pipeline-num-layers (2) must split evenly over "
            "the other 1 pipeline stage(s), at least one layer each",
        ),
        (
            "--pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 1 "
            "--decoder-last-pipeline-num-layers 2",
            2,
            "--decoder-first-pipeline-num-layers 1 and --decoder-last-pipeline-num-layers 2 must "
            "add up to --num-layers (2) with 2 pipeline stages",
        ),
        (
            "--het-tp-policy rebatch",
            2,
            "--het-tp-policy rebatch moves micro-batches between data-parallel replicas, and "
            "--global-batch-size 4 gives each of the 2 replicas one: nothing can move (at least 8",
        ),
        (
            "--het-dp --het-tp-policy migrate --tensor-model-parallel-size 2",
            4,
            "--het-dp moves micro-batches between data-parallel replicas",
        ),
        (
            "--pipeline-model-parallel-size 2 --tensor-model-parallel-size 2",
            6,
            "world size (6) is not divisible by --tensor-model-parallel-size (2) x "
            "--pipeline-model-parallel-size (2)",
        ),
        (
            "--max-position-embeddings 16",
            1,
            "--seq-length (32) exceeds --max-position-embeddings (16)",
        ),
        ("--hidden-dropout 1.5", 1, "--hidden-dropout must be in [0, 1)"),
        ("--adam-beta1 1.5", 1, "--adam-beta1 must be in [0, 1), got 1.5"),
        ("--adam-eps 0", 1, "--adam-eps must be positive, got 0.0"),
        ("--weight-decay -0.1", 1, "--weight-decay must be >= 0, got -0.1"),
        ("--lr-warmup-init 1", 1, "--lr-warmup-init (1.0) must be between 0 and --lr"),
        ("--seed 0", 1, "--seed must be positive and below 2**32"),
        ("--seed 4294967296", 1, "--seed must be positive and below 2**32"),
        (
            "--override-opt_param-scheduler --use-checkpoint-opt_param-scheduler",
            1,
            "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler are mutually",
        ),
        (
            "--tokenizer-type ByteLevelTokenizer",
            1,
            "--vocab-size 255 contradicts --tokenizer-type ByteLevelTokenizer",
        ),
        ("--data-path some/prefix", 1, "give exactly one of --mock-data and --data-path"),
        ("--train-iters 0", 1, "--train-iters must be positive, got 0"),
        ("--tensorboard-log-interval 0", 1, "--tensorboard-log-interval must be positive, got 0"),
        ("--tensorboard-queue-size -1", 1, "--tensorboard-queue-size must be >= 0, got -1"),
        ("--het-dp-compress int8", 1, "--het-dp-compress int8 compresses the data-parallel"),
        (
            "--het-dp-compress bf16 --use-distributed-optimizer",
            2,
            "--use-distributed-optimizer reduce-scatters",
        ),
        ("--het-dp-compress int8 --overlap-grad-reduce", 2, "--overlap-grad-reduce reduces"),
        (
            "--het-dp-compress int8 --bf16 --grad-reduce-in-bf16",
            2,
            "--grad-reduce-in-bf16 keeps bf16 gradient buffers",
        ),
        ("--het-dp-compress bf16", 8, "beyond 4 replicas; the data-parallel size is 8"),
        # values megatron-core or torch would fail on only once the model or optimizer is built
        ("--ffn-hidden-size -4", 1, "--ffn-hidden-size must be positive, got -4"),
        ("--kv-channels 0", 1, "--kv-channels must be positive, got 0"),
        ("--init-method-std -0.1", 1, "--init-method-std must be >= 0, got -0.1"),
        (
            "--embedding-init-method-std -1",
            1,
            "--embedding-init-method-std must be >= 0, got -1.0",
        ),
        ("--optimizer sgd --sgd-momentum -0.5", 1, "--sgd-momentum must be >= 0, got -0.5"),
        ("--bf16 --loss-scale -1", 1, "--loss-scale must be >= 0 (0 or left out: a dynamic"),
        (
            "--fp16 --initial-loss-scale 0.5 --min-loss-scale 1",
            1,
            "--initial-loss-scale (0.5) must be >= --min-loss-scale (1.0)",
        ),
        (
            "--num-layers 6 --recompute-granularity full --recompute-method uniform "
            "--recompute-num-layers 4",
            1,
            "--recompute-method uniform --recompute-num-layers 4 must divide every pipeline "
            "stage's layers, and stage 0 has 6",
        ),
        (
            "--num-layers 7 --pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 3"
            " --recompute-granularity full --recompute-method uniform --recompute-num-layers 2",
            2,
            "stage 0 has 3",
        ),
        (
            "--num-layers 8 --pipeline-model-parallel-size 2 --tensor-model-parallel-size 2 "
            "--het-tp-policy migrate --recompute-granularity full --recompute-method uniform "
            "--recompute-num-layers 2",
            4,
            "--het-tp-policy migrate moves layers between stages (--het-tp-pipeline-moves both)",
        ),
    ],
)
def test_contradictions_name_the_flag(extra, world, message):
    with pytest.raises(ArgumentError) as err:
        _args(extra, world_size=world)
    assert message in str(err.value)


def _het_tp(extra="", world_size=1, cuda=False):
    """The validated het-TP config validate_args returns (nothing of it lands in args)."""
    args = build_parser().parse_args((BASE + " " + extra).split())
    config = validate_args(args, world_size, cuda_available=cuda)
    assert not hasattr(args, "het_tp_plan_obj") and not hasattr(args, "het_tp_resize_shares")
    return config


def test_het_tp_flags():
    config = _het_tp(
        "--tensor-model-parallel-size 2 --het-tp-plan attn=3,1;mlp=200,56", world_size=2
    )
    assert config.het_tp and config.partition_plan.counts(1, "mlp") == (200, 56)
    config = _het_tp("--het-tp --het-tp-granularity 4 --tensor-model-parallel-size 2", world_size=2)
    assert config.het_tp and config.partition_plan is None and config.granularity == 4
    assert not _het_tp().het_tp and not _het_tp().active
    config = _het_tp(
        "--tensor-model-parallel-size 2 --het-tp-resize 0,0.75 --het-tp-max-resize 0.8",
        world_size=2,
    )
    assert config.het_tp and config.resize_shares == (0.0, 0.75)
    assert config.priority == "dw" and config.policy == "static"
    assert config.sample_interval == 8  # one step in 8 of each 50-step refresh
    config = _het_tp(
        "--tensor-model-parallel-size 2 --het-tp-resize 0,0.5 --het-tp-priority-interval 4",
        world_size=2,
    )
    assert config.sample_interval == 4  # at least one observed step per refresh
    config = _het_tp(
        "--tensor-model-parallel-size 2 --het-tp-policy hybrid --het-tp-emulate "
        "persistent:rank=1,factor=2,start=20",
        world_size=2,
    )
    assert config.het_tp and config.interval == 10 and config.resize_shares is None
    config = _het_tp(
        "--tensor-model-parallel-size 2 --het-tp-policy none --het-tp-emulate "
        "rotating:factor=2,period=5",
        world_size=2,
    )
    assert not config.het_tp and config.timed
    with pytest.raises(ArgumentError, match="--het-tp-emulate is implemented for CPU runs"):
        _het_tp(
            "--tensor-model-parallel-size 2 --het-tp-policy migrate --het-tp-emulate "
            "persistent:rank=1,factor=2",
            world_size=2,
            cuda=True,
        )
    # `none` slows nothing: as without the flag, on GPUs too, and it times no rank by itself
    for cuda in (False, True):
        config = _het_tp(
            "--tensor-model-parallel-size 2 --het-tp-policy static --het-tp-emulate none",
            world_size=2,
            cuda=cuda,
        )
        assert config.scenario is None and not config.timed
    config = _het_tp(
        "--tensor-model-parallel-size 2 --het-tp-policy migrate --het-tp-emulate-dilation 3",
        world_size=2,
    )
    assert config.emulate_dilation == 3.0 and config.timer == "cpu"
    with pytest.raises(
        ArgumentError, match="--het-tp-emulate-dilation emulates a device per rank on CPU"
    ):
        _het_tp("--het-tp-policy none --het-tp-emulate-dilation 2", cuda=True)


@pytest.mark.parametrize(
    "extra,message",
    [
        (
            "--het-tp-plan attn=3,3;mlp=128,128",
            "--het-tp-plan: plan attn: counts [3, 3] sum to 6, the model has 4 units",
        ),
        ("--het-tp-plan attn=4;mlp=256", "--het-tp-plan: plan attn: 1 counts for 2 ranks"),
        (
            "--het-tp --het-tp-granularity 3",
            "--het-tp-granularity 3 does not divide --ffn-hidden-size 256",
        ),
        (
            "--het-tp --het-tp-granularity 256",
            "= 1 MLP units must split evenly over --tensor-model-parallel-size 2",
        ),
        ("--het-tp-granularity 0", "--het-tp-granularity must be positive"),
        (
            "--het-tp-plan missing.json",
            "--het-tp-plan: plan file missing.json: No such file or directory",
        ),
        (
            "--het-tp-plan runs/plan1",
            "--het-tp-plan: plan file runs/plan1: No such file or directory",
        ),
        (
            "--het-tp-resize 0,0.6",
            "--het-tp-resize: rank 1 would skip 60% of its units, more than --het-tp-max-resize "
            "0.5 allows",
        ),
        (
            "--het-tp-resize 0,0.6 --het-tp-max-resize 0.5",
            "more than --het-tp-max-resize 0.5 allows",
        ),
        ("--het-tp-resize 0.5", "--het-tp-resize '0.5': 1 shares given, the TP size is 2"),
        ("--het-tp-resize 0,half", "--het-tp-resize '0,half': expected one share per TP rank"),
        ("--het-tp-resize 0,-0.1", "--het-tp-resize: rank 1 share -0.1 is not within [0, 1]"),
        ("--het-tp-max-resize 1.5", "--het-tp-max-resize must be within [0, 1], got 1.5"),
        ("--het-tp-priority-interval 0", "--het-tp-priority-interval must be positive"),
        (
            "--het-tp-priority-sample-interval 0",
            "--het-tp-priority-sample-interval must be within [1, --het-tp-priority-interval 50], "
            "got 0",
        ),
        (
            "--het-tp-priority-interval 10 --het-tp-priority-sample-interval 11",
            "--het-tp-priority-sample-interval must be within [1, --het-tp-priority-interval 10], "
            "got 11",
        ),
        (
            "--het-tp-policy none --het-tp-plan attn=3,1;mlp=200,56",
            "--het-tp-policy none runs vanilla megatron-core layers; drop --het-tp-plan",
        ),
        (
            "--het-tp-policy hybrid --het-tp-resize 0,0.5",
            "--het-tp-resize sets fixed shares; --het-tp-policy hybrid decides them itself",
        ),
        (
            "--het-tp-policy migrate --het-tp-interval 0",
            "--het-tp-interval must be positive, got 0",
        ),
        (
            "--het-tp-policy migrate --het-tp-end 1.5",
            "--het-tp-end (1.5) must be >= 1 and below --het-tp-onset (1.3)",
        ),
        (
            "--het-tp-policy migrate --het-tp-onset-at-once 1.2",
            "--het-tp-onset-at-once (1.2) must be >= --het-tp-onset (1.3)",
        ),
        (
            "--het-tp-policy resize --het-tp-emulate persistent:rank=2,factor=2",
            "--het-tp-emulate 'persistent:rank=2,factor=2': rank 2 is not a TP rank (TP size 2)",
        ),
        ("--het-tp-policy resize --het-tp-emulate slow", "unknown scenario 'slow'"),
        (
            "--het-tp-policy none --het-tp-emulate-dilation 0.5",
            "--het-tp-emulate-dilation must be a finite number >= 1, got 0.5",
        ),
        (
            "--het-tp-policy none --het-tp-emulate-dilation inf",
            "--het-tp-emulate-dilation must be a finite number >= 1, got inf",
        ),
        (
            "--het-tp-policy none --het-tp-emulate-dilation 3 --het-tp-timer wall",
            "it needs --het-tp-timer cpu, got wall",
        ),
        (
            "--het-tp-policy zero --het-tp-resize 0,0.25",
            "cuts a fixed 50%: --het-tp-resize shares must be 0 or 0.5",
        ),
        (
            "--het-tp-policy zero --het-tp-resize 0,0.5 --het-tp-priority wg",
            "--het-tp-policy zero ranks units by --het-tp-priority dw; drop --het-tp-priority wg",
        ),
    ],
)
def test_het_tp_flag_errors(extra, message):
    with pytest.raises(ArgumentError) as err:
        _args("--tensor-model-parallel-size 2 " + extra, world_size=2)
    assert message in str(err.value)


def test_hidden_not_divisible_by_heads():
    args = build_parser().parse_args(BASE.replace("--hidden-size 64", "--hidden-size 66").split())
    with pytest.raises(
        ArgumentError,
        match=r"--hidden-size \(66\) must be divisible by --num-attention-heads \(4\)",
    ):
        validate_args(args, 1, cuda_available=False)


def test_data_path_must_exist(tmp_path):
    (tmp_path / "d.bin").write_bytes(b"")
    args = build_parser().parse_args(
        BASE.replace("--mock-data --vocab-size 255", f"--data-path {tmp_path}/d").split()
    )
    # as Megatron-LM: a corpus's ids need the tokenizer that made them
    with pytest.raises(ArgumentError, match="--data-path needs --tokenizer-type"):
        validate_args(args, 1, cuda_available=False)
    args = build_parser().parse_args(
        BASE.replace(
            "--mock-data --vocab-size 255",
            f"--data-path {tmp_path}/d --tokenizer-type ByteLevelTokenizer",
        ).split()
    )
    with pytest.raises(ArgumentError, match=rf"--data-path {tmp_path}/d: no {tmp_path}/d.idx"):
        validate_args(args, 1, cuda_available=False)
    (tmp_path / "d.idx").write_bytes(b"")  # there, but not an index
    with pytest.raises(ArgumentError, match=rf"--data-path {tmp_path}/d: {tmp_path}/d.idx is"):
        validate_args(args, 1, cuda_available=False)


def test_upstream_s_dashed_spellings_are_accepted():
    """Megatron-LM takes these under two names each."""
    args = build_parser().parse_args(
        BASE.split()
        + ["--override-opt-param-scheduler", "--persistent-save-interval", "7"]
        + ["--use-checkpoint-opt-param-scheduler"]
    )
    assert args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler
    assert args.save_interval == 7


def test_data_path_blends():
    assert parse_data_path(["a", "b"]) == (["a", "b"], None)
    assert parse_data_path(["0.3", "a", "0.7", "b"]) == (["a", "b"], [0.3, 0.7])
    for bad in (["0.3", "a", "b"], ["0.3", "a", "0.7"], ["a", "0.5"], ["-1", "a", "2", "b"]):
        with pytest.raises(ArgumentError, match="--data-path"):
            parse_data_path(bad)


def test_padded_vocab_size():
    assert padded_vocab_size(256, 128, 1) == 256
    assert padded_vocab_size(257, 128, 1) == 384
    assert padded_vocab_size(256, 128, 4) == 512
    assert padded_vocab_size(50257, 128, 8) == 51200


def _run_cli(args, world_size=1, timeout=120):
    popen = _start_cli(args, world_size)
    try:
        out, err = popen.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        popen.kill()
        raise
    return subprocess.CompletedProcess(popen.args, popen.returncode, out, err)


def _start_cli(args, world_size=1):
    env = dict(os.environ, WORLD_SIZE=str(world_size))
    env.pop("RANK", None)
    return subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


@pytest.mark.parametrize(
    "argv,world,message",
    [
        (BASE + " --no-such-flag 3", 1, "unrecognized arguments: --no-such-flag 3"),
        (
            BASE.replace("--num-attention-heads 4", "--num-attention-heads 3"),
            1,
            "--hidden-size (64) must be divisible by --num-attention-heads (3)",
        ),
        (
            BASE.replace("--num-attention-heads 4", "--num-attention-heads 3")
            + " --tensor-model-parallel-size 2",
            2,
            "--num-attention-heads (3) must be divisible by --tensor-model-parallel-size (2)",
        ),
        (
            BASE + " --global-batch-size 5",
            2,
            "--global-batch-size (5) is not a multiple of --micro-batch-size (2) x data-parallel "
            "size (2)",
        ),
    ],
    ids=["unknown-flag", "heads-vs-hidden", "heads-vs-tp", "global-batch"],
)
def test_bad_flags_exit_2_without_traceback(argv, world, message):
    proc = _run_cli(argv.split(), world_size=world)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert proc.stderr.strip().splitlines()[-1].startswith("pretrain_gpt.py: error:")


def _parse_error(argv, capsys) -> str:
    """What pretrain_gpt.py's parsing prints as it exits with status 2 on `argv`."""
    from megatron.hetero.arguments import parse_args

    with pytest.raises(SystemExit) as done:
        parse_args(argv, world_size=1)
    assert done.value.code == 2
    return capsys.readouterr().err


def test_unsupported_megatron_lm_flags_are_named_apart_from_typos(capsys):
    """A Megatron-LM flag this trainer lacks is refused as one (with its values), a typo as
    unrecognized with the nearest flag; neither is ignored."""

    for extra, message in [
        (
            " --num-experts 8 --head-lr-mult 2 --moe-router-topk=2 --async-save --no-such-flag 3",
            "error: Megatron-LM flags (core_v0.16.1) this trainer does not support: "
            "--num-experts 8, --moe-router-topk=2 (mixture of experts: het-TP partitions dense "
            "attention heads and MLP units); --head-lr-mult 2 (README.md: Flags); --async-save "
            "(checkpoints are written synchronously, staged until every rank finished); "
            "unrecognized arguments: --no-such-flag 3\n",
        ),
        (
            " --lr-decay-stlye cosine",
            "error: unrecognized arguments: --lr-decay-stlye cosine "
            "(did you mean --lr-decay-style?)\n",
        ),
        (" stray", "error: unrecognized arguments: stray\n"),
        (  # a value before any flag, a short option, a bare "--"
            " stray --num-experts 8 -x 3 -- a",
            "error: Megatron-LM flags (core_v0.16.1) this trainer does not support: "
            "--num-experts 8 (mixture of experts: het-TP partitions dense attention heads and MLP "
            "units); unrecognized arguments: stray, -x 3, -- a\n",
        ),
    ]:
        assert _parse_error((BASE + extra).split(), capsys).endswith(message), extra


def test_every_reason_for_refusing_megatron_lm_flags_names_some():
    """Each prefix of a family of unsupported Megatron-LM flags matches a flag of core_v0.16.1's
    parser that this trainer lacks (a prefix the list outgrew would be dead text)."""
    from megatron.hetero.arguments import UNSUPPORTED_FAMILIES
    from megatron.hetero.megatron_lm_flags import FLAGS

    ours = {name for action in build_parser()._actions for name in action.option_strings}
    for prefixes, why in UNSUPPORTED_FAMILIES:
        for prefix in prefixes:
            matched = {flag for flag in FLAGS if flag.startswith(prefix)}
            assert matched - ours, (prefix, why)


def test_use_checkpoint_args_needs_a_checkpoint_folder_and_sizes_until_one_is_saved(
    tmp_path, capsys
):

    unsized = BASE.replace("--num-layers 2 --hidden-size 64", "") + " --use-checkpoint-args"
    for extra, message in [
        ("", "error: --use-checkpoint-args needs --load (or --pretrained-checkpoint)\n"),
        (  # the auto-resume pattern's first run: nothing saved yet, so the sizes are needed
            f" --load {tmp_path} --save {tmp_path}",
            "error: the following arguments are required: --num-layers, --hidden-size "
            "(--use-checkpoint-args: no checkpoint to take them from yet)\n",
        ),
    ]:
        assert _parse_error((unsized + extra).split(), capsys).endswith(message), extra
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("4")
    (tmp_path / "iter_0000004").mkdir()  # no common state: a damaged checkpoint
    assert f"error: --use-checkpoint-args: {tmp_path}/iter_0000004: its recorded flags cannot" in (
        _parse_error((unsized + f" --load {tmp_path}").split(), capsys)
    )


def test_missing_required_flag_is_named():
    proc = _run_cli(["--num-layers", "2"])
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [  # one line, every missing flag at once
        "pretrain_gpt.py: error: the following arguments are required: --hidden-size, "
        "--num-attention-heads, --seq-length, --micro-batch-size, --lr"
    ]


def test_load_and_save_are_checked_at_start(tmp_path):
    missing = str(tmp_path / "typo")
    with pytest.raises(ArgumentError, match=f"--load {missing}: no such directory"):
        _args(f"--load {missing}")
    # Megatron's auto-resume pattern: the first run's --load (= --save) does not exist yet
    _args(f"--load {missing} --save {missing}")
    assert os.path.isdir(missing) and os.listdir(missing) == []  # created, probe removed
    # the same folder through a link is the same folder (the training loop's test, too)
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    _args(f"--load {tmp_path}/real/ckpt --save {tmp_path}/link/ckpt")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ArgumentError, match=f"--save {blocker}/ckpt: not writable"):
        _args(f"--save {blocker}/ckpt")


def test_megatron_checkpoint_flags_are_checked_at_start(tmp_path):
    for extra, message in [
        ("--finetune", "--finetune loads a model: give --load"),
        (
            f"--load {tmp_path} --finetune --pretrained-checkpoint {tmp_path}",
            "--finetune with --pretrained-checkpoint would finetune from --load's own",
        ),
        ("--ckpt-step 5", "--ckpt-step needs --load (or --pretrained-checkpoint)"),
        (f"--load {tmp_path} --ckpt-step 0", "--ckpt-step must be positive, got 0"),
        ("--exit-on-missing-checkpoint", "--exit-on-missing-checkpoint needs --load"),
        (
            f"--save {tmp_path} --save-interval 2 --save-retain-interval 3",
            "--save-retain-interval (3) must be a positive multiple of --save-interval (2)",
        ),
        (
            f"--pretrained-checkpoint {tmp_path}/typo",
            f"--pretrained-checkpoint {tmp_path}/typo: no such directory",
        ),
    ]:
        with pytest.raises(ArgumentError) as err:
            _args(extra)
        assert message in str(err.value), extra
    # Megatron-LM's finetuning pattern: --load (= --save) does not exist yet
    mine = f"{tmp_path}/mine"
    args = _args(f"--load {mine} --save {mine} --pretrained-checkpoint {tmp_path} --ckpt-step 2")
    assert args.pretrained_checkpoint == str(tmp_path) and args.ckpt_step == 2
    with pytest.raises(ArgumentError, match="no such directory"):  # a typo stays one
        _args(f"--load {tmp_path}/typo --pretrained-checkpoint {tmp_path}")
    for flag in ("no_load_optim", "no_load_rng", "no_save_optim", "no_save_rng"):
        assert getattr(_args(f"--{flag.replace('_', '-')}"), flag) is True


def test_early_errors_exit_2_with_one_line(tmp_path):
    prefix = make_corpus(tmp_path)
    damage(prefix + ".bin", "truncate")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    base = BASE.split()
    cases = [
        (base + ["--load", str(tmp_path / "typo")], 1, "--load"),
        (base + ["--save", f"{blocker}/ckpt"], 1, "not writable"),
        (
            base
            + ["--tensor-model-parallel-size", "2", "--het-tp-policy", "migrate"]
            + ["--het-tp-emulate", "persistent:rank=1,factor=nan"],
            2,
            "slowdown factors must be finite numbers >= 1, got nan",
        ),
        (base + ["--het-tp-policy", "migrate"], 1, "--tensor-model-parallel-size 1 has nothing"),
        (
            [a for a in base if a not in ("--mock-data", "--vocab-size", "255")]
            + ["--data-path", prefix, "--tokenizer-type", "ByteLevelTokenizer"],
            1,
            f"{prefix}.bin is corrupt",
        ),
    ]
    # each case is a fresh interpreter that fails at start: launched side by side
    started = [_start_cli(argv, world_size=world) for argv, world, _ in cases]
    for (argv, _, message), popen in zip(cases, started):
        out, err = popen.communicate(timeout=300)
        proc = subprocess.CompletedProcess(argv, popen.returncode, out, err)
        assert proc.returncode == 2, (message, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("pretrain_gpt.py: error:"), proc.stderr
        assert message in lines[0], lines[0]
        assert "Traceback" not in proc.stderr + proc.stdout


@pytest.mark.parametrize(
    "extra,message",
    [
        (
            "--transformer-impl transformer_engine",
            "--transformer-impl transformer_engine: Transformer Engine layers are not supported",
        ),
        ("--fp8-format hybrid", "--fp8-format hybrid: FP8 needs Transformer Engine"),
        ("--spec my.module my_spec", "--spec my.module my_spec: hettp builds"),
        ("--spec", "--spec: hettp builds"),
        ("--cuda-graph-impl local", "--cuda-graph-impl local: CUDA graphs are not supported"),
    ],
)
def test_megatron_flags_not_supported_yet_are_refused_by_name(extra, message):
    with pytest.raises(ArgumentError) as err:
        _args(extra)
    assert str(err.value).startswith(message)


def test_refused_flags_accept_their_supported_values():
    args = _args("--transformer-impl local --cuda-graph-impl none")
    assert (args.transformer_impl, args.cuda_graph_impl) == ("local", "none")


@pytest.mark.parametrize(
    "extra,message",
    [
        ("--recompute-granularity full", "--recompute-granularity full needs --recompute-method"),
        (
            "--recompute-granularity full --recompute-method uniform --recompute-num-layers 3",
            "needs --recompute-num-layers between 1 and --num-layers (2), got 3",
        ),
        (
            "--recompute-granularity selective --recompute-method block",
            "--recompute-method applies to --recompute-granularity full only (not selective)",
        ),
        ("--recompute-num-layers 1", "--recompute-num-layers applies to --recompute-granularity"),
        (
            "--recompute-activations --recompute-granularity full --recompute-method uniform "
            "--recompute-num-layers 1",
            "--recompute-activations means --recompute-granularity selective, not full",
        ),
        (
            "--sequence-parallel --tensor-model-parallel-size 2 --seq-length 33 "
            "--max-position-embeddings 33",
            "--seq-length (33) must be divisible by --tensor-model-parallel-size (2)",
        ),
        ("--overlap-grad-reduce --ddp-bucket-size 0", "--ddp-bucket-size must be positive"),
        (
            "--lr-decay-samples 5",
            "--lr-decay-samples goes with --train-samples; with --train-iters use --lr-decay-iters",
        ),
        ("--lr-warmup-fraction 0.1 --lr-warmup-iters 2", "--lr-warmup-fraction and"),
        (
            "--overlap-param-gather --overlap-grad-reduce",
            "--overlap-param-gather is only supported with --use-distributed-optimizer",
        ),
        (
            "--overlap-param-gather --use-distributed-optimizer",
            "--overlap-param-gather needs --overlap-grad-reduce",
        ),
    ],
)
def test_recompute_and_overlap_flags_are_checked_as_megatron_does(extra, message):
    world = 2 if "--tensor-model-parallel-size 2" in extra else 1
    with pytest.raises(ArgumentError, match=re.escape(message)):
        _args(extra, world)


def test_a_bucket_size_without_overlap_is_ignored_with_a_warning():
    with pytest.warns(UserWarning, match="--ddp-bucket-size is ignored without"):
        _args("--ddp-bucket-size 1000")


def test_a_het_tp_flag_the_run_never_reads_is_warned_of_by_name():
    with pytest.warns(UserWarning, match="--het-tp-attn-granularity is ignored: --het-tp-policy"):
        _args("--het-tp-attn-granularity 1 --tensor-model-parallel-size 2", 2)
    with pytest.warns(UserWarning, match="--het-tp-priority is ignored: no rank skips units"):
        _args(
            "--het-tp-policy migrate --het-tp-priority magnitude --tensor-model-parallel-size 2", 2
        )


def test_parallel_checkpoint_saving_is_the_default_and_the_old_checkpoint_flags_warned_no_ops():
    assert _args("").ckpt_fully_parallel_save
    for flag in ("--no-ckpt-fully-parallel-save", "--disable-ckpt-fully-parallel-save"):
        assert not _args(flag).ckpt_fully_parallel_save
    with pytest.warns(UserWarning, match="--ckpt-fully-parallel-save is deprecated"):
        assert _args("--ckpt-fully-parallel-save").ckpt_fully_parallel_save
    for flag in ("--use-dist-ckpt", "--dist-ckpt-format torch_dist"):
        with pytest.warns(UserWarning, match=f"{flag.split()[0]} is deprecated and has no effect"):
            _args(flag)


def test_sequence_parallel_is_dropped_at_tp1_with_megatrons_warning():
    with pytest.warns(UserWarning, match="Disabling sequence parallelism"):
        args = _args("--sequence-parallel")
    assert args.sequence_parallel is False
    assert _args("--sequence-parallel --tensor-model-parallel-size 2", 2).sequence_parallel
    assert _args("--recompute-activations").recompute_granularity == "selective"


def test_megatron_lm_no_fusion_flags_are_accepted():
    """Megatron-LM command lines turn fusions off; this trainer never fuses, so they pass."""
    from megatron.hetero.arguments import NEVER_FUSED

    args = _args(" ".join(f"--no-{fusion}" for fusion in NEVER_FUSED))
    assert args.no_masked_softmax_fusion and args.no_persist_layer_norm


def test_what_uniform_recompute_and_loss_scales_accept():
    """The chunks that divide every stage; layers that stay in their stages; bf16 runs, whose
    loss-scale flags nothing reads."""
    uniform = "--recompute-granularity full --recompute-method uniform --recompute-num-layers"
    _args(f"--num-layers 6 {uniform} 3")
    _args(f"--num-layers 6 {uniform} 1")
    _args(
        "--num-layers 6 --recompute-granularity full --recompute-method block "
        "--recompute-num-layers 4"
    )
    pipeline = "--num-layers 8 --pipeline-model-parallel-size 2 --tensor-model-parallel-size 2"
    _args(f"{pipeline} --het-tp-policy migrate {uniform} 1", 4)
    _args(f"{pipeline} --het-tp-policy migrate --het-tp-pipeline-moves units {uniform} 2", 4)
    _args(f"{pipeline} --het-tp-policy hybrid {uniform} 2", 4)  # resizing: layers stay
    _args("--bf16 --initial-loss-scale 0.5 --loss-scale 0")
    _args("--fp16 --loss-scale 0", cuda=True)  # Megatron-LM's spelling of a dynamic scale
    _args("--sgd-momentum -0.5")  # Adam's run: never read
    _args("--fp16 --loss-scale 8 --initial-loss-scale 0.5", cuda=True)  # static: no initial


def test_logging_folders_must_take_files_before_anything_is_built(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.raises(ArgumentError, match=f"--tensorboard-dir {blocked}/tb: not writable"):
        _args(f"--tensorboard-dir {blocked}/tb")
    saved = f"--wandb-project p --wandb-exp-name e --save {tmp_path}/ckpt"
    fake = tmp_path / "site"  # the check that wandb is installed comes first
    (fake / "wandb").mkdir(parents=True)
    (fake / "wandb" / "__init__.py").write_text("")
    sys.path.insert(0, str(fake))
    try:
        with pytest.raises(ArgumentError, match=f"--wandb-save-dir {blocked}/w: not writable"):
            _args(f"{saved} --wandb-save-dir {blocked}/w")
        (tmp_path / "ckpt").mkdir(exist_ok=True)  # the --save check made it
        (tmp_path / "ckpt" / "wandb").write_text("")  # a file where the folder goes
        under = re.escape(f"--save (wandb/ under it) {tmp_path}/ckpt/wandb: not writable")
        with pytest.raises(ArgumentError, match=under):
            _args(saved)
    finally:
        sys.path.remove(str(fake))


def test_split_weights_take_megatron_cores_number_syntax(tmp_path):
    prefix = make_corpus(tmp_path)
    data = [a for a in BASE.split() if a not in ("--mock-data", "--vocab-size", "255")]
    data += ["--data-path", prefix, "--tokenizer-type", "ByteLevelTokenizer"]
    for split in ("1e3,1,1", "1_000,1,1", "-1,1,1"):
        args = build_parser().parse_args(data + [f"--split={split}"])
        with pytest.raises(
            ArgumentError, match="must be up to three non-negative weights in plain"
        ):
            validate_args(args, 1, cuda_available=False)
    args = build_parser().parse_args(data + ["--split", "1.0, 0, 0"])
    validate_args(args, 1, cuda_available=False)


def test_refused_load_and_unwritable_metrics_leave_no_folder(tmp_path):
    """The checks that refuse a run come before the ones that create its folders."""
    save = tmp_path / "new-save"
    with pytest.raises(ArgumentError, match="no such directory"):
        _args(f"--save {save} --load {tmp_path / 'typo'}")
    assert not save.exists()
    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.raises(ArgumentError, match=f"--metrics-file {blocked}: not writable"):
        _args(f"--metrics-file {blocked / 'm.jsonl'}")


def _readme_flags_table(text: str) -> dict[str, set[str]]:
    """README.md's Flags table: per group, every `--flag` its row names."""
    table = text.split("\n## Flags\n", 1)[1].split("\n\n", 2)[1]
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 2 and cells[0] not in ("group", "---"):
            rows[cells[0]] = set(re.findall(r"--[a-z0-9][a-z0-9_-]*", cells[1]))
    return rows


def test_the_readme_flags_table_is_what_the_parser_accepts():
    """Every flag the README's table lists parses (the refused ones too: refused by name after
    parsing), and every het-TP flag the parser has is in the table; the table's policy choices
    are the parser's."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    rows = _readme_flags_table(text)
    assert {"model", "training", "checkpoints", "het-TP (hettp)"} <= set(rows), sorted(rows)
    parser = build_parser()
    known = set(parser._option_string_actions)
    listed = set().union(*rows.values())
    assert not listed - known, sorted(listed - known)
    het = {o for o in known if o.startswith("--het")}
    assert het == rows["het-TP (hettp)"], sorted(het ^ rows["het-TP (hettp)"])
    policy = parser._option_string_actions["--het-tp-policy"].choices
    assert f"--het-tp-policy {{{','.join(policy)}}}" in text


def test_the_readme_s_complete_launch_commands_are_valid():
    """Every whole `torchrun ... pretrain_gpt.py` line of the README's bash blocks (not those
    with `...`, nor upstream's through scripts/upstream_cpu.py) parses and validates at its
    --nproc_per_node ranks on CPU."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    commands = [
        line.split("#", 1)[0]
        for block in re.findall(r"```bash\n(.*?)```", text, re.S)
        for line in block.replace("\\\n", " ").splitlines()
        if re.search(r"torchrun --nproc_per_node \d+ pretrain_gpt\.py", line) and "..." not in line
    ]
    assert len(commands) >= 2, commands  # the CPU example and the pipeline one
    for command in commands:
        ranks, flags = re.search(r"--nproc_per_node (\d+) pretrain_gpt\.py(.*)", command).groups()
        args = build_parser().parse_args(flags.split())
        validate_args(args, int(ranks), cuda_available=False)


def test_the_local_launcher_s_usage_example_is_a_valid_command():
    """scripts/run_local.sh's header shows how to launch (the README sends users there): its
    pretrain_gpt.py flags parse and validate at the ranks it would start (TP=2: two)."""
    header = open(os.path.join(ROOT, "scripts", "run_local.sh"), encoding="utf-8").read()
    example = header.split("#   bash scripts/run_local.sh ", 1)[1].split("\n#   DRY_RUN", 1)[0]
    argv = example.replace("\\\n#", " ").split()
    args = build_parser().parse_args(argv)
    validate_args(args, 2, cuda_available=False)
    assert args.tensor_model_parallel_size == 2 and args.het_tp_policy == "hybrid"
