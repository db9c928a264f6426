"""Partition plans, unit layouts and transfer schedules: pure, no process group."""

from __future__ import annotations

import pytest
import torch

from hettp.plan import PartitionPlan, PlanError
from hettp.transfer import CostModel, PrimitiveCost, TransferSchedule, UnitMove, plan_transfer
from hettp.units import UnitLayout


def _plan(attn, mlp, layers=2, unit_size=1):
    return PartitionPlan.from_counts(len(attn), layers, sum(attn), sum(mlp), attn, mlp, unit_size)


def test_even_plan_is_megatrons_partition():
    plan = PartitionPlan.even(4, 2, attn_units=8, mlp_units=16)
    assert plan.units(1, "attn", 2) == (4, 5)
    assert plan.units(0, "mlp", 3) == (12, 13, 14, 15)
    assert plan.counts(0, "mlp") == (4, 4, 4, 4)
    with pytest.raises(PlanError, match=r"attention units \(6\) divisible by TP size 4"):
        PartitionPlan.even(4, 1, attn_units=6, mlp_units=16)


def test_inline_spec_and_json_roundtrip(tmp_path):
    plan = PartitionPlan.parse("attn=3,1,0;mlp=5,0,7", 3, 2, 4, 12)
    assert plan.counts(1, "attn") == (3, 1, 0) and plan.units(0, "mlp", 2) == tuple(range(5, 12))
    assert PartitionPlan.from_json(plan.to_json()) == plan
    path = tmp_path / "p.json"
    path.write_text(plan.to_json())
    assert PartitionPlan.parse(str(path), 3, 2, 4, 12) == plan
    # a block left out stays even
    assert PartitionPlan.parse("mlp=10,2", 2, 1, 4, 12).counts(0, "attn") == (2, 2)


def test_summary_merges_identical_layers():
    plan = _plan([2, 1, 1], [6, 3, 3], layers=4)
    assert plan.summary() == "TP=3 layers 0-3: attn 2/1/1 mlp 6/3/3"
    layers = list(plan.layers)
    layers[3] = {"attn": ((0, 1, 2, 3), (), ()), "mlp": layers[3]["mlp"]}
    mixed = PartitionPlan(3, 4, 12, 1, tuple(layers))
    assert mixed.summary() == "TP=3 layers 0-2: attn 2/1/1 mlp 6/3/3; layer 3: attn 4/0/0 mlp 6/3/3"


@pytest.mark.parametrize(
    "spec,message",
    [
        ("attn=3,2;mlp=8,4", "attn: counts [3, 2] sum to 5, the model has 4 units"),
        ("attn=2,2;mlp=13,-1", "mlp: negative unit count"),
        ("attn=2,2,0;mlp=6,6", "attn: 3 counts for 2 ranks"),
        ("attn=2,x;mlp=6,6", "attn counts must be integers"),
        ("heads=2,2", "expected 'attn=<counts>;mlp=<counts>'"),
        ("attn=2,2;attn=2,2", "'attn' given twice"),
    ],
)
def test_inline_spec_errors(spec, message):
    with pytest.raises(PlanError) as err:
        PartitionPlan.parse(spec, 2, 2, 4, 12)
    assert message in str(err.value)


def test_validation_names_layer_block_and_units():
    good = _plan([2, 2], [3, 3])
    layers = list(good.layers)
    layers[1] = {"attn": ((0, 1), (1, 3)), "mlp": good.layers[1]["mlp"]}
    with pytest.raises(PlanError, match="plan layer 1 attn: unit 1 is owned by ranks 0 and 1"):
        PartitionPlan(2, 4, 6, 1, tuple(layers))
    layers[1] = {"attn": ((0,), (1, 3)), "mlp": good.layers[1]["mlp"]}
    with pytest.raises(PlanError, match="plan layer 1 attn: ranks own 3 of 4 units; unowned: 2"):
        PartitionPlan(2, 4, 6, 1, tuple(layers))
    layers[1] = {"attn": ((0, 1, 2, 3), (9,)), "mlp": good.layers[1]["mlp"]}
    with pytest.raises(PlanError, match="rank 1 lists unit 9; units are 0..3"):
        PartitionPlan(2, 4, 6, 1, tuple(layers))
    with pytest.raises(PlanError, match="plan has 2 layers, the model has 3"):
        good.check_model(2, 3, 4, 6, 1)
    with pytest.raises(PlanError, match="plan JSON"):
        PartitionPlan.from_json('{"version": 1, "tp_size": 2}')


