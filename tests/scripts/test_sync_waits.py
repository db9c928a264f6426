"""scripts/sync_waits.py on hand-made profiler traces: each rank's segments and waits, and the
step split into the slowest rank's total, per-block imbalance and transfer."""

from __future__ import annotations

import json

import pytest

from tests.utils import load_script


def _trace(rank, step, segments, waits, start=1000.0):
    """A rank's trace of profiler step `step`: collectives after `segments` ms of compute each,
    lasting `waits` ms; the step ends 2 ms after the last."""
    events, t = [], start
    for segment, wait in zip(segments, waits):
        t += segment * 1e3
        events.append({"ph": "X", "name": "gloo:all_reduce", "ts": t, "dur": wait * 1e3})
        events.append({"ph": "X", "name": "c10d::allreduce_", "ts": t, "dur": 50.0})  # not read
        t += wait * 1e3
    t += 2e3
    events.append({"ph": "X", "name": f"ProfilerStep#{step}", "ts": start, "dur": t - start})
    events.append({"ph": "X", "name": f"ProfilerStep#{step - 1}", "ts": 0.0, "dur": start})
    return {"distributedInfo": {"rank": rank}, "traceEvents": events}


def test_a_step_splits_into_the_slowest_total_imbalance_and_transfer(tmp_path, capsys):
    sw = load_script("sync_waits")
    # block 1: rank 0 is slower (10 vs 4 ms), block 2: rank 1 (3 vs 9): each rank's total is
    # 13 ms, yet every block waits for its slower rank: 19 ms of compute, 6 of imbalance
    rank0 = _trace(0, 7, [10.0, 3.0], [1.0, 7.0])
    rank1 = _trace(1, 7, [4.0, 9.0], [7.0, 1.0])
    for rank, trace in ((1, rank1), (0, rank0)):  # written out of order: read by the rank named
        (tmp_path / f"host_{rank}.pt.trace.json").write_text(json.dumps(trace))
    traces = sw.load(str(tmp_path))
    assert sw.last_common_step(traces) == 7
    ranks = [sw.rank_step(t, 7) for t in traces]
    assert [s.segment_ms for s in ranks[0].syncs] == pytest.approx([10.0, 3.0, 2.0])
    assert [s.wait_ms for s in ranks[1].syncs] == pytest.approx([7.0, 1.0, 0.0])
    summary = sw.summarize(ranks)
    assert summary.busy_ms == pytest.approx((15.0, 15.0))  # with the 2 ms tail
    assert summary.sum_of_slowest_ms == pytest.approx(21.0)
    assert summary.imbalance_ms == pytest.approx(6.0)
    assert summary.transfer_ms == pytest.approx(2.0)  # 1 ms at each collective
    assert summary.step_ms == pytest.approx((23.0, 23.0))  # = slowest total + imbalance + transfer
    assert sw.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "profiler step 7, 2 ranks" in out and "per-block imbalance 6.0" in out


def test_traces_that_do_not_match_are_refused_with_the_reason(tmp_path, capsys):
    sw = load_script("sync_waits")
    with pytest.raises(sw.TraceError, match="different numbers of collectives"):
        sw.summarize(
            [
                sw.rank_step(_trace(0, 3, [1.0, 2.0], [1.0, 1.0]), 3),
                sw.rank_step(_trace(1, 3, [1.0], [1.0]), 3),
            ]
        )
    with pytest.raises(sw.TraceError, match="no ProfilerStep#9"):
        sw.rank_step(_trace(0, 3, [1.0], [1.0]), 9)
    assert sw.main([str(tmp_path)]) == 2
    assert "no *.json profiler traces" in capsys.readouterr().err
    for name in ("a", "b"):  # two runs profiled into one directory
        (tmp_path / f"{name}.json").write_text(json.dumps(_trace(0, 3, [1.0], [1.0])))
    assert sw.main([str(tmp_path)]) == 2
    assert "more than one trace for ranks [0]" in capsys.readouterr().err
