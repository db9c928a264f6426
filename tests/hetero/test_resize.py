"""Resizing: the pure parts (shares, cap, priorities, unit views) in milliseconds, then on real
gloo groups: forward and gradients against a dense reference with the skipped units zeroed,
frozen skipped units, restoring, priority order through a migration, and the paper's baseline."""

from __future__ import annotations

import math

import pytest
import torch

from hettp.plan import PartitionPlan
from hettp.resize import (SCORERS, Priorities, ResizeError, Scorer, active_counts, check_shares,
                          parse_shares, realized_share, register_scorer, skipped_count,
                          skipped_units, swapped_units)
from hettp.units import UnitLayout
from tests.utils import BASE, GQA, MHA, close, het_numerics, run_ranks, train, train_with_resizes

# ---- pure -------------------------------------------------------------------------------


@pytest.mark.parametrize("units,share,skipped", [(4, 0.5, 2), (2, 0.25, 0), (4, 0.25, 1),
                                                 (10, 0.1, 1), (3, 0.5, 1), (0, 0.5, 0),
                                                 (7, 1.0, 7), (5, 0.0, 0)])
def test_skipped_count_never_exceeds_the_share(units, share, skipped):
    assert skipped_count(units, share) == skipped
    assert skipped <= units * share + 1e-9


def test_shares_are_checked_against_the_cap():
    assert parse_shares("0, 0.5", 2, 0.5) == (0.0, 0.5)
    check_shares((0.9, 0.0), 0.9)
    with pytest.raises(ResizeError, match="rank 0 would skip 90% .* --het-tp-max-resize 0.5"):
        check_shares((0.9, 0.0), 0.5)
    with pytest.raises(ResizeError, match="3 shares given, the TP size is 2"):
        parse_shares("0,0,0", 2, 0.5)
    with pytest.raises(ResizeError, match=r"rank 1 share nan is not within \[0, 1\]"):
        check_shares((0.0, math.nan), 1.0)


def _plan():
    # 2 layers, TP=3; rank 2 owns no attention unit in layer 0
    return PartitionPlan(3, 4, 6, 1, (
        {"attn": ((0, 1), (2, 3), ()), "mlp": ((0, 1, 2), (3,), (4, 5))},
        {"attn": ((3,), (0, 1, 2), ()), "mlp": ((5, 4), (0, 1), (2, 3))}))


def test_priorities_order_measured_units_and_try_unmeasured_first():
    plan = _plan()
    priorities = Priorities.unmeasured(plan)
    assert priorities.order((0, "mlp"), (0, 1, 2)) == (0, 1, 2)  # nothing known: keep order
    priorities = priorities.updated({(0, "mlp"): {0: 1.0, 2: 3.0}, (1, "mlp"): {4: 2.0, 5: 1.0}})
    # unit 1 was never measured: it ranks first so it gets measured
    assert priorities.order((0, "mlp"), (0, 1, 2)) == (1, 2, 0)
    assert priorities.order((1, "mlp"), (5, 4)) == (4, 5)
    # relative scores: a later interval with 10x smaller updates ranks the same way
    later = priorities.updated({(0, "mlp"): {0: 0.3, 2: 0.1}})
    assert later.scores[(0, "mlp")][0] == pytest.approx(1.5)
    assert later.order((0, "mlp"), (0, 1, 2)) == (1, 0, 2)
    ordered = later.ordered_plan(plan, ranks=[0])
    assert ordered.units(0, "mlp", 0) == (1, 0, 2)
    assert ordered.units(1, "mlp", 0) == (5, 4) or ordered.units(1, "mlp", 0) == (4, 5)
    assert ordered.units(0, "mlp", 2) == (4, 5)  # rank 2 not resized: untouched
    assert ordered.units(1, "mlp", 2) == plan.units(1, "mlp", 2)


def test_active_counts_skipped_units_and_swaps():
    plan = _plan()
    shares = (0.5, 0.0, 0.5)
    counts = active_counts(plan, shares)
    assert counts[(0, "mlp")] == (2, 1, 1) and counts[(0, "attn")] == (1, 2, 0)
    skipped = skipped_units(plan, shares)
    assert skipped[(0, "mlp", 0)] == {2} and skipped[(0, "mlp", 2)] == {5}
    assert skipped[(0, "attn", 2)] == frozenset()
    resorted = Priorities.unmeasured(plan).updated({(0, "mlp"): {2: 5.0, 0: 1.0, 1: 2.0}}) \
        .ordered_plan(plan, ranks=[0, 2])
    assert resorted.units(0, "mlp", 0) == (2, 1, 0)
    assert swapped_units(plan, resorted, shares) == 1  # unit 2 back in, unit 0 out
    # realized share of rank 0: attn 1 of 2 and 1 of 1 units -> skip 1 + 0; mlp 1 of 3, 1 of 2
    assert realized_share(plan, shares, 0) == pytest.approx((1 + 0 + 1 + 1) / (2 + 1 + 3 + 2))
    assert realized_share(plan, shares, 0, {"attn": 3.0, "mlp": 1.0}) == pytest.approx(
        (3 + 0 + 1 + 1) / (6 + 3 + 3 + 2))


