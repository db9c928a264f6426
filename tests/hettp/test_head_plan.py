"""Query heads as attention units, pure: which groups' K/V a rank holds, where a head sits in
megatron-core's QKV tensor, the flag, and how the planner weighs K/V replicas (milliseconds)."""

from __future__ import annotations

import dataclasses

import pytest

from hettp.config import ConfigError, HetTPConfig, ModelShape
from hettp.dealing import grouped_plan, proportional_plan
from hettp.plan import HeadUnits, PartitionPlan
from hettp.planner import (
    ATTENTION_COST_RANGE,
    CALL_PRICE_RANGE,
    SPLIT_GAIN,
    Planner,
    balancing_shares,
    split_check,
)
from hettp.step_model import StepModel, block_works, plan_work

# Llama-3-70B's attention at TP=8: 64 heads in 8 groups, one head per unit
LLAMA = HeadUnits(heads_per_unit=1, heads_per_group=8, groups=8)


def test_units_groups_and_canonical_fragments():
    heads = HeadUnits(heads_per_unit=2, heads_per_group=4, groups=2)  # 8 heads, 4 units
    assert heads.units == 4 and heads.fragments == 12  # per group: 4 query heads, K, V
    assert [heads.group_of(u) for u in range(4)] == [0, 0, 1, 1]
    assert heads.query_fragments(0) == (0, 1) and heads.query_fragments(3) == (8, 9)
    assert heads.kv_fragments(0) == (4, 5) and heads.kv_fragments(1) == (10, 11)
    every = sorted(
        [f for u in range(4) for f in heads.query_fragments(u)]
        + [f for g in range(2) for f in heads.kv_fragments(g)]
    )
    assert every == list(range(12))  # the canonical tensor, each piece once
    owners = [(0, 1, 2), (3,)]  # group 1 split over both ranks
    assert heads.holders(owners) == {0: (0,), 1: (0, 1)}
    assert heads.replicated(owners) == (1,)
    with pytest.raises(ValueError, match="3 query heads per attention unit do not divide"):
        HeadUnits(3, 4, 2)


def test_the_flag_is_checked_against_the_model():
    gqa = ModelShape(
        tp_size=2, num_layers=2, query_groups=2, ffn_hidden_size=128, attention_heads=8
    )
    config = HetTPConfig(het_tp=True, attn_granularity=1).validated(gqa)
    assert config.head_units(gqa) == 1 and config.attention_units(gqa) == 8
    whole = HetTPConfig(het_tp=True, attn_granularity=4).validated(gqa)
    assert whole.head_units(gqa) == 0 and whole.attention_units(gqa) == 2  # = a whole group
    plan = HetTPConfig(plan="attn=3,5", attn_granularity=1).validated(gqa).partition_plan
    assert plan.counts(0, "attn") == (3, 5)
    with pytest.raises(ConfigError, match="--het-tp-attn-granularity 3 must divide the 4 query"):
        HetTPConfig(het_tp=True, attn_granularity=3).validated(gqa)
    mha = ModelShape(
        tp_size=2, num_layers=2, query_groups=8, ffn_hidden_size=128, attention_heads=8
    )
    with pytest.raises(ConfigError, match=r"divide the 1 query head per group \(8 heads, as many"):
        HetTPConfig(het_tp=True, attn_granularity=2).validated(mha)
    with pytest.raises(ConfigError, match="--het-tp-attn-granularity must be >= 0"):
        HetTPConfig(het_tp=True, attn_granularity=-1).validated(gqa)
    with pytest.raises(ConfigError, match="--het-tp-plan: .* sum to 2, the model has 8 units"):
        HetTPConfig(plan="attn=1,1", attn_granularity=1).validated(gqa)


def _plan(attn, mlp=(64, 64), heads=LLAMA, tp=2):
    groups_plan = PartitionPlan.from_counts(tp, 2, heads.units, sum(mlp), attn, mlp, 4, heads)
    return groups_plan


