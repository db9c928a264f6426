"""Attention's per-call part: the probe that prices it and how the planner weighs it."""

from __future__ import annotations

import random
import time

import pytest
import torch

from hettp import attention_probe
from hettp.attention_probe import CallPrice, ProbeShape, call_seconds, probe
from hettp.dealing import proportional_plan
from hettp.plan import HeadUnits, PartitionPlan
from hettp.step_model import block_works, plan_work

SHAPE = ProbeShape(seq=32, batch=2, hidden=128, head_dim=32, heads_per_unit=2, mlp_rows=256)


def test_the_call_is_what_the_first_unit_cost_beyond_the_others_average():
    # none 1, one unit 4 (call 1 + unit 2), five units 12: the call is 1
    assert call_seconds(1.0, 4.0, 12.0, units=4) == pytest.approx(1.0)
    assert call_seconds(1.0, 4.0, 6.0, units=1) == pytest.approx(1.0)
    assert call_seconds(1.0, 3.0, 11.0, units=4) == 0.0  # no per-call part
    assert call_seconds(1.0, 3.0, 13.0, units=4) == 0.0  # inverted by noise: not a saving
    with pytest.raises(ValueError, match="units must be >= 1"):
        call_seconds(1.0, 3.0, 5.0, units=0)
    price = CallPrice(call_s=2e-3, gemm_s_per_param=1e-8, sizes_s=(0.0, 0.0, 0.0))
    assert price.work == pytest.approx(2e5)


def test_a_shape_is_checked():
    with pytest.raises(ValueError, match=r"ProbeShape.heads_per_unit must be >= 1, got 0"):
        ProbeShape(seq=8, batch=1, hidden=64, head_dim=16, heads_per_unit=0, mlp_rows=64)
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        probe(SHAPE, rounds=0)


def test_the_probe_finds_a_per_call_cost_that_is_there(monkeypatch):
    """A rank holding any unit pays 8 ms more a step, whatever its units, and half the rounds
    are slowed by up to 20 ms (a shared machine's spells): each size's fastest round prices
    the call at that 8 ms. The clock is a seeded fake, so the test reads the probe's arithmetic
    and not this machine's load (with a real sleep it failed 1 run in 5 beside two busy loops)."""
    rng = random.Random(0)

    def fake_timed(run, device):
        run()
        size = run.__self__
        if isinstance(size, attention_probe._Gemm):
            seconds = 0.004
        else:
            seconds = 1e-4 + (0.008 + 0.001 * size.groups if size.heads else 0.0)
        slowed = rng.random() < 0.5
        return seconds + (rng.uniform(0.0, 0.02) if slowed else rng.uniform(0.0, 5e-5))

    monkeypatch.setattr(attention_probe, "_timed", fake_timed)
    price = probe(SHAPE)
    none, one, more = price.sizes_s
    assert none < one < more
    assert price.call_s == pytest.approx(0.008, abs=2e-4)
    assert price.gemm_s_per_param == pytest.approx(
        0.004 / (SHAPE.mlp_rows * SHAPE.hidden), rel=0.02
    )
    assert price.work == pytest.approx(price.call_s / price.gemm_s_per_param)


def test_a_fast_spell_one_size_catches_does_not_price_the_call(monkeypatch):
    """Every round of the one-unit size in the second set runs 6 ms fast (a spell that size
    alone caught): its set prices the call at 2 ms, the others at the 8 ms there is, and the
    median set's price is the probe's (the fastest round of all would read the 2 ms)."""
    seen = {"one": 0}

    def fake_timed(run, device):
        size = run.__self__
        if isinstance(size, attention_probe._Gemm):
            return 0.004
        if not size.heads:
            return 1e-4
        seconds = 1e-4 + 0.008 + 0.001 * size.groups
        if size.groups == 1:
            seen["one"] += 1
            in_set = (seen["one"] - 1 - attention_probe.WARMUP_ROUNDS) // 12
            if in_set == 1:
                seconds -= 0.006
        return seconds

    monkeypatch.setattr(attention_probe, "_timed", fake_timed)
    price = probe(SHAPE, rounds=12, sets=5)
    assert price.call_s == pytest.approx(0.008)
    assert price.sizes_s[1] == pytest.approx(1e-4 + 0.009)
    seen["one"] = 0
    assert probe(SHAPE, rounds=12, sets=1).call_s == pytest.approx(0.008)  # no spell in set 0
    with pytest.raises(ValueError, match="sets must be >= 1"):
        probe(SHAPE, sets=0)


def test_a_size_is_timed_by_the_wall_clock():
    """The probe's timer reads what a run takes, sleeps included (a sleep never ends early)."""
    assert attention_probe._timed(lambda: time.sleep(0.01), "cpu") >= 0.01


def test_the_probe_runs_every_size_the_model_has():
    """One query head a unit without RoPE, and the MLP's GEMM; sizes grow with the units."""
    shape = ProbeShape(
        seq=16, batch=1, hidden=64, head_dim=16, heads_per_unit=1, mlp_rows=64, rope=False
    )
    price = probe(shape, rounds=3)
    assert price.call_s >= 0 and price.gemm_s_per_param > 0
    assert price.sizes_s[0] < price.sizes_s[2]


HEADS = HeadUnits(1, 4, 2)


def _plan(attn, mlp=(64, 64)):
    return PartitionPlan.from_counts(2, 2, HEADS.units, sum(mlp), attn, mlp, 4, HEADS)


def test_a_rank_computing_any_attention_unit_pays_the_call():
    work = {"attn": 2.0, "mlp": 1.0, "kv": 2.0, "call": 5.0}
    # rank 0 holds no attention: no call there; rank 1 holds all 8 heads (2 groups' K/V)
    assert block_works(_plan((0, 8)), work)[0] == (0.0, 8 * 2.0 + 2 * 2.0 + 5.0)
    assert plan_work(_plan((4, 4)), work) == (2 * (8 + 2 + 5 + 64),) * 2
    # resized to one of its two heads: the call stays with it (as its group's K/V)
    assert block_works(_plan((2, 6)), work, shares=(0.5, 0.0))[0][0] == 2.0 + 2.0 + 5.0
    assert block_works(_plan((2, 6)), {**work, "call": 0.0})[0][0] == 2 * 2.0 + 2.0


def test_a_slow_rank_s_first_head_is_dealt_with_its_call():
    """Rank 0 a quarter as fast: dealt by finish time with its group's K/V, it takes a head;
    with a per-call part as large as a head, that head would finish after rank 1's eight,
    and it takes none."""
    even = _plan((4, 4))
    speeds = (1.0, 4.0)
    assert proportional_plan(even, speeds, kv=1.0).counts(0, "attn") == (1, 7)
    assert proportional_plan(even, speeds, kv=1.0, call=1.0).counts(0, "attn") == (0, 8)


def test_the_probe_leaves_the_default_generator_alone(monkeypatch):
    """It runs on the deciding rank only: a draw from the default generator there would put
    that rank's dropout masks out of step with the rest of its TP group from then on."""
    monkeypatch.setattr(attention_probe, "_timed", lambda run, device: run() or 1e-3)
    torch.manual_seed(7)
    before = torch.get_rng_state()
    probe(SHAPE, rounds=1, sets=1)
    assert torch.equal(torch.get_rng_state(), before)
