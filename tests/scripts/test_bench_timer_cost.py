"""scripts/bench_timer_cost.py: the timers' counted cost and the interleaved ratios it prints
(the two-rank run itself takes minutes and is a benchmark, not run here)."""

from __future__ import annotations

import types

from tests.utils import load_script


def test_hook_cost_is_the_timer_hooks_alone():
    bench = load_script("bench_timer_cost")
    seconds = bench.hook_cost(blocks=6, calls=160)
    # Two identity marks a hooked call, each acting forward and backward: microseconds, not
    # nothing (the marks are autograd nodes) and not milliseconds.
    assert 1e-7 < seconds < 1e-3


def test_table_ratios_are_per_round_medians():
    bench = load_script("bench_timer_cost")
    rows = {
        "plain": {"wall": [1.0, 2.0, 1.0], "cpu": [1.0, 1.0, 1.0]},
        "het untimed": {"wall": [1.1, 2.2, 1.1], "cpu": [1.0, 1.0, 1.0]},
        "het timed": {"wall": [1.21, 2.42, 1.21], "cpu": [1.0, 1.1, 1.0]},
    }
    extra = {
        "boundary_seconds": 0.01,
        "timed_steps": 10,
        "hook_seconds": 1e-4,
        "hooked_calls": 5,
    }
    opts = types.SimpleNamespace(tp=2, policy="migrate", rounds=3, steps=1, model=bench.MODEL)
    lines = bench.table(rows, opts, extra)
    plain, untimed, timed = (line.split() for line in lines[2:5])
    assert untimed[-2:] == ["1.1000", "1.0000"]  # vs plain: wall, cpu
    assert timed[-4:] == ["1.2100", "1.0000", "1.1000", "1.0000"]  # vs plain, vs untimed
    # Counted: 1 ms a step at the boundary + 5 x 0.1 ms of hooks over a 1.21 s median step.
    assert "together 1.50 ms, 0.12% of het timed's step" in lines[5]


def test_model_flags_add_two_micro_batches_a_step_unless_given():
    bench = load_script("bench_timer_cost")
    flags = bench.model_flags(bench.MODEL)
    assert flags[-2:] == ["--global-batch-size", "8"]  # the default model's 4 x 2
    given = bench.model_flags("--micro-batch-size 3 --global-batch-size 3")
    assert given == ["--micro-batch-size", "3", "--global-batch-size", "3"]
    assert bench.model_flags("--num-layers 2")[-1] == "2"  # Megatron's default micro-batch 1
