"""The pure report -> decision path (hettp.loop) that the Megatron controller runs on TP rank 0:
no process group, milliseconds."""

from __future__ import annotations

import random

import pytest

from hettp.detect import Detection, StragglerDetector
from hettp.loop import NEAR_EVEN, ControlLoop, TimingReport, Verdict, step_model, work_of
from hettp.plan import PartitionPlan
from hettp.planner import Planner
from hettp.step_model import plan_work
from hettp.transfer import REBUILD_FACTOR, CostModel, MigrationCost, plan_transfer

UNIT_WORK = {"attn": 4.0, "mlp": 1.0}


def _loop(policy, tp=2, cost=None):
    migration = cost or MigrationCost(unit_bytes={"attn": 4096, "mlp": 1024})
    planner = Planner(policy, UNIT_WORK, cap=0.5, migration_seconds=migration.seconds)
    return ControlLoop(planner, StragglerDetector(tp, patience=1, window=1), migration)


def _report(iteration, plan, shares, factors, per_unit=1e-3, rest=0.05, noise=0.0, rng=None):
    """What the ranks would measure: compute = per-unit time x factor x active work."""
    work = plan_work(plan, UNIT_WORK, shares)
    jitter = [1 + (rng.uniform(-noise, noise) if rng else 0.0) for _ in factors]
    compute = tuple(per_unit * f * w * j for f, w, j in zip(factors, work, jitter))
    return TimingReport(iteration, compute, work, rest + max(compute))


def _drive(loop, plan, rows, interval=4, noise=0.0, seed=0):
    """Report after report, applying every decision as the runtime would."""
    rng = random.Random(seed)
    shares = (0.0,) * plan.tp_size
    decisions = []
    for n, factors in enumerate(rows, 1):
        verdict = loop.report(
            _report(n * interval, plan, shares, factors, noise=noise, rng=rng), plan, shares
        )
        if verdict.decision is not None:
            decisions.append(verdict.decision)
            plan, shares = verdict.decision.plan, verdict.decision.shares
            loop.applied()
    return decisions, plan, shares


def test_slowest_replica_per_tp_position():
    a = TimingReport(8, (1.0, 2.1, 0.5), (10.0, 10.0, 0.0), 3.0)
    b = TimingReport(8, (1.1, 1.0, 0.7), (10.0, 12.0, 0.0), 3.5)
    merged = TimingReport.slowest_replica([a, b])
    assert merged == TimingReport(8, (1.1, 2.1, 0.7), (10.0, 12.0, 0.0), 3.5)


def test_step_model_plans_measured_factors_for_stragglers_only():
    report = TimingReport(4, (1.0, 2.2, 1.1), (1.0, 1.0, 1.0), 3.0)
    model = step_model(report, (1.0, 2.2, 1.1), {1}, per_unit=0.5)
    assert model.factors == (1.0, pytest.approx(2.2), 1.0)  # rank 2's 1.1 is noise
    assert model.rest == pytest.approx(3.0 - 2.2) and model.slope == pytest.approx(0.5)
    # a straggler with no work (None) is planned at the slowest known factor
    model = step_model(report, (1.0, None, 2.0), {1}, per_unit=0.5)
    assert model.factors == (1.0, 2.0, 1.0)


def test_migrate_moves_work_off_a_persistent_straggler_and_back():
    even = PartitionPlan.even(2, 2, 4, 64)
    rows = [[1, 1]] * 2 + [[1, 2]] * 6 + [[1, 1]] * 6
    decisions, plan, _ = _drive(_loop("migrate"), even, rows, noise=0.02)
    assert [d.action for d in decisions] == ["migrate", "migrate"]
    first = decisions[0]
    work = plan_work(first.plan, UNIT_WORK)
    assert 1.7 < work[0] / work[1] < 2.3  # balanced for a 2x rank 1
    assert plan_work(plan, UNIT_WORK) == plan_work(even, UNIT_WORK)  # back once it ended


