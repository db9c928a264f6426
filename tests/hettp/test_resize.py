"""Resizing, the pure parts (shares, cap, priorities, unit views), in milliseconds; on real gloo
groups in tests/hetero/test_resize.py."""

from __future__ import annotations

import math

import pytest
import torch

from hettp.plan import PartitionPlan
from hettp.resize import (
    SCORERS,
    FrozenSince,
    Priorities,
    ResizeError,
    Scorer,
    active_counts,
    check_shares,
    first_moment_factor,
    parse_shares,
    realized_share,
    register_scorer,
    resumed_moment_factor,
    skipped_count,
    skipped_units,
    swapped_units,
)
from hettp.units import UnitLayout
from tests.utils import BASE

# ---- pure -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "units,share,skipped",
    [
        (4, 0.5, 2),
        (2, 0.25, 0),
        (4, 0.25, 1),
        (10, 0.1, 1),
        (3, 0.5, 1),
        (0, 0.5, 0),
        (7, 1.0, 7),
        (5, 0.0, 0),
    ],
)
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
    return PartitionPlan(
        3,
        4,
        6,
        1,
        (
            {"attn": ((0, 1), (2, 3), ()), "mlp": ((0, 1, 2), (3,), (4, 5))},
            {"attn": ((3,), (0, 1, 2), ()), "mlp": ((5, 4), (0, 1), (2, 3))},
        ),
    )


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
    # layer 1 as its (earlier) scores order it: 4 before 5
    assert ordered.units(1, "mlp", 0) == later.order((1, "mlp"), plan.units(1, "mlp", 0))
    assert ordered.units(1, "mlp", 0) == (4, 5)
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
    resorted = (
        Priorities.unmeasured(plan)
        .updated({(0, "mlp"): {2: 5.0, 0: 1.0, 1: 2.0}})
        .ordered_plan(plan, ranks=[0, 2])
    )
    assert resorted.units(0, "mlp", 0) == (2, 1, 0)
    assert swapped_units(plan, resorted, shares) == 1  # unit 2 back in, unit 0 out
    # realized share of rank 0: attn 1 of 2 and 1 of 1 units -> skip 1 + 0; mlp 1 of 3, 1 of 2
    assert realized_share(plan, shares, 0) == pytest.approx((1 + 0 + 1 + 1) / (2 + 1 + 3 + 2))
    assert realized_share(plan, shares, 0, {"attn": 3.0, "mlp": 1.0}) == pytest.approx(
        (3 + 0 + 1 + 1) / (6 + 3 + 3 + 2)
    )


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
    # a rank that holds none of the block's units: no sums (a reshape to -1 was ambiguous)
    assert layout.unit_sums(local[:0], 0).shape == (0,)
    permuted = layout.permuted(local, n, [2, 0, 1])
    for new, old in enumerate([2, 0, 1]):
        assert torch.equal(layout.payload(permuted, n, new), layout.payload(local, n, old))
    columns = UnitLayout(axis=1, width=3)
    wide = torch.randn(5, 12)
    (view,) = columns.prefix(wide, 4, 2)
    assert view.data_ptr() == wide.data_ptr() and view.shape == (5, 6)


def test_unit_sums_read_every_layout_at_fp32_or_better():
    # column-split weights in parts (units along axis 1), and a 3-d tensor split on its middle
    for layout, shape in [
        (UnitLayout(axis=1, width=3, parts=2), (5, 2 * 4 * 3)),
        (UnitLayout(axis=1, width=2), (3, 4 * 2, 2)),
        (UnitLayout(axis=0, width=2, parts=2), (2 * 4 * 2, 3)),
    ]:
        local = torch.randn(shape)
        sums = layout.unit_sums(local, 4)
        assert sums.dtype == torch.float64
        for position in range(4):
            expected = layout.payload(local, 4, position).double().sum().item()
            assert sums[position].item() == pytest.approx(expected, rel=1e-5, abs=1e-5)
    # bf16 evidence (a GPU model's weights) is summed at fp32: 4097 ones would read 4096 in bf16
    ones = torch.ones(2, 4097, dtype=torch.bfloat16)
    assert UnitLayout(axis=0, width=1).unit_sums(ones, 2).tolist() == [4097.0, 4097.0]


