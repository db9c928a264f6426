"""Comparison scenarios and report metrics on synthetic run records: pure, milliseconds."""

from __future__ import annotations

import json

import pytest

from hettp.emulate import ScenarioError
from hettp.plan import HeadUnits, PartitionPlan
from hettp.report import (
    Run,
    compare,
    ideal_step,
    markdown,
    reaction_steps,
    scaling_share,
    unit_pieces,
    whole_unit_compute,
)
from hettp.scenarios import builtin, resolve
from hettp.transfer import minimum_bytes, plan_transfer


def _records(steps, losses=None, compute=None, decisions=(), interval=5, tokens=(4, 128), **parts):
    """JSONL-like records of one run: step seconds per iteration from 1, compute per rank per
    report (constant), decisions as given."""
    out = [{"kind": "run", "args": {"global_batch_size": tokens[0], "seq_length": tokens[1]}}]
    for i, t in enumerate(steps, 1):
        loss = losses[i - 1] if losses else 5.0 - 0.01 * i
        out.append({"kind": "train", "iteration": i, "elapsed_ms": t * 1e3, "lm_loss": loss})
        if compute is not None and i % interval == 0:
            out.append(
                {
                    "kind": "timing",
                    "iteration": i,
                    "compute_s": compute(i) if callable(compute) else compute,
                    **{f"{name}_s": value for name, value in parts.items()},
                }
            )
    out.extend({"kind": "decision", **d} for d in decisions)
    return out


def _run(scenario, policy, steps, repeat=0, **kw):
    return Run.from_records(
        _records(steps, **kw), scenario, policy, repeat, f"{scenario}.{policy}.{repeat}"
    )


def test_builtin_scenarios_scale_with_the_run_and_parse():
    specs = builtin(4, 60)
    assert set(specs) >= {
        "none",
        "persistent-2x",
        "persistent-4x",
        "transient",
        "rotating",
        "multi",
        "noisy",
        "mild",
        "rare-3x",
        "episode",
        "slow-rank-0",
        "several",
        "device-3x",
    }
    assert specs["device-3x"].device(4) and not specs["rare-3x"].device(4)
    assert specs["rare-3x"].factors(4, 1)[0] == (1.0, 1.0, 1.0, 3.0)  # the last rank
    assert specs["episode"].factors(4, 60)[19][1] == 2.5 and specs["episode"].varying(4, 60)
    assert specs["episode"].factors(4, 60)[40][1] == 1.0  # over after two thirds of the run
    assert specs["slow-rank-0"].factors(2, 1)[0] == (2.0, 1.0)
    assert specs["several"].factors(2, 1)[0] == (2.0, 1.5)
    assert specs["multi"].emulate == "multi:factors=8/6"  # half of 4 ranks
    assert specs["persistent-2x"].factors(4, 3)[0] == (1.0, 2.0, 1.0, 1.0)
    assert not specs["persistent-2x"].varying(4, 60)
    assert specs["transient"].varying(4, 60) and specs["rotating"].varying(4, 60)
    assert specs["noisy"].real and specs["noisy"].factors(4, 2) == [(1.0,) * 4] * 2
    for spec in specs.values():
        spec.check(4)


def test_replica_scenarios_slow_one_replica_or_different_tp_ranks_of_two():
    specs = builtin(2, 24, replicas=2)  # global ranks 0-1: replica 0, 2-3: replica 1
    assert specs["replica-3x"].factors(2, 1, 1, 2) == [(1.0, 1.0, 1.0, 3.0)]
    assert specs["crossed-3x"].factors(2, 1, 1, 2) == [(1.0, 3.0, 3.0, 1.0)]
    assert "crossed-3x" not in builtin(2, 24)
    for spec in specs.values():
        spec.check(2, replicas=2)
    # the bound pools every rank of the job: two of four at a third of the speed
    assert ideal_step(1.0, 1.0, (1.0, 1 / 3, 1 / 3, 1.0)) == pytest.approx(1.5)


