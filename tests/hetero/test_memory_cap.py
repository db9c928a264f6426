"""--het-tp-memory-cap on real gloo ranks: the units a migration hands a fast rank stay within
the cap on every step, counted in the weights each rank holds, and hybrid resizes the
straggler for what the cap keeps on it."""

from __future__ import annotations

import pytest

from hettp.metrics import read_metrics
from hettp.plan import PartitionPlan
from tests.utils import run_ranks
from tests.utils.workers import train_and_count_sharded_weights

MODEL = (
    "--tensor-model-parallel-size 2 --num-layers 2 --hidden-size 128 --num-attention-heads 4 "
    "--seq-length 64 --max-position-embeddings 64 --micro-batch-size 4 "
    "--global-batch-size 4 --lr 1e-3 --mock-data --vocab-size 255 --hidden-dropout 0 "
    "--attention-dropout 0 --log-interval 100 --eval-iters 0 --train-iters 24 "
    "--het-tp-interval 3 --het-tp-policy hybrid "
    "--het-tp-emulate persistent:rank=1,factor=6"
).split()
CAP = 1.3


def _run(tmp_path, name, *extra):
    metrics = str(tmp_path / f"{name}.jsonl")
    ranks = run_ranks(
        train_and_count_sharded_weights, 2, MODEL + ["--metrics-file", metrics, *extra]
    )
    return ranks, list(read_metrics(metrics, "decision"))


def test_a_capped_migration_keeps_every_rank_within_the_cap(tmp_path):
    free, free_decisions = _run(tmp_path, "free")
    capped, decisions = _run(tmp_path, "capped", "--het-tp-memory-cap", str(CAP))
    even = capped[0]["weights"][1]
    assert even == capped[1]["weights"][1] == free[0]["weights"][1]  # the even split
    # uncapped, the fast rank takes 1.8-2x its even share: the cap binds
    assert max(free[0]["weights"].values()) > 1.5 * even
    # capped, no rank holds more than the cap on any step, and the fast rank did take units
    for rank in capped:
        assert max(rank["weights"].values()) <= CAP * even
    assert max(capped[0]["weights"].values()) > 1.15 * even
    # the move left rank 1 (6x) more than it can finish in time: hybrid resized it for that
    moves = [d for d in decisions if d["action"] == "hybrid-migrate"]
    assert moves, decisions
    assert moves[0]["shares"][0] == 0.0 and moves[0]["shares"][1] > 0.0
    assert "memory cap" in moves[0]["reason"]
    assert max(moves[0]["details"]["unit_state"]) <= CAP
    assert " x the even split's" in capped[0]["stdout"].split("hybrid-migrate", 1)[1]
    held = PartitionPlan.from_json(moves[-1]["plan"])
    assert held.counts(0, "mlp")[0] > held.counts(0, "mlp")[1]
    # uncapped, the move balances by itself: no resize kept
    free_moves = [d for d in free_decisions if d["action"] == "hybrid-migrate"]
    assert free_moves and all(not any(d["shares"]) for d in free_moves), free_decisions


def test_a_starting_plan_over_the_cap_is_refused_naming_the_flag(tmp_path):
    """Before anything moves: a --het-tp-plan, or the plan of the checkpoint resumed from,
    that puts a rank over the cap."""
    import pytest

    from tests.utils.workers import train

    uneven = ["--het-tp-plan", "attn=3,1;mlp=320,192", "--train-iters", "2"]
    with pytest.raises(AssertionError) as err:
        run_ranks(train, 2, MODEL + uneven + ["--het-tp-memory-cap", "1.2"])
    assert "--het-tp-plan puts 1.33x the even split's unit state on TP rank 0, over " in str(
        err.value
    )
    assert "--het-tp-memory-cap 1.2" in str(err.value)
    ckpt = str(tmp_path / "ckpt")
    run_ranks(train, 2, MODEL + uneven + ["--save", ckpt, "--save-interval", "2"])
    with pytest.raises(AssertionError) as err:
        run_ranks(train, 2, MODEL + ["--load", ckpt, "--het-tp-memory-cap", "1.1"])
    assert "the checkpoint's plan puts 1.33x the even split's unit state on TP rank 0" in str(
        err.value
    )
    # within the cap, it resumes in its plan
    resumed = run_ranks(
        train,
        2,
        MODEL
        + ["--load", ckpt, "--het-tp-memory-cap", "1.4", "--train-iters", "3"]
        + ["--use-checkpoint-opt_param-scheduler"],  # a longer run: the saved decay goes on
    )[0]
    assert "het-TP plan at iteration 2 (resumed from the checkpoint)" in resumed["stdout"]


def test_head_units_count_their_k_v_replicas_against_the_cap(tmp_path):
    """GQA with one query group of 4 heads per rank, query heads as units: a rank given heads
    of the other rank's group computes that group's K/V as a replica, which the cap counts.
    Each rank's weights as allocated (the replicas' rows included) stay within it."""
    gqa = (
        "--tensor-model-parallel-size 2 --num-layers 2 --hidden-size 128 "
        "--num-attention-heads 8 --group-query-attention --num-query-groups 2 --swiglu "
        "--ffn-hidden-size 256 --disable-bias-linear --position-embedding-type rope "
        "--normalization RMSNorm --seq-length 64 --max-position-embeddings 64 "
        "--micro-batch-size 4 --global-batch-size 4 --lr 1e-3 --mock-data --vocab-size 255 "
        "--hidden-dropout 0 --attention-dropout 0 --log-interval 100 --eval-iters 0 "
        "--train-iters 15 --het-tp-interval 3 --het-tp-policy migrate "
        "--het-tp-attn-granularity 1 --het-tp-emulate persistent:rank=1,factor=4"
    ).split()
    metrics = str(tmp_path / "heads.jsonl")
    ranks = run_ranks(
        train_and_count_sharded_weights,
        2,
        gqa + ["--het-tp-memory-cap", "1.25", "--metrics-file", metrics],
    )
    even = ranks[0]["weights"][1]
    assert ranks[1]["weights"][1] == even
    for rank in ranks:
        assert max(rank["weights"].values()) <= 1.25 * even
    moves = [d for d in read_metrics(metrics, "decision") if d["action"] == "migrate"]
    assert moves and max(ranks[0]["weights"].values()) > 1.1 * even
    # the planner's count of what each rank holds is what the ranks allocated
    final = ranks[0]["weights"][max(ranks[0]["weights"])] / even
    assert moves[-1]["details"]["unit_state"][0] == pytest.approx(final, abs=0.01)