def test_each_verdict_says_where_its_factors_were_read():
    """Before any move, the fit's prior reads the ranks (their works are equal); once a move
    changed the split, the anchor carries their slowdowns across it; the split back to even
    drops the anchor, and the fit, whose points now span a line, reads them."""
    loop, plan, shares = _loop("migrate"), PartitionPlan.even(2, 2, 4, 64), (0.0, 0.0)
    readings = []
    for n, factors in enumerate([[1, 1]] * 2 + [[1, 2]] * 4 + [[1, 1]] * 4, 1):
        verdict = loop.report(_report(4 * n, plan, shares, factors), plan, shares)
        readings.append(verdict.reading)
        if verdict.decision is not None:
            plan = verdict.decision.plan
            loop.applied()
    assert readings[:3] == ["prior"] * 3  # the move is decided on the third report
    assert readings[3:7] == ["anchor"] * 4  # the move back on the seventh
    assert readings[7:] == ["fit"] * 3


def test_hybrid_migrates_at_once_where_the_move_repays_within_a_step():
    decisions, plan, shares = _drive(
        _loop("hybrid"), PartitionPlan.even(2, 2, 4, 64), [[1, 1]] + [[1, 3]] * 8
    )
    assert [d.action for d in decisions] == ["hybrid-migrate"]  # no lossy resize first
    first = decisions[0]
    assert first.details["remaining_steps"] == 1
    assert first.details["migration_s"] < first.details["gain_s"]
    assert "no resize needed" in first.reason and not any(shares)
    work = plan_work(plan, UNIT_WORK)
    assert 2.5 < work[0] / work[1] < 3.5  # balanced for a 3x rank 1


def test_hybrid_resizes_first_where_the_move_repays_only_later():
    # the same straggle, a move costing more than a step saves: it waits until the straggle
    # has lasted long enough to repay it, and the resize bridges the wait
    costly = MigrationCost(unit_bytes={"attn": 4096, "mlp": 1024}, rebuild_factor=40.0)
    decisions, plan, shares = _drive(
        _loop("hybrid", cost=costly), PartitionPlan.even(2, 2, 4, 64), [[1, 1]] + [[1, 3]] * 8
    )
    assert [d.action for d in decisions] == ["hybrid-resize", "hybrid-migrate"]
    assert decisions[0].shares[1] > 0 and not any(shares)
    moved = decisions[1]
    assert moved.details["remaining_steps"] > 1 and "resize undone" in moved.reason
    assert moved.details["migration_s"] < moved.details["gain_s"]
    assert moved.details["migration_s"] > moved.details["gain_s"] / moved.details["remaining_steps"]


def test_a_steady_noisy_group_never_decides():
    decisions, _, _ = _drive(
        _loop("hybrid", tp=4),
        PartitionPlan.even(4, 2, 8, 64),
        [[1, 1, 1, 1]] * 60,
        noise=0.08,
        seed=5,
    )
    assert decisions == []


def test_state_dict_resumes_the_same_decisions():
    """A loop restored from a checkpointed state decides what the uninterrupted one does."""
    even = PartitionPlan.even(2, 2, 4, 64)
    rows = [[1, 1]] * 2 + [[1, 3.5]] * 4 + [[1, 1]] * 4
    straight = _loop("hybrid")
    want, _, _ = _drive(straight, even, rows)
    first = _loop("hybrid")
    before, plan, shares = _drive(first, even, rows[:4])

    def rest_of_run(loop):
        p, s, out = plan, shares, []
        for n, factors in enumerate(rows[4:], 5):
            verdict = loop.report(_report(n * 4, p, s, factors), p, s)
            if verdict.decision is not None:
                out.append(verdict.decision)
                p, s = verdict.decision.plan, verdict.decision.shares
                loop.applied()
        return out

    resumed = _loop("hybrid")
    resumed.load_state_dict(first.state_dict())
    after = rest_of_run(resumed)
    assert [d.action for d in before + after] == [d.action for d in want]
    assert [d.plan for d in before + after] == [d.plan for d in want]
    assert resumed.detector.stragglers == straight.detector.stragglers
    # without the state, a loop takes the ongoing straggle for a new one and acts again
    assert [d.action for d in rest_of_run(_loop("hybrid"))] != [d.action for d in after]


