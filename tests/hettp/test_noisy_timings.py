"""The control loop on the timings a busy machine gives: a straggle that begins part-way through
a step, per-step noise on every rank, a per-call part the timed optimizer step does not cover.
Pure: the loop is driven step by step as the Megatron controller drives it."""

from __future__ import annotations

import random
import statistics

import pytest

from hettp.anchor import SlowdownAnchor
from hettp.costfit import ComputeFit
from hettp.detect import StragglerDetector
from hettp.loop import ControlLoop, TimingReport
from hettp.plan import PartitionPlan
from hettp.planner import Planner, plan_work
from hettp.transfer import MigrationCost

UNIT_WORK = {"attn": 64.0, "mlp": 1.0}  # 8 query groups of 64 and 1024 neurons a layer
PER_CALL = 0.08  # seconds a step whatever the units; the timed optimizer step is half of it
REST = 0.1  # seconds a step outside the sharded compute


def _straggle(policy, factor, noise, seed, sharded_only, steps=60, onset=8):
    """TP=2, rank 0 `factor`x slower from step `onset` on, the onset step half-slowed (the
    straggle began mid-step). `sharded_only`: only its per-unit work is slowed, as
    --het-tp-emulate does; else all of its compute, as a slow device. Returns the decisions
    as (step, action, reason, planned factors) and the steady E: the best split's step time
    over the mean of the last 30 steps' (noise-free) step times."""
    rng = random.Random(seed)
    plan, shares = PartitionPlan.even(2, 2, 8, 1024), (0.0, 0.0)
    migration = MigrationCost(unit_bytes={"attn": 64 * 4096, "mlp": 4096})
    planner = Planner(policy, UNIT_WORK, cap=0.5, migration_seconds=migration.seconds)
    loop = ControlLoop(planner, StragglerDetector(2), migration, interval=4)
    total = sum(plan_work(plan, UNIT_WORK))
    per_unit = 0.28 / (total / 2)

    def compute(rank, work, slow):
        f = slow if rank == 0 else 1.0
        return PER_CALL * (1.0 if sharded_only else f) + per_unit * work * f

    decisions, times = [], []
    for step in range(1, steps + 1):
        slow = 1.0 if step < onset else factor if step > onset else (1 + factor) / 2
        work = plan_work(plan, UNIT_WORK, shares)
        clean = [compute(r, w, slow) for r, w in enumerate(work)]
        measured = tuple(c * (1 + rng.uniform(-noise, noise)) for c in clean)
        timed_fixed = tuple(
            PER_CALL / 2 * (slow if r == 0 and not sharded_only else 1) for r in (0, 1)
        )
        times.append(max(clean) + REST)
        report = TimingReport(step, measured, tuple(work), max(measured) + REST, timed_fixed)
        verdict = loop.run_step(report, plan, shares)
        if verdict is not None and verdict.decision is not None:
            d = verdict.decision
            decisions.append((step, d.action, d.reason, verdict.model.factors))
            plan, shares = d.plan, d.shares
            loop.applied()
    # the best split: both ranks finish together
    slow0 = [compute(0, w, factor) for w in range(int(total) + 1)]
    best = min(max(s, compute(1, total - w, factor)) for w, s in enumerate(slow0)) + REST
    return decisions, best / statistics.mean(times[-30:])


@pytest.mark.parametrize("sharded_only", [True, False], ids=["emulated", "device"])
@pytest.mark.parametrize("factor", [2.5, 4.0])
def test_an_onset_mid_step_is_planned_at_its_level(factor, sharded_only):
    """The detector's window at the onset holds a normal step, the half-slowed one and a slow
    one: its median is half way (1.6x for a 2.2x rank). Planned from it, the first move stopped
    half way and two or three rebalances followed; planned at the last step's level, the first
    move is right, and at most one rebalance corrects what the per-call part adds."""
    decisions, e = _straggle("migrate", factor, 0.0, 0, sharded_only)
    assert 1 <= len(decisions) <= 2, decisions
    step, action, _, planned = decisions[0]
    assert step <= 10 and action == "migrate"
    slow = PER_CALL * (1 if sharded_only else factor) + 0.28 * factor
    truth = slow / (PER_CALL + 0.28)  # the slow rank over the fast at the even split
    assert planned[0] == pytest.approx(truth, rel=0.03)
    assert e >= 0.93