def test_unit_views_sums_and_permutation():
    layout = UnitLayout(axis=0, width=2, parts=2)  # SwiGLU fc1: gate rows, then up rows
    n = 3
    local = torch.arange(2 * n * 2 * 4, dtype=torch.float32).reshape(2 * n * 2, 4)
    gate, up = layout.prefix(local, n, 2)
    assert gate.data_ptr() == local.data_ptr() and up.shape == (4, 4)  # views
    assert torch.equal(up, local[6:10])
    (skip_gate, skip_up) = layout.suffix(local, n, 2)
    assert torch.equal(skip_gate, local[4:6]) and torch.equal(skip_up, local[10:12])
    sums = layout.unit_sums(local, n)
    for position in range(n):
        assert sums[position].item() == layout.payload(local, n, position).sum().item()
    permuted = layout.permuted(local, n, [2, 0, 1])
    for new, old in enumerate([2, 0, 1]):
        assert torch.equal(layout.payload(permuted, n, new), layout.payload(local, n, old))
    columns = UnitLayout(axis=1, width=3)
    wide = torch.randn(5, 12)
    (view,) = columns.prefix(wide, 4, 2)
    assert view.data_ptr() == wide.data_ptr() and view.shape == (5, 6)


def test_scorers_measure_what_they_say_and_are_pluggable():
    layout = UnitLayout(axis=1, width=2)  # e.g. fc2: 3 units of 2 columns
    weight = torch.tensor([[1.0, -2.0, 0.5, 0.5, 0.0, 3.0]])
    grad = torch.tensor([[1.0, 1.0, -4.0, 0.0, 9.0, 1.0]])
    delta = torch.tensor([[0.1, -0.1, 0.0, 0.0, 0.2, 0.0]])

    def per_unit(name):
        return layout.unit_sums(SCORERS[name].evidence(weight, grad, delta), 3).tolist()

    assert per_unit("magnitude") == pytest.approx([3.0, 1.0, 3.0])
    assert per_unit("wg") == pytest.approx([3.0, 2.0, 3.0])
    assert per_unit("dw") == pytest.approx([0.2, 0.0, 0.2])
    assert SCORERS["dw"].needs_delta and not SCORERS["magnitude"].per_step
    with pytest.raises(ValueError, match="'dw' is already registered"):
        register_scorer(Scorer("dw", lambda w, g, d: w))
    register_scorer(Scorer("grad", lambda w, g, d: g.abs(), help="accumulated |gradient|"))
    try:
        from megatron.hetero.arguments import build_parser

        args = build_parser().parse_args(BASE.split() + ["--het-tp-priority", "grad"])
        assert args.het_tp_priority == "grad"
    finally:
        del SCORERS["grad"]


# ---- numerics on real groups ------------------------------------------------------------

RESIZE_CASES = {
    # rank 1 skips half: 1 of its 2 query groups, 64 of its 128 ffn neurons
    "tp2-mha": (MHA, 2, None, (0.0, 0.5)),
    # uneven plan; rank 0 skips 1 of 2 groups and 15 of 30 units, rank 1 keeps its only group,
    # rank 3 skips 8 of 32 SwiGLU units
    "tp4-gqa-swiglu": (GQA, 4, "attn=2,1,1,0;mlp=30,2,0,32", (0.5, 0.5, 0.0, 0.25)),
}