def test_per_unit_values_fill_every_layout():
    values = torch.tensor([1.0, 2.0, 3.0, 4.0])
    for layout, shape in [
        (UnitLayout(axis=0, width=2, parts=2), (2 * 4 * 2, 3)),  # SwiGLU fc1 rows
        (UnitLayout(axis=1, width=3, parts=2), (5, 2 * 4 * 3)),
        (UnitLayout(axis=1, width=2), (3, 4 * 2, 2)),
        (UnitLayout(axis=0, width=5), (4 * 5,)),  # a bias
    ]:
        full = layout.per_unit(values, shape, 4)
        assert full.shape == shape
        for position in range(4):
            assert torch.all(layout.payload(full, 4, position) == values[position]), layout


def _adam(m, v, grad, betas=(0.9, 0.999)):
    """One step of Adam's moments."""
    return betas[0] * m + (1 - betas[0]) * grad, betas[1] * v + (1 - betas[1]) * grad**2


def _corrected(m, v, count, betas=(0.9, 0.999)):
    return m / (1 - betas[0] ** count), v / (1 - betas[1] ** count)


def test_a_resumed_unit_reads_its_moments_as_when_frozen():
    """Adam's count went on while the unit was skipped: rescaled, its moments read at the later
    count as they did when frozen; never updated, after its first update they read as a fresh
    Adam's after one step (m_hat = g, v_hat = g^2)."""
    gen = torch.Generator().manual_seed(0)
    m = v = torch.zeros(5, dtype=torch.float64)
    for _ in range(100):
        m, v = _adam(m, v, torch.randn(5, generator=gen, dtype=torch.float64))
    frozen = _corrected(m, v, 100)
    rescaled = (
        m * resumed_moment_factor(0.9, 100, 1000),
        v * resumed_moment_factor(0.999, 100, 1000),
    )
    for got, want in zip(_corrected(*rescaled, 1000), frozen):
        torch.testing.assert_close(got, want)
    # left alone, the second moment would read 6.6x smaller (an update 2.6x larger)
    assert _corrected(m, v, 1000)[1].sum() / frozen[1].sum() == pytest.approx(0.1506, abs=1e-4)
    grad = torch.randn(5, generator=gen, dtype=torch.float64)
    m, v = _adam(torch.zeros(5, dtype=torch.float64), torch.zeros(5, dtype=torch.float64), grad)
    m, v = m * first_moment_factor(0.9, 1001), v * first_moment_factor(0.999, 1001)
    m_hat, v_hat = _corrected(m, v, 1001)
    torch.testing.assert_close(m_hat, grad)
    torch.testing.assert_close(v_hat, grad**2)
    with pytest.raises(ValueError, match="frozen at step 0"):
        resumed_moment_factor(0.9, 0, 10)
    with pytest.raises(ValueError, match="frozen at step 12 cannot resume at step 10"):
        resumed_moment_factor(0.9, 12, 10)
    with pytest.raises(ValueError, match="no update"):
        first_moment_factor(0.9, 0)


def test_frozen_since_keeps_when_each_unit_was_frozen():
    frozen = FrozenSince()
    frozen.update({"0.attn": {1, 2}}, 0)
    assert frozen.since == {"0.attn": {1: 0, 2: 0}} and frozen.resuming == {}
    frozen.update({"0.attn": {2, 3}, "0.kv": {1}}, 5)  # 1 resumes, 3 and group 1 freeze at 5
    assert frozen.since == {"0.attn": {2: 0, 3: 5}, "0.kv": {1: 5}}
    assert frozen.resuming == {"0.attn": {1: 0}}
    # a resize put back at the same boundary (a failed move): 2 takes back its count
    frozen.update({"0.attn": {3}, "0.kv": {1}}, 5)
    frozen.update({"0.attn": {2, 3}, "0.kv": {1}}, 5)
    assert frozen.since == {"0.attn": {2: 0, 3: 5}, "0.kv": {1: 5}}
    assert frozen.resuming == {"0.attn": {1: 0}}
    saved = FrozenSince.from_state_dict(frozen.state_dict())
    assert saved == frozen
    assert frozen.take_resuming() == {"0.attn": {1: 0}} and frozen.resuming == {}
    # frozen and resumed between the same two steps: nothing to rescale
    frozen.update({"0.attn": {2}, "0.kv": set()}, 9)
    assert frozen.since == {"0.attn": {2: 0}}
    assert frozen.resuming == {"0.attn": {3: 5}, "0.kv": {1: 5}}
    # the optimizer started over (loaded without its state): every count past it reads 0
    frozen.update({"0.attn": {2, 3}}, 2)
    assert frozen.since == {"0.attn": {2: 0, 3: 0}} and frozen.resuming == {"0.kv": {1: 0}}


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