def test_rebalanced_moves_only_the_surplus():
    even = PartitionPlan.even(4, 2, attn_units=8, mlp_units=16)
    plan = even.rebalanced(attn_counts=[4, 2, 2, 0], mlp_counts=[4, 4, 4, 4])
    assert plan.layers[0]["attn"] == ((0, 1, 6, 7), (2, 3), (4, 5), ())
    assert plan.layers[0]["mlp"] == even.layers[0]["mlp"]
    moves = plan_transfer(even, plan, {"attn": 1, "mlp": 1}.get).moves
    assert len(moves) == 2 * 2  # rank 3's two groups, in each of 2 layers
    back = plan.rebalanced(attn_counts=[2, 2, 2, 2])
    assert [len(u) for u in back.layers[1]["attn"]] == [2, 2, 2, 2]
    assert len(plan_transfer(plan, back, {"attn": 1, "mlp": 1}.get).moves) == 2 * 2
    one_layer = even.rebalanced(mlp_counts=[1, 7, 4, 4], layers=[1])
    assert one_layer.counts(0, "mlp") == (4, 4, 4, 4) and one_layer.counts(1, "mlp") == (1, 7, 4, 4)
    with pytest.raises(PlanError, match="sum to 7"):
        even.rebalanced(attn_counts=[4, 2, 1, 0])


def test_unit_layout_roundtrip_with_parts():
    # SwiGLU fc1 with 3 local units of width 2: [gate u0 u1 u2 | up u0 u1 u2] rows
    layout = UnitLayout(axis=0, width=2, parts=2)
    local = torch.arange(12 * 3).reshape(12, 3)
    payloads = [layout.payload(local, 3, p) for p in range(3)]
    assert payloads[1].tolist() == local[[2, 3, 8, 9]].tolist()
    assert torch.equal(layout.assemble(payloads, local), local)
    swapped = layout.assemble([payloads[2], payloads[0]], local)
    assert swapped.tolist() == local[[4, 5, 0, 1, 10, 11, 6, 7]].tolist()
    assert layout.assemble([], local).shape == (0, 3)
    assert layout.global_fragment(unit=5, part=1, num_units=8) == (13, 16)


@pytest.mark.parametrize("axis,parts", [(0, 1), (0, 2), (1, 1), (1, 2)])
def test_unit_layout_gathers_agree_with_per_unit_payloads(axis, parts):
    """run, permuted and rebuilt gather in one index_select what payload and assemble build
    unit by unit: the same tensors, for kept units in any order mixed with received ones."""
    layout = UnitLayout(axis=axis, width=3, parts=parts)
    local = torch.randn(4 * 3 * parts, 5) if axis == 0 else torch.randn(5, 4 * 3 * parts)
    payloads = [layout.payload(local, 4, p) for p in range(4)]
    for positions in ([1, 2], [3, 0, 2], [2], []):
        expected = (
            torch.cat([payloads[p] for p in positions], dim=axis)
            if positions
            else layout.run(local, 4, [])
        )
        assert torch.equal(layout.run(local, 4, positions), expected)
    order = [2, 0, 3, 1]
    assert torch.equal(
        layout.permuted(local, 4, order), layout.assemble([payloads[p] for p in order], local)
    )
    received = [torch.randn_like(payloads[0]) for _ in range(2)]
    sources = [3, received[0], 0, received[1]]
    expected = layout.assemble([payloads[3], received[0], payloads[0], received[1]], local)
    assert torch.equal(layout.rebuilt(local, 4, sources), expected)
    assert torch.equal(layout.rebuilt(local, 4, [1]), payloads[1])
    assert layout.rebuilt(local, 4, []).shape == layout.assemble([], local).shape


def test_schedule_moves_each_changed_unit_once_directly():
    old = _plan([2, 2], [3, 3])
    new = _plan([4, 0], [1, 5])
    schedule = plan_transfer(old, new, {"attn": 100, "mlp": 10}.get)
    moves = {(m.layer, m.block, m.unit): (m.src, m.dst) for m in schedule.moves}
    # attn units 2,3 move 1->0; mlp units 1,2 move 0->1; per layer
    assert moves == {(layer, "attn", u): (1, 0) for layer in (0, 1) for u in (2, 3)} | {
        (layer, "mlp", u): (0, 1) for layer in (0, 1) for u in (1, 2)
    }
    assert schedule.total_bytes == 2 * (2 * 100 + 2 * 10)
    assert set(schedule.bundles()) == {(1, 0), (0, 1)}
    assert schedule.bundle_bytes() == {(0, 1): 40, (1, 0): 400}
    assert plan_transfer(old, old, {"attn": 1, "mlp": 1}.get).moves == ()
    with pytest.raises(ValueError, match="different models"):
        plan_transfer(old, _plan([2, 2], [3, 3], layers=3), {"attn": 1, "mlp": 1}.get)


