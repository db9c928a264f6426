"""scripts/bench_inert_hooks.py: its hooks sit on the parameters' gradient accumulators and run
in every backward of the hooked set (else it would time nothing), and it refuses bad counts."""

from __future__ import annotations

import pytest

from tests.utils import load_script


def test_every_inert_hook_runs_in_every_backward_of_the_hooked_set(monkeypatch, capsys):
    bench = load_script("bench_inert_hooks")
    calls = []
    made = bench._inert_hook

    def counting(param, buckets):
        hook = made(param, buckets)

        def counted(*unused):
            calls.append(param)
            return hook(*unused)

        return counted

    monkeypatch.setattr(bench, "_inert_hook", counting)
    result = bench.main(["--params", "3", "--rebuilds", "2", "--repeats", "2", "--steps", "1"])
    # 3 x 2 hooks, each in the warm-up and the timed backward of both rounds
    assert len(calls) == 3 * 2 * 2 * 2
    assert result["ratio"] > 0
    assert "3 parameters, 2 inert hooks each (6): backward" in capsys.readouterr().out


def test_a_count_below_one_is_refused_naming_the_flag(capsys):
    bench = load_script("bench_inert_hooks")
    with pytest.raises(SystemExit):
        bench.main(["--rebuilds", "0"])
    assert "--rebuilds must be >= 1, got 0" in capsys.readouterr().err
