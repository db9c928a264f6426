"""scripts/bench_noisy_loop.py: the pure control loop on noisy timings, side by side (a few
seeds here; the benchmark runs 30 a row)."""

from __future__ import annotations

import pytest

from tests.utils import load_script


def test_a_persistent_row_and_an_end_row(capsys):
    bench = load_script("bench_noisy_loop")
    common = ["--runs", "10", "--noise", "0.05", "--factors", "2.5", "--policies", "migrate"]
    assert bench.main([*common, "--tp", "4", "--slow-rank", "2"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[0].split()[:5] == ["noise", "factor", "kind", "policy", "ended"]
    assert [r.split()[2] for r in rows[1:]] == ["emulated", "device"]
    assert bench.main([*common, "--tp", "4", "--slow-rank", "1", "--stop", "23"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert "back <= 2" in rows[0] and "never" in rows[0]
    device = rows[2].split()
    assert device[2] == "device" and device[4] == "10/10" and device[5] == "0/10"


@pytest.mark.parametrize(
    "args, error",
    [
        (["--tp", "4", "--slow-rank", "4"], "0 <= --slow-rank < --tp"),
        (["--stop", "5"], "--stop must be after the onset"),
        (["--runs", "5"], "--runs must be >= 10"),
    ],
)
def test_bad_flags_are_named(args, error, capsys):
    with pytest.raises(SystemExit):
        load_script("bench_noisy_loop").main(args)
    assert error in capsys.readouterr().err
