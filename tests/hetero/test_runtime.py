"""The het-TP runtime's lifecycle on real gloo ranks: every migration leaves its record, and a
checkpoint carries the runtime's state, so a resumed run starts where the saved one stood."""

from __future__ import annotations

import pytest

from hettp.metrics import read_metrics
from hettp.plan import PartitionPlan
from megatron.hetero.checkpointing import TRACKER_FILE
from tests.utils import run_ranks, train, train_with_failing_planner, train_with_slow_boundary
from tests.utils.scripts import load_script

MODEL = (
    "--tensor-model-parallel-size 2 --num-layers 2 --hidden-size 64 --num-attention-heads 4 "
    "--seq-length 32 --max-position-embeddings 32 --micro-batch-size 2 "
    "--global-batch-size 2 --lr 1e-3 --mock-data --vocab-size 255 --hidden-dropout 0 "
    "--attention-dropout 0 --log-interval 100 --eval-iters 0 --lr-decay-iters 12 "
    "--het-tp-interval 3 "
    "--het-tp-emulate persistent:rank=1,factor=3"
).split()


def _records(result, kind):
    return list(read_metrics(result["metrics_file"], kind))


def _run(tmp_path, name, policy, iters, *extra):
    return run_ranks(
        train,
        2,
        MODEL
        + [
            "--het-tp-policy",
            policy,
            "--train-iters",
            str(iters),
            "--metrics-file",
            str(tmp_path / f"{name}.jsonl"),
            *extra,
        ],
    )[0]


