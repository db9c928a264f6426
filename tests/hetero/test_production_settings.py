"""Het-TP under the settings production Megatron jobs use: sequence parallelism, overlapped
gradient reduction in small buckets, full and selective recomputation, and all of them together,
on TP=2 x DP=2 (4 gloo ranks): the even plan equals vanilla megatron-core with the same flags, a
migration keeps the losses, a resize freezes and a restore resumes, and a checkpoint saved after
a migration loads into vanilla with the same flags."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from tests.utils import (
    MHA,
    resumed_misfits,
    run_ranks,
    train,
    train_and_count_whole_masters,
    train_and_read_norms,
    train_with_repartitions,
    train_with_resizes,
    using_group_step_adam,
)

SP = "--sequence-parallel"
OVERLAP = "--overlap-grad-reduce --ddp-bucket-size 20000"  # several buckets for this model
FULL = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
SELECTIVE = "--recompute-granularity selective"
DISTOPT = "--use-distributed-optimizer"
PARAM_GATHER = "--overlap-param-gather"
SETTINGS = {
    "sp": SP,
    "overlap": OVERLAP,
    "recompute-full": FULL,
    "recompute-selective": SELECTIVE,
    "distributed-optimizer": DISTOPT,
    "all": f"{SP} {OVERLAP} {FULL} {DISTOPT} {PARAM_GATHER}",
}


def _argv(flags: str, iters: int = 10) -> list[str]:
    return (
        MHA.replace("--train-iters 1", f"--train-iters {iters}")
        + " --global-batch-size 8 --weight-decay 0.1 --het-tp-granularity 4"
        " --tensor-model-parallel-size 2 --eval-iters 0 --log-interval 5 " + flags
    ).split()


def _saved_at_6_after_a_migration(tmp_path, argv, moves=("attn=1,3;mlp=20,44",)):
    """A het run migrating at step 3 (`moves` in turn) and saving at 6 (and 10): its result,
    and a folder whose latest checkpoint is the one of step 6."""
    ckpt = tmp_path / "ckpt"
    result = run_ranks(
        train_with_repartitions,
        4,
        argv + ["--save", str(ckpt), "--save-interval", "6"],
        {3: list(moves)},
    )[0]
    only6 = tmp_path / "only6"
    only6.mkdir()
    (only6 / "iter_0000006").symlink_to(ckpt / "iter_0000006")
    (only6 / "latest_checkpointed_iteration.txt").write_text("6")
    return result, only6


@functools.cache
def _vanilla(setting: str) -> dict:
    """Rank 0's result of vanilla megatron-core with a setting's flags (10 steps), once."""
    return run_ranks(train, 4, _argv(SETTINGS[setting]))[0]


def _close(got: dict, want: dict, steps, rel: float = 1e-5) -> None:
    for step in steps:
        assert abs(got[step] - want[step]) <= rel * abs(want[step]), (step, got, want)


# overlap, full recomputation and the distributed optimizer alone are in "all" (and in the
# checkpoint and priority tests below); SP and selective recomputation change the numerics most
@pytest.mark.parametrize("setting", ["sp", "recompute-selective", "all"])
def test_even_plan_equals_vanilla_and_a_migration_keeps_the_losses(setting):
    argv = _argv(SETTINGS[setting])
    vanilla = _vanilla(setting)
    # het-TP layers in the even plan for 4 steps, then rank 0 takes most units
    migrated = run_ranks(train_with_repartitions, 4, argv + ["--het-tp"], {4: "attn=3,1;mlp=48,16"})
    assert [e["iteration"] for e in migrated[0]["events"]] == [4]
    event = migrated[0]["events"][0]
    assert event["bytes"] > 0 and event["old_wrapper_buffers"] == 0
    assert event["old_buffers_alive"] == 0  # the replaced wrapper's buffers are freed
    # ... though the imports' objects are out of the collector's reach (training.py: a full
    # collection over them cost the first migrations and random steps ~0.25 s)
    assert migrated[0]["frozen_objects"] > 100_000
    # the config's hooks are the rebuilt DDP wrapper's (grad sync only with overlap)
    overlap = "--overlap-grad-reduce" in SETTINGS[setting]
    assert event["hooks"] == {
        "no_sync_func": True,
        "grad_sync_func": True if overlap else "unset",
        "param_sync_func": "unset",
    }
    for result in migrated:
        _close(result["losses"], vanilla["losses"], range(1, 11))


def test_a_failed_transfer_under_all_settings_leaves_training_intact():
    """A rank failing mid-transfer, and then one failing to build the optimizer after the new
    shards were installed (after the build, then between its collectives), under the
    distributed optimizer and overlapped reductions and gathers: every rank keeps its weights,
    masters, moments and plan (the gathered copies are dropped; the half-rebuilt wrapper's
    hooks and buffers are let go), and a later migration still works; the losses stay
    vanilla's."""
    argv = _argv(SETTINGS["all"])
    vanilla = _vanilla("all")
    faults = (
        {"iteration": 4, "rank": 1, "stage": "exchange"},
        {"iteration": 5, "rank": 0, "stage": "optimizer"},
        {"iteration": 6, "rank": 1, "stage": "param groups"},
    )
    plans = {4: "attn=3,1;mlp=48,16", 5: "attn=3,1;mlp=48,16", 6: "attn=3,1;mlp=48,16"}
    plans[7] = "attn=1,3;mlp=20,44"
    results = run_ranks(train_with_repartitions, 4, argv + ["--het-tp"], plans, faults)
    for result in results:
        failed, *rebuilds, done = result["events"]
        assert failed["iteration"] == 4 and failed["unchanged"] and failed["plan_kept"]
        for it, event in zip((5, 6), rebuilds):
            assert event["iteration"] == it and event["unchanged"] and event["plan_kept"]
            assert event["stray_buffers"] == 0
            assert f"rebuild of the optimizer at iteration {it} aborted" in event["error"]
        assert done["iteration"] == 7 and done["units_moved"] > 0
        # fp32 weights: the optimizer's views of them hold no gradient accumulator, so each
        # parameter carries the live wrapper's hook alone after failed and successful rebuilds
        hooks = [event["post_hooks"] for event in result["events"]]
        assert all(h == {"others": 0, "one_each": True} for h in hooks), hooks
        _close(result["losses"], vanilla["losses"], range(1, 11))


