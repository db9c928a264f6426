"""scripts/bench_dilation.py: the device step it reads a dilated run against, and a tiny run
end to end (the measurement itself is a benchmark, not a test)."""

from __future__ import annotations

import pytest

from tests.utils import load_script


def test_the_device_step_waits_at_each_collective_for_the_last_rank():
    bench = load_script("bench_dilation")
    unit, blocks = 0.001, 4 * bench.LAYERS  # two blocks a layer, forward and backward
    even = bench.device_step([(1.0, 2.0)] * 2, {}, 3.0, unit)
    assert even == pytest.approx(3.0 * unit * 1.5 * blocks)
    # a balanced slowed rank steps as the even plan does
    assert bench.device_step([(1.0, 2.0), (0.5, 1.0)], {1: 2.0}, 3.0, unit) == pytest.approx(even)
    # equal totals, uneven blocks: between two collectives the slowest rank's work since the
    # last one decides (tail of the block before, then the part before the collective)
    uneven = bench.device_step([(1.6, 1.4), (0.8, 2.2)], {}, 1.0, unit)
    assert 1.5 * blocks * unit < uneven < (1.6 + 2.2) / 2 * blocks * unit


def test_a_tiny_run_prints_every_pattern_against_the_device_step(capsys):
    bench = load_script("bench_dilation")
    assert bench.main(["--ranks", "2", "--dilation", "2", "--steps", "1", "--unit-ms", "0.2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("2 gloo ranks on")
    assert [line.split()[0] for line in out[2:]] == list(bench.PATTERNS)
    for line in out[2:]:
        assert float(line.split()[-1]) > 0
    with pytest.raises(SystemExit):
        bench.main(["--dilation", "1"])