@pytest.mark.parametrize("case", list(RESIZE_CASES))
def test_resized_forward_equals_dense_reference_with_skipped_units_zeroed(case):
    model, tp, spec, shares = RESIZE_CASES[case]
    argv = model.split() + ["--het-tp"]
    groups = 4
    mlp_units = (128 // 2) if "--swiglu" in model else 256
    plan = (PartitionPlan.parse(spec, tp, 2, groups, mlp_units) if spec
            else PartitionPlan.even(tp, 2, groups, mlp_units))
    zeroed = {}
    for (layer, block, _), units in skipped_units(plan, shares).items():
        zeroed.setdefault((layer, block), []).extend(sorted(units))
    assert any(zeroed.values())
    resized = run_ranks(het_numerics, tp, argv + ["--tensor-model-parallel-size", str(tp)],
                        [spec], shares, None, zeroed)[0][0]
    reference = run_ranks(het_numerics, 1, argv, [None], None, zeroed, zeroed)[0][0]
    assert resized.pop("skipped_grads_zero") is True  # skipped units get no gradient
    reference.pop("skipped_grads_zero")
    assert set(resized) == set(reference)
    for key, want in reference.items():
        close(resized[key], want, f"{case} {key}")


# ---- training on real groups ------------------------------------------------------------

TRAIN = (MHA.replace("--train-iters 1", "--train-iters 14") +
         " --global-batch-size 4 --weight-decay 0.1 --tensor-model-parallel-size 2").split()


def _skipped(record):
    return {key: set(b["units"][b["active"]:]) for key, b in record["blocks"].items()}


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def resized_run():
    """Rank 1 skips half its units from the start; restored at 6; rank 0 resized at 8;
    units migrate to rank 0 at 10 (priorities refreshed every 4 iterations). Under --bf16, so
    the fp32 master weights are frozen too."""
    actions = {6: [("resize", (0.0, 0.0))], 8: [("resize", (0.5, 0.0))],
               10: [("migrate", "rebalance:attn=3,1;mlp=160,96")]}
    return run_ranks(train_with_resizes, 2,
                     TRAIN + ["--het-tp-resize", "0,0.5", "--het-tp-priority-interval", "4",
                              "--bf16"], actions)


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
            assert not _same(records[6]["blocks"][key]["values"][unit][:1],
                             records[8]["blocks"][key]["values"][unit][:1])


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
    idle = run_ranks(train, 2, TRAIN + ["--het-tp-resize", "0,0", "--het-tp-priority", "wg",
                                        "--het-tp-priority-interval", "2"])[0]["losses"]
    assert plain == idle


def test_scorer_observes_only_sampled_iterations():
    """dw copies the sharded weights on the steps it observes (about 10% of a CPU step when it
    observes every step), so it observes iterations divisible by the sample interval."""
    argv = TRAIN + ["--het-tp-resize", "0,0.5", "--het-tp-priority-interval", "8",
                    "--het-tp-priority-sample-interval", "3", "--train-iters", "7"]
    records = run_ranks(train_with_resizes, 2, argv, {})[1]["records"]
    once = records[3]["observed"]  # unit-steps observed at iteration 3
    assert once > 0
    assert [records[it]["observed"] for it in range(1, 8)] == [
        None, None, once, once, once, 2 * once, 2 * once]


def test_paper_baseline_updates_skipped_units_with_imputed_gradients():
    result = run_ranks(train_with_resizes, 2, TRAIN + ["--het-tp-policy", "zero",
                                                       "--het-tp-resize", "0,0.5",
                                                       "--train-iters", "4"], {})
    records = result[1]["records"]
    assert "skipped gradients imputed with 1e-08" in result[0]["stdout"]
    moved = sum(not _same(records[2]["blocks"][key]["values"][u][:1],
                          records[3]["blocks"][key]["values"][u][:1])
                for key, units in _skipped(records[2]).items() for u in units
                if u in _skipped(records[3])[key])
    assert moved > 0  # not frozen: the optimizer steps them (weight decay, imputed gradient)


def test_resize_state_survives_a_checkpoint(tmp_path):
    """Stop at 5 and resume: the same losses as one straight run, through a priority refresh at
    4 and 8 and a restore at 6 (the resumed run must bring back the saved skipped units and
    the saved priorities, not the initial ones)."""
    argv = TRAIN + ["--het-tp-resize", "0,0.5", "--het-tp-priority-interval", "4",
                    "--train-iters", "10"]
    actions = {6: [("resize", (0.0, 0.0))]}
    straight = run_ranks(train_with_resizes, 2, argv, actions)[0]["losses"]
    ckpt = ["--save", str(tmp_path / "ckpt"), "--save-interval", "5"]
    run_ranks(train_with_resizes, 2, argv + ckpt + ["--exit-interval", "5"], actions)
    resumed = run_ranks(train_with_resizes, 2, argv + ckpt + ["--load", str(tmp_path / "ckpt")],
                        actions)[0]["losses"]
    assert sorted(resumed) == list(range(6, 11))
    assert [resumed[i] for i in range(6, 11)] == [straight[i] for i in range(6, 11)]