def _split_check(plan, model, work):
    """The planner's split check at the speeds that balance `model`."""
    return split_check(plan, model, work, model.balanced_work(sum(plan_work(plan, work))))


def test_work_counts_the_replicas_a_split_brings():
    heads = HeadUnits(1, 4, 2)
    work = {"attn": 2.0, "mlp": 1.0, "kv": 2.0}
    even = _plan((4, 4), heads=heads)
    split = _plan((3, 5), heads=heads)
    assert plan_work(even, work) == (2 * (8 + 64 + 2), 2 * (8 + 64 + 2))
    # rank 1 holds a head of group 0 too: one more K/V replica per layer
    assert plan_work(split, work) == (2 * (6 + 64 + 2), 2 * (10 + 64 + 4))
    assert plan_work(dataclasses.replace(split, heads=None), work)[1] == 2 * (10 + 64)


def test_grouped_plan_keeps_groups_whole_and_splits_each_block_in_proportion():
    heads = HeadUnits(1, 4, 2)
    plan = _plan((3, 5), heads=heads)  # group 0 split
    even = grouped_plan(plan, (1.0, 1.0))
    for layer in range(2):
        assert heads.replicated(even.layers[layer]["attn"]) == ()
        # rank 0 held 3 of group 0's heads: it keeps group 0
        assert set(even.units(layer, "attn", 0)) == {0, 1, 2, 3}
    # rank 1 3x as fast: it finishes both groups sooner than rank 0 one, and the MLP is split
    # 1 : 3 as in the proportional plan, not given to rank 0 to make up for its attention
    # (every block ends in a collective: that would leave both blocks unbalanced)
    grouped = grouped_plan(plan, (1.0, 3.0))
    for layer in range(2):
        assert grouped.counts(layer, "attn") == (0, 8)
        assert grouped.counts(layer, "mlp") == proportional_plan(plan, (1.0, 3.0)).counts(
            layer, "mlp"
        )
    assert grouped.counts(0, "mlp") == (32, 96)


def test_the_block_model_sees_what_a_rank_s_totals_hide():
    """Two blocks, rank 1 at 2x: a plan giving rank 1 all of one block and rank 0 all of the
    other evens out the totals (the sum model's step is the balanced one), but each block
    waits for its one working rank."""
    model = StepModel(rest=0.0, factors=(1.0, 2.0), slope=1.0)
    crossed = [(0.0, 1.0), (2.0, 0.0)]  # rank 1's one unit of work, rank 0's two
    assert model.step_time(tuple(map(sum, zip(*crossed)))) == pytest.approx(2.0)
    assert model.blocks_time(crossed) == pytest.approx(4.0)
    even = [(2 / 3, 1 / 3), (4 / 3, 2 / 3)]  # each block in proportion to speed
    assert model.blocks_time(even) == pytest.approx(2.0)
    # the per-call part spread evenly over the blocks, as the sum model has it
    called = StepModel(rest=0.5, factors=(1.0, 1.0), slope=1.0, fixed=1.0)
    assert called.blocks_time([(1.0, 1.0), (2.0, 2.0)]) == pytest.approx(
        called.step_time((3.0, 3.0))
    )


def test_attention_is_dealt_with_the_replicas_it_brings():
    """The head-units benchmark's shape (8 heads in 2 groups, a K/V replica 0.6 of a head's
    work; rank 0 at 3.5x): dealt by count, rank 0 got 2 heads and its group's K and V, and ran
    its attention 25-30% over rank 1's after the first move; dealt with the replicas, 1."""
    heads = HeadUnits(1, 4, 2)
    work = {"attn": 1.0, "mlp": 0.02, "kv": 0.6}
    even = _plan((4, 4), mlp=(704, 704), heads=heads)
    slow = StepModel(rest=0.0, factors=(3.5, 1.0), slope=1.0)
    speeds = slow.balanced_work(sum(plan_work(even, work)))
    by_count = proportional_plan(even, speeds)
    target = proportional_plan(even, speeds, kv=0.6)
    assert by_count.counts(0, "attn") == (2, 6) and target.counts(0, "attn") == (1, 7)
    assert target.counts(0, "mlp") == by_count.counts(0, "mlp")
    attention = [block_works(p, work)[0] for p in (by_count, target)]
    assert slow.blocks_time([attention[1]]) < slow.blocks_time([attention[0]]) * 0.95
    # without replicas to pay for (group units' plans), dealing is by count as before
    plain = dataclasses.replace(even, heads=None)
    assert proportional_plan(plain, speeds, kv=0.6) == proportional_plan(plain, speeds)