def test_pipeline_scenarios_slow_one_rank_of_a_stage_or_the_whole_stage():
    specs = builtin(2, 24, stages=2)  # global ranks 0-1: stage 0, 2-3: stage 1
    assert specs["stage-rank-2x"].factors(2, 1, 2) == [(1.0, 1.0, 1.0, 2.0)]
    assert specs["stage-2x"].factors(2, 1, 2) == [(1.0, 1.0, 2.0, 2.0)]
    assert specs["persistent-2x"].factors(2, 1, 2) == [(1.0, 2.0, 1.0, 2.0)]  # TP rank 1 of each
    for spec in specs.values():
        spec.check(2, stages=2)
    assert "stage-2x" not in builtin(2, 24)
    specs["stage-rank-2x"].check(2, stages=2, replicas=2)  # global rank 3 of 8
    with pytest.raises(ScenarioError, match="global rank 3 is not below the world size \\(2\\)"):
        specs["stage-rank-2x"].check(2)
    with pytest.raises(ScenarioError, match="stage 1 is not a pipeline stage \\(1 stages\\)"):
        specs["stage-2x"].check(2)


def test_scenario_files_and_errors(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(
        json.dumps(
            [
                {"name": "slow0", "emulate": "persistent:rank=0,factor=3"},
                {"name": "busy1", "noisy_neighbor": {"rank": 1}},
            ]
        )
    )
    specs = resolve(f"none,{path}", 2, 20)
    assert [s.name for s in specs] == ["none", "slow0", "busy1"]
    assert specs[1].factors(2, 1) == [(3.0, 1.0)] and specs[2].neighbor_rank == 1
    with pytest.raises(ScenarioError, match="unknown scenario 'slowest'"):
        resolve("slowest", 2, 20)
    with pytest.raises(ScenarioError, match="repeat: none"):
        resolve("none,none", 2, 20)
    bad = tmp_path / "bad.json"
    for content, message in (
        ([{"name": "x", "emulate": "persistent:rank=5,factor=2"}], "rank 5 is not a TP"),
        ([{"name": "x", "noisy_neighbor": {"rank": 2}}], "rank 2 is not a TP rank"),
        ([{"name": "x", "slow": 1}], "unknown keys \\['slow'\\]"),
        ([{"emulate": "none"}], 'needs a "name"'),
        ([{"name": "x", "emulate": {"rank": 1}}], "emulate must be a --het-tp-emulate"),
        ({"name": "x"}, "JSON list"),
    ):
        bad.write_text(json.dumps(content))
        with pytest.raises(ScenarioError, match=message):
            resolve(str(bad), 2, 20)


def test_minimum_bytes_counts_only_gains():
    old = PartitionPlan.even(2, 2, 4, 8)
    new = old.rebalanced(attn_counts=(3, 1), mlp_counts=(6, 2))
    sizes = {"attn": 100, "mlp": 10}
    assert minimum_bytes(old, new, sizes.get) == 2 * (1 * 100 + 2 * 10)
    assert plan_transfer(old, new, sizes.get).total_bytes == minimum_bytes(old, new, sizes.get)
    assert minimum_bytes(old, old, sizes.get) == 0


def test_reaction_counts_steps_until_within_ten_percent():
    steps = [2.0] * 6 + [1.05, 1.0, 0.98, 1.0, 1.02, 1.0]
    run = _run("s", "migrate", steps)
    assert reaction_steps(run, 1, 1.0) == 6  # settles at iteration 7
    assert reaction_steps(_run("s", "m", [2.0] * 10), 1, 1.0) is None
    # a late excursion resets it: it must stay settled
    late = _run("s", "m", [1.0] * 5 + [1.5] * 3 + [1.0] * 4)
    assert reaction_steps(late, 1, 1.0) == 8


def test_compare_metrics_follow_the_design_definitions():
    """T_fast 1.0 s with C 0.8 s, rank 1 2x slow at TP=2: T_ideal = 0.2 + 0.8 * 2 / 1.5."""
    n = 20
    compute = [0.8, 0.8]
    fast = [1.0] * n
    runs = [
        _run("none", "none", fast, compute=compute),
        _run("none", "hybrid", [1.02] * n, compute=compute),
        _run("slow", "none", [1.8] * n, compute=[0.8, 1.6]),
        _run(
            "slow",
            "migrate",
            [1.6] * 10 + [1.1] * 10,
            compute=compute,
            decisions=[{"action": "migrate", "iteration": 5, "bytes": 300, "min_bytes": 300}],
            losses=[5.0 - 0.01 * i + 1e-7 for i in range(1, n + 1)],
        ),
    ]
    factors = {"none": [(1.0, 1.0)] * n, "slow": [(1.0, 2.0)] * n}
    result = compare(runs, factors, {"none": False, "slow": False})
    b = result["baseline"]
    assert b["t_fast_s"] == pytest.approx(1.0) and b["c_s"] == pytest.approx(0.8)
    rows = {(r["scenario"], r["policy"]): r for r in result["rows"]}
    t_ideal = 0.2 + 0.8 * 2 / 1.5
    assert ideal_step(1.0, 0.8, (1.0, 0.5)) == pytest.approx(t_ideal)
    mig = rows[("slow", "migrate")]
    assert mig["t_ideal_s"] == pytest.approx(t_ideal)
    assert mig["E"] == pytest.approx(t_ideal / 1.1)
    assert mig["R"] == pytest.approx((1.8 - 1.1) / (1.8 - t_ideal))
    assert mig["speedup"] == pytest.approx(1.8 / 1.1)
    assert mig["tokens_per_s"] == pytest.approx(512 / 1.1)
    assert mig["bytes_vs_min"] == pytest.approx(1.0) and mig["decisions"] == 1
    assert mig["decisions_first_run"] == ["migrate@5"]
    assert mig["loss_gap"] == pytest.approx(1e-7)
    assert mig["reaction_steps"] == 10  # 1.6 until iteration 10, then steady 1.1
    assert rows[("slow", "none")]["R"] == pytest.approx(0.0)
    assert rows[("none", "hybrid")]["E"] is None and rows[("none", "hybrid")]["R"] is None
    assert rows[("none", "hybrid")]["speedup"] == pytest.approx(1 / 1.02)
    table = markdown(result)
    assert "| slow | migrate | 1100.0 (0.0) |" in table and "C/T_fast 0.80" in table


def test_pipeline_runs_join_their_stages_reports_and_the_slowest_stage_bounds_the_step():
    """TP=2 x PP=2: each stage's timing records become one per-rank row (stage 0's ranks, then
    stage 1's), each stage's latest at every report; units move inside a stage, so one 2x rank
    in stage 1 bounds the step at that stage's balanced time, and a whole 2x stage at 2x."""

    def pipeline(steps, compute):
        records = [{"kind": "run", "args": {"global_batch_size": 8, "seq_length": 128}}]
        records[0]["args"]["pipeline_model_parallel_size"] = 2
        for i, t in enumerate(steps, 1):
            records.append({"kind": "train", "iteration": i, "elapsed_ms": t * 1e3, "lm_loss": 5})
            for stage in (0, 1) if i % 5 == 0 else (1,) if i == 7 else ():  # 7: stage 1 only
                row = compute[2 * stage : 2 * stage + 2]
                records.append({"kind": "timing", "iteration": i, "stage": stage, "compute_s": row})
        return records

    n = 20
    runs = [
        Run.from_records(pipeline([1.0] * n, [0.8] * 4), "none", policy, 0, "x")
        for policy in ("vanilla", "none")
    ]
    # 7: stage 1 alone (its detection changed), joined with stage 0's report of 5
    assert [it for it, _ in runs[1].compute] == [5, 7, 10, 15, 20] and runs[1].stages == 2
    assert runs[1].compute[0][1] == [0.8] * 4
    slow = [0.8, 0.8, 0.8, 1.6]  # what the vanilla runs measure: T_ideal's speeds
    runs.append(Run.from_records(pipeline([1.5] * n, slow), "slow", "vanilla", 0, "y"))
    runs.append(Run.from_records(pipeline([1.2] * n, [0.8] * 4), "slow", "migrate", 0, "z"))
    factors = {"none": [(1.0,) * 4] * n, "slow": [(1.0, 1.0, 1.0, 2.0)] * n}
    result = compare(runs, factors, {"none": False, "slow": False})
    row = next(r for r in result["rows"] if r["policy"] == "migrate")
    assert row["t_ideal_s"] == pytest.approx(0.2 + 0.8 * 2 / 1.5)
    assert ideal_step(1.0, 0.8, (1.0, 1.0, 0.5, 0.5), stages=2) == pytest.approx(1.8)
    assert ideal_step(1.0, 0.8, (1.0, 0.5, 1.0, 1.0), stages=2) == pytest.approx(0.2 + 1.6 / 1.5)


def test_layer_moves_count_as_decisions_with_their_split_and_bytes():
    records = _records([1.0] * 8, compute=[0.5, 0.5], interval=4)
    records.append(
        {"kind": "layers", "iteration": 4, "before": [2, 2], "after": [3, 1], "bytes": 2048}
    )
    run = Run.from_records(records, "stage-2x", "migrate-layers", 0, "x")
    assert run.decisions == [
        {"action": "layers 3/1", "iteration": 4, "bytes": 2048, "min_bytes": 2048}
    ]


def test_medians_over_repeats_and_varying_scenarios():
    n = 12
    runs = [_run("none", "none", [1.0] * n, repeat=k, compute=[0.5, 0.5]) for k in range(3)]
    # bursts: rank 0 4x slow on iterations 3-4 and 9-10; the step time is the mean after the
    # start-up's two steps (the cold first one, and the second holding the attention probe)
    factors = [(4.0, 1.0) if i in (3, 4, 9, 10) else (1.0, 1.0) for i in range(1, n + 1)]
    steps = [9.0, 5.0] + [2.0 if i in (3, 4, 9, 10) else 1.0 for i in range(3, n + 1)]
    for k, scale in enumerate((1.0, 1.1, 0.9)):
        runs.append(_run("burst", "none", [s * scale for s in steps], repeat=k, compute=[0.5, 0.5]))
    result = compare(
        runs, {"none": [(1.0, 1.0)] * n, "burst": factors}, {"none": False, "burst": True}
    )
    row = [r for r in result["rows"] if r["scenario"] == "burst"][0]
    mean = (4 * 2.0 + 6 * 1.0) / 10
    assert row["step_s"] == pytest.approx(mean)  # median of the three rounds
    assert row["spread_s"] == pytest.approx(0.2 * mean)
    ideal = ideal_step(1.0, 0.5, (0.25, 1.0))
    assert row["t_ideal_s"] == pytest.approx((4 * ideal + 6 * 1.0) / 10)
    assert row["reaction_steps"] is None  # not a persistent straggle


def test_real_contention_speeds_are_measured_from_vanilla():
    n = 10
    runs = [
        _run("none", "none", [1.0] * n, compute=[0.4, 0.4]),
        _run("busy", "none", [1.4] * n, compute=[0.4, 0.8]),
        _run("busy", "migrate", [1.2] * n, compute=[0.5, 0.5]),
    ]
    result = compare(
        runs,
        {"none": [(1.0, 1.0)] * n, "busy": [(1.0, 1.0)] * n},
        {"none": False, "busy": False},
        real={"busy"},
    )
    assert result["speeds"]["busy"][0] == pytest.approx((1.0, 0.5))
    row = [r for r in result["rows"] if r["policy"] == "migrate"][0]
    assert row["t_ideal_s"] == pytest.approx(0.6 + 0.4 * 2 / 1.5)


def test_compare_needs_the_vanilla_baseline():
    with pytest.raises(ValueError, match="no-straggler vanilla"):
        compare(
            [_run("slow", "none", [1.0] * 4, compute=[0.1, 0.1])],
            {"slow": [(2.0, 1.0)] * 4},
            {"slow": False},
        )


def test_plain_vanilla_is_the_baseline_and_timed_vanilla_gives_c_and_real_speeds():
    """Speedups, E and R are against plain megatron-core runs ('vanilla', no het-TP code, no
    timing records); the timed vanilla runs ('none') give C and the measured real speeds, and
    their own row is what the timing costs."""
    n = 10
    runs = [
        _run("none", "vanilla", [1.0] * n),
        _run("none", "none", [1.02] * n, compute=[0.6, 0.6]),
        # the emulation times it: 2x emulated, read 2.5x (what the planner sees)
        _run("slow", "vanilla", [1.6] * n, compute=[0.6, 1.5]),
        _run("slow", "migrate", [1.2] * n, compute=[0.8, 0.8]),
        _run("busy", "vanilla", [1.5] * n),
        _run("busy", "none", [1.55] * n, compute=[0.6, 1.2]),
        _run("busy", "migrate", [1.25] * n, compute=[0.8, 0.8]),
    ]
    flat = [(1.0, 1.0)] * n
    result = compare(
        runs,
        {"none": flat, "slow": [(1.0, 2.0)] * n, "busy": flat},
        {"none": False, "slow": False, "busy": False},
        real={"busy"},
    )
    b = result["baseline"]
    assert b["t_fast_s"] == pytest.approx(1.0) and b["c_s"] == pytest.approx(0.6)
    rows = {(r["scenario"], r["policy"]): r for r in result["rows"]}
    assert rows[("none", "none")]["speedup"] == pytest.approx(1 / 1.02)  # the timers' cost
    assert result["speeds_from"] == {"none": "measured", "slow": "measured", "busy": "measured"}
    assert result["speeds"]["slow"][0] == pytest.approx((1.0, 0.4))
    t_ideal = 0.4 + 0.6 * 2 / 1.4
    assert rows[("slow", "migrate")]["speedup"] == pytest.approx(1.6 / 1.2)
    assert rows[("slow", "migrate")]["E"] == pytest.approx(t_ideal / 1.2)
    assert result["speeds"]["busy"][0] == pytest.approx((1.0, 0.5))  # from the timed runs
    assert rows[("busy", "migrate")]["speedup"] == pytest.approx(1.5 / 1.25)  # vs plain
    t_ideal = 0.4 + 0.6 * 2 / 1.5
    assert rows[("busy", "migrate")]["R"] == pytest.approx((1.5 - 1.25) / (1.5 - t_ideal))
    with pytest.raises(ValueError, match="real-contention scenario 'busy' needs timed vanilla"):
        compare(
            [r for r in runs if r.path != "busy.none.0" and r.scenario != "slow"],
            {"none": flat, "busy": flat},
            {"none": False, "busy": False},
            real={"busy"},
        )


def test_the_bound_keeps_each_ranks_unmovable_part_and_stretches_what_the_mode_slows():
    """T_fast 1.0 s; per rank 0.8 s timed compute of which 0.2 s the optimizer step (stays on
    each rank), 0.9 s of compute in all; rank 1 3x slow at TP=2."""
    # sharded mode: 0.2 s unslowed; f_r (0.2 + 0.6 w_r) balanced over w_0 + w_1 = 2
    assert ideal_step(1.0, 0.8, (1.0, 1 / 3), movable=0.6) == pytest.approx(0.2 + 1.2)
    assert ideal_step(1.0, 0.8, (1.0, 1 / 3)) == pytest.approx(0.2 + 0.8 * 2 / (4 / 3))
    # a rank too slow to finish even its unmovable part gets no units: all on rank 0
    assert ideal_step(1.0, 0.8, (1.0, 0.1), movable=0.2) == pytest.approx(0.2 + 6.0)
    n = 10
    parts = {"fixed": [0.2, 0.2], "busy": [0.9, 0.9]}
    runs = [
        _run("none", "none", [1.0] * n, compute=[0.8, 0.8], **parts),
        _run("slow", "none", [2.6] * n, compute=[0.8, 2.4], **parts),
        _run("dev", "none", [2.8] * n, compute=[0.8, 2.4], **parts),
    ]
    factors = {"none": [(1.0, 1.0)] * n, "slow": [(1.0, 3.0)] * n, "dev": [(1.0, 3.0)] * n}
    result = compare(runs, factors, {"none": False, "slow": False, "dev": False}, device={"dev"})
    assert result["baseline"]["fixed_s"] == pytest.approx(0.2)
    assert result["baseline"]["busy_s"] == pytest.approx(0.9)
    rows = {r["scenario"]: r for r in result["rows"]}
    assert rows["slow"]["t_ideal_s"] == pytest.approx(ideal_step(1.0, 0.8, (1, 1 / 3), 0.6))
    assert rows["dev"]["t_ideal_s"] == pytest.approx(ideal_step(1.0, 0.9, (1, 1 / 3), 0.6))
    assert result["bounds"]["dev"] == {"slowed_s": 0.9, "movable_s": pytest.approx(0.6)}


def test_whole_units_leave_each_block_at_its_slowest_rank():
    # 8 heads at 1 : 1/3.6 go 7 : 1 at best: 7 heads' time where a proportional split takes
    # 8 / 1.278 (a rank's compute at an even split, 4 heads, is 1 s, all of it in its heads)
    speeds = (1.0, 1 / 3.6)
    assert whole_unit_compute(speeds, {"attn": (8, 1.0)}, 1.0, 1.0) == pytest.approx(7 / 4)
    # what a split in whole units makes exactly (3 : 1 at 3x) costs nothing over 2 / (4/3) s
    exact = {"attn": (4, 0.4), "mlp": (400, 0.6)}
    assert whole_unit_compute((1.0, 1 / 3), exact, 1.0, 1.0) == pytest.approx(1.5)
    # what a rank pays whatever it holds is stretched on the slow rank, not dealt: half of it
    # per-call at 2x leaves the slow rank room for 1 head of 8, and the fast rank computes
    # 0.5 + 7 x 0.125 s (a proportional split: 2 / 1.5 s)
    assert whole_unit_compute((1.0, 0.5), {"attn": (8, 1.0)}, 1.0, 0.5) == pytest.approx(1.375)
    with pytest.raises(ValueError, match="positive"):
        whole_unit_compute((1.0, 0.0), {"attn": (8, 1.0)}, 1.0, 1.0)


def test_the_share_of_compute_that_grows_with_units_is_read_off_the_runs_timing_records():
    records = _records([1.0] * 8, compute=[0.5, 0.5], interval=4)
    run = Run.from_records(records, "s", "migrate", 0, "x")
    assert run.loads == [] and scaling_share([run]) is None  # no work logged: no line
    # compute at full speed = 0.1 + 0.01 x work; even work 40 a rank: 0.4 of 0.5 s grows
    loads = [([40.0, 40.0], [0.5, 0.5], [1.0, 1.0]), ([60.0, 20.0], [0.7, 0.9], [1.0, 3.0])]
    loads += [([70.0, 10.0], [0.8, 0.4], [1.0, 2.0]), ([50.0, 30.0], [0.6, 0.4], [1.0, None])]
    for i, (work, compute, factor) in enumerate(loads, 9):
        records.append(
            {"kind": "timing", "iteration": i, "compute_s": compute, "work": work, "factor": factor}
        )
    run = Run.from_records(records, "s", "migrate", 0, "x")
    assert len(run.loads) == 4
    share = scaling_share([run])
    assert share == pytest.approx(0.8)


def test_unit_pieces_count_the_mlp_in_the_planners_chunks_and_weigh_blocks_by_work():
    plan = PartitionPlan.even(2, 2, attn_units=8, mlp_units=1344)
    pieces = unit_pieces(plan.to_json(), {"attn": 170.0, "mlp": 1.5, "kv": 0})
    assert pieces["attn"] == (8, pytest.approx(8 * 170 / (8 * 170 + 1344 * 1.5)), 0.0, 0)
    assert pieces["mlp"][0] == 1344 // 8  # mlp_chunk: widths in multiples of 8 neurons


def test_the_whole_unit_bound_of_head_units_pays_for_their_k_v_replicas():
    """8 heads in 2 groups, a K/V replica as heavy as a head, rank 1 at 3x: 7 : 1 leaves the
    fast rank 7 heads and 2 replicas (1.8 of the even split's 1.0), 6 : 2 the slow rank 2 heads
    and a replica, 1.8 too; counted without replicas, 6 : 2 took 1.5."""
    heads = HeadUnits(1, 4, 2)
    plan = PartitionPlan.from_counts(2, 1, 8, 16, (4, 4), (8, 8), 4, heads)
    pieces = unit_pieces(plan.to_json(), {"attn": 1.0, "mlp": 0.0, "kv": 1.0}, heads)
    assert pieces["attn"] == (8, pytest.approx(1.0), pytest.approx(0.1), 4)
    assert whole_unit_compute((1.0, 1.0), pieces, 1.0, 1.0) == pytest.approx(1.0)
    assert whole_unit_compute((1.0, 1 / 3), pieces, 1.0, 1.0) == pytest.approx(1.8)
    plain = {"attn": pieces["attn"][:2], "mlp": pieces["mlp"]}
    assert whole_unit_compute((1.0, 1 / 3), plain, 1.0, 1.0) == pytest.approx(1.5)
    # a run's head units come from its flags (its plan's JSON does not carry them)
    args = {"global_batch_size": 4, "seq_length": 8, "num_attention_heads": 8}
    gqa = {**args, "group_query_attention": True, "num_query_groups": 2}
    for flags, want in (
        ({**gqa, "het_tp_attn_granularity": 1}, heads),
        ({**gqa, "het_tp_attn_granularity": 4}, None),  # a whole group: group units
        ({**gqa, "het_tp_attn_granularity": 0}, None),
        ({**args, "het_tp_attn_granularity": 1}, None),  # MHA: a group is one head
    ):
        step = {"kind": "train", "iteration": 1, "elapsed_ms": 1.0, "lm_loss": 5.0}
        run = Run.from_records([{"kind": "run", "args": flags}, step], "s", "p", 0, "p")
        assert run.heads == want


def test_a_report_gives_the_whole_unit_bound_and_how_soon_a_straggle_end_was_undone():
    n, plan = 12, PartitionPlan.even(2, 1, attn_units=4, mlp_units=80)
    fine = PartitionPlan.even(2, 1, attn_units=4, mlp_units=320).to_json()
    priced = [{"kind": "priced", "iteration": 3, "unit_work": {"attn": 16.0, "mlp": 1.0}}]
    shape = [{"kind": "plan", "iteration": 0, "plan": plan.to_json()}, *priced]

    def run(scenario, policy, steps, decisions=(), records=()):
        rec = _records(steps, compute=[0.5, 0.5], interval=4, decisions=decisions)
        return Run.from_records([*rec, *records], scenario, policy, 0, policy)

    # rank 1 3x slow in iterations 4-7; the straggle's first normal step is 8
    factors = [(1.0, 3.0) if 4 <= i <= 7 else (1.0, 1.0) for i in range(1, n + 1)]
    undo = [{"action": "migrate", "iteration": 5}, {"action": "migrate", "iteration": 9}]
    runs = [
        run("none", "vanilla", [1.0] * n),
        run("none", "none", [1.0] * n),
        run("ep", "vanilla", [1.0] * n),
        run("ep", "migrate", [1.0] * n, undo, shape),
        run("ep", "resize", [1.0] * n, [{"action": "resize", "iteration": 5}], shape),
        # finer pieces: the MLP in 40 chunks, which whole units split exactly 30 : 10
        run("ep", "fine", [1.0] * n, (), [{"kind": "plan", "iteration": 0, "plan": fine}, *priced]),
    ]
    result = compare(runs, {"none": [(1.0, 1.0)] * n, "ep": factors}, {"none": False, "ep": True})
    rows = {(r["scenario"], r["policy"]): r for r in result["rows"]}
    # 4 groups at 1 : 1/3 split exactly 3 : 1, the MLP's 10 chunks at best 8 : 2 (7.5 : 2.5)
    assert unit_pieces(plan.to_json(), {"attn": 16.0, "mlp": 1.0}) == {
        "attn": (4, pytest.approx(64 / 144), 0.0, 0),
        "mlp": (10, pytest.approx(80 / 144), 0.0, 0),
    }
    e = rows[("ep", "migrate")]["E_whole_units"]
    assert 0.9 < e < 1.0
    assert rows[("ep", "vanilla")]["E_whole_units"] is None  # its plan is not known
    assert rows[("ep", "fine")]["E_whole_units"] == pytest.approx(1.0)  # each policy its own
    assert rows[("ep", "migrate")]["undone_after"] == [2]  # at the boundary after step 9
    assert rows[("ep", "resize")]["undone_after"] == [None]  # never undone
    assert rows[("ep", "vanilla")]["undone_after"] is None  # decides nothing
    assert rows[("none", "none")]["E_whole_units"] is None
    text = markdown(result)
    assert "| 2 |" in text and "never" in text and f"({e:.3f})" in text


def test_the_plotted_bound_is_the_report_s_with_pipeline_stages(tmp_path, monkeypatch):
    """step_time.png's T_ideal line: the slowest stage paces the step, as in the table (it
    pooled every stage's ranks, a bound the report itself says no plan reaches)."""
    from hettp import plots

    seen = []
    real = plots.ideal_step
    monkeypatch.setattr(plots, "ideal_step", lambda *a: seen.append(a) or real(*a))
    runs = [
        Run("stage-2x", policy, 0, "x", step_s={1: 1.0, 2: 1.0}, loss={1: 2.0, 2: 1.9}, stages=2)
        for policy in ("vanilla", "migrate")
    ]
    speeds = {"stage-2x": [(1.0, 1.0, 0.5, 0.5)] * 2}
    bounds = {"stage-2x": {"slowed_s": 0.8, "movable_s": 0.8}}
    plots.plot(
        runs, speeds, {"t_fast_s": 1.0}, bounds, str(tmp_path / "s.png"), str(tmp_path / "l.png")
    )
    assert seen and all(call[-1] == 2 for call in seen)
    assert real(*seen[0]) == pytest.approx(1.8)  # stage 1 at half speed: 0.2 + 0.8 / 0.5


def test_real_contention_speeds_are_taken_over_the_least_slowed_rank():
    """Its runs time the wall clock, its base the CPU clock: a rank no neighbour slowed read
    0.93-0.95 against it, which raised the bound of every policy."""
    from hettp.report import measured_speeds

    run = Run("noisy", "none", 0, "x", compute=[(2, [0.107, 0.2]), (4, [0.107, 0.2])])
    plain = measured_speeds([run], (0.1, 0.1), 4)
    assert plain[0] == pytest.approx((0.1 / 0.107, 0.5))
    relative = measured_speeds([run], (0.1, 0.1), 4, relative=True)
    assert relative == [pytest.approx((1.0, 0.107 / 0.2))] * 4