def test_every_rank_detects_alike_only_the_deciding_rank_plans_and_all_learn_the_same_fit():
    plan, shares = PartitionPlan.even(2, 2, 4, 64), (0.0, 0.0)
    decider, other = _loop("migrate"), _loop("migrate")
    for n, factors in enumerate([[1, 1], [1, 1.4], [1, 1.4], [1, 1]], 1):
        report = _report(4 * n, plan, shares, factors)
        detected, seen = decider.detect(report), other.detect(report)
        assert seen == detected  # the same timings: the same detection, nothing sent
        sent = decider.observe(report, detected, plan, shares, decide=True)
        mine = other.observe(report, seen, plan, shares, decide=False)
        assert mine.decision is None and mine.model is None
        assert mine.factors == pytest.approx(sent.factors)
        # the deciding rank sends its decision; both learn from the same verdict
        decider.learn(report, sent)
        other.learn(report, Verdict(mine.factors, seen, mine.model, sent.decision))
        assert other.fit.state_dict() == decider.fit.state_dict()
    # every rank's point counts, at the fastest rank's speed: rank 1's 1.4x reports too
    points = decider.fit.state_dict()["points"]
    assert len(points) == 8 and all(c == pytest.approx(points[0][1]) for _, c, _ in points)


def test_median_report_of_steps():
    steps = [
        TimingReport(1, (1.0, 2.0), (4.0, 4.0), 3.0),
        TimingReport(2, (1.2, 9.0), (4.0, 4.0), 9.5),
        TimingReport(3, (0.8, 2.2), (4.0, 4.0), 3.1),
    ]
    assert TimingReport.median(steps) == TimingReport(3, (1.0, 2.2), (4.0, 4.0), 3.1)
    with pytest.raises(ValueError, match="at least one step"):
        TimingReport.median([])


def test_a_report_at_a_change_is_at_the_level_the_last_step_is_at():
    """At an onset the window holds a normal step, a half-slowed one and a slow one: the
    median is half way, the level of the last step is not. The detector says the same."""
    steps = [
        TimingReport(7, (1.0, 1.0), (4.0, 4.0), 1.2, (0.1, 0.1)),
        TimingReport(8, (1.0, 1.8), (4.0, 4.0), 2.0, (0.1, 0.1)),
        TimingReport(9, (1.02, 2.2), (4.0, 4.0), 2.4, (0.1, 0.12)),
    ]
    assert TimingReport.median(steps).compute == (1.0, 1.8)
    level = TimingReport.latest_level(steps, band=1.3)
    assert level == TimingReport(9, (1.0, 2.0), (4.0, 4.0), 2.2, (0.1, 0.11))
    detector = StragglerDetector(2)
    for step in steps:
        seen = detector.update(step.compute)
    assert seen.slowdown == pytest.approx((1.0, 1.8)) and seen.onsets == {1}
    assert detector.level() == pytest.approx((1.0, 2.0))


def test_migration_cost_uses_the_exact_unit_bytes():
    old = PartitionPlan.even(2, 2, 4, 64)
    new = old.rebalanced([3, 1], [40, 24])
    cost = MigrationCost(CostModel(), {"attn": 10_000, "mlp": 3_000})
    schedule = plan_transfer(old, new, {"attn": 10_000, "mlp": 3_000}.__getitem__)
    assert cost.seconds(old, new) == pytest.approx(
        REBUILD_FACTOR * min(CostModel().predict(schedule).values())
    )
    assert cost.seconds(old, old) == 0.0
    loop = _loop("migrate", cost=cost)
    loop.report(_report(4, old, (0.0, 0.0), [1, 1]), old, (0.0, 0.0), {"attn": 1, "mlp": 2})
    assert cost.unit_bytes == {"attn": 1, "mlp": 2}  # what the partition says it carries now


def test_work_of_vanilla_layers_is_an_even_share():
    assert work_of(None, None, (0.0, 0.0), 2) == (1.0, 1.0)
    plan = PartitionPlan.even(2, 1, 2, 8)
    assert work_of(plan, UNIT_WORK, (0.0, 0.5), 2) == (8.0, 6.0)