def test_planner_splits_a_group_only_where_whole_groups_cannot_balance():
    heads = HeadUnits(1, 4, 2)
    work = {"attn": 2.0, "mlp": 1.0, "kv": 2.0}
    planner = Planner("migrate", work)
    even = _plan((4, 4), heads=heads)
    # rank 0 at 1.3x: the MLP alone evens the work out whatever attention costs
    slow = StepModel(rest=0.0, factors=(1.3, 1.0), slope=1.0)
    target = planner._target(even, slow)
    assert all(heads.replicated(layer["attn"]) == () for layer in target.layers)
    assert target.counts(0, "attn") == (4, 4) and target.counts(0, "mlp")[0] < 64
    # at 1.6x the split is 2% faster at the modelled attention cost (4% at twice it): under
    # SPLIT_GAIN at one end of the range, so whole groups
    at_1_6 = StepModel(rest=0.0, factors=(1.6, 1.0), slope=1.0)
    target = planner._target(even, at_1_6)
    assert target.counts(0, "attn") == (4, 4)
    check = _split_check(even, at_1_6, work)
    assert check.split.counts(0, "attn") == (3, 5) and check.whole.counts(0, "attn") == (4, 4)
    assert 0 < check.gains[1.0, 1.0] < SPLIT_GAIN < check.gains[2.0, 1.0]
    # at 2x, 4% and 7%: the split
    at_2x = StepModel(rest=0.0, factors=(2.0, 1.0), slope=1.0)
    assert planner._target(even, at_2x).counts(0, "attn") == (3, 5)
    # a 3x rank, and an MLP too small to absorb what a whole group leaves: it splits group 0
    tiny = _plan((4, 4), mlp=(1, 1), heads=heads)
    slower = StepModel(rest=0.0, factors=(3.0, 1.0), slope=1.0)
    target = planner._target(tiny, slower)
    assert target.counts(0, "attn") == (2, 6)
    assert heads.replicated(target.layers[0]["attn"]) == (0,)
    grouped = grouped_plan(tiny, [1 / 3, 1.0])
    assert grouped.counts(0, "attn") == (0, 8)
    assert slower.blocks_time(block_works(target, work)) < slower.blocks_time(
        block_works(grouped, work)
    )
    assert target == proportional_plan(tiny, slower.balanced_work(sum(plan_work(tiny, work))))


def test_a_split_that_gains_less_than_its_unmodelled_cost_keeps_whole_groups():
    """The head-units benchmark's shape at TP=2 (8 heads in 2 groups, unit works as the run
    priced them, rank 0 at 3.5x): one head and its group's K/V on rank 0 is predicted 2-4%
    faster than whole groups, and ran 12-17% slower (fixed plans, results/notes.md)."""
    heads = HeadUnits(1, 4, 2)
    work = {"attn": 107074.0, "mlp": 1536.0, "kv": 65536.0}
    even = _plan((4, 4), mlp=(704, 704), heads=heads)
    slow = StepModel(rest=0.08, factors=(3.5, 1.0), slope=4.1e-8, fixed=0.02, apart=0.013)
    check = _split_check(even, slow, work)
    assert check.split.counts(0, "attn") == (1, 7) and check.whole.counts(0, "attn") == (0, 8)
    assert 0 < min(check.gains.values()) < SPLIT_GAIN and max(check.gains.values()) < 0.05
    assert Planner("migrate", work)._target(even, slow) == check.whole
    # TP=4, one group of 4 heads (dimension 32) per rank, rank 1 at 3x: whole groups put two
    # groups on one rank; the split is predicted 6-16% faster than them, but only 3-5% faster
    # than the same split with rank 1's one head on a fast rank, which is taken
    heads4 = HeadUnits(1, 4, 4)
    work4 = {"attn": 53248.0, "mlp": 1536.0, "kv": 32768.0}
    even4 = _plan((4, 4, 4, 4), mlp=(352,) * 4, heads=heads4, tp=4)
    slow4 = StepModel(0.08, (1.0, 3.0, 1.0, 1.0), slope=8.2e-8, fixed=0.01, apart=0.013)
    check = _split_check(even4, slow4, work4)
    assert check.split.counts(0, "attn") == (5, 1, 5, 5) and min(check.gains.values()) > 0.06
    assert min(check.over_trimmed.values()) < SPLIT_GAIN
    target = Planner("migrate", work4)._target(even4, slow4)
    assert target == check.trimmed and target.counts(0, "attn") == (6, 0, 5, 5)
    assert heads4.replicated(target.layers[0]["attn"]) != ()


