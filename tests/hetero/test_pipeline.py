"""Pipeline parallelism with vanilla megatron-core layers on real gloo ranks: megatron-core's 1F1B
schedule over 2 stages (with and without TP=2) continues a single-stage checkpoint on the
single-stage run's losses, and a 2-stage checkpoint loads back into one stage."""

from __future__ import annotations

import shutil

import pytest

from tests.utils import MHA, run_ranks, train

# 4 layers (2 per stage), tied embeddings (their gradients meet across the first and last
# stage), dropout 0, a fixed decay length so every run shares the schedule
MODEL = (
    MHA.replace("--num-layers 2", "--num-layers 4").replace("--train-iters 1", "")
    + " --global-batch-size 8 --eval-iters 0 --log-interval 1 --lr-decay-iters 6"
)


def _run(ranks: int, extra: str) -> dict:
    return run_ranks(train, ranks, (MODEL + " " + extra).split())[0]["losses"]


def _close(got: dict, want: dict, iterations) -> None:
    for it in iterations:
        assert got[it] == pytest.approx(want[it], rel=1e-5), (it, got, want)


@pytest.fixture(scope="module")
def single_stage(tmp_path_factory):
    """One rank, one stage: 2 iterations saved, then the run continued to 6 (the reference)."""
    root = tmp_path_factory.mktemp("pipeline")
    _run(1, f"--train-iters 2 --save {root / 'start'}")
    shutil.copytree(root / "start", root / "reference")
    return root, _run(1, f"--train-iters 6 --load {root / 'reference'}")


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1-pp2", "tp2-pp2"])
def test_two_stages_continue_a_single_stage_checkpoint_on_its_losses(single_stage, tp):
    root, reference = single_stage
    load = root / f"tp{tp}"
    shutil.copytree(root / "start", load)
    losses = _run(
        2 * tp,
        f"--train-iters 6 --load {load} --pipeline-model-parallel-size 2 "
        f"--tensor-model-parallel-size {tp}",
    )
    assert sorted(losses) == [3, 4, 5, 6]
    _close(losses, reference, range(3, 7))


def test_a_two_stage_checkpoint_loads_into_one_stage(single_stage):
    root, reference = single_stage
    shutil.copytree(root / "start", root / "two")
    two = root / "two"
    _run(2, f"--train-iters 4 --load {two} --save {two} --pipeline-model-parallel-size 2")
    back = _run(1, f"--train-iters 6 --load {two}")  # saved at 4 by the 2 stages
    assert sorted(back) == [5, 6]
    _close(back, reference, (5, 6))
