"""The memory cap on a rank's unit state (--het-tp-memory-cap): counting, water-filling, and
the planner's moves within it (pure, no process group)."""

from __future__ import annotations

import pytest

from hettp.detect import Detection
from hettp.memory import MemoryCap, canonical_params, held_params, water_filled
from hettp.plan import HeadUnits, PartitionPlan
from hettp.planner import Planner, balanced_target
from hettp.step_model import StepModel, plan_work

UNIT_WORK = {"attn": 4.0, "mlp": 1.0}
UNIT_PARAMS = {"attn": 4.0, "mlp": 1.0}
EVEN = PartitionPlan.even(2, 2, 8, 256)
SLOW = StepModel(0.05, (1.0, 3.0), 0.001)  # rank 1 at 3x


def test_held_params_count_units_and_each_k_v_replica():
    assert held_params(EVEN, UNIT_PARAMS) == (2 * (4 * 4.0 + 128), 2 * (4 * 4.0 + 128))
    assert canonical_params(EVEN, UNIT_PARAMS) == sum(held_params(EVEN, UNIT_PARAMS))
    # one group of 4 heads per rank, head units: a rank holding 1 head of the other group
    # keeps that group's K/V too
    heads = HeadUnits(1, 4, 2)
    plan = PartitionPlan.from_counts(2, 1, 8, 64, [5, 3], [32, 32], heads=heads)
    params = {"attn": 2.0, "mlp": 1.0, "kv": 3.0}
    assert held_params(plan, params) == (5 * 2.0 + 2 * 3.0 + 32, 3 * 2.0 + 3.0 + 32)
    assert canonical_params(plan, params) == 8 * 2.0 + 2 * 3.0 + 64  # each K/V once


def test_water_filled_caps_a_rank_and_spreads_its_excess_by_speed():
    assert water_filled([3.0, 1.0], [1.0, 1.0]) == [0.75, 0.25]
    assert water_filled([3.0, 1.0], [0.6, 1.0]) == pytest.approx([0.6, 0.4])
    # the excess of a capped rank goes to the others in proportion to their speeds
    assert water_filled([4.0, 4.0, 1.0, 1.0], [0.3, 1.0, 1.0, 1.0]) == pytest.approx(
        [0.3, 0.7 * 4 / 6, 0.7 / 6, 0.7 / 6]
    )
    with pytest.raises(ValueError, match="leave no room"):
        water_filled([1.0, 1.0], [0.4, 0.4])


def test_a_cap_below_the_even_split_is_refused():
    with pytest.raises(ValueError, match="even split itself needs 1.0"):
        MemoryCap(0.9, UNIT_PARAMS)


@pytest.mark.parametrize("factor", [1.0, 1.1, 1.25, 1.4])
def test_the_balanced_plan_stays_within_the_cap(factor):
    cap = MemoryCap(factor, UNIT_PARAMS)
    free = balanced_target(EVEN, SLOW, UNIT_WORK)
    even_share = canonical_params(EVEN, UNIT_PARAMS) / 2
    assert max(held_params(free, UNIT_PARAMS)) > 1.4 * even_share  # ~1.5x its share, uncapped
    capped = balanced_target(EVEN, SLOW, UNIT_WORK, cap)
    assert cap.fits(capped)
    # the cap binds but leaves the move as large as it allows: within a unit block of it
    held = held_params(capped, UNIT_PARAMS)
    assert held[0] > cap.limit(EVEN) - 2 * (UNIT_PARAMS["attn"] + 8 * UNIT_PARAMS["mlp"])
    if factor == 1.0:
        assert capped == EVEN
    else:
        assert SLOW.step_time(plan_work(capped, UNIT_WORK)) < SLOW.step_time(
            plan_work(EVEN, UNIT_WORK)
        )


def test_a_cap_that_does_not_bind_changes_nothing():
    cap = MemoryCap(2.0, UNIT_PARAMS)
    assert balanced_target(EVEN, SLOW, UNIT_WORK, cap) == balanced_target(EVEN, SLOW, UNIT_WORK)


def test_head_units_count_their_replicas_against_the_cap():
    """TP=4, one group of 3 heads per rank, rank 2 at 3x. Uncapped, a fast rank takes the
    slow rank's whole group (with its K/V: twice its attention state); capped at 1.15x, the
    attention stays where it was and only MLP units move."""
    heads = HeadUnits(1, 3, 4)
    even = PartitionPlan.even(4, 2, 12, 2048, heads=heads)
    work = {"attn": 3000.0, "mlp": 400.0, "kv": 2000.0}
    params = {"attn": 2000.0, "mlp": 400.0, "kv": 2000.0}
    model = StepModel(0.05, (1.0, 1.0, 3.0, 1.0), 1e-6)
    cap = MemoryCap(1.15, params)
    free = balanced_target(even, model, work)
    capped = balanced_target(even, model, work, cap)
    assert not cap.fits(free) and cap.fits(capped)
    assert max(free.counts(0, "attn")) == 6 and capped.counts(0, "attn") == (3, 3, 3, 3)
    assert held_params(capped, params)[2] < held_params(even, params)[2]  # the MLP moved


def _onset(factors, stragglers):
    return Detection(
        tuple(factors), frozenset(stragglers), True, frozenset(stragglers), frozenset()
    )


def test_migrate_moves_within_the_cap_and_hybrid_resizes_what_it_keeps_on_the_straggler():
    cap = MemoryCap(1.2, UNIT_PARAMS)
    seen = _onset((1.0, 3.0), {1})
    migrate = Planner("migrate", UNIT_WORK, memory=cap).decide(8, seen, SLOW, EVEN, (0.0, 0.0))
    assert migrate.action == "migrate" and cap.fits(migrate.plan) and not any(migrate.shares)
    assert migrate.plan != EVEN
    # what each rank will hold, in multiples of the even split's, for the log
    held = migrate.details["unit_state"]
    assert held[0] == pytest.approx(1.2 * max(cap.ratios(migrate.plan)), abs=1e-3)
    assert held[0] <= 1.2
    assert held[1] < 1.0
    hybrid = Planner(
        "hybrid", UNIT_WORK, cap=0.5, migration_seconds=lambda a, b: 0.0, memory=cap
    ).decide(8, seen, SLOW, EVEN, (0.0, 0.0))
    assert hybrid.action == "hybrid-migrate" and hybrid.plan == migrate.plan
    assert hybrid.shares[0] == 0.0 and 0.0 < hybrid.shares[1] <= 0.5
    assert "memory cap" in hybrid.reason
    assert hybrid.predicted_after < migrate.predicted_after  # the resize finishes the balance
    # uncapped, hybrid's move balances by itself and undoes nothing
    free = Planner("hybrid", UNIT_WORK, cap=0.5, migration_seconds=lambda a, b: 0.0).decide(
        8, seen, SLOW, EVEN, (0.0, 0.0)
    )
    assert free.action == "hybrid-migrate" and not any(free.shares)
    assert not cap.fits(free.plan)