@pytest.mark.parametrize(
    "noise, most_swapped, most_ended, least_e",
    [(0.1, 0, 0, 0.9), (0.25, 2, 16, 0.78)],
    ids=["10%", "25%"],
)
def test_a_persistent_straggler_on_noisy_timings_stays_planned_for(
    noise, most_swapped, most_ended, least_e
):
    """Per-step noise on each rank, 30 runs a mode (60 in all). At 10% (about this VM's busy
    reports): no run ends the straggle or takes the fast rank for the slow one, and 9 runs of
    10 hold E >= 0.9. At 25%: at most 2 runs swap the ranks and 16 end the straggle (it is
    found again at the next steps), and 9 runs of 10 hold E >= 0.78. The loop before these
    fixes: at 10%, 4 runs ended it, 4 swapped, and E fell to 0.44-0.59 in some; at 25%, 18
    runs swapped the ranks, 25 ended it, and a tenth of them sat at E 0.50-0.57."""
    es, ended, swapped = [], 0, 0
    for sharded_only in (True, False):
        for seed in range(30):
            decisions, e = _straggle("migrate", 2.5, noise, seed, sharded_only)
            es.append(e)
            ended += any("no straggler left" in why for _, _, why, _ in decisions)
            swapped += any("ranks [1]" in why for _, _, why, _ in decisions)
    assert swapped <= most_swapped
    assert ended <= most_ended
    assert sorted(es)[len(es) // 10] >= least_e


def _noisy_anchor(seed, hiccups=()):
    """An anchor after a change, fed 3 + 32 steps of ±20% noise around (1.0, 0.5); the steps
    in `hiccups` take twice as long. Returns it and its reading after the window."""
    rng = random.Random(seed)
    anchor = SlowdownAnchor(2, window=3)
    anchor.rebase((2.0, 1.0))
    after_window = None
    for step in range(35):
        noise = [1 + rng.uniform(-0.2, 0.2) for _ in range(2)]
        slow = 2.0 if step in hiccups else 1.0
        anchor.step((1.0 * noise[0] * slow, 0.5 * noise[1] * slow))
        if step == 2:
            after_window = anchor.factors((1.0, 0.5))
    return anchor, after_window


def test_the_anchor_base_sharpens_with_the_steps_after_its_window():
    """Three noisy steps (±20%) fix the base every later reading is scaled by; the 32 steps
    after them refine it, a hiccup among them (2x) does not, nor do later steps."""
    window_errors, refined_errors = [], []
    for seed in range(20):
        anchor, after_window = _noisy_anchor(seed)
        window_errors.append(abs(after_window[0] - 2.0))
        refined_errors.append(abs(anchor.factors((1.0, 0.5))[0] - 2.0))
        with_hiccups, _ = _noisy_anchor(seed, hiccups=(10, 20, 30))
        # the hiccup steps' noise is drawn but left out: a little further off, not 2x
        assert with_hiccups.factors((1.0, 0.5))[0] == pytest.approx(
            anchor.factors((1.0, 0.5))[0], rel=0.06
        )
    assert statistics.mean(refined_errors) < statistics.mean(window_errors) / 2

    settled = anchor.factors((1.0, 0.5))
    for _ in range(10):  # past the 32 steps, a new level (the straggle ends): the base stays
        assert anchor.step((0.5, 0.5)) == [(settled[0] / 2, settled[1])]
    again = SlowdownAnchor(2, window=3)
    again.load_state_dict(anchor.state_dict())
    assert again.step((1.0, 0.5)) == anchor.step((1.0, 0.5))


def test_a_rank_without_work_reads_no_faster_than_the_fastest_working_rank():
    """A rank left without units is read on the fitted per-call part alone; fitted 4x too
    large, it read 0.25, and every working rank 4x slower than it."""
    fit = ComputeFit()
    for _ in range(4):  # a line with a per-call part of 0.2, where the truth is 0.05
        fit.add([0.0, 1.0], [0.05, 0.3], [1.0, 1.0], [0.04, 0.04])
        fit.add([0.5, 2.0], [0.3, 0.5], [1.0, 1.0], [0.04, 0.04])
    assert fit.fitted and fit.line().fixed > 0.15
    zero, working = fit.factors([0.0, 3.0], [0.05, 0.8])
    assert zero == pytest.approx(working)
    # a slow rank without work still reads slow where its compute says so
    slow, working = fit.factors([0.0, 3.0], [0.6, 0.8])
    assert slow > 2 * working