def test_a_batch_ramp_mid_straggle_does_not_hide_its_end():
    """Each step's work grows 4x while rank 1 straggles (a batch-size ramp), then the straggle
    ends: told of the ramp, the loop moves the units back. Seconds compared across the ramp
    would put rank 1's time at its end 2x above its straggling time before, and never end it."""
    even = PartitionPlan.even(2, 2, 4, 64)
    loop, plan, shares, scale = _loop("migrate"), even, (0.0, 0.0), 1
    rows = [(1, [1, 1])] * 2 + [(1, [1, 2])] * 4 + [(4, [1, 2])] * 4 + [(4, [1, 1])] * 6
    actions = []
    for n, (microbatches, factors) in enumerate(rows, 1):
        if microbatches != scale:
            loop.work_scaled(microbatches / scale)
            scale = microbatches
        report = _report(n * 4, plan, shares, factors, 1e-3 * scale, 0.05 * scale)
        verdict = loop.report(report, plan, shares)
        if verdict.decision is not None:
            actions.append((n, verdict.decision.action))
            plan, shares = verdict.decision.plan, verdict.decision.shares
            loop.applied()
    assert [a for _, a in actions] == ["migrate", "migrate"], actions
    assert actions[0][0] <= 4 and actions[1][0] >= 11  # at the onset, then at the end only
    assert plan_work(plan, UNIT_WORK) == plan_work(even, UNIT_WORK)


def test_the_fit_scales_with_the_work():
    from hettp.costfit import ComputeFit

    fit = ComputeFit()
    fit.add([10.0, 20.0], [1.1, 2.1], [1.0, 1.0], [0.1, 0.1])
    fit.add([10.0, 30.0], [1.1, 3.1], [1.0, 1.0], [0.1, 0.1])
    before = fit.line()
    fit.rescale(4.0)
    after = fit.line()
    assert after.per_unit == pytest.approx(4 * before.per_unit)
    assert after.fixed == pytest.approx(4 * before.fixed)


def test_reweighed_units_keep_the_report_interval_and_forget_what_was_learned():
    """Core attention priced at step 3 of an interval of 5: the interval goes on in the new
    units (its report still comes at step 5, with the new work), the fit starts over."""
    loop = ControlLoop(
        Planner("migrate", {"attn": 4.0, "mlp": 1.0}), StragglerDetector(2), interval=5
    )
    for i in range(1, 4):
        loop.step(TimingReport(i, (1.0, 1.0), (10.0, 10.0), 1.5))
    loop.fit.add((10.0, 10.0), (1.0, 1.0), (1.0, 1.0))
    loop.reweighed((12.0, 12.0))
    assert not loop.fit._points
    assert loop.step(TimingReport(4, (1.0, 1.0), (12.0, 12.0), 1.5)) is None
    due = loop.step(TimingReport(5, (1.0, 1.0), (12.0, 12.0), 1.5))
    assert due.closes_interval and due.report.work == (12.0, 12.0)
    # steps of two splits cannot be re-expressed by one work: the interval starts over
    loop.step(TimingReport(6, (1.0, 1.0), (12.0, 12.0), 1.5))
    loop.step(TimingReport(7, (1.0, 1.0), (14.0, 10.0), 1.5))
    loop.reweighed((13.0, 11.0))
    assert all(
        loop.step(TimingReport(i, (1.0, 1.0), (13.0, 11.0), 1.5)) is None for i in (8, 9, 10)
    )


def test_a_straggle_seen_at_an_interval_s_last_step_is_planned_at_the_level_it_is_at():
    """Rank 1 3x slow from step 7; the loop's interval closes at 8, where the onset shows (the
    second slow step). The interval's median there is half slow: planned on it, a 3x rank was
    given work for 2x (a third where a quarter balances), and a straggle's end seen at an
    interval's close planned half way back."""
    loop = ControlLoop(
        Planner("migrate", UNIT_WORK, cap=0.5), StragglerDetector(2), MigrationCost(), interval=4
    )
    even = plan = PartitionPlan.even(2, 2, 4, 64)
    shares, decided = (0.0, 0.0), {}
    for step in range(1, 9):
        factors = (1.0, 3.0) if step >= 7 else (1.0, 1.0)
        verdict = loop.run_step(_report(step, plan, shares, factors), plan, shares)
        if verdict is not None and verdict.decision is not None:
            decided[step] = verdict.decision
    assert sorted(decided) == [8], decided
    assert decided[8].plan != even
    work = plan_work(decided[8].plan, UNIT_WORK)
    assert work[1] / sum(work) == pytest.approx(0.25, abs=0.03)