def test_sequence_parallel_norms_are_marked_and_reduced_over_the_tp_group():
    """With SP every norm weight is replicated over the TP group and its gradient all-reduced
    there (finalize_model_grads reads the mark); the first step's update keeps them equal."""
    result = run_ranks(train_and_read_norms, 2, _argv(SP, iters=2) + ["--het-tp"])
    for rank in result:
        assert rank["losses"] and all(math.isfinite(v) for v in rank["losses"].values())
    norms = [r["norms"] for r in result]
    assert norms[0] and set(norms[0]) == set(norms[1])
    for name, (marked, value) in norms[0].items():
        assert marked, name
        assert torch.equal(value, norms[1][name][1]), name  # same update on both TP ranks


@pytest.mark.parametrize("adam", ["torch", "fused"])
def test_resize_then_restore_under_all_settings(adam):
    """Rank 1 skips half its units from the start (bit-identical weights and Adam state while
    skipped), rank 0 from step 3; both compute them again from step 4, their moments in the
    distributed optimizer's ranges rescaled for Adam's count (rank 0's, frozen after step 2,
    before step 4; rank 1's, frozen before any update, after it). With torch's Adam (a count
    per parameter) and with one counting per group as TE's and apex's FusedAdam do."""
    argv = _argv(SETTINGS["all"], iters=7) + ["--het-tp-resize", "0,0.5"]
    actions = {2: [("resize", (0.5, 0.5))], 3: [("resize", (0.0, 0.0))]}
    if adam == "torch":
        ranks = run_ranks(train_with_resizes, 4, argv, actions, range(1, 6))
    else:
        ranks = run_ranks(using_group_step_adam, 4, train_with_resizes, argv, actions, range(1, 6))
    records = ranks[1]["records"]
    skipped = {k: set(b["units"][b["active"] :]) for k, b in records[1]["blocks"].items()}
    assert any(skipped.values())
    for it in (1, 2):
        for key, units in skipped.items():
            for unit in units:
                now = records[it]["blocks"][key]["values"][unit]
                then = records[it + 1]["blocks"][key]["values"][unit]
                assert all(torch.equal(a, b) for a, b in zip(now, then)), (key, unit, it)
    for key, units in skipped.items():
        assert records[4]["blocks"][key]["active"] == len(records[4]["blocks"][key]["units"])
        for unit in units:
            before = records[3]["blocks"][key]["values"][unit][0]
            assert not torch.equal(before, records[5]["blocks"][key]["values"][unit][0])
    resumes = resumed_misfits(ranks)
    assert {(since, it) for _, _, since, it, _ in resumes} == {(0, 3), (2, 3)}
    assert max(misfit for *_, misfit in resumes) < 1e-5, resumes
    assert all(math.isfinite(v) for v in ranks[0]["losses"].values())