def test_a_split_must_gain_at_every_price_of_attention_s_per_call_part():
    """Unit works as three runs priced them (8 heads in 2 groups, one-head units). At head dim
    64 the probe's call is 0.45 of a head's work: a split that gives the slow rank its first
    heads is predicted 4-9% faster at the probe's price and 1% at the runs' (2.3x it), so whole
    groups (such splits ran 7% slower, results/notes.md). At head dim 128 (0.21 of a head) the
    split gains 4.7% at 2.3x and would not at 5x (it ran 10% faster); at head dim 192 (0.09),
    4.5-8% at every price, under the 5% margin the planner had before (it ran 4-5% faster)."""
    heads = HeadUnits(1, 4, 2)

    def even(mlp):
        return PartitionPlan.from_counts(2, 2, 8, 2 * mlp, (4, 4), (mlp, mlp), 1, heads)

    small = {"attn": 115728.0, "mlp": 1536.0, "kv": 65536.0, "call": 52283.0}
    slow = StepModel(0.08, (2.7, 1.0), slope=4.1e-8, apart=0.013)
    check = _split_check(even(704), slow, small)
    assert check.split.counts(0, "attn") == (2, 6) and check.whole.counts(0, "attn") == (0, 8)
    assert min(check.gains[scale, 1.0] for scale in ATTENTION_COST_RANGE) > SPLIT_GAIN
    assert check.gains[1.0, max(CALL_PRICE_RANGE)] < SPLIT_GAIN
    assert Planner("migrate", small)._target(even(704), slow) == check.whole

    mid = {"attn": 356730.0, "mlp": 3072.0, "kv": 262144.0, "call": 74684.0}
    slow = StepModel(0.042, (1.0, 2.5), slope=1.95e-8, apart=0.06)
    check = _split_check(even(1408), slow, mid)
    assert check.split.counts(0, "attn") == (6, 2) and check.whole.counts(0, "attn") == (8, 0)
    assert min(check.gains.values()) > SPLIT_GAIN
    assert Planner("migrate", mid)._target(even(1408), slow) == check.split
    five = {**mid, "call": 5 * mid["call"]}  # priced at 5x the probe's: whole groups
    assert _split_check(even(1408), slow, five).gains[1.0, 1.0] < SPLIT_GAIN
    assert Planner("migrate", five)._target(even(1408), slow) == check.whole

    large = {"attn": 781915.0, "mlp": 4608.0, "kv": 589824.0, "call": 68824.0}
    slow = StepModel(0.054, (1.0, 1.7), slope=1.83e-8, fixed=0.05, apart=0.138)
    check = _split_check(even(2112), slow, large)
    assert check.split.counts(0, "attn") == (5, 3) and check.whole.counts(0, "attn") == (4, 4)
    assert SPLIT_GAIN < min(check.gains.values()) < 0.05  # under the margin of before
    assert Planner("migrate", large)._target(even(2112), slow) == check.split


