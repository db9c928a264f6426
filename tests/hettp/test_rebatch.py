"""Uneven micro-batch counts over data-parallel replicas (hettp/rebatch.py), pure."""

import itertools
import random

import pytest

from hettp import rebatch
from hettp.rebatch import RebatchError


def test_even_counts_deal_megatrons_slots_and_any_counts_cover_the_batch_once():
    for replicas, each in ((2, 3), (4, 2)):
        counts = rebatch.even_counts(replicas * each, replicas)
        for r in range(replicas):
            assert rebatch.slots(counts, r) == [k * replicas + r for k in range(each)]
    counts = (5, 1, 2)
    dealt = [rebatch.slots(counts, r) for r in range(3)]
    assert [len(d) for d in dealt] == list(counts)
    assert sorted(itertools.chain(*dealt)) == list(range(8))
    assert dealt[1] == [1]  # round one gives every replica a slot, in order


def test_loss_weights_give_every_micro_batch_the_even_splits_weight():
    counts = (5, 1, 2)
    total, replicas = sum(counts), len(counts)
    for r, n in enumerate(counts):
        # the schedule divides by the replica's count, the DP reduce by the replica count
        assert rebatch.loss_weight(counts, r) / n / replicas == pytest.approx(1 / total)
    assert rebatch.loss_weight((3, 3), 0) == 1.0


def _brute(total, seconds, fixed):
    best = None
    for counts in itertools.product(range(1, total + 1), repeat=len(seconds)):
        if sum(counts) == total:
            t = rebatch.step_seconds(counts, seconds, fixed)
            best = t if best is None else min(best, t)
    return best


def test_split_is_the_min_max_of_brute_force():
    rng = random.Random(2)
    for _ in range(40):
        replicas = rng.randint(2, 4)
        total = rng.randint(replicas, 10)
        seconds = [rng.uniform(0.1, 3.0) for _ in range(replicas)]
        fixed = [rng.uniform(0.0, 1.0) for _ in range(replicas)]
        counts = rebatch.split(total, seconds, fixed)
        assert sum(counts) == total and min(counts) >= 1
        assert rebatch.step_seconds(counts, seconds, fixed) == pytest.approx(
            _brute(total, seconds, fixed)
        )


def test_a_slow_replica_gets_fewer_micro_batches_and_equal_paces_keep_the_split():
    decision = rebatch.decide((2, 2), (1.0, 3.0))
    assert decision.after == (3, 1)
    assert decision.predicted_before == pytest.approx(6.0)
    assert decision.predicted_after == pytest.approx(3.0)
    assert "3.00x" in decision.reason
    assert rebatch.decide((2, 2), (1.0, 1.04)) is None  # noise
    back = rebatch.decide((3, 1), (1.0, 1.0))  # the straggle ended: back to even
    assert back.after == (2, 2)
    assert rebatch.decide((4, 4), (1.0, 1.1)) is None  # (5, 3) would take 5.0 s, not 4.4
    assert rebatch.decide((4, 4), (1.0, 1.3)) is None  # (5, 3): 5.0 s against 5.2: < 5%


def test_rescaled_keeps_proportions_and_at_least_one_each():
    assert rebatch.rescaled((3, 1), 8) == (6, 2)
    assert rebatch.rescaled((6, 2), 4) == (3, 1)
    assert rebatch.rescaled((7, 1), 2) == (1, 1)
    assert sum(rebatch.rescaled((5, 2, 1), 13)) == 13


def test_bad_counts_and_paces_are_refused_by_value():
    with pytest.raises(RebatchError, match=r"\[3, 0\] must be >= 1 each"):
        rebatch.check_counts((3, 0), 3)
    with pytest.raises(RebatchError, match="sum to the global batch's 4"):
        rebatch.check_counts((2, 1), 4)
    with pytest.raises(RebatchError, match="cannot give each of 3 replicas one"):
        rebatch.split(2, (1.0, 1.0, 1.0))
    with pytest.raises(RebatchError, match="must be positive"):
        rebatch.split(4, (1.0, 0.0))
    with pytest.raises(RebatchError, match="do not split evenly"):
        rebatch.even_counts(5, 2)
