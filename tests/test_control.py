"""The control loop end to end on real gloo ranks: emulated straggler, detection from measured
compute times, one decision broadcast and applied by every rank at the same step."""

from __future__ import annotations

import pytest

from hettp.metrics import read_metrics
from hettp.plan import PartitionPlan
from tests.distributed import run_ranks
from tests.test_het_tp import MHA
from tests.workers import train_with_control

# Timing needs the sharded GEMMs to dominate their linears' call overheads: hidden 256.
TRAIN = (MHA.replace("--train-iters 1", "--train-iters 40").replace("--hidden-size 64",
                                                                    "--hidden-size 256") +
         " --global-batch-size 4 --tensor-model-parallel-size 2 --het-tp-interval 5").split()
STRAGGLER = ["--het-tp-emulate", "persistent:rank=1,factor=2,start=20"]


def _run(tmp_path, name, extra):
    metrics = str(tmp_path / f"{name}.jsonl")
    ranks = run_ranks(train_with_control, 2, TRAIN + extra + ["--metrics-file", metrics])
    return ranks, list(read_metrics(metrics))


@pytest.fixture(scope="module")
def steady(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("steady"), "steady", ["--het-tp-policy", "migrate"])


def test_migrate_acts_on_an_emulated_straggler_and_stays_lossless(tmp_path, steady):
    ranks, records = _run(tmp_path, "migrate", ["--het-tp-policy", "migrate", *STRAGGLER])
    decisions = [r for r in records if r["kind"] == "decision"]
    assert len(decisions) == 1, decisions
    first = decisions[0]
    # the straggle starts at 20; reports come every 5 steps: acted on within interval + 2
    assert first["action"] == "migrate" and 20 < first["iteration"] <= 27
    assert first["slowdown"][1] > 1.5 and first["predicted_after_s"] < first["predicted_before_s"]
    plan = PartitionPlan.from_json(first["plan"])
    assert plan.counts(0, "mlp")[1] < plan.counts(0, "mlp")[0]
    # every rank applied the same decision at the same step boundary
    assert ranks[0]["seen"] == ranks[1]["seen"]
    changed = [i for i in sorted(ranks[0]["seen"]) if i > 1 and
               ranks[0]["seen"][i][0] != ranks[0]["seen"][i - 1][0]]
    assert changed == [first["iteration"]]
    assert "het-TP decision at iteration" in ranks[0]["stdout"]
    # lossless: the loss sequence of the run without a straggler
    want = steady[0][0]["losses"]
    for i, loss in ranks[0]["losses"].items():
        assert loss == pytest.approx(want[i], rel=1e-5), i
    # the timing reports saw rank 1 slow after the onset only
    timing = {r["iteration"]: r["slowdown"] for r in records if r["kind"] == "timing"}
    assert max(timing[i][1] for i in (5, 10, 15)) < 1.3 and timing[25][1] > 1.5


def test_a_steady_cluster_sees_no_decision(steady):
    ranks, records = steady
    assert not [r for r in records if r["kind"] == "decision"]
    assert len([r for r in records if r["kind"] == "timing"]) == 8


def test_hybrid_resizes_at_once_then_migrates(tmp_path):
    ranks, records = _run(tmp_path, "hybrid", ["--het-tp-policy", "hybrid", *STRAGGLER])
    actions = [(r["iteration"], r["action"]) for r in records if r["kind"] == "decision"]
    assert actions and actions[0][1] == "hybrid-resize" and 20 < actions[0][0] <= 27
    assert ranks[1]["seen"][actions[0][0]][1][1] > 0  # rank 1 resized from that step
    assert "hybrid-migrate" in [a for _, a in actions]
    migrated = next(i for i, a in actions if a == "hybrid-migrate")
    assert ranks[1]["seen"][migrated][1] == (0.0, 0.0)  # the move undid the resize
    assert ranks[0]["seen"] == ranks[1]["seen"]