def test_a_slow_rank_gets_part_of_a_group_only_where_that_beats_giving_it_none():
    """TP=4, one group of 4 heads per rank, unit works as the run priced them (head dim 32),
    the step model of the run's first report (no cost line yet: no per-call part, the
    optimizer's seconds apart). At 2.9x the split gave rank 1 one head, which the model
    called 1.8-6% faster than none over the range; runs that held it stepped 2-24% slower
    than after its move in 7 of 9, and at 3.4x (hidden 768) 12-20% slower in 3 of 3
    (results/trimmed-split/). Under SPLIT_GAIN at one end of the range: the heads go to the
    fast ranks. At 2.2x the head gains 3.8-6.4% and stays."""
    heads = HeadUnits(1, 4, 4)
    work = {"attn": 63828.0, "mlp": 1536.0, "kv": 32768.0, "call": 31240.0}
    even = _plan((4, 4, 4, 4), mlp=(352,) * 4, heads=heads, tp=4)

    def model(factor, rank=1):
        factors = tuple(factor if r == rank else 1.0 for r in range(4))
        return StepModel(0.077, factors, slope=0.2 / 1.72e6, fixed=0.0, apart=0.02)

    check = _split_check(even, model(2.93), work)
    assert check.split.counts(0, "attn") == (5, 1, 5, 5)
    assert check.trimmed.counts(0, "attn") == (6, 0, 5, 5)
    assert check.whole.counts(0, "attn") == (8, 0, 4, 4)
    assert min(check.gains.values()) > SPLIT_GAIN  # over whole groups: taken until now
    assert 0 < min(check.over_trimmed.values()) < SPLIT_GAIN
    assert min(check.trimmed_gains.values()) > SPLIT_GAIN
    assert not check.taken and check.chosen == check.trimmed
    assert check.trimmed.counts(0, "mlp") == check.split.counts(0, "mlp")  # attention only
    assert heads.replicated(check.trimmed.layers[0]["attn"]) != ()  # rank 1's group, split
    assert Planner("migrate", work)._target(even, model(2.93)) == check.trimmed

    check = _split_check(even, model(2.2), work)
    assert min(check.over_trimmed.values()) > SPLIT_GAIN
    assert check.taken and check.chosen == check.split

    # rank 3 at 4x: the split gives it nothing, so there is nothing to trim
    check = _split_check(even, model(4.0, rank=3), work)
    assert check.split.counts(0, "attn") == (6, 5, 5, 0) and check.trimmed is None
    assert check.over_trimmed == {} and check.chosen == check.split
    # rank 0 at 1.6x keeps 3 heads in the split, which gains 6-10% over whole groups and
    # 2.9-6.6% over the trimmed split; the trimmed split gains 2-4% over whole groups, under
    # SPLIT_GAIN, so it is not a step on the way: the split is weighed against whole groups
    check = _split_check(even, model(1.6, rank=0), work)
    assert check.split.counts(0, "attn") == (3, 5, 4, 4)
    assert check.trimmed.counts(0, "attn") == (0, 6, 5, 5)
    assert min(check.trimmed_gains.values()) < SPLIT_GAIN
    assert min(check.over_trimmed.values()) < SPLIT_GAIN < min(check.gains.values())
    assert check.taken and check.chosen == check.split


def test_the_joint_controller_migrates_to_the_planners_target():
    """Joint (TP x DP) weighs a migration to the same plan the planner would take: with head
    units, whole groups where the MLP can even out the work, not the proportional split."""
    from hettp.joint import JointState, ReplicaPace, options

    heads = HeadUnits(1, 4, 2)
    work = {"attn": 2.0, "mlp": 1.0, "kv": 2.0}
    even = _plan((4, 4), heads=heads)
    slow = StepModel(rest=0.0, factors=(1.3, 1.0), slope=1.0)
    state = JointState(even, (0.0, 0.0), (2,), (ReplicaPace(0.0, (1.3, 1.0)),), 1.0, 0.0)
    found = {o.action: o for o in options(state, work, 0.5, lambda old, new: 0.1)}
    target = Planner("migrate", work)._target(even, slow)
    assert found["migrate"].plan == target
    assert all(heads.replicated(layer["attn"]) == () for layer in target.layers)
    split = proportional_plan(even, slow.balanced_work(sum(plan_work(even, work))))
    assert split.counts(0, "attn") != (4, 4)  # what joint took before: a split group