def _fanout(n, size, dsts=None):
    dsts = dsts if dsts is not None else range(1, n)
    return TransferSchedule(n, tuple(UnitMove(0, "mlp", i, 0, d, size) for i, d in enumerate(dsts)))


def test_cost_model_predictions_follow_the_formulas():
    model = CostModel(
        p2p=PrimitiveCost(1.0, 0.1, 100.0),
        all_to_all=PrimitiveCost(2.0, 0.01, 50.0),
        scatter=PrimitiveCost(0.5, 0.2, 100.0),
        broadcast=PrimitiveCost(3.0, 0.5, 10.0),
    )
    s = _fanout(4, 100)  # rank 0 sends 100 bytes to each of 3 ranks
    p = model.predict(s)
    assert p["p2p"] == pytest.approx(1.0 + 3 * 0.1 + 300 / 100.0)
    assert p["all_to_all"] == pytest.approx(2.0 + 3 * 0.01 + 300 / 50.0)
    assert p["scatter"] == pytest.approx(0.5 + 3 * 0.2 + 3 * 100 / 100.0)
    assert p["broadcast"] == pytest.approx(3.0 + 2 * (0.5 + 300 / 10.0))
    many = TransferSchedule(4, (UnitMove(0, "mlp", 0, 0, 1, 5), UnitMove(0, "mlp", 1, 2, 3, 5)))
    assert set(model.predict(many)) == {"p2p", "all_to_all"}  # scatter/broadcast need one source
    assert model.choose(TransferSchedule(4, ())) == ("none", {})


SLOW = PrimitiveCost(1e-4, 1e-2, 1e9)  # per-message latency dominates
FAST = PrimitiveCost(1e-4, 1e-4, 1e9)


@pytest.mark.parametrize(
    "costs,schedule,expected",
    [
        # equal constants, one big fan-out: batched p2p (scatter pads, broadcast resends)
        (
            dict(p2p=FAST, all_to_all=FAST, scatter=FAST, broadcast=FAST),
            _fanout(4, 10_000_000),
            "p2p",
        ),
        # a single source with expensive p2p messages: scatter
        (
            dict(p2p=SLOW, all_to_all=SLOW, scatter=FAST, broadcast=SLOW),
            _fanout(8, 1000),
            "scatter",
        ),
        # dense many-to-many with expensive p2p messages: all_to_all
        (
            dict(p2p=SLOW, all_to_all=FAST, scatter=SLOW, broadcast=SLOW),
            TransferSchedule(
                4,
                tuple(
                    UnitMove(0, "mlp", 4 * s + d, s, d, 100)
                    for s in range(4)
                    for d in range(4)
                    if s != d
                ),
            ),
            "all_to_all",
        ),
        # one tiny move on two ranks with a cheap broadcast call
        (
            dict(p2p=FAST, all_to_all=FAST, scatter=FAST, broadcast=PrimitiveCost(1e-6, 1e-6, 1e9)),
            _fanout(2, 8),
            "broadcast",
        ),
    ],
)
def test_choice_is_the_cheapest_prediction(costs, schedule, expected):
    model = CostModel(**costs)
    choice, predictions = model.choose(schedule)
    assert choice == expected
    assert predictions[choice] == min(predictions.values())


def test_pipeline_stages_slice_and_join_a_whole_model_plan():
    layers = [
        PartitionPlan.from_counts(2, 1, 4, 64, (a, 4 - a), (8 * a, 64 - 8 * a), 4) for a in range(4)
    ]
    whole = PartitionPlan.joined(layers)  # every layer differs
    assert [whole.counts(i, "attn") for i in range(4)] == [(0, 4), (1, 3), (2, 2), (3, 1)]
    stages = [whole.stage(0, 1), whole.stage(1, 3)]
    assert [s.num_layers for s in stages] == [1, 3]
    assert stages[1].layers == tuple(layer.layers[0] for layer in layers[1:])
    assert PartitionPlan.joined(stages) == whole
    with pytest.raises(PlanError, match="a stage of layers 3-4 does not fit"):
        whole.stage(3, 2)
    other = PartitionPlan.even(2, 2, 4, 32, 8)
    with pytest.raises(PlanError, match="stages disagree"):
        PartitionPlan.joined([stages[0], other])
