"""Resizing on real gloo groups: forward and gradients against a dense reference with the
skipped units zeroed, frozen skipped units, restoring, priority order through a migration, and
the paper's baseline (the pure parts: tests/hettp/test_resize.py)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from hettp.plan import PartitionPlan
from hettp.resize import skipped_count, skipped_units
from tests.utils import (
    GEMM_BACKWARD,
    GQA,
    MHA,
    GroupStepAdam,
    close,
    het_numerics,
    resume_misfit,
    resumed_misfits,
    run_ranks,
    train,
    train_with_resizes,
)

# ---- numerics on real groups ------------------------------------------------------------

RESIZE_CASES = {
    # rank 1 skips half: 1 of its 2 query groups, 64 of its 128 ffn neurons
    "tp2-mha": (MHA, 2, None, (0.0, 0.5)),
    # uneven plan; rank 0 skips 1 of 2 groups and 15 of 30 units, rank 1 keeps its only group,
    # rank 3 skips 8 of 32 SwiGLU units
    "tp4-gqa-swiglu": (GQA, 4, "attn=2,1,1,0;mlp=30,2,0,32", (0.5, 0.5, 0.0, 0.25)),
    # the same under sequence parallelism (the TP=1 reference runs without it)
    "tp4-gqa-swiglu-sp": (
        GQA + " --sequence-parallel",
        4,
        "attn=2,1,1,0;mlp=30,2,0,32",
        (0.5, 0.5, 0.0, 0.25),
    ),
}


@pytest.mark.parametrize("case", list(RESIZE_CASES))
def test_resized_forward_equals_dense_reference_with_skipped_units_zeroed(case):
    model, tp, spec, shares = RESIZE_CASES[case]
    argv = model.split() + ["--het-tp"]
    groups = 4
    mlp_units = (128 // 2) if "--swiglu" in model else 256
    plan = (
        PartitionPlan.parse(spec, tp, 2, groups, mlp_units)
        if spec
        else PartitionPlan.even(tp, 2, groups, mlp_units)
    )
    zeroed = {}
    for (layer, block, _), units in skipped_units(plan, shares).items():
        zeroed.setdefault((layer, block), []).extend(sorted(units))
    assert any(zeroed.values())
    resized = run_ranks(
        het_numerics,
        tp,
        argv + ["--tensor-model-parallel-size", str(tp)],
        [spec],
        shares,
        None,
        zeroed,
    )[0][0]
    reference = run_ranks(het_numerics, 1, argv, [None], None, zeroed, zeroed)[0][0]
    assert resized.pop("skipped_grads_zero") is True  # skipped units get no gradient
    reference.pop("skipped_grads_zero")
    # resized column linears run megatron-core's GEMM, as their unresized peers do
    assert resized.pop("column_backward") == {GEMM_BACKWARD}
    reference.pop("column_backward")
    assert set(resized) == set(reference)
    for key, want in reference.items():
        close(resized[key], want, f"{case} {key}")


# ---- training on real groups ------------------------------------------------------------

TRAIN = (
    MHA.replace("--train-iters 1", "--train-iters 14")
    + " --global-batch-size 4 --weight-decay 0.1 --tensor-model-parallel-size 2"
).split()


def _skipped(record):
    return {key: set(b["units"][b["active"] :]) for key, b in record["blocks"].items()}


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def resized_run():
    """Rank 1 skips half its units from the start; restored at 6; rank 0 resized at 8;
    units migrate to rank 0 at 10; restored at 12 (priorities refreshed every 4 iterations,
    which swaps units in and out). Under --bf16, so the fp32 master weights are frozen too."""
    actions = {
        6: [("resize", (0.0, 0.0))],
        8: [("resize", (0.5, 0.0))],
        10: [("migrate", "rebalance:attn=3,1;mlp=160,96")],
        12: [("resize", (0.0, 0.0))],
    }
    return run_ranks(
        train_with_resizes,
        2,
        TRAIN + ["--het-tp-resize", "0,0.5", "--het-tp-priority-interval", "4", "--bf16"],
        actions,
        range(1, 14),
    )


def test_skipped_units_stay_frozen_and_resume_when_restored(resized_run):
    records = resized_run[1]["records"]
    assert "het-TP resize at iteration 0 (initial)" in resized_run[0]["stdout"]
    assert all(math.isfinite(v) for v in resized_run[0]["losses"].values())
    frozen = changed = 0
    for it in range(1, 6):
        before, after = records[it], records[it + 1]
        assert set(after["state_keys"]) == {"master", "exp_avg", "exp_avg_sq"}
        for key, skipped in _skipped(before).items():
            for unit, values in before["blocks"][key]["values"].items():
                later = after["blocks"][key]["values"][unit]
                if unit in skipped and unit in _skipped(after)[key]:
                    # weights, Adam moments: bit-identical (weight decay 0.1 would change them)
                    assert _same(values, later), f"skipped unit {key} {unit} changed at {it + 1}"
                    frozen += 1
                else:
                    changed += not _same(values[:1], later[:1])
    assert frozen > 100 and changed > 100
    # restored at 6: the units rank 1 skipped until then train again
    skipped_until_6 = _skipped(records[5])
    assert all(not s for s in _skipped(records[6]).values())
    for key, units in skipped_until_6.items():
        for unit in units:
            assert not _same(
                records[6]["blocks"][key]["values"][unit][:1],
                records[8]["blocks"][key]["values"][unit][:1],
            )


@pytest.mark.parametrize("adam", [torch.optim.AdamW, GroupStepAdam])
def test_step_counts_and_betas_read_per_parameter_and_per_group(adam):
    """torch's Adam counts steps per parameter; TE's and apex's fused Adams (GroupStepAdam's
    layout) per group: resumed units are rescaled with either."""
    from megatron.hetero.unit_state import adam_betas, step_count

    params = [torch.nn.Parameter(torch.ones(3)) for _ in range(2)]
    optimizer = adam(
        [{"params": params[:1]}, {"params": params[1:]}],
        lr=0.1,
        weight_decay=0.0,
        betas=(0.8, 0.99),
        eps=1e-8,
    )
    view = SimpleNamespace(subs=[SimpleNamespace(optimizer=optimizer)])
    assert step_count(view) == 0
    for _ in range(3):
        for p in params:
            p.grad = torch.ones(3)
        optimizer.step()
    assert step_count(view) == 3
    assert adam_betas(view) == {"exp_avg": 0.8, "exp_avg_sq": 0.99}
    plain = SimpleNamespace(subs=[SimpleNamespace(optimizer=torch.optim.SGD(params, lr=0.1))])
    assert adam_betas(plain) == {} and step_count(plain) == 0


def test_resumed_units_read_their_moments_as_when_frozen(resized_run):
    """Adam counts steps per tensor, not per unit, and its bias correction went on while a
    unit was skipped: before its first step back, its moments are rescaled to read as they did
    when it was frozen (units frozen after 4 to 10 steps), and a unit skipped from the start
    (zero moments) reads as a fresh Adam's after its first update. Every resume in the run:
    the restores at 6 and 12, the priority refreshes' swaps and the migration's re-sort."""
    events = resumed_misfits(resized_run)
    assert {since for _, _, since, _, _ in events} >= {0, 4, 8}, events
    for key, unit, since, it, misfit in events:
        assert misfit < 1e-5, (key, unit, since, it, misfit)


def test_a_first_update_the_optimizer_skips_waits_for_the_next():
    """Rank 1's units, skipped from the start, resume at 2; the optimizer skips step 3 (as on an
    fp16 overflow: its count stays), so their moments, still zero, are rescaled after step 4."""
    actions = {2: [("resize", (0.0, 0.0)), ("skip next step", None)]}
    argv = TRAIN + ["--het-tp-resize", "0,0.5", "--train-iters", "4"]
    ranks = run_ranks(train_with_resizes, 2, argv, actions, {2, 3, 4})
    records = ranks[1]["records"]
    assert [records[it]["count"] for it in (2, 3, 4)] == [2, 2, 3]
    keys = records[2]["state_keys"]
    m, v = 1 + keys.index("exp_avg"), 1 + keys.index("exp_avg_sq")
    resumed = 0
    for key, units in _skipped(records[1]).items():
        for unit in units:
            at3, at4 = (records[it]["blocks"][key]["values"][unit] for it in (3, 4))
            assert not at3[v].any()  # no update yet
            misfit = resume_misfit((at3[m], at3[v]), (at4[m], at4[v]), 0, records[3]["count"])
            assert misfit < 1e-5, (key, unit, misfit)
            resumed += 1
    assert resumed > 100


def test_priority_order_survives_a_migration(resized_run):
    before, after = resized_run[0]["records"][9], resized_run[0]["records"][10]
    assert after["shares"] == (0.5, 0.0)
    for key, block in after["blocks"].items():
        grew = set(block["units"]) - set(before["blocks"][key]["units"])
        assert grew, f"{key}: rank 0 received no units"
        # rank 0 is resized: its units, received ones included, are in priority order, so the
        # skipped suffix is its lowest-priority units
        assert block["order_ok"], key
        assert block["active"] == len(block["units"]) - skipped_count(len(block["units"]), 0.5)


def test_resizer_with_no_share_is_bit_identical_to_plain_het_tp(tmp_path):
    plain = run_ranks(train, 2, TRAIN + ["--het-tp"])[0]["losses"]
    idle = run_ranks(
        train,
        2,
        TRAIN
        + ["--het-tp-resize", "0,0", "--het-tp-priority", "wg", "--het-tp-priority-interval", "2"],
    )[0]["losses"]
    assert plain == idle


def test_scorer_observes_only_sampled_iterations():
    """dw copies the sharded weights on the steps it observes (about 10% of a CPU step when it
    observes every step), so it observes iterations divisible by the sample interval."""
    argv = TRAIN + [
        "--het-tp-resize",
        "0,0.5",
        "--het-tp-priority-interval",
        "8",
        "--het-tp-priority-sample-interval",
        "3",
        "--train-iters",
        "7",
    ]
    records = run_ranks(train_with_resizes, 2, argv, {}, ())[1]["records"]
    once = records[3]["observed"]  # unit-steps observed at iteration 3
    assert once > 0
    assert [records[it]["observed"] for it in range(1, 8)] == [
        None,
        None,
        once,
        once,
        once,
        2 * once,
        2 * once,
    ]


def test_paper_baseline_updates_skipped_units_with_imputed_gradients():
    result = run_ranks(
        train_with_resizes,
        2,
        TRAIN + ["--het-tp-policy", "zero", "--het-tp-resize", "0,0.5", "--train-iters", "4"],
        {},
        (2, 3),
    )
    records = result[1]["records"]
    assert "skipped gradients imputed with 1e-08" in result[0]["stdout"]
    moved = sum(
        not _same(
            records[2]["blocks"][key]["values"][u][:1], records[3]["blocks"][key]["values"][u][:1]
        )
        for key, units in _skipped(records[2]).items()
        for u in units
        if u in _skipped(records[3])[key]
    )
    assert moved > 0  # not frozen: the optimizer steps them (weight decay, imputed gradient)


def test_resize_state_survives_a_checkpoint(tmp_path):
    """Stop at 5 and resume: the same losses as one straight run, through a priority refresh at
    4 and 8 and a restore at 6 (the resumed run must bring back the saved skipped units and
    the saved priorities, not the initial ones). Rank 0 is resized at 2 and restored at 5,
    the step saved: its units' moments, frozen after step 2, are rescaled before step 6, and
    rank 1's, frozen before any update, after step 7, in the resumed run as in the straight
    one (the checkpoint keeps when each unit was frozen, and which resume is pending)."""
    argv = TRAIN + [
        "--het-tp-resize",
        "0,0.5",
        "--het-tp-priority-interval",
        "4",
        "--train-iters",
        "10",
    ]
    actions = {
        2: [("resize", (0.5, 0.5))],
        5: [("resize", (0.0, 0.5))],
        6: [("resize", (0.0, 0.0))],
    }
    straight = run_ranks(train_with_resizes, 2, argv, actions, ())[0]["losses"]
    ckpt = ["--save", str(tmp_path / "ckpt"), "--save-interval", "5"]
    run_ranks(train_with_resizes, 2, argv + ckpt + ["--exit-interval", "5"], actions, ())
    resumed = run_ranks(
        train_with_resizes, 2, argv + ckpt + ["--load", str(tmp_path / "ckpt")], actions, ()
    )[0]["losses"]
    assert sorted(resumed) == list(range(6, 11))
    assert [resumed[i] for i in range(6, 11)] == [straight[i] for i in range(6, 11)]


def test_evaluation_runs_every_unit_and_training_stays_resized(tmp_path):
    """Rank 1 skips half its units while training; evaluated, the model is all of them: the
    test loss at the end is what vanilla megatron-core reads from the run's checkpoint. And
    training after an evaluation is resized as before: the same losses as without one."""
    ckpt = str(tmp_path / "ckpt")
    argv = (
        MHA.replace("--train-iters 1", "--train-iters 4").replace("--eval-iters 0", "")
        + " --tensor-model-parallel-size 2 --split 90,5,5"
    ).split()
    resize = ["--het-tp", "--het-tp-resize", "0,0.5"]
    evals = ["--eval-iters", "1", "--eval-interval", "2"]
    resized = run_ranks(train, 2, argv + resize + evals + ["--save", ckpt])[0]
    quiet = run_ranks(train, 2, argv + resize + ["--eval-iters", "0"])[0]
    assert resized["losses"] == quiet["losses"]
    vanilla = run_ranks(train, 2, argv + evals + ["--load", ckpt])[0]
    assert resized["test_loss"] == pytest.approx(vanilla["test_loss"], rel=1e-5)


def test_priorities_refresh_on_a_rank_left_without_units_of_a_block():
    """A migration leaves rank 0 no query group, then another moves two back: the priority
    refresh before it scores every unit of every block on every rank (a scorer read at the
    refresh, magnitude), and rank 0's empty attention weights failed to reshape (hybrid with
    --het-tp-priority magnitude crashed at its first move after one that emptied a rank's
    attention). Lossless against plain het-TP."""
    argv = TRAIN + ["--het-tp-resize", "0,0", "--het-tp-priority", "magnitude"]
    actions = {
        2: [("migrate", "rebalance:attn=0,4;mlp=128,128")],
        4: [("migrate", "rebalance:attn=2,2;mlp=128,128")],
    }
    moved = run_ranks(train_with_resizes, 2, argv, actions, ())[0]["losses"]
    plain = run_ranks(train, 2, TRAIN + ["--het-tp"])[0]["losses"]
    for i, loss in plain.items():
        assert moved[i] == pytest.approx(loss, rel=1e-5), i