def test_the_planner_is_given_each_reports_measured_compute():
    """The planner judges a move against the report's measured compute
    (hettp.planner.Planner._contradicted): the loop must hand it over with the step."""
    seen = []

    class Recording(Planner):
        def decide(self, *args, **kwargs):
            seen.append(args[5:])
            return super().decide(*args, **kwargs)

    loop = ControlLoop(Recording("migrate", UNIT_WORK), StragglerDetector(2, patience=1, window=1))
    even = PartitionPlan.even(2, 2, 4, 64)
    report = _report(8, even, (0.0, 0.0), (1.0, 2.0))
    verdict = loop.report(report, even, (0.0, 0.0))
    assert verdict.decision is not None and verdict.refused is None
    assert seen == [(report.measured,)]
    # what the planner refused is in the verdict (the timing record and a log line carry it)
    refusing = Recording("migrate", UNIT_WORK)
    refusing.decide = lambda *args, **kwargs: setattr(refusing, "refused", "move refused") or None
    loop = ControlLoop(refusing, StragglerDetector(2, patience=1, window=1))
    assert loop.report(report, even, (0.0, 0.0)).refused == "move refused"


def test_a_rebalance_that_ran_slower_than_predicted_is_undone_and_not_made_again():
    """Each rank's compute carries a per-call part, so after the first move off a 3x rank the
    model rebalances further (to no attention on it). That plan's steps run 30% slower than
    its compute says (a cost no term of the model holds): two reports later the loop moves
    back to the plan it left, and stays there while the model still calls the other better."""
    even = PartitionPlan.even(2, 2, 4, 64)
    loop, plan, shares = _loop("migrate"), even, (0.0, 0.0)
    decisions, plans = [], []
    for n in range(1, 17):
        factors = (1.0, 1.0) if n <= 2 else (1.0, 3.0)
        work = plan_work(plan, UNIT_WORK, shares)
        compute = tuple(1e-3 * f * (w + 20.0 * (w > 0)) for f, w in zip(factors, work))
        step = 0.05 + max(compute)
        if len(decisions) >= 2 and plan == decisions[1].plan:  # the rebalance's plan
            step *= 1.3
        verdict = loop.report(TimingReport(4 * n, compute, work, step), plan, shares)
        if verdict.decision is not None:
            decisions.append(verdict.decision)
            plan = verdict.decision.plan
            loop.applied()
        plans.append(plan)
    reasons = [d.reason for d in decisions]
    assert len(decisions) == 3, reasons
    assert reasons[1].startswith("rebalance") and reasons[2].startswith("revert (measured)")
    assert decisions[2].plan == decisions[0].plan and decisions[1].plan != decisions[0].plan
    assert plans[-1] == decisions[0].plan  # not made again


def test_a_move_back_to_a_near_even_split_drops_the_slowdown_the_anchor_carried():
    """A move back after a straggle lands on the MLP's chunks, a few per cent off even. The
    slowdown the anchor carries across that change may be stale (a run read 1.25x from a
    one-step report at it, kept it, and then refused the next burst's rebalance as the model's
    error): within NEAR_EVEN of an even split the ranks' ratios are read directly. Further
    from even, the anchor stands."""
    near = PartitionPlan.from_counts(2, 2, 4, 128, (2, 2), (65, 63))
    far = PartitionPlan.from_counts(2, 2, 4, 128, (2, 2), (80, 48))
    near_spread, far_spread = (
        max(w) / min(w) for w in (plan_work(p, UNIT_WORK) for p in (near, far))
    )
    assert 1.0 < near_spread <= NEAR_EVEN < far_spread
    for plan, reads in ((near, 1.0), (far, 1.25)):
        loop = _loop("migrate")
        loop.anchor.rebase((1.0, 1.25))  # the stale reading, carried across the change
        work = plan_work(plan, UNIT_WORK)
        for i in range(1, 5):  # both ranks at full speed
            detection = loop.detect(TimingReport(i, tuple(1e-3 * w for w in work), work, 0.2))
        assert detection.slowdown[1] == pytest.approx(reads, rel=0.02), plan.summary()


