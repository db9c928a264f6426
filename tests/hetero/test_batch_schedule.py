"""The global batch of each step under --rampup-batch-size, against Megatron-LM's arithmetic
worked by hand, and the flag's checks."""

from __future__ import annotations

import pytest

from megatron.hetero.arguments import ArgumentError, build_parser, validate_args
from megatron.hetero.batch_schedule import BatchSchedule, Rampup, StepBatch
from tests.utils import BASE


def _run(schedule: BatchSchedule, steps: int) -> list[int]:
    consumed, sizes = 0, []
    for _ in range(steps):
        batch = schedule.at(consumed)
        assert batch.num_microbatches * 2 == batch.global_batch_size  # micro-batch 2, DP 1
        sizes.append(batch.global_batch_size)
        consumed += batch.global_batch_size
    return sizes


def test_a_ramp_grows_the_batch_in_equal_shares_of_its_samples():
    # 2 -> 8 by 2: three increments of 24 / 3 = 8 samples each; past sample 24 the full batch
    schedule = BatchSchedule(8, 2, 1, Rampup(2, 2, 24))
    assert _run(schedule, 12) == [2, 2, 2, 2, 4, 4, 6, 6, 8, 8, 8, 8]
    # the ramp's 8 steps reach 28 samples; (60 - 28) // 8 = 4 full steps follow
    assert schedule.iterations(60) == 12
    assert schedule.iterations(63) == 12  # a partial last batch is dropped
    assert schedule.at(12) == StepBatch(global_batch_size=4, num_microbatches=2)


def test_megatron_lms_documented_ramp():
    """16 -> 1024 by 8 over 300000 samples: 126 intervals of ~2381 samples."""
    schedule = BatchSchedule(1024, 1, 8, Rampup(16, 8, 300_000))
    assert schedule.at(0).global_batch_size == 16
    assert schedule.at(2380).global_batch_size == 16
    assert schedule.at(2381).global_batch_size == 24
    assert schedule.at(300_001) == StepBatch(1024, 128)


def test_without_a_ramp_every_step_is_the_full_batch():
    schedule = BatchSchedule(8, 2, 2)
    assert {schedule.at(c) for c in (0, 8, 10_000)} == {StepBatch(8, 2)}
    assert schedule.iterations(87) == 10


@pytest.mark.parametrize(
    "ramp, message",
    [
        ("0 2 24", "START, INCREMENT and SAMPLES must be positive"),
        ("2 2 0", "START, INCREMENT and SAMPLES must be positive"),  # megatron-core: 0/0
        ("8 2 24", "START must be smaller than --global-batch-size (8)"),
        ("2 4 24", "--global-batch-size (8) minus START is not a multiple of INCREMENT"),
        ("1 1 24", "reaches a global batch of 1, not a multiple of --micro-batch-size x "),
        ("2 1 24", "reaches a global batch of 3, not a multiple of --micro-batch-size x "),
    ],
)
def test_a_ramp_that_cannot_run_is_refused_naming_the_flag(ramp, message):
    argv = BASE.replace("--train-iters 10", "--train-samples 64").split()
    with pytest.raises(ArgumentError) as err:
        args = build_parser().parse_args(
            argv + ["--global-batch-size", "8", "--rampup-batch-size", *ramp.split()]
        )
        validate_args(args, 1, cuda_available=False)
    assert f"--rampup-batch-size {ramp}" in str(err.value)
    assert message in str(err.value)


def test_a_ramp_needs_sample_based_training():
    args = build_parser().parse_args(
        (BASE + " --global-batch-size 8 --rampup-batch-size 2 2 24").split()
    )
    with pytest.raises(ArgumentError, match="--rampup-batch-size 2 2 24 goes with --train-samples"):
        validate_args(args, 1, cuda_available=False)


def test_the_training_length_counts_the_ramps_steps():
    argv = BASE.replace("--train-iters 10", "--train-samples 60")
    args = build_parser().parse_args(
        (argv + " --global-batch-size 8 --rampup-batch-size 2 2 24").split()
    )
    validate_args(args, 1, cuda_available=False)
    assert args.train_iters == 12


def test_only_the_batches_a_ramp_reaches_must_split_into_micro_batches():
    """4 -> 8 by 2 over 4 samples jumps from 4 straight to 8 (6 is never reached): Megatron-LM
    runs it with micro-batch 4, so it is accepted."""
    assert BatchSchedule(8, 4, 1, Rampup(4, 2, 4)).reached() == [4, 8]
    argv = BASE.replace("--train-iters 10", "--train-samples 64")
    args = build_parser().parse_args(
        (argv + " --micro-batch-size 4 --global-batch-size 8 --rampup-batch-size 4 2 4").split()
    )
    validate_args(args, 1, cuda_available=False)
    assert BatchSchedule(8, 2, 1, Rampup(2, 2, 24)).reached() == [2, 4, 6, 8]
