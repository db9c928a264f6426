"""scripts/compare.py end to end on 2 ranks (--quick): launch, metrics, report, plots. Checks the
outputs exist and agree with the runs' JSONL; never the timings."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys

import pytest

from hettp.metrics import read_metrics
from tests.utils import BASE, ROOT, load_script

SCRIPT = os.path.join(ROOT, "scripts", "compare.py")


def _steady(path):
    steps = [r["elapsed_ms"] / 1e3 for r in read_metrics(path, "train")]
    return statistics.median(steps[len(steps) // 2 :])


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout


def test_quick_report_agrees_with_the_runs(quick):
    out, stdout = quick
    report = json.loads((out / "report.json").read_text())
    names = [s["name"] for s in report["scenarios"]]
    assert names[:2] == ["none", "persistent-4x"]
    if len(os.sched_getaffinity(0)) >= 2:
        assert "noisy" in names  # real contention ran
        assert report["dilation"] == 1.0  # a core per rank: nothing to stretch
    rows = {(r["scenario"], r["policy"]): r for r in report["rows"]}
    # plain vanilla everywhere; timed vanilla (none) where C and real speeds come from
    timed = {"none", "noisy"}
    assert set(rows) == {(s, p) for s in names for p in ("vanilla", "migrate")} | {
        (s, "none") for s in names if s in timed
    }
    base = [_steady(out / p) for p in rows[("none", "vanilla")]["runs"]]
    assert report["baseline"]["t_fast_s"] == pytest.approx(statistics.median(base))
    # the plain runs carry no het-TP code: no timing records where nothing is emulated
    for path in rows[("none", "vanilla")]["runs"]:
        assert list(read_metrics(out / path, "timing")) == []
        assert list(read_metrics(out / path, "run"))[0]["args"]["het_tp_policy"] == "static"
        assert list(read_metrics(out / path, "eval")) == []  # compared runs only train
    assert all(list(read_metrics(out / p, "timing")) for p in rows[("none", "none")]["runs"])
    table = (out / "report.md").read_text()
    for (scenario, policy), row in rows.items():
        paths = [out / p for p in row["runs"]]
        assert len(paths) == report["repeats"] == 2 and all(p.exists() for p in paths)
        if scenario in ("none", "persistent-4x"):  # constant scenarios: steady-state median
            assert row["step_s"] == pytest.approx(statistics.median(_steady(p) for p in paths))
        decisions = [list(read_metrics(p, "decision")) for p in paths]
        assert row["decisions"] == statistics.median(len(d) for d in decisions)
        assert row["bytes_moved"] == statistics.median(
            sum(r["bytes"] for r in d) for d in decisions
        )
        finals = [list(read_metrics(p, "train"))[-1]["lm_loss"] for p in paths]
        assert row["final_loss"] == pytest.approx(statistics.median(finals))
        assert f"| {scenario} | {policy} | {row['step_s'] * 1e3:.1f} " in table
    # the planner acted on the emulated straggler and the move was lossless and minimal
    mig = rows[("persistent-4x", "migrate")]
    assert mig["decisions"] >= 1 and mig["decisions_first_run"][0].startswith("migrate@")
    assert mig["bytes_vs_min"] == pytest.approx(1.0)
    assert abs(mig["loss_gap"]) <= 1e-5 * abs(mig["final_loss"])
    assert rows[("persistent-4x", "vanilla")]["E"] is not None
    assert rows[("none", "none")]["speedup"] > 0  # the timers' cost, against plain vanilla
    assert "report in" in stdout and "iteration 12/12" in stdout


def test_quick_plots_are_images(quick):
    import matplotlib.image as mpimg

    out, _ = quick
    for name in ("step_time.png", "loss.png"):
        image = mpimg.imread(out / name)
        assert image.shape[0] > 300 and image.shape[1] > 600  # one panel per scenario
        assert image[..., :3].std() > 0.05  # not blank


def test_report_only_rebuilds_the_same_table(quick):
    out, _ = quick
    before = (out / "report.json").read_text()
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--quick", "--out", str(out), "--report-only"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((out / "report.json").read_text())["rows"] == json.loads(before)["rows"]
    # with other flags than the runs': refused naming the flag, the report left as it was
    iters = load_script("compare").parse(["--quick"]).iters
    for flag, value in (("--iters", iters + 6), ("--tp", 4)):
        other = [sys.executable, SCRIPT, "--quick", "--out", str(out), "--report-only"]
        proc = subprocess.run(other + [flag, str(value)], cwd=ROOT, capture_output=True, text=True)
        assert proc.returncode != 0 and f"--report-only {flag}: " in proc.stderr, proc.stderr
        assert json.loads((out / "report.json").read_text())["rows"] == json.loads(before)["rows"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--policies", "none,fast"], "--policies: unknown fast"),
        (["--scenarios", "slowest"], "unknown scenario 'slowest'"),
        (["--iters", "10", "--interval", "6"], "--interval 6 leaves fewer than two reports"),
        (["--tp", "0"], "--tp must be >= 1"),
        (["--", "--num-layers", "2", "--train-iters", "5"], "may not set --train-iters"),
        (["--tp", "64", "--scenarios", "noisy"], "need a core per rank"),
        (["--dilation", "0.5"], "--dilation must be 'auto' or a number >= 1, got '0.5'"),
        (["--dilation", "inf"], "--dilation must be 'auto' or a number >= 1, got 'inf'"),
        (
            ["--dilation", "2", "--scenarios", "noisy"],
            "real-contention scenarios need --dilation 1",
        ),
        (["--", "--het-tp-emulate-dilation", "2"], "may not set --het-tp-emulate-dilation"),
        (["--", "--rampup-batch-size", "2", "2", "8"], "may not set --rampup-batch-size"),
        (["--pp", "2", "--dp", "2"], "--pp with --dp > 1"),
        (
            ["--pp", "4", "--policies", "migrate"],
            "--pp 4: the model's --num-layers 2 do not split evenly over it",
        ),
        (["--scenarios", "stage-2x"], "unknown scenario 'stage-2x'"),  # a --pp scenario
        (["--policies", "migrate-layers"], "--policies migrate-layers: needs --pp > 1"),
        (["--policies", "migrate,joint"], "--policies joint: needs --dp > 1"),
        (["--scenarios", "crossed-3x"], "unknown scenario 'crossed-3x'"),  # a --dp scenario
        (["--dp", "2", "--scenarios", "noisy"], "real-contention scenarios with --dp > 1"),
        (["--run-timeout", "0"], "--run-timeout must be a positive number of seconds, got 0"),
        (
            ["--pp", "4", "--policies", "migrate", "--", "--num-layers=6"],
            "--pp 4: the model's --num-layers 6 do not split evenly over it",
        ),
    ],
)
def test_bad_arguments_name_the_flag(argv, message, tmp_path):
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--out", str(tmp_path / "x"), *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "x").exists()  # nothing launched, nothing written


def test_pipeline_stages_run_and_the_slow_stage_is_measured(tmp_path):
    """--pp 2 at TP=1 (2 ranks), 4 layers: each run has two stages and 4 micro-batches per
    step; the timed runs report per stage, and the whole slow stage's speed is measured from
    them; migrate-layers moves a layer off the slow stage (reported as a decision).

    The stage is slowed 4x, not the built-in stage-2x's 2x: only its sharded GEMMs are, and in
    this 64-wide model that read as 1.7x of its layer compute, against the 1.67x a 3/1 split
    needs to save the planner's 10% (a loaded clean-clone CI run once read less, and moved
    nothing)."""
    scenario = tmp_path / "stage-4x.json"
    scenario.write_text(
        json.dumps([{"name": "stage-4x", "emulate": "persistent:stage=1,factor=4"}])
    )
    model = (
        "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--max-position-embeddings 32 --micro-batch-size 2 --lr 1e-3 --mock-data "
        "--vocab-size 255 --hidden-dropout 0 --attention-dropout 0"
    ).split()
    proc = subprocess.run(
        [
            sys.executable,
            SCRIPT,
            "--quick",
            "--tp",
            "1",
            "--pp",
            "2",
            "--scenarios",
            str(scenario),
            "--policies",
            "none,migrate-layers",
            "--repeats",
            "1",
            "--iters",
            "8",
            "--interval",
            "2",
            "--out",
            str(tmp_path),
            "--",
            *model,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["pp"] == 2 and report["microbatches"] == 4
    rows = {(r["scenario"], r["policy"]): r for r in report["rows"]}
    policies = ("vanilla", "none", "migrate-layers")
    assert set(rows) == {(s, p) for s in ("none", "stage-4x") for p in policies}
    moves = rows[("stage-4x", "migrate-layers")]["decisions_first_run"]
    assert moves and moves[0].startswith("layers 3/1@"), moves
    # (whether a steady cluster moves nothing is test_pipeline.py's: this model's layers take
    # well under a millisecond, and a clean-clone CI run once read its steady stages 10% apart)
    path = tmp_path / rows[("stage-4x", "none")]["runs"][0]
    args = list(read_metrics(path, "run"))[0]["args"]
    assert args["pipeline_model_parallel_size"] == 2 and args["global_batch_size"] == 8
    assert {r["stage"] for r in read_metrics(path, "timing")} == {0, 1}
    fast, slow = report["speeds"]["stage-4x"][-1]  # stage 0's rank, stage 1's
    assert fast == 1.0 and slow < 0.6, report["speeds"]["stage-4x"][-1]
    assert "PP=2 (4 micro-batches per step)" in (tmp_path / "report.md").read_text()


def _one_run(tmp_path, *argv) -> subprocess.CompletedProcess:
    """compare.py --quick on the no-straggler scenario, one round, into `tmp_path`."""
    return subprocess.run(
        [sys.executable, SCRIPT, "--quick", "--scenarios", "none", "--repeats", "1"]
        + ["--out", str(tmp_path), *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_failing_run_is_named_with_its_log(tmp_path):
    # compare.py's own flags are fine; pretrain_gpt.py refuses the model on every rank
    proc = _one_run(
        tmp_path,
        *"-- --num-layers 1 --hidden-size 63 --num-attention-heads 4 --seq-length 16".split(),
        *"--micro-batch-size 1 --lr 1e-3 --mock-data".split(),
    )
    log = tmp_path / "runs" / "none.vanilla.0.log"
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f"run none / vanilla / round 1 failed (exit codes [2, 2]); log {log}" in proc.stderr
    assert "--hidden-size (63) must be divisible" in log.read_text()
    assert not (tmp_path / "report.json").exists()


def test_a_run_past_its_timeout_is_named_so(tmp_path):
    # enough iterations to outlast the timeout anywhere: a quick run's 12 took under a
    # second on a fast 2-core machine, and finished
    proc = _one_run(tmp_path, "--run-timeout", "1", "--iters", "2000")
    assert proc.returncode == 1, proc.stderr[-2000:]
    # the first run of the round (rounds start at different configurations)
    assert re.search(
        r"run none / \S+ / round 1 ran past --run-timeout 1 s and was stopped", proc.stderr
    )


def test_model_flags_are_read_in_either_form_and_a_report_reads_runs_made_elsewhere():
    compare = load_script("compare")
    flags = ["--num-layers=4", "--micro-batch-size", "2", "--micro-batch-size=3"]
    assert compare._flag_value(flags, "--num-layers", "1") == "4"
    assert compare._flag_value(flags, "--micro-batch-size", "1") == "3"  # the last, as argparse
    assert compare._flag_value(flags, "--hidden-size", "64") == "64"
    # --pp 2 splits 4 layers given as --num-layers=4 (read as 1 before: refused)
    assert compare.parse(["--pp", "2", "--scenarios", "none", "--", "--num-layers=4"]).pp == 2
    # a report of runs launched elsewhere (more ranks than cores here, or noisy) is not held
    # to this machine's cores, and is not dilated unless told
    many = str(4 * len(os.sched_getaffinity(0)))
    for scenarios in ("none", "noisy"):
        a = compare.parse(["--tp", many, "--scenarios", scenarios, "--report-only"])
        assert a.dilation == 1.0


def test_dilation_gives_each_rank_a_device_when_ranks_outnumber_cores():
    compare = load_script("compare")
    cores = len(os.sched_getaffinity(0))
    assert compare.parse(["--tp", str(cores), "--scenarios", "none"]).dilation == 1.0
    # twice the ranks of cores: each GEMM takes up to 2x its CPU time; 1.5x that covers it
    assert compare.parse(["--tp", str(2 * cores), "--scenarios", "none"]).dilation == 3.0
    assert compare.parse(["--tp", "4", "--scenarios", "none", "--dilation", "2.5"]).dilation == 2.5
    # ranks sit on core rank % cores: the busiest core holds ceil(ranks / cores) of them
    assert compare._dilation(None, "auto", 5, 4) == 3.0
    assert compare._dilation(None, "auto", 3, 2) == 3.0
    assert compare._dilation(None, "auto", 4, 4) == 1.0


def test_head_unit_variants_run_their_policy_with_head_units():
    compare = load_script("compare")
    a = compare.parse(["--scenarios", "none", "--policies", "migrate,migrate-heads,hybrid-heads"])
    assert a.policy_list[-3:] == ["migrate", "migrate-heads", "hybrid-heads"]
    assert [compare._base(p) for p in a.policy_list[-2:]] == ["migrate", "hybrid"]
    assert compare.VARIANTS["hybrid-heads"][1] == ["--het-tp-attn-granularity", "1"]


def test_data_parallel_defaults_are_what_the_layout_can_run():
    """At TP=1 a replica is one rank: no crossed TP straggler, no TP moves (the defaults
    named a scenario that exists at TP > 1 only, and policies the trainer refuses there)."""
    compare = load_script("compare")
    single = compare.parse(["--tp", "1", "--dp", "2"])
    assert [s.name for s in single.scenario_list] == ["none", "replica-3x"]
    assert single.policy_list[-1:] == ["rebatch"] and "migrate" not in single.policy_list
    both = compare.parse(["--tp", "2", "--dp", "2"])
    assert [s.name for s in both.scenario_list] == ["none", "replica-3x", "crossed-3x"]


def test_capped_variants_run_their_policy_within_the_memory_cap():
    compare = load_script("compare")
    a = compare.parse(
        ["--scenarios", "none", "--policies", "migrate-capped,hybrid-capped", "--memory-cap", "1.3"]
    )
    assert [compare._base(p) for p in a.policy_list[-2:]] == ["migrate", "hybrid"]
    assert compare._variant_flags("hybrid-capped", a) == ["--het-tp-memory-cap", "1.3"]
    assert compare._variant_flags("migrate-heads", a) == ["--het-tp-attn-granularity", "1"]
    assert compare._variant_flags("migrate", a) == []
    with pytest.raises(SystemExit):
        compare.parse(
            ["--scenarios", "none", "--policies", "migrate-capped", "--memory-cap", "0.9"]
        )
    # with pipeline stages a cap needs the moves kept to units, which compare.py sets (its own
    # flag): the trainer refused the run, after the runs before it had taken their minutes
    staged = compare.parse(
        ["--pp", "2", "--scenarios", "none", "--policies", "migrate-capped", "--memory-cap", "1.3"]
    )
    flags = compare._variant_flags("migrate-capped", staged)
    assert flags == ["--het-tp-memory-cap", "1.3", "--het-tp-pipeline-moves", "units"]
    from megatron.hetero.arguments import build_parser, validate_args

    argv = BASE.replace("--num-layers 2", "--num-layers 4").split() + flags
    argv += ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    argv += ["--het-tp-policy", "migrate", "--global-batch-size", "8"]
    validate_args(build_parser().parse_args(argv), 4, cuda_available=False)


def test_rounds_start_at_different_configurations():
    compare = load_script("compare")
    configs = list("abcdefg")
    orders = [compare.round_order(configs, r, 3) for r in range(3)]
    assert orders[0] == configs
    for order in orders:
        assert sorted(order) == configs  # every configuration once a round
    # a third of the list further each round, odd rounds reversed: each round starts with
    # another configuration, and none keeps its place in every round
    assert orders[1] == list("bagfedc") and orders[2] == list("efgabcd")
    assert len({order[0] for order in orders}) == 3
    for place in range(len(configs)):
        assert len({order[place] for order in orders}) > 1
    # and from one round to the next no configuration runs after the same one
    for one, other in zip(orders, orders[1:]):
        pairs = [{(o[i], o[i + 1]) for i in range(len(o) - 1)} for o in (one, other)]
        assert not pairs[0] & pairs[1]
    assert compare.round_order(configs, 0, 1) == configs