@pytest.mark.parametrize("scorer", ["wg", "dw"])  # gradients; weights a step old
def test_priorities_under_the_distributed_optimizer_are_the_plain_optimizers(scorer):
    """Under the distributed optimizer (and --overlap-param-gather) a DP rank's gradient is
    reduced, and its weights current, only in its own range: scored there and summed over the
    replicas, the priorities are the plain optimizer's, so rank 1 re-sorts its units into the
    same order, the same on both replicas (which stay identical)."""
    flags = [
        "--het-tp-resize",
        "0,0.5",
        "--het-tp-priority",
        scorer,
        "--het-tp-priority-interval",
        "3",
        "--het-tp-priority-sample-interval",
        "1",
    ]
    plain = run_ranks(train_with_resizes, 4, _argv(OVERLAP, iters=7) + flags, {}, (7,))
    sharded = run_ranks(
        train_with_resizes,
        4,
        _argv(f"{OVERLAP} {DISTOPT} {PARAM_GATHER}", iters=7) + flags,
        {},
        (7,),
    )

    def orders(rank, iteration):
        blocks = rank["records"][iteration]["blocks"]
        return {key: (b["units"], b["active"]) for key, b in blocks.items()}

    assert orders(plain[1], 7) != orders(plain[1], 2)  # the refreshes re-sorted rank 1
    for tp_rank in (0, 1):  # global ranks tp_rank and tp_rank + 2 are its two replicas
        for iteration in (3, 6, 7):
            want = orders(plain[tp_rank], iteration)
            assert orders(sharded[tp_rank], iteration) == want, (tp_rank, iteration)
            assert orders(sharded[tp_rank + 2], iteration) == want, (tp_rank, iteration)
        first, second = sharded[tp_rank]["records"][7], sharded[tp_rank + 2]["records"][7]
        for key, block in first["blocks"].items():
            for unit, values in block["values"].items():
                other = second["blocks"][key]["values"][unit]
                assert all(torch.equal(a, b) for a, b in zip(values, other))


def test_a_checkpoint_saved_after_a_migration_loads_into_vanilla(tmp_path):
    argv = _argv(SETTINGS["all"])
    het, only6 = _saved_at_6_after_a_migration(tmp_path, argv + ["--het-tp"])
    vanilla = run_ranks(train, 4, argv + ["--load", str(only6)])[0]
    assert sorted(vanilla["losses"]) == [7, 8, 9, 10]
    _close(vanilla["losses"], het["losses"], range(7, 11))


def test_distributed_optimizer_checkpoints_load_without_it_and_at_another_tp_size(tmp_path):
    """Under --use-distributed-optimizer a checkpoint holds whole masters and moments in the
    plain optimizer's layout: saved after a migration, it continues in vanilla without the
    distributed optimizer exactly as the het run, and at TP=1 x DP=4 (other GEMM splits:
    float rounding only)."""
    argv = _argv(f"{SP} {OVERLAP} {DISTOPT}")
    het, only6 = _saved_at_6_after_a_migration(tmp_path, argv + ["--het-tp"])
    plain = [a for a in argv if a != "--use-distributed-optimizer"]
    vanilla = run_ranks(train, 4, plain + ["--load", str(only6)])[0]
    assert sorted(vanilla["losses"]) == [7, 8, 9, 10]
    _close(vanilla["losses"], het["losses"], range(7, 11))
    tp1 = " ".join(plain).replace(
        "--tensor-model-parallel-size 2", "--tensor-model-parallel-size 1"
    )
    tp1 = tp1.replace(SP, "").split()
    dp4 = run_ranks(train, 4, tp1 + [DISTOPT, "--load", str(only6)])[0]
    _close(dp4["losses"], het["losses"], range(7, 11), rel=1e-4)


