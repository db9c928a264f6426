"""Layer splits over pipeline stages from measured stage speeds (pure)."""

import itertools

import pytest

from hettp.stages import (
    StageError,
    adjacent,
    balance_layers,
    check_split,
    optimal_split,
    stage_of_layers,
    tp_imbalance,
)


def _brute_force(per_layer, num_layers, rest):
    stages = len(per_layer)
    best = None
    for counts in itertools.product(range(1, num_layers + 1), repeat=stages):
        if sum(counts) == num_layers:
            cost = max(r + n * c for r, n, c in zip(rest, counts, per_layer))
            best = cost if best is None else min(best, cost)
    return best


@pytest.mark.parametrize(
    "per_layer,num_layers,rest",
    [
        ((1.0, 2.0), 6, None),
        ((1.0, 1.0, 3.0), 9, None),
        ((2.5, 1.0, 1.0, 1.5), 12, None),
        ((1.0, 7.0), 4, None),
        ((1.0, 1.0), 6, (0.0, 3.0)),  # the last stage's output layer: 3 layers' worth
        ((2.0, 1.0, 1.0), 9, (0.5, 0.0, 4.0)),
        ((1.0, 3.0, 1.0, 1.0), 10, (1.0, 0.0, 0.0, 2.5)),
    ],
)
def test_the_greedy_split_is_optimal(per_layer, num_layers, rest):
    counts = optimal_split(per_layer, num_layers, rest)
    rest = rest or (0.0,) * len(per_layer)
    assert sum(counts) == num_layers and min(counts) >= 1
    assert max(r + n * c for r, n, c in zip(rest, counts, per_layer)) == pytest.approx(
        _brute_force(per_layer, num_layers, rest)
    )


def test_a_stage_twice_as_slow_gives_a_layer_to_its_neighbour():
    split = balance_layers((2, 2), (2.0, 1.0))  # stage 0 takes 1.0 s a layer, stage 1 0.5 s
    assert split.counts == (1, 3)
    assert split.after == (1.0, 1.5)
    assert split.gain == pytest.approx(0.25)
    assert split.summary() == "1/3"


def test_balanced_or_nearly_balanced_stages_stay():
    assert balance_layers((2, 2), (1.0, 1.0)) is None
    assert balance_layers((4, 4), (1.05, 1.0)) is None  # gains less than the threshold
    assert balance_layers((2, 2), (0.0, 1.0)) is None  # no timed compute on stage 0


def test_what_stays_with_a_stage_counts_in_its_time():
    """PP=2, 4 layers, the last stage's output layer and loss cost 4 layers' worth, stage 0
    slowed 2x: moving a layer to the last stage would make the step slower (7 s against 6), so
    it stays; with the output layer left out, the layers alone asked for 1/3."""
    assert balance_layers((2, 2), (4.0, 2.0)).counts == (1, 3)
    assert balance_layers((2, 2), (4.0, 2.0), stage_rest=(0.0, 4.0)) is None
    # where the rest leaves room, the move is priced with it: (4+0, 2+0.5) -> (2+0, 3+0.5)
    split = balance_layers((2, 2), (4.0, 2.0), stage_rest=(0.0, 0.5))
    assert split.counts == (1, 3) and split.before == (4.0, 2.5) and split.after == (2.0, 3.5)
    with pytest.raises(StageError, match="one non-negative time for each stage"):
        balance_layers((2, 2), (4.0, 2.0), stage_rest=(0.0,))


def test_a_move_must_repay_its_cost():
    assert balance_layers((2, 2), (2.0, 1.0), layer_move_seconds=0.1).counts == (1, 3)
    # 0.5 s saved a step, 100 steps to repay: a 60 s move is not worth it
    assert balance_layers((2, 2), (2.0, 1.0), layer_move_seconds=60.0) is None


def test_a_split_that_skips_a_stage_is_reached_one_layer_at_a_time():
    # an optimum for (1, 1, 4) with stage 2 very slow is (3, 2, 1): layer 2 would skip stage 1
    split = balance_layers((1, 1, 4), (1.0, 1.0, 40.0))
    assert adjacent((1, 1, 4), split.counts)
    assert split.counts == (1, 2, 3)


def test_splits_are_checked_by_name():
    check_split((2, 2), 4, 2)
    with pytest.raises(StageError, match="holds 5 layers, not 4"):
        check_split((3, 2), 4, 2)
    with pytest.raises(StageError, match="leaves a stage without layers"):
        check_split((0, 4), 4, 2)
    with pytest.raises(StageError, match="names 3 stages, not 2"):
        check_split((1, 1, 2), 4, 2)
    assert stage_of_layers((1, 2)) == [0, 1, 1]
    assert not adjacent((1, 1, 4), (4, 1, 1))


def test_tp_imbalance_is_the_slowest_ranks_compute_over_the_fastests():
    assert tp_imbalance([0.2, 0.3]) == pytest.approx(1.5)
    assert tp_imbalance([0.4]) == 1.0
    assert tp_imbalance([0.0, 0.1]) == float("inf")
