"""Attention's per-call part read from a run's own reports (hettp.attention_fit) and
scripts/attention_call.py, which reads it from metrics files."""

from __future__ import annotations

import json

import pytest

from hettp.attention_fit import AttentionSample, attention_samples, measured_call
from hettp.plan import HeadUnits, PartitionPlan
from tests.utils.scripts import load_script

WORK = {"attn": 100.0, "mlp": 1.0, "kv": 0.0, "call": 5.0}  # call: the probe's price
CALL_S, PER_WORK_S = 0.004, 1e-4  # the truth the reports are drawn from: call 40 work


def _plan(attn, layers=2, heads=None, units=4):
    return PartitionPlan.from_counts(2, layers, units, 64, attn, [32, 32], heads=heads)


def _seconds(plan, rank, work=WORK, factor=1.0, noise=0.0):
    """What `rank` computes in attention a step: per layer it holds any unit, the call and its
    units' work (with head units their K/V replicas), at `factor`."""
    total = 0.0
    for layer in plan.layers:
        units = layer["attn"][rank]
        if units:
            kv = len(plan.heads.groups_of(units)) * work["kv"] if plan.heads else 0.0
            total += CALL_S + PER_WORK_S * (len(units) * work["attn"] + kv)
    return total * factor * (1.0 + noise)


def _report(plan, factors, noise=(0.0, 0.0)):
    seconds = [_seconds(plan, r, factor=f, noise=n) for r, (f, n) in enumerate(zip(factors, noise))]
    return attention_samples(plan, WORK, seconds, factors)


def test_the_call_is_the_intercept_of_the_unslowed_ranks_seconds_against_their_work():
    even, moved = _plan([2, 2]), _plan([1, 3])
    samples = []
    # two reports before the straggle, then rank 0 at 2.5x: before a move nothing prices it
    # (a per cent of noise at works 1.5x apart moves the intercept by about a tenth of it:
    # why one short run's reading is rough, scripts/attention_call.py)
    for noise in ((0.004, -0.004), (-0.002, 0.0)):
        samples += _report(even, (1.0, 1.0), noise)
    samples += _report(even, (2.5, 1.0))
    assert measured_call(samples) is None  # every sample at one work: call and unit read alike
    for noise in ((0.0, 0.004), (0.0, -0.002), (0.0, 0.002), (0.0, 0.0)):
        samples += _report(moved, (2.5, 1.0), noise)
    got = measured_call(samples)
    assert got.call_s == pytest.approx(CALL_S, rel=0.1)
    assert got.per_work_s == pytest.approx(PER_WORK_S, rel=0.05)
    assert got.work == pytest.approx(CALL_S / PER_WORK_S, rel=0.15)  # 40: 8x the probe's 5
    assert got.samples == 4 + 1 + 4  # the slowed rank's reports left out


def test_a_straggler_s_seconds_and_a_rank_without_attention_give_no_sample():
    moved = _plan([0, 4])
    samples = _report(moved, (3.0, 1.0))
    assert samples == [AttentionSample(_seconds(moved, 1), 4 * 2 * WORK["attn"], 2)]
    # a rank that read fast stands as measured, over its factor
    [fast, other] = _report(_plan([2, 2]), (0.9, 1.0))
    assert fast.seconds == pytest.approx(_seconds(_plan([2, 2]), 0))
    assert other.calls == 2
    with pytest.raises(ValueError, match="1 attention times and 2 factors for 2 TP ranks"):
        attention_samples(moved, WORK, [0.1], [1.0, 1.0])


def test_head_units_weigh_the_k_v_replicas_their_heads_bring():
    heads = HeadUnits(1, 4, 2)  # 8 heads in 2 groups, one head a unit
    work = {**WORK, "kv": 30.0}
    split = PartitionPlan.from_counts(2, 1, 8, 64, [3, 5], [32, 32], heads=heads)
    seconds = [_seconds(split, r, work) for r in range(2)]
    one, two = attention_samples(split, work, seconds, (1.0, 1.0))
    assert one.work == 3 * 100.0 + 30.0  # heads 0-2, in group 0
    assert two.work == 5 * 100.0 + 2 * 30.0  # head 3 of group 0 and group 1: two replicas


