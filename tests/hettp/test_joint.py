"""The joint controller of data split and TP partition (hettp/joint.py), pure."""

import pytest

from hettp.joint import JointController, JointState, ReplicaPace, options
from hettp.plan import PartitionPlan
from hettp.step_model import plan_work

UNIT_WORK = {"attn": 4.0, "mlp": 1.0}
PLAN = PartitionPlan.even(2, 2, 4, 16)  # 2 layers: 4 query groups, 16 MLP units each


def _state(factors, counts=(2, 2), plan=PLAN, shares=(0.0, 0.0), fixed=0.0):
    return JointState(
        plan, shares, counts, tuple(ReplicaPace(0.0, f) for f in factors), 0.01, fixed
    )


def _cost(old, new):
    return 0.5


def test_stragglers_at_different_tp_positions_want_a_plan_for_one_replica_and_a_rebatch():
    # replica 0 slow at TP rank 0, replica 1 at TP rank 1: the shared plan balanced for the
    # slowest replica at each position is the even one, so moving units alone cannot help
    state = _state([(3.0, 1.0), (1.0, 3.0)])
    found = {o.action: o for o in options(state, UNIT_WORK, 0.5, _cost)}
    assert "migrate" not in found  # the slowest-per-position plan is the plan already held
    assert "rebatch" not in found and "resize" not in found  # equally slow replicas, positions
    best = JointController(budget=0.5).choose(list(found.values()), horizon=100).option
    assert best.action in ("migrate:replica0+rebatch", "migrate:replica1+rebatch")
    assert best.step_seconds < 0.8 * found["none"].step_seconds
    assert best.counts in ((3, 1), (1, 3))


def test_a_slow_replica_is_rebatched_at_no_cost_and_equal_replicas_do_nothing():
    ctl = JointController(budget=0.0)  # no moving at all: rebatching moves no state
    state = _state([(3.0, 3.0), (1.0, 1.0)])
    choice = ctl.choose(options(state, UNIT_WORK, 0.5, _cost), horizon=10)
    assert choice.option.action == "rebatch" and choice.option.counts == (1, 3)
    steady = _state([(1.0, 1.0), (1.0, 1.0)])
    assert ctl.choose(options(steady, UNIT_WORK, 0.5, _cost), horizon=10).option.action == "none"


def test_a_short_horizon_does_not_repay_a_move_and_a_long_one_does():
    state = _state([(3.0, 1.0), (3.0, 1.0)])  # rank 0 slow in both replicas: migrate
    ctl = JointController(budget=1.0)
    found = options(state, UNIT_WORK, 0.5, lambda old, new: 5.0)
    assert ctl.choose(found, horizon=2).option.action in ("none", "resize")
    assert ctl.choose(found, horizon=1000).option.action.startswith("migrate")


def test_replicas_of_one_pace_are_planned_for_once(monkeypatch):
    # eight replicas of three paces: the shared plan for the slowest per position (the even
    # plan here) and one plan per distinct replica pace; at scale hundreds of replicas share
    # a few paces, and a plan per replica would cost seconds a report
    import hettp.joint as joint

    planned = []

    def counting(plan, model, work, memory=None):
        planned.append(model)
        return joint_plan(plan, model, work, memory)

    joint_plan = joint.balanced_target
    monkeypatch.setattr(joint, "balanced_target", counting)
    paces = [(1.0, 1.0)] * 4 + [(2.0, 1.0)] * 2 + [(1.0, 2.0)] * 2
    found = options(_state(paces, counts=(2,) * 8), UNIT_WORK, 0.5, _cost)
    assert len(planned) == 4  # slowest (2, 2), replica 0's (1, 1), 4's (2, 1), 6's (1, 2)
    targets = {o.action.split("+")[0] for o in found if o.action.startswith("migrate")}
    assert targets == {"migrate:replica4", "migrate:replica6"}
    # twenty replicas of twenty paces: plans for the REPLICA_TARGETS slowest only (replica
    # 19's pace is the slowest per position, the shared plan's target)
    planned.clear()
    paces = [(1.0 + r / 10, 1.0) for r in range(20)]
    found = options(_state(paces, counts=(2,) * 20), UNIT_WORK, 0.5, _cost)
    assert len(planned) == 1 + joint.REPLICA_TARGETS
    names = {o.action.split("+")[0] for o in found if o.action.startswith("migrate:")}
    # (neighbouring paces can round to one plan here, weighed once)
    assert names and names <= {f"migrate:replica{r}" for r in range(11, 19)}


