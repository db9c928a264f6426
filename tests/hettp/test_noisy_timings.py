"""The control loop on the timings a busy machine gives (hettp.sim.noisy): a straggle that begins
part-way through a step, per-step noise on every rank, a per-call part the timed optimizer step
does not cover. Pure: the loop is driven step by step as the Megatron controller drives it."""

from __future__ import annotations

import random
import statistics

import pytest

from hettp.anchor import SlowdownAnchor
from hettp.costfit import ComputeFit
from hettp.sim.noisy import end_lags, even_split_ratio, straggle


@pytest.mark.parametrize("sharded_only", [True, False], ids=["emulated", "device"])
@pytest.mark.parametrize("factor", [2.5, 4.0])
def test_an_onset_mid_step_is_planned_at_its_level(factor, sharded_only):
    """The detector's window at the onset holds a normal step, the half-slowed one and a slow
    one: its median is half way (1.6x for a 2.2x rank). Planned from it, the first move stopped
    half way and two or three rebalances followed; planned at the last step's level, the first
    move is right, and at most one rebalance corrects what the per-call part adds."""
    run = straggle("migrate", factor, 0.0, 0, sharded_only)
    assert 1 <= len(run.decisions) <= 2, run.decisions
    first = run.decisions[0]
    assert first.step <= 10 and first.action == "migrate"
    assert first.planned[0] == pytest.approx(even_split_ratio(factor, sharded_only), rel=0.03)
    assert run.steady_e >= 0.93


@pytest.mark.parametrize(
    "noise, most_swapped, most_ended, least_e",
    [(0.1, 0, 0, 0.9), (0.25, 5, 16, 0.78)],
    ids=["10%", "25%"],
)
def test_a_persistent_straggler_on_noisy_timings_stays_planned_for(
    noise, most_swapped, most_ended, least_e
):
    """Per-step noise on each rank, 30 runs a mode (60 in all). At 10% (about this VM's busy
    reports): no run ends the straggle or takes the fast rank for the slow one, and 9 runs of
    10 hold E >= 0.9. At 25%: at most 5 runs swap the ranks and 16 end the straggle (it is
    found again at the next steps), and 9 runs of 10 hold E >= 0.78. (5 since levels are read
    from the steps since the last change, 2 before; over 360 other runs at 25%, 17 against
    16, mean E 0.944 against 0.943: this noise decides.) The loop before these
    fixes: at 10%, 4 runs ended it, 4 swapped, and E fell to 0.44-0.59 in some; at 25%, 18
    runs swapped the ranks, 25 ended it, and a tenth of them sat at E 0.50-0.57."""
    runs = [straggle("migrate", 2.5, noise, s, mode) for mode in (True, False) for s in range(30)]
    assert sum(r.swapped for r in runs) <= most_swapped
    assert sum(r.ended for r in runs) <= most_ended
    assert sorted(r.steady_e for r in runs)[len(runs) // 10] >= least_e


def test_a_fast_ranks_noise_at_a_move_is_not_carried_into_its_later_readings():
    """TP=4, rank 2 2x or 3x slow, 10% per-step noise, 40 runs. The anchor carried each rank's
    level across a move as read, a fast rank's 1.1x of noise included; a few slower steps on
    top then read as a 1.3x onset and the plan took units off a fast rank (6 and 5 of 40
    runs with rank 0 or 2 slow, before the fast ranks were carried at 1.0)."""
    runs = [
        straggle("migrate", factor, 0.1, seed, mode, tp=4, slow_rank=2)
        for factor in (2.0, 3.0)
        for mode in (True, False)
        for seed in range(10)
    ]
    assert sum(r.swapped for r in runs) == 0
    assert sum(r.ended for r in runs) <= 1
    assert sorted(r.steady_e for r in runs)[len(runs) // 10] >= 0.92


def test_a_straggle_still_starting_at_a_move_keeps_its_level():
    """TP=4 at 20% noise, hybrid: a fast rank's noise sometimes moves units before the slow
    rank's onset has registered (the onset step is half-slowed). Carried at 1.0 with the other
    non-stragglers, that rank read normal ever after, and 4 of 40 runs never planned for it
    (E down to 0.56); it keeps its level where it reads past the onset. Before either (every
    rank carried as read), the worst tenth of these runs held E 0.78."""
    runs = [
        straggle("hybrid", factor, 0.2, seed, mode, tp=4, slow_rank=2)
        for factor in (2.0, 3.0)
        for mode in (True, False)
        for seed in range(10)
    ]
    assert all(any(d.planned[2] > 1.0 for d in r.decisions) for r in runs)
    assert sorted(r.steady_e for r in runs)[len(runs) // 10] >= 0.8


def test_the_plan_goes_back_within_two_steps_of_a_straggles_end():
    """TP=4, a slow device (rank 1 or 2 at 1.8-4x, two per-call parts) whose straggle ends at
    step 20, 23 or 26, 5% noise, 108 runs: the split is back within NEAR_EVEN of even by the
    second normal step in 96 and never stays off. A recovered rank read through a level taken
    from the window's 3 steps kept their noise (a 2.5x rank carried at 2.78x read 1.2x, inside
    the detector's band, and was planned for as a milder straggler for good): 89 within two
    steps and 4 never before the carry of 1.0 for the fast ranks, 91 and 10 with it, before
    levels were read from the steps since the change."""
    lags = [
        lag
        for per_call in (0.08, 0.3)
        for lag in end_lags(
            ((4, 1), (4, 2)), (1.8, 2.5, 4.0), (20, 23, 26), 3, False, steps=40, per_call=per_call
        )
    ]
    assert sum(lag is None for lag in lags) <= 2
    assert sum(lag is not None and lag <= 2 for lag in lags) >= 94


def test_an_emulated_straggles_end_is_followed_back_to_even():
    """As --het-tp-emulate slows a rank (its units only, not its per-call part), a recovered
    rank that had moved units off reads slower than it is through the level continuity carried
    (2.1x at the even split, 1.28x once recovered at 400 units of 784), inside the detector's
    band. TP=2 and TP=4, 1.5-4x ending at step 20 or 26, 5% noise, 72 runs: 6 never came
    back and 65 were back within 8 steps; 45 and 23 before the model's end of a level inside
    the band (at more work) and the move back at an end however little it gains. Within 2
    steps: 31, against 16; the drift to the band level is planned for first."""
    lags = end_lags(((2, 0), (4, 1), (4, 2)), (1.5, 2.5, 4.0), (20, 26), 4, True)
    assert sum(lag is None for lag in lags) <= 9
    assert sum(lag is not None and lag <= 8 for lag in lags) >= 58


def test_the_noisy_group_names_a_slow_rank_it_has():
    with pytest.raises(ValueError, match="slow rank 4 is not in a TP group of 4"):
        straggle("migrate", 2.0, 0.1, 0, True, tp=4, slow_rank=4)


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