def test_noise_that_inverts_the_line_prices_nothing():
    even, moved = _plan([2, 2]), _plan([1, 3])
    samples = _report(even, (1.0, 1.0)) + _report(even, (1.0, 1.0))
    # more work read as less time: no positive slope
    samples += [
        AttentionSample(s.seconds * 0.5, s.work, s.calls) for s in _report(moved, (2.5, 1.0))
    ]
    samples += [
        AttentionSample(s.seconds * 0.5, s.work, s.calls) for s in _report(moved, (2.5, 1.0))
    ]
    assert measured_call(samples) is None


def _metrics(path, plan_before, plan_after, reports, heads=None, call=5.0):
    """A run's metrics file in the records the runtime writes (hettp.metrics)."""
    args = {"num_attention_heads": 4, "num_query_groups": 4, "group_query_attention": False}
    args.update(micro_batch_size=2, global_batch_size=8, data_parallel_size=1)
    records = [
        {"kind": "run", "args": args},
        {"kind": "plan", "iteration": 0, "why": "initial", "plan": plan_before.to_json()},
        # the probe's call: 0.2 ms a micro-batch, 4 micro-batches a step
        {"kind": "priced", "iteration": 3, "unit_work": {**WORK, "call": call}, "call_s": 2e-4},
    ]
    for iteration, plan, factors, change in reports:
        seconds = [_seconds(plan, r, factor=f) for r, f in enumerate(factors)]
        records.append(
            {"kind": "timing", "iteration": iteration, "attention_s": seconds, "factor": factors}
        )
        if change == "move":
            records.append({"kind": "decision", "iteration": iteration, "shares": [0.0, 0.0]})
            records.append(
                {"kind": "repartition", "iteration": iteration, "plan": plan_after.to_json()}
            )
        elif change in ("resize", "resumed resized"):  # decided, or restored by a resume
            kind = "decision" if change == "resize" else "resize"
            records.append({"kind": kind, "iteration": iteration, "shares": [0.3, 0.0]})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_the_script_reads_the_call_from_a_run_and_sets_it_against_the_probe(tmp_path, capsys):
    script = load_script("attention_call")
    even, moved = _plan([2, 2]), _plan([1, 3])
    slow = (2.5, 1.0)
    reports = [(3, even, (1.0, 1.0), None), (6, even, (1.0, 1.0), None)]
    reports += [(9, even, slow, "move")]  # measured before the move at its end
    reports += [(i, moved, slow, None) for i in (12, 15, 18, 21)]
    run = _metrics(tmp_path / "moved.jsonl", even, moved, reports)
    got = script.run_call(run)
    # 3 (cold) is left out; 6 gives both ranks, 9 and every later report the fast rank
    assert got.samples == 2 + 1 + 4 and got.works == (200.0, 300.0)
    assert got.measured.work == pytest.approx(CALL_S / PER_WORK_S, rel=1e-6)
    assert got.ratio == pytest.approx(8.0, rel=1e-6)

    # a run that resized at its straggle's onset: its resized intervals say nothing
    resized = [*reports[:2], (9, even, slow, "resize"), *reports[3:]]
    assert script.run_call(_metrics(tmp_path / "resized.jsonl", even, even, resized)).samples == 3
    resumed = [*reports[:2], (9, even, slow, "resumed resized"), *reports[3:]]
    assert script.run_call(_metrics(tmp_path / "resumed.jsonl", even, even, resumed)).samples == 3

    unmoved = _metrics(tmp_path / "even.jsonl", even, even, reports[:2])
    vanilla = tmp_path / "vanilla.jsonl"
    vanilla.write_text(json.dumps({"kind": "train", "iteration": 1}) + "\n")
    assert script.main([run, unmoved, str(vanilla), run]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (
        "moved.jsonl: call 0.40 attention units a layer (4.00 ms a step), probed 0.05 "
        "(0.80 ms): measured / probed 8.00 (7 samples)"
    )
    assert out[1] == "even.jsonl: cannot price the call: attention works [200.0] a layer"
    assert out[2] == (
        "vanilla.jsonl: skipped: no run or priced record: not a het-TP run that can migrate"
    )
    assert out[4] == "median measured / probed over 2 runs: 8.00"