def test_resize_shares_leave_the_replicas_out():
    """A rank skipping heads still computes its groups' K/V: the share is cut from the rest."""
    heads = HeadUnits(1, 4, 2)
    work = {"attn": 2.0, "mlp": 1.0, "kv": 8.0}
    plan = _plan((4, 4), mlp=(8, 8), heads=heads)
    model = StepModel(rest=0.0, factors=(1.5, 1.0), slope=1.0)
    (share, _) = balancing_shares(plan, work, model, {0}, cap=0.9)
    kept = 2 * 8.0  # one group's K/V in each of 2 layers
    movable = plan_work(plan, work)[0] - kept
    assert model.rank_time(0, kept + (1 - share) * movable) == pytest.approx(
        plan_work(plan, work)[1], rel=1e-3
    )


def test_a_groups_kv_travels_once_to_each_rank_new_to_it():
    from hettp.transfer import KV_REPLICA, minimum_bytes, plan_transfer
    from hettp.wire import runs

    heads = HeadUnits(heads_per_unit=1, heads_per_group=4, groups=2)  # 8 heads, 4 per group
    sizes = {"attn": 10, "mlp": 1, KV_REPLICA: 1000}.get

    def plan(attn):
        return PartitionPlan.from_counts(2, 2, 8, 4, attn, [2, 2], heads=heads)

    even = plan([4, 4])  # rank 0 holds group 0, rank 1 group 1
    # rank 0 takes heads 4-6 of group 1 (new to it): head 4 brings the K/V, 5 and 6 go without
    schedule = plan_transfer(even, plan([7, 1]), sizes)
    brings = {(m.layer, m.unit): m.brings_replica for m in schedule.moves}
    assert brings == {(layer, u): u == 4 for layer in (0, 1) for u in (4, 5, 6)}
    assert schedule.total_bytes == 2 * (3 * 10 + 1000)
    assert minimum_bytes(even, plan([7, 1]), sizes) == schedule.total_bytes
    # a run sends one kind of unit: the carrier alone, then the heads without K/V
    assert [[m.unit for m in r] for r in runs(schedule.moves)] == [[4], [5, 6], [4], [5, 6]]
    # moving back, rank 1 already holds group 1: nothing but the heads travels
    back = plan_transfer(plan([7, 1]), even, sizes)
    assert not any(m.brings_replica for m in back.moves) and back.total_bytes == 2 * 3 * 10
    assert minimum_bytes(plan([7, 1]), even, sizes) == back.total_bytes
    # without head units there is no K/V to carry and the key is never asked for
    groups = PartitionPlan.from_counts(2, 1, 2, 4, [1, 1], [2, 2])
    assert (
        plan_transfer(
            groups,
            PartitionPlan.from_counts(2, 1, 2, 4, [2, 0], [2, 2]),
            {"attn": 10, "mlp": 1}.get,
        ).total_bytes
        == 10
    )


def test_a_rank_that_keeps_a_group_receives_its_heads_without_kv():
    from hettp.transfer import KV_REPLICA, plan_transfer

    heads = HeadUnits(heads_per_unit=1, heads_per_group=2, groups=2)  # 4 heads, 2 per group
    owners = {"attn": ((0, 2), (1, 3)), "mlp": ((0,), (1,))}  # each rank holds both groups
    old = PartitionPlan(2, 4, 2, 1, (owners,), heads)
    swapped = PartitionPlan(2, 4, 2, 1, ({"attn": ((1, 3), (0, 2)), "mlp": owners["mlp"]},), heads)
    schedule = plan_transfer(old, swapped, {"attn": 10, "mlp": 1, KV_REPLICA: 1000}.get)
    assert len(schedule.moves) == 4 and schedule.total_bytes == 40