def test_a_change_carries_the_planners_reading_of_the_ranks_that_do_not_straggle():
    """Rank 1 straggles at 3x; rank 2 reads 1.2x (noise, under the onset) and rank 3 1.4x
    (past the onset, its patience not yet run out). After a move, the anchor carries rank 2
    at 1.0, as the planner read it, and ranks 1 and 3 at their levels: a straggle may be
    starting on rank 3."""
    loop = ControlLoop(
        Planner("migrate", UNIT_WORK), StragglerDetector(4, patience=3, window=3), interval=100
    )
    work = (10.0,) * 4
    for n in range(1, 4):
        loop.detect(TimingReport(n, (1.0, 3.0, 1.2, 1.4), work, 3.2))
    assert loop.detector.stragglers == {1}
    loop.applied()
    # with each rank's compute and work at that level, which an end at the change is held to
    assert loop.anchor.state_dict()["then"] == [[1.0, 3.0, 1.2, 1.4], [10.0] * 4]
    moved = (14.0, 4.0, 11.0, 11.0)  # the same speeds at a new split: compute per work as before
    compute = tuple(c * w / 10.0 for c, w in zip((1.0, 3.0, 1.2, 1.4), moved))
    for n in range(4, 7):
        loop.detect(TimingReport(n, compute, moved, 3.2))
    assert loop.factors(TimingReport(6, compute, moved, 3.2)) == pytest.approx((1.0, 3.0, 1.0, 1.4))


def test_a_level_is_read_from_the_steps_since_the_change_at_it():
    """The level a change carries across (and every later reading of the rank with it) is the
    median of the steps since the last change at the window's level, not of the window's 3
    steps: three high ones (2.3x for a 2.0x rank) stayed in the rank's readings, and a
    recovered 2.5x rank carried at 2.78x read 1.2x and stayed planned for. At an onset the
    steps before it are not at its level and are left out."""
    detector = StragglerDetector(2)
    for slow in (2.0, 1.9, 2.1, 1.95, 2.05, 2.0, 1.9, 2.1, 2.3, 2.3, 2.25):
        detector.update((1.0, slow))
    assert detector.level() == pytest.approx((1.0, 2.05))  # 2.3 from the window alone
    detector.rebase()  # a change: the steps before it are of another split
    for slow in (2.3, 2.3, 2.25):
        detector.update((1.0, slow))
    assert detector.level() == pytest.approx((1.0, 2.3))
    onset = StragglerDetector(2)
    for slow in (1.0,) * 8 + (2.3, 2.4):
        onset.update((1.0, slow))
    assert onset.level() == pytest.approx((1.0, 2.35))
    again = StragglerDetector(2)
    again.load_state_dict(detector.state_dict())
    assert again.level() == detector.level()


def test_a_report_half_way_through_a_straggles_end_is_not_planned_on():
    """An interval that closed two steps after a 3.8x straggle ended (TP=2, its units alone
    slowed) has a median of 2.7x where the detector's window reads 1.4x: a rebalance planned on
    it moved units off the recovered rank (a real run). The planner waits for the detector;
    a report at the detector's level is planned on."""
    plan = PartitionPlan.even(2, 2, 4, 64)
    work = plan_work(plan, UNIT_WORK)
    report = TimingReport(33, (0.1, 0.27), work, 0.35)
    for level, planned in ((1.4, False), (2.6, True)):
        loop = _loop("migrate")
        seen = Detection((1.0, level), frozenset({1}), False, frozenset(), frozenset())
        verdict = loop.observe(report, seen, plan, (0.0, 0.0), True)
        assert (verdict.decision is not None) == planned, (level, verdict)