def test_a_migrated_run_resumes_in_its_plan_without_moving_again(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    straight = _run(tmp_path, "straight", "migrate", 12)
    # saved by --save-interval at the boundary of the first decision: rank 1 is 3x slow from
    # the start; the first 3 steps are warm-up, so the detector's window of 3 is full at step 6
    first = _run(
        tmp_path,
        "first",
        "migrate",
        12,
        "--save",
        ckpt,
        "--save-interval",
        "6",
        "--exit-interval",
        "6",
    )
    resumed = _run(tmp_path, "resumed", "migrate", 12, "--load", ckpt)

    # every migration the controller decided wrote its repartition record, at the minimum bytes
    moves = _records(first, "repartition")
    assert [d["iteration"] for d in _records(first, "decision")] == [6]
    assert [r["iteration"] for r in moves] == [d["iteration"] for d in _records(first, "decision")]
    assert moves and all(r["bytes"] == r["min_bytes"] > 0 for r in moves)
    migrated = PartitionPlan.from_json(moves[-1]["plan"])
    assert migrated != PartitionPlan.from_json(_records(first, "plan")[0]["plan"])

    # the resumed run starts in the migrated plan, says so, and does not move again
    plans = _records(resumed, "plan")
    assert [(p["iteration"], p["why"]) for p in plans] == [(6, "resumed from the checkpoint")]
    assert PartitionPlan.from_json(plans[0]["plan"]) == migrated
    assert "het-TP plan at iteration 6 (resumed from the checkpoint)" in resumed["stdout"]
    # Nothing moves because of the resume: a restored detector sees no new straggle. The loop
    # may still correct the split at its first report (12), as an unresumed run may at any
    # report: a rebalance, never an onset's migration.
    decisions = _records(resumed, "decision")
    assert all(d["iteration"] == 12 and d["reason"].startswith("rebalance") for d in decisions)
    assert [r["iteration"] for r in _records(resumed, "repartition")] == [
        d["iteration"] for d in decisions
    ]
    for step in range(7, 13):
        assert resumed["losses"][step] == pytest.approx(straight["losses"][step], rel=1e-5)
    # each report splits a rank's compute by block: attention's seconds, the optimizer's
    # (fixed), and the MLP's the rest
    timing = _records(straight, "timing")
    assert len(timing) >= 3
    for record in timing:
        for compute, fixed, attention in zip(
            record["compute_s"], record["fixed_s"], record["attention_s"]
        ):
            assert 0 < attention < compute - fixed
    # scripts/attention_call.py reads the per-call part from these records: the unslowed
    # rank's attention seconds of the intervals after the cold first one, at its works under
    # the plans the run held (here too few to price it: a line wants 4 pairs)
    call = load_script("attention_call").run_call(straight["metrics_file"])
    [unit] = {p["unit_work"]["attn"] for p in _records(straight, "priced")}
    held = [_records(straight, "plan")[0], *_records(straight, "repartition")]
    works = {len(PartitionPlan.from_json(p["plan"]).layers[0]["attn"][0]) * unit for p in held}
    assert call.samples >= 2 and set(call.works) <= {round(w, 1) for w in works}
    # core attention keeps the price the first run put on it (its fit is in those units)
    [priced] = _records(first, "priced")
    assert priced["iteration"] == 3
    assert [(p["core_scale"], p["unit_work"]) for p in _records(resumed, "priced")] == [
        (priced["core_scale"], priced["unit_work"])
    ]


def test_a_resized_run_resumes_with_its_shares_and_priorities(tmp_path):
    ckpt = tmp_path / "ckpt"
    # saved at 7, one step after the resize at the first report (6, after the warm-up), and run
    # on to 12 as the reference: the resize's shares come from measured speeds, so only this
    # run's own decision is the one its checkpoint holds
    first = _run(tmp_path, "first", "resize", 12, "--save", str(ckpt), "--save-interval", "7")
    (ckpt / TRACKER_FILE).write_text("7")  # as if it had stopped at 7
    resumed = _run(tmp_path, "resumed", "resize", 12, "--load", str(ckpt))
    decisions = _records(first, "decision")
    assert decisions[0]["iteration"] == 6 and decisions[0]["shares"][1] > 0
    resizes = _records(resumed, "resize")
    assert [(r["iteration"], r["why"], r["shares"]) for r in resizes] == [
        (7, "resumed from the checkpoint", decisions[0]["shares"])
    ]
    # A restored detector knows the straggle: a fresh one would take it as an onset and resize
    # again at the first report after its warm-up (12). What the resumed run may still do is
    # what any run may at any report: on this tiny model a report now and then reads the
    # resized 3x rank as recovered (1.07x once in CI) and restores.
    again = _records(resumed, "decision")
    assert all(d["action"] == "restore" for d in again), again
    # lossy, but the same skipped units from the same priorities: the same trajectory, up to
    # a later decision of either run (the loop may correct the shares at any report)
    later = [d["iteration"] for d in decisions + again if d["iteration"] > 7]
    for step in range(8, min(later, default=12) + 1):
        assert resumed["losses"][step] == pytest.approx(first["losses"][step], rel=1e-5)

    # under another policy the saved state does not describe the run: it starts afresh, says
    # so, and acts on the straggle itself (a restored detector would take it as handled)
    other = _run(tmp_path, "other", "migrate", 16, "--load", str(ckpt))  # 3 warm-up steps
    assert (
        "het-TP state of the checkpoint not resumed: it was saved under other het-TP "
        "flags" in other["stdout"]
    )
    assert _records(other, "resize") == []
    # (a move, and where its measured MLP blocks stay uneven a rebalance)
    actions = [d["action"] for d in _records(other, "decision")]
    assert actions and set(actions) == {"migrate"}, actions


def test_the_step_boundary_counts_in_the_next_iterations_time(tmp_path):
    """As Megatron-LM's elapsed time per iteration (line to line): het-TP's boundary work
    (reports, decisions, migrations) counts, in the iteration after it; test hooks do not."""
    slow = 0.3
    argv = MODEL[:-2] + [  # no straggler: no decision, the boundary is the injected sleep
        "--het-tp-policy",
        "static",
        "--het-tp",
        "--train-iters",
        "6",
        "--metrics-file",
        str(tmp_path / "m.jsonl"),
    ]
    result = run_ranks(train_with_slow_boundary, 2, argv, slow)[0]
    elapsed = {r["iteration"]: r["elapsed_ms"] / 1e3 for r in _records(result, "train")}
    assert sorted(elapsed) == list(range(1, 7))
    for iteration in range(2, 7):
        # the boundary before it counted; the hook's sleep, left out, would add another `slow`
        assert slow <= elapsed[iteration] < 1.8 * slow, (iteration, elapsed)


def test_a_planner_failure_on_the_deciding_rank_stops_every_rank_by_name(tmp_path):
    """Only TP rank 0 plans; had it raised alone, its peer would wait in the decision's
    broadcast until the job's time ran out."""
    argv = MODEL + ["--het-tp-policy", "migrate", "--train-iters", "12"]
    argv += ["--metrics-file", str(tmp_path / "m.jsonl")]
    with pytest.raises(AssertionError) as err:
        run_ranks(train_with_failing_planner, 2, argv, timeout=120)
    message = str(err.value)
    assert "exceeded" not in message
    for rank in (0, 1):
        assert f"rank {rank}: RuntimeError: het-TP's decision at iteration" in message
    assert message.count("failed on the deciding rank: ValueError: planner broke (injected)") >= 2


def test_a_planner_failure_in_one_pipeline_stage_stops_every_stage_by_name(tmp_path):
    """TP=2 x PP=2, the last stage's planner fails: its ranks raise, and the first stage's,
    which wait for every stage's verdict at each step boundary, raise it too instead of
    failing on a closed connection (gloo) or waiting for the watchdog (NCCL)."""
    argv = MODEL + ["--het-tp-policy", "migrate", "--train-iters", "12"]
    argv += ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    with pytest.raises(AssertionError) as err:
        run_ranks(train_with_failing_planner, 4, argv, 1, timeout=120)
    message = str(err.value)
    assert "exceeded" not in message
    for rank in (0, 1):  # the first stage
        assert f"rank {rank}: RuntimeError: het-TP's control of pipeline stage 1 failed" in message
    assert message.count("ValueError: planner broke (injected)") >= 4
