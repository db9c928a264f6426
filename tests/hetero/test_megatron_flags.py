"""Megatron-LM flags honoured on real gloo ranks: sample-based schedules (equal to the
iteration-based ones, and resumed exactly), per-token loss, causal masks left to the attention,
manual garbage collection, throughput logging, the params norm and zero-gradient count,
zero-centred norms, the torch profiler; and what the rest map to."""

from __future__ import annotations

import os
import re

import pytest
import torch

from hettp.metrics import read_metrics
from megatron.hetero.arguments import build_parser, validate_args
from megatron.hetero.data import dataset_config, tokenizer_from_args
from megatron.hetero.flops import flops_per_sample
from megatron.hetero.training import optimizer_config
from tests.utils import GQA, MHA, run_ranks, train

TP2 = " --tensor-model-parallel-size 2 --global-batch-size 8 --eval-iters 0 --log-interval 1"


def _argv(extra: str = "", iters: str = "--train-iters 10") -> list[str]:
    return (MHA.replace("--train-iters 1", iters) + TP2 + " " + extra).split()


def _args(extra: str):
    args = build_parser().parse_args((MHA + " " + extra).split())
    validate_args(args, 1, cuda_available=False)
    return args


def _close(got, want, rel=1e-5):
    assert got.keys() == want.keys()
    for step in want:
        assert abs(got[step] - want[step]) <= rel * abs(want[step]), (step, got, want)


def test_a_sample_based_schedule_is_the_iteration_based_one():
    """(Resuming one exactly: the ramp-up test below.)"""
    by_iters = run_ranks(train, 2, _argv("--lr-warmup-iters 2 --lr-decay-style cosine --het-tp"))[0]
    samples = "--train-samples 80 --lr-warmup-samples 16 --lr-decay-style cosine --het-tp"
    by_samples = run_ranks(train, 2, _argv(samples, iters=""))[0]
    # 80 samples = 10 x 8 with the same learning rates
    assert by_samples["losses"] == by_iters["losses"]
    assert sorted(by_samples["losses"]) == list(range(1, 11))


def test_a_ramped_up_batch_resumes_mid_ramp_on_the_same_losses(tmp_path):
    """--rampup-batch-size 2 2 24 to a global batch of 8 (micro-batch 2): Megatron-LM's batch
    sizes, a checkpoint at each change of the micro-batch count, and a resume mid-ramp."""
    ramp = (
        "--train-samples 60 --rampup-batch-size 2 2 24 --lr-warmup-samples 8 "
        "--lr-decay-style cosine --het-tp-policy none"  # timed: told of each change
    )
    whole = run_ranks(train, 2, _argv(ramp, iters=""))[0]
    first = run_ranks(train, 2, _argv(ramp + f" --save {tmp_path} --exit-interval 5", iters=""))[0]
    resumed = run_ranks(train, 2, _argv(ramp + f" --load {tmp_path}", iters=""))[0]
    sizes = [int(s) for s in re.findall(r"global batch size:\s+(\d+)", whole["stdout"])]
    assert sizes == [2, 2, 2, 2, 4, 4, 6, 6, 8, 8, 8, 8]
    assert "ramping up batch size from 2 to 4" in whole["stdout"]
    # the micro-batch count changes before step 5: checkpointed at 4; the exit at 5
    assert sorted(d for d in os.listdir(tmp_path) if d.startswith("iter_")) == [
        "iter_0000004",
        "iter_0000005",
    ]
    assert sorted(resumed["losses"]) == list(range(6, 13))
    assert {**first["losses"], **resumed["losses"]} == whole["losses"]


def test_per_token_loss_implicit_masks_gc_and_throughput_leave_the_losses(tmp_path):
    """Every micro-batch here has the same token count, so the per-token loss is the
    per-micro-batch mean; the causal mask the dataloader no longer makes is the attention's."""
    plain = run_ranks(train, 2, _argv("--het-tp"))[0]
    flags = (
        "--het-tp --calculate-per-token-loss --no-create-attention-mask-in-dataloader "
        "--manual-gc --manual-gc-interval 3 --log-throughput --no-mmap-bin-files"
    )
    other = run_ranks(train, 2, _argv(flags))[0]
    _close(other["losses"], plain["losses"])
    assert "throughput per GPU (TFLOP/s/GPU): " in other["stdout"]


def test_zero_centred_norms_start_at_zero_and_scale_by_one_plus_weight():
    from megatron.hetero.model import transformer_config
    from megatron.hetero.spec import LayerNorm1P, TorchNorm

    args = _args("--apply-layernorm-1p")
    norm = TorchNorm(transformer_config(args), 64)
    assert isinstance(norm, LayerNorm1P) and torch.count_nonzero(norm.weight) == 0
    x = torch.randn(3, 64)
    want = torch.nn.functional.layer_norm(x, (64,), torch.ones(64), torch.zeros(64), 1e-5)
    assert torch.allclose(norm(x), want)
    from megatron.hetero.spec import RMSNorm1P

    rms = TorchNorm(transformer_config(_args("--apply-layernorm-1p --normalization RMSNorm")), 64)
    assert isinstance(rms, RMSNorm1P) and torch.count_nonzero(rms.weight) == 0
    want = torch.nn.functional.rms_norm(x, (64,), torch.ones(64), 1e-5)
    assert torch.allclose(rms(x), want)