def test_distributed_optimizer_bf16_checkpoints_resume_exactly(tmp_path):
    """--bf16 under the distributed optimizer: the fp32 masters and moments a checkpoint saved
    after a migration holds resume training bit for bit (read a share by each data-parallel
    replica, --ckpt-fully-parallel-load), and saving leaves no whole fp32 copy of the weights
    behind (the checkpoint's plain-layout twin is dropped)."""
    argv = _argv(f"{SP} {DISTOPT} --bf16") + ["--het-tp"]
    straight, only6 = _saved_at_6_after_a_migration(tmp_path, argv)
    again = tmp_path / "again"  # the resumed run saves too (at 8 and 10)
    resumed = run_ranks(
        train_and_count_whole_masters,
        4,
        argv
        + ["--load", str(only6), "--save", str(again), "--save-interval", "2"]
        + ["--ckpt-fully-parallel-load"],
    )
    for rank in resumed:
        assert sorted(rank["losses"]) == [7, 8, 9, 10]
        assert rank["losses"] == {i: straight["losses"][i] for i in range(7, 11)}
        # none after loading (counted at 7) nor after the save at 8 (counted at 9)
        assert rank["whole_masters"] == {i: 0 for i in range(7, 11)}


def test_a_parallel_load_of_scattered_units_resumes_exactly(tmp_path):
    """Two rebalances leave TP rank 0 the MLP units 0-19, 56-63 and 20-31 in that local
    order: ids 56-63 are a piece that is a column slice of linear_fc2's weight (not contiguous
    in memory). Read by one data-parallel replica and broadcast to the other
    (--ckpt-fully-parallel-load), every replica resumes the run exactly."""
    argv = _argv("") + ["--het-tp"]
    moves = ("rebalance:attn=2,2;mlp=20,44", "rebalance:attn=2,2;mlp=40,24")
    straight, only6 = _saved_at_6_after_a_migration(tmp_path, argv, moves)
    resumed = run_ranks(train, 4, argv + ["--load", str(only6), "--ckpt-fully-parallel-load"])
    for rank in resumed:
        assert sorted(rank["losses"]) == [7, 8, 9, 10]
        _close(rank["losses"], straight["losses"], range(7, 11), rel=1e-6)


def test_bf16_under_all_settings_migrates_there_and_back_exactly():
    """--bf16 with SP, overlap and recomputation: the even plan equals vanilla exactly (het-TP
    runs vanilla's kernels, megatron-core's core attention included), and units moved away and
    back at one step boundary restore the exact state (fp32 masters and Adam moments travel
    with them), so the run equals one that never moved bit for bit."""
    argv = _argv(SETTINGS["all"] + " --bf16") + ["--het-tp"]
    vanilla = run_ranks(train, 4, argv[:-1])[0]
    steady = run_ranks(train_with_repartitions, 4, argv, {})[0]
    moved = run_ranks(
        train_with_repartitions, 4, argv, {4: ["attn=3,1;mlp=48,16", "attn=2,2;mlp=32,32"]}
    )
    assert [e["iteration"] for e in moved[0]["events"]] == [4, 4]
    for result in moved:
        assert result["losses"] == steady["losses"]
    assert steady["losses"] == vanilla["losses"], (steady["losses"], vanilla["losses"])
    assert vanilla["losses"][10] < vanilla["losses"][1]


def test_the_control_loop_migrates_under_all_settings():
    """pretrain_gpt.py's loop with SP, overlap and full recomputation on 4 ranks: a 3x straggler
    on TP rank 1 is detected and acted on by a migration, and the losses equal the run with
    --het-tp alone."""
    argv = _argv(SETTINGS["all"], iters=12)
    control = [
        "--het-tp-policy",
        "migrate",
        "--het-tp-emulate",
        "persistent:rank=1,factor=3",
        "--het-tp-interval",
        "2",
    ]
    decided = run_ranks(train, 4, argv + control)
    alone = run_ranks(train, 4, argv + ["--het-tp"])[0]
    stdout = decided[0]["stdout"]
    assert "het-TP decision at iteration" in stdout and ": migrate" in stdout, stdout
    assert "het-TP repartition at iteration" in stdout
    for result in decided:
        _close(result["losses"], alone["losses"], range(1, 13))