def test_a_resize_in_force_is_undone_when_the_straggle_ends():
    resized = _state([(1.0, 1.0), (1.0, 1.0)], shares=(0.3, 0.0))
    choice = JointController(budget=0.1).choose(options(resized, UNIT_WORK, 0.5, None), horizon=10)
    assert choice.option.action == "restore" and choice.option.shares == (0.0, 0.0)


def _simulate(budget, steps=4000, interval=10, move_seconds=6.0):
    """A straggler (3x, TP rank 0 of replica 0, then of both) that comes and goes; returns the
    controller after every report's choice was applied, with what it moved and trained."""
    ctl = JointController(budget)
    plan, shares, counts = PLAN, (0.0, 0.0), (2, 2)
    for start in range(0, steps, interval):
        phase = (start // 150) % 4
        f = {0: (1.0, 1.0), 1: (3.0, 1.0), 2: (1.0, 1.0), 3: (2.5, 1.0)}[phase]
        factors = [f, f if phase == 3 else (1.0, 1.0)]
        slow = frozenset(
            (r, p) for r, row in enumerate(factors) for p, f in enumerate(row) if f > 1
        )
        state = _state(factors, counts, plan, shares)
        choice = ctl.choose(
            options(state, UNIT_WORK, 0.5, lambda old, new: move_seconds),
            horizon=ctl.hold(start, slow, interval),
        )
        o = choice.option
        plan, shares, counts = o.plan, o.shares, o.counts
        trained = interval * state.step_seconds(plan_work(plan, UNIT_WORK, shares), counts)
        ctl.account(o.move_seconds, trained + o.move_seconds)
    return ctl


@pytest.mark.parametrize("budget", [0.01, 0.02])
def test_the_migration_budget_holds_over_a_run_with_a_straggler_that_comes_and_goes(budget):
    ctl = _simulate(budget)
    assert ctl.moved > 0  # it did move
    assert ctl.spent_share <= budget, (ctl.moved, ctl.trained, ctl.queue)
    free = _simulate(1.0)
    assert free.spent_share > budget  # the budget, not the gains, held it back
    assert _simulate(0.0).moved == 0.0  # no budget: rebatches and resizes only


def test_the_queue_grows_by_moves_beyond_the_budget_and_drains():
    ctl = JointController(budget=0.1)
    ctl.account(5.0, 10.0)
    assert ctl.queue == pytest.approx(4.0)
    ctl.account(0.0, 30.0)
    assert ctl.queue == pytest.approx(1.0)
    ctl.account(0.0, 100.0)
    assert ctl.queue == 0.0
    again = JointController(budget=0.1)
    again.load_state_dict(ctl.state_dict())
    assert again.spent_share == pytest.approx(5.0 / 140.0)
    ctl.hold(40, frozenset({(0, 1)}), 10)
    assert again.hold(1, frozenset(), 10) == 10
    again.load_state_dict(ctl.state_dict())
    assert again.hold(100, frozenset({(0, 1)}), 10) == 60  # slow since 40
    assert again.hold(110, frozenset(), 10) == 10  # a change: from now on
    with pytest.raises(ValueError, match=r"budget must be within \[0, 1\], got 1.5"):
        JointController(1.5)


def test_under_a_memory_cap_every_migration_the_joint_policy_weighs_fits_it():
    from hettp.memory import MemoryCap

    state = _state([(3.0, 1.0), (1.0, 3.0)])
    free = [o for o in options(state, UNIT_WORK, 0.5, _cost) if o.action.startswith("migrate")]
    cap = MemoryCap(1.2, UNIT_WORK)
    assert free and not all(cap.fits(o.plan) for o in free)
    capped = [
        o
        for o in options(state, UNIT_WORK, 0.5, _cost, memory=cap)
        if o.action.startswith("migrate")
    ]
    assert capped and all(cap.fits(o.plan) and o.plan != PLAN for o in capped)