def test_the_torch_profiler_writes_a_trace_of_the_asked_steps(tmp_path):
    argv = _argv(
        f"--profile --use-pytorch-profiler --profile-step-start 2 --profile-step-end 4 "
        f"--tensorboard-dir {tmp_path}",
        iters="--train-iters 6",
    )
    run_ranks(train, 2, argv)
    traces = [f for f in os.listdir(tmp_path) if f.endswith(".pt.trace.json")]
    assert len(traces) == 1  # --profile-ranks 0 only


def test_flags_reach_the_optimizer_ddp_and_data_config():
    from megatron.hetero.model import transformer_config
    from megatron.hetero.training import ddp_config

    args = _args("--decoupled-lr 5e-4 --decoupled-min-lr 4e-5 --bf16 --grad-reduce-in-bf16")
    config = optimizer_config(args)
    assert (config.decoupled_lr, config.decoupled_min_lr) == (5e-4, 4e-5)
    assert not ddp_config(args).grad_reduce_in_fp32
    assert ddp_config(_args("--bf16")).grad_reduce_in_fp32
    model = transformer_config(_args("--calculate-per-token-loss --apply-layernorm-1p"))
    assert model.calculate_per_token_loss and model.layernorm_zero_centered_gamma
    args = _args("--no-mmap-bin-files --no-create-attention-mask-in-dataloader")
    data = dataset_config(args, tokenizer_from_args(args))
    assert not data.mmap_bin_files and not data.create_attention_mask


def test_a_checkpoint_from_before_sample_counting_resumes_its_schedule():
    """Checkpoints without the 'samples' mark counted scheduler steps in iterations."""
    from megatron.hetero.checkpointing import scheduler_state_in_samples

    old = {"num_steps": 50, "lr_warmup_steps": 2, "lr_decay_steps": 100, "wd_incr_steps": 100}
    new = scheduler_state_in_samples({**old, "max_lr": 1e-3}, 8)
    assert new == {
        "num_steps": 400,
        "lr_warmup_steps": 16,
        "lr_decay_steps": 800,
        "wd_incr_steps": 800,
        "max_lr": 1e-3,
    }


def test_throughput_counts_megatrons_model_flops():
    args = _args("--swiglu --group-query-attention --num-query-groups 2 --ffn-hidden-size 96")
    h, s, layers, vocab = 64, 32, 2, 256
    q, kv = 64, 2 * 16 * 2  # 4 heads x 16 channels; K and V of 2 groups
    per_token = layers * (h * 96 * 3 + h * (q + kv) + q * s + q * h) + h * vocab
    assert flops_per_sample(args, vocab) == pytest.approx(6 * s * per_token)


def test_params_norm_and_zero_gradients_count_each_element_once(tmp_path):
    """--log-params-norm and --log-num-zeros-in-grad with head units, a query group split over
    the TP ranks (its K/V on both) and the distributed optimizer over 2 replicas: vanilla
    TP=1's figures on the same fp32 model (the K/V and the position embedding counted once,
    each replica's range of the masters summed), in Megatron-LM's fields of the iteration
    line."""
    argv = GQA.replace("--train-iters 1", "--train-iters 3").split() + [
        "--global-batch-size",
        "8",
        "--log-interval",
        "1",
        "--log-params-norm",
        "--log-num-zeros-in-grad",
        "--untie-embeddings-and-output-weights",  # input rows of unseen tokens: zero gradients
        # position rows past --seq-length get none either, in a tensor every TP rank holds
        "--position-embedding-type",
        "learned_absolute",
        "--max-position-embeddings",
        "64",
    ]
    vanilla = run_ranks(train, 1, argv + ["--metrics-file", str(tmp_path / "tp1.jsonl")])[0]
    het = ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer", "--het-tp"]
    het += ["--het-tp-attn-granularity", "1", "--het-tp-plan", "attn=3,5"]
    split = run_ranks(train, 4, argv + het + ["--metrics-file", str(tmp_path / "het.jsonl")])[0]
    want = list(read_metrics(str(tmp_path / "tp1.jsonl"), "train"))
    got = list(read_metrics(str(tmp_path / "het.jsonl"), "train"))
    assert [r["iteration"] for r in got] == [r["iteration"] for r in want] == [1, 2, 3]
    for a, b in zip(got, want):
        assert a["params_norm"] == pytest.approx(b["params_norm"], rel=1e-6), a["iteration"]
        assert a["num_zeros"] == b["num_zeros"] > 0, a["iteration"]
    line = re.search(
        r"iteration\s+3/.* \| num zeros: (\S+) \| params norm: (\S+) \|", split["stdout"]
    )
    assert line and float(line.group(1)) == got[-1]["num_zeros"]
    assert float(line.group(2)) == pytest.approx(got[-1]["params_norm"], abs=5e-4)
    assert "params norm" in vanilla["stdout"]
