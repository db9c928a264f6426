"""Pipeline parallelism on real gloo ranks: megatron-core's 1F1B schedule over 2 or 3 stages, with
vanilla layers and with het-TP layers inside the stages at TP=2 (uneven plans, migrations at
step boundaries, a failed one), continues a single-stage checkpoint on the single-stage
run's losses; two-stage checkpoints load back into one stage, het-TP's in its plan."""

from __future__ import annotations

import shutil

import pytest

from tests.utils import (
    MHA,
    run_ranks,
    train,
    train_with_control,
    train_with_layer_moves,
    train_with_repartitions,
)

# 4 layers (2 per stage), tied embeddings (their gradients meet across the first and last
# stage), dropout 0, a fixed decay length so every run shares the schedule
MODEL = (
    MHA.replace("--num-layers 2", "--num-layers 4").replace("--train-iters 1", "")
    + " --global-batch-size 8 --eval-iters 0 --log-interval 1 --lr-decay-iters 8"
)
TP2_PP2 = "--pipeline-model-parallel-size 2 --tensor-model-parallel-size 2"


def _layered_plan(path) -> str:
    """A whole-model plan whose layers differ (rank 1 holds 1, 2, 3, 3 query groups)."""
    from hettp.plan import PartitionPlan

    counts = [((3, 1), (200, 56)), ((2, 2), (160, 96)), ((1, 3), (60, 196)), ((1, 3), (100, 156))]
    plan = PartitionPlan.joined(
        [PartitionPlan.from_counts(2, 1, 4, 256, attn, mlp) for attn, mlp in counts]
    )
    path.write_text(plan.to_json())
    return str(path)


def _argv(extra: str) -> list[str]:
    return (MODEL + " " + extra).split()


def _run(ranks: int, extra: str) -> dict:
    return run_ranks(train, ranks, _argv(extra))[0]["losses"]


def _close(got: dict, want: dict, iterations) -> None:
    for it in iterations:
        assert got[it] == pytest.approx(want[it], rel=1e-5), (it, got, want)


@pytest.fixture(scope="module")
def single_stage(tmp_path_factory):
    """One rank, one stage: 2 iterations saved, then the run continued to 8 (the reference)."""
    root = tmp_path_factory.mktemp("pipeline")
    _run(1, f"--train-iters 2 --save {root / 'start'}")
    shutil.copytree(root / "start", root / "reference")
    return root, _run(1, f"--train-iters 8 --load {root / 'reference'}")


def _from_start(root, name):
    shutil.copytree(root / "start", root / name)
    return root / name


@pytest.mark.parametrize(
    "ranks, layout",
    [
        (2, "--pipeline-model-parallel-size 2"),
        # a middle stage (neither embedding nor loss): layers 2 + 1 + 1
        (3, "--pipeline-model-parallel-size 3 --decoder-first-pipeline-num-layers 2"),
        (4, TP2_PP2 + " --het-tp --het-tp-plan attn=3,1;mlp=160,96"),
        # 1 layer in the first stage, 3 in the last; the plan's layers 1-3 go to the last
        (4, TP2_PP2 + " --decoder-first-pipeline-num-layers 1 --het-tp --het-tp-plan {layered}"),
        # sequence-parallel activations between stages, the distributed optimizer, evaluation
        (
            4,
            TP2_PP2 + " --het-tp --sequence-parallel --use-distributed-optimizer "
            "--eval-iters 1 --eval-interval 3",
        ),
    ],
    ids=[
        "tp1-pp2",
        "tp1-pp3",
        "tp2-pp2-het-uneven",
        "tp2-pp2-1+3-layers-het",
        "tp2-pp2-het-all",
    ],
)
def test_pipeline_stages_continue_a_single_stage_checkpoint_on_its_losses(
    single_stage, ranks, layout
):
    root, reference = single_stage
    load = _from_start(root, f"{ranks}-{len(layout)}")
    layout = layout.format(layered=_layered_plan(root / "layered.json"))
    result = run_ranks(train, ranks, _argv(f"--train-iters 6 --load {load} {layout}"))[0]
    losses = result["losses"]
    stages = layout.split("--pipeline-model-parallel-size ")[1].split()[0]
    assert f"pipeline-model-parallel size {stages}" in result["stdout"]  # it ran in stages
    assert sorted(losses) == [3, 4, 5, 6]
    _close(losses, reference, range(3, 7))
    if "--het-tp-plan" in layout:  # each stage took its layers: joined, they are the plan
        from hettp.plan import PartitionPlan

        given = PartitionPlan.parse(layout.split("--het-tp-plan ")[1].split()[0], 2, 4, 4, 256, 1)
        assert f"het-TP plan at iteration 2 (initial): {given.summary()}" in result["stdout"]


def test_a_two_stage_checkpoint_loads_into_one_stage(single_stage):
    root, reference = single_stage
    two = _from_start(root, "two")
    _run(2, f"--train-iters 4 --load {two} --save {two} --pipeline-model-parallel-size 2")
    back = _run(1, f"--train-iters 6 --load {two}")  # saved at 4 by the 2 stages
    assert sorted(back) == [5, 6]
    _close(back, reference, (5, 6))


def _whole(*layers) -> str:
    """A whole-model plan (JSON) from per-layer ((attn counts), (mlp counts))."""
    from hettp.plan import PartitionPlan

    return PartitionPlan.joined(
        [PartitionPlan.from_counts(2, 1, 4, 256, attn, mlp) for attn, mlp in layers]
    ).to_json()


EVEN, MOVED, OTHER = ((2, 2), (128, 128)), ((1, 3), (40, 216)), ((3, 1), (200, 56))


def test_migrations_inside_stages_are_lossless_and_their_checkpoint_loads_anywhere(single_stage):
    """At 4 only the first stage's layers move, at 5 only the last stage's; at 6 a move fails
    on a TP rank of the first stage only, and every rank keeps its state (building optimizers
    runs collectives over the whole job, so all stages commit or none). Saved at 6 in the
    moved plan, the checkpoint continues in one vanilla stage and in het-TP's two stages."""
    root, reference = single_stage
    moved = _from_start(root, "moved")
    argv = _argv(f"--train-iters 6 --load {moved} --save {moved} {TP2_PP2} --het-tp")
    plans = {4: _whole(MOVED, MOVED, EVEN, EVEN), 5: _whole(MOVED, MOVED, OTHER, OTHER)}
    plans[6] = _whole(EVEN, EVEN, OTHER, OTHER)
    faults = ({"iteration": 6, "rank": 1, "stage": "pack", "pipeline_stage": 0},)
    ranks = run_ranks(train_with_repartitions, 4, argv, plans, faults)
    for rank, result in enumerate(ranks):  # ranks 0-1: the first stage, 2-3: the last
        moves = [e for e in result["events"] if "error" not in e]
        assert [e["units_moved"] for e in moves] == (
            [2 + 88 * 2, 0] if rank < 2 else [0, 2 + 72 * 2]
        )
        assert [e["plan"] for e in moves] == [plans[4], plans[5]]
        failed = [e for e in result["events"] if "error" in e]
        assert [e["iteration"] for e in failed] == [6], result["events"]
        assert failed[0]["unchanged"] and failed[0]["plan_kept"]
        assert "aborted: TP rank(s) [1] failed" in failed[0]["error"]
        _close(result["losses"], reference, range(3, 7))
    shutil.copytree(moved, root / "moved-vanilla")
    vanilla = _run(1, f"--train-iters 8 --load {root / 'moved-vanilla'}")
    assert sorted(vanilla) == [7, 8]  # resumed (a start over would match the reference too)
    _close(vanilla, reference, (7, 8))
    het = run_ranks(train, 4, _argv(f"--train-iters 8 --load {moved} {TP2_PP2} --het-tp"))[0]
    assert (
        "het-TP plan at iteration 6 (resumed from the checkpoint): TP=2 layers 0-1: attn 1/3 "
        "mlp 40/216; layers 2-3: attn 3/1 mlp 200/56"
    ) in het["stdout"]
    _close(het["losses"], reference, (7, 8))


def test_layer_moves_between_stages_are_lossless_and_their_checkpoint_loads_anywhere(
    single_stage, tmp_path
):
    """Whole layers move between the two stages of TP=2 x PP=2 with uneven unit plans: at 3
    layer 1 goes to the last stage (1/3), at 4 layers 1 and 2 go to the first (3/1); at 5 a
    move fails on one rank while it packs, at 6 on a sender after the transfer (which its
    receivers completed), and every rank keeps its state. The losses stay on
    the single-stage run's; saved at 6 in the 3/1 split, the checkpoint continues in one
    vanilla stage, in two vanilla stages (2/2) and in het-TP's two stages (3/1 again)."""
    root, reference = single_stage
    moved = _from_start(root, "layers")
    plan = _layered_plan(tmp_path / "plan.json")
    argv = _argv(f"--train-iters 6 --load {moved} --save {moved} {TP2_PP2} --het-tp-plan {plan}")
    faults = (
        {"iteration": 5, "global_rank": 2, "stage": "built"},
        {"iteration": 6, "global_rank": 1, "stage": "exchanged"},
    )
    moves = {3: (1, 3), 4: (3, 1), 5: (2, 2), 6: (2, 2)}
    ranks = run_ranks(train_with_layer_moves, 4, argv, moves, faults)
    layers = {3: ([1], [2, 3, 4]), 4: ([1, 2, 3], [4]), 5: ([1, 2, 3], [4]), 6: ([1, 2, 3], [4])}
    for rank, result in enumerate(ranks):  # ranks 0-1: the first stage, 2-3: the last
        stage = rank // 2
        for it, numbers in layers.items():
            assert result["seen"][it][0] == numbers[stage], (rank, it, result["seen"])
            split = (1, 3) if it == 3 else (3, 1)  # the failed move's rank put its split back
            assert tuple(result["seen"][it][2]) == split, (rank, it)
        sent = {e["iteration"]: e.get("sent") for e in result["events"]}
        assert sent[3] == ((1,) if stage == 0 else ())
        assert sent[4] == (() if stage == 0 else (1, 2))
        failed, late = result["events"][-2:]
        assert "aborted before any transfer" in failed["error"] and failed["kept"], failed
        assert "aborted in the transfer, nothing changed" in late["error"] and late["kept"], late
        _close(result["losses"], reference, range(3, 7))
    # the moved layers kept their units: the last stage's plan at 3 holds layers 1-3's
    from hettp.plan import PartitionPlan

    whole = PartitionPlan.from_json(open(plan).read())
    assert PartitionPlan.from_json(ranks[2]["seen"][3][1]) == whole.stage(1, 3)
    assert PartitionPlan.from_json(ranks[0]["seen"][4][1]) == whole.stage(0, 3)
    assert (
        "het-TP layer move at iteration 4: layers per stage 1/3 -> 3/1 (asked)"
        in (ranks[0]["stdout"])
    )
    for name, ranks_, extra in (
        ("one-vanilla", 1, ""),
        ("two-vanilla", 2, "--pipeline-model-parallel-size 2"),
    ):
        shutil.copytree(moved, root / name)
        resumed = _run(ranks_, f"--train-iters 8 --load {root / name} {extra}")
        assert sorted(resumed) == [7, 8], name  # resumed, not started over
        _close(resumed, reference, (7, 8))
    het = run_ranks(
        train_with_layer_moves, 4, _argv(f"--train-iters 8 --load {moved} {TP2_PP2} --het-tp"), {}
    )
    assert [r["seen"][7][0] for r in het] == [[1, 2, 3], [1, 2, 3], [4], [4]]
    assert (
        "het-TP layers per pipeline stage at iteration 6 (resumed from the checkpoint, not the "
        "flags' split): 3/1"
    ) in het[0]["stdout"]
    _close(het[0]["losses"], reference, (7, 8))


def test_layer_moves_with_data_parallel_replicas_and_the_distributed_optimizer(single_stage):
    """TP=1 x PP=2 x DP=2 under --use-distributed-optimizer: each replica's stages move their
    layers (1/3, then 3/1), whole masters and moments gathered over DP and scattered into the
    rebuilt optimizer's ranges; the losses stay on the single-stage run's. At 5 a move fails
    to build its optimizer on one rank after the layers were exchanged and installed: every
    rank puts back its layers, split, wrapper and optimizer."""
    root, reference = single_stage
    moved = _from_start(root, "layers-dp")
    argv = _argv(
        f"--train-iters 8 --load {moved} --pipeline-model-parallel-size 2 --het-tp "
        "--use-distributed-optimizer"
    )
    fault = {"iteration": 5, "global_rank": 1, "stage": "optimizer"}
    ranks = run_ranks(train_with_layer_moves, 4, argv, {3: (1, 3), 4: (3, 1), 5: (2, 2)}, (fault,))
    for rank, result in enumerate(ranks):  # pipeline stage = rank // 2 (TP 1, DP 2 inner)
        assert [e["iteration"] for e in result["events"]] == [3, 4, 5]
        assert result["seen"][3][0] == ([1] if rank < 2 else [2, 3, 4])
        assert result["seen"][4][0] == ([1, 2, 3] if rank < 2 else [4])
        failed = result["events"][2]
        assert "rebuild of the optimizer aborted: rank(s) [1] failed" in failed["error"]
        assert failed["kept"] and failed["stray_buffers"] == 0
        assert result["seen"][5][0] == result["seen"][4][0]
        assert tuple(result["seen"][5][2]) == (3, 1)
        _close(result["losses"], reference, range(3, 9))  # 6-8 trained after the failure


# Timing wants the sharded GEMMs to dominate their linears' per-call costs (test_control.py)
TIMED = (
    MHA.replace("--num-layers 2", "--num-layers 4")
    .replace("--train-iters 1", "--train-iters 14")
    .replace("--hidden-size 64", "--hidden-size 256")
    .replace("--seq-length 32", "--seq-length 128")
    .replace("--micro-batch-size 2", "--micro-batch-size 4")
    + " --global-batch-size 8 --eval-iters 0 --log-interval 1 --het-tp-interval 4"
    " --het-tp-onset 1.5"
)


def test_a_straggler_in_one_stage_is_acted_on_by_that_stage_only(tmp_path, steady_timed):
    """Global rank 3 (TP rank 1 of the last stage) is 3x slow from step 6: the last stage's TP
    group detects it and moves units off it; the first stage, whose TP rank 1 is not slow, keeps
    its split. Every rank applies the move at the same step boundary, and the losses are those
    of the same run without a straggler, in which nothing moves. Layers stay in their stages
    (--het-tp-pipeline-moves units: with layer moves, one follows, as the slow stage is still
    slower after its units moved)."""
    from hettp.metrics import read_metrics
    from hettp.plan import PartitionPlan

    metrics = tmp_path / "control.jsonl"
    argv = (
        TIMED + f" {TP2_PP2} --het-tp-policy migrate --metrics-file {metrics}"
        " --het-tp-emulate persistent:global=3,factor=3,start=6 --het-tp-pipeline-moves units"
    ).split()
    ranks = run_ranks(train_with_control, 4, argv)
    records = list(read_metrics(str(metrics)))
    decisions = [r for r in records if r["kind"] == "decision"]
    assert decisions and all(d["stage"] == 1 for d in decisions), decisions
    first = decisions[0]
    assert first["action"] == "migrate" and "ranks [1]" in first["reason"]
    assert 7 <= first["iteration"] <= 9 and first["units_moved"] > 0
    assert "het-TP decision at iteration" in ranks[0]["stdout"]  # printed on stage 0's rank 0
    # the whole-model plan after the move: the first stage's layers even, the last stage's
    # lighter on TP rank 1
    moved = [r for r in records if r["kind"] == "repartition"]
    assert [r["iteration"] for r in moved] == [d["iteration"] for d in decisions]
    plan = PartitionPlan.from_json(moved[0]["plan"])
    for layer in (0, 1):
        assert plan.counts(layer, "mlp") == (512, 512), plan.summary()
    for layer in (2, 3):
        assert plan.counts(layer, "mlp")[1] < plan.counts(layer, "mlp")[0], plan.summary()
    # each stage's group reported, marked with its stage; stage 0 never saw a straggler
    timing = [r for r in records if r["kind"] == "timing"]
    assert {r["stage"] for r in timing} == {0, 1}
    assert max(max(r["slowdown"]) for r in timing if r["stage"] == 0) < 1.5
    assert max(r["slowdown"][1] for r in timing if r["stage"] == 1) > 2
    # the two ranks of each stage changed plans at the same boundaries; stage 0 never did
    assert ranks[0]["seen"] == ranks[1]["seen"] and ranks[2]["seen"] == ranks[3]["seen"]
    assert len({seen[0] for seen in ranks[0]["seen"].values()}) == 1
    changed = [
        i for i in sorted(ranks[2]["seen"]) if ranks[2]["seen"][i][0] != ranks[2]["seen"][1][0]
    ]
    assert changed and changed[0] == first["iteration"]
    _close(ranks[0]["losses"], steady_timed, range(1, 15))


@pytest.fixture(scope="module")
def steady_timed(tmp_path_factory):
    """The timed model's losses under the migrate policy without a straggler (nothing moves)."""
    from hettp.metrics import read_metrics

    steady = tmp_path_factory.mktemp("steady") / "steady.jsonl"
    argv = f"{TIMED} {TP2_PP2} --het-tp-policy migrate --metrics-file {steady}".split()
    reference = run_ranks(train, 4, argv)[0]["losses"]
    kinds = {r["kind"] for r in read_metrics(str(steady))}
    assert "decision" not in kinds and "layers" not in kinds, kinds
    return reference


@pytest.mark.parametrize(
    "straggler, moves",
    [("stage=1", "both"), ("global=3", "layers")],
    ids=["whole-stage-slow", "one-rank-slow-layers-only"],
)
def test_a_slow_stage_gives_a_layer_to_its_neighbour(tmp_path, steady_timed, straggler, moves):
    """The last stage 3x slow from step 4 (both its ranks, or its TP rank 1 with unit moves
    ruled out): at a report of both stages the planner moves layer 2 to the first stage (2/2 ->
    3/1, which balances 1.5 s against 1.5 s per 4 layers' time), every rank at the same
    boundary; no TP units move, and the losses are the steady run's."""
    from hettp.metrics import read_metrics

    metrics = tmp_path / "layers.jsonl"
    argv = (
        TIMED + f" {TP2_PP2} --het-tp-policy migrate --metrics-file {metrics}"
        f" --het-tp-emulate persistent:{straggler},factor=3,start=4"
        f" --het-tp-pipeline-moves {moves}"
    ).split()
    ranks = run_ranks(train_with_layer_moves, 4, argv, {})
    records = list(read_metrics(str(metrics)))
    moved = [r for r in records if r["kind"] == "layers"]
    assert len(moved) == 1, moved
    assert (moved[0]["before"], moved[0]["after"], moved[0]["layers_moved"]) == (
        [2, 2],
        [3, 1],
        [2],
    )
    at = moved[0]["iteration"]
    assert 5 <= at <= 12
    slow, fast = moved[0]["stage_seconds"][1], moved[0]["stage_seconds"][0]
    assert slow > 1.5 * fast  # measured: the last stage's layer compute
    assert not [r for r in records if r["kind"] in ("decision", "repartition")]
    assert f"het-TP layer move at iteration {at}: layers per stage 2/2 -> 3/1" in ranks[0]["stdout"]
    for rank, result in enumerate(ranks):
        numbers = result["seen"][at][0]
        assert numbers == ([1, 2, 3] if rank < 2 else [4]), (rank, result["seen"])
        assert result["seen"][at - 1][0] == ([1, 2] if rank < 2 else [3, 4])
    _close(ranks[0]["losses"], steady_timed, range(1, 15))


def test_with_both_kinds_of_moves_a_stage_moves_its_units_first(tmp_path, steady_timed):
    """One rank of the last stage 3x slow from the start, units and layers allowed (the
    default): the report at 4 already shows the stage slower, but its TP ranks uneven, so no
    layer moves until the stage's units have moved (without the rule, layers moved at 4 and
    units at 7) (a layer move first would act on a pace the unit move
    then changes); losses equal the steady run's."""
    from hettp.metrics import read_metrics

    metrics = tmp_path / "both.jsonl"
    argv = (
        TIMED + f" {TP2_PP2} --het-tp-policy migrate --metrics-file {metrics}"
        " --het-tp-emulate persistent:global=3,factor=3,start=1"
    ).split()
    ranks = run_ranks(train_with_layer_moves, 4, argv, {})
    records = list(read_metrics(str(metrics)))
    decisions = [r for r in records if r["kind"] == "decision"]
    assert decisions and decisions[0]["action"] == "migrate" and decisions[0]["stage"] == 1
    layer_moves = [r["iteration"] for r in records if r["kind"] == "layers"]
    assert all(at > decisions[0]["iteration"] for at in layer_moves), (layer_moves, decisions)
    _close(ranks[0]["losses"], steady_timed, range(1, 15))


def test_a_straggler_in_one_stage_is_resized_in_that_stage_only(tmp_path):
    """--het-tp-policy resize at TP=2 x PP=2, global rank 3 3x slow from step 6: the last
    stage's TP group skips units of its TP rank 1, the first stage's ranks keep all theirs.
    The checkpoint holds each stage's shares, and a resumed run takes them up per stage."""
    from megatron.core import dist_checkpointing

    from hettp.metrics import read_metrics
    from megatron.hetero.runtime import SavedPlan

    metrics, save = tmp_path / "resize.jsonl", tmp_path / "ckpt"
    argv = (
        TIMED + f" {TP2_PP2} --het-tp-policy resize --metrics-file {metrics} --save {save}"
        " --het-tp-emulate persistent:global=3,factor=3,start=6"
    ).split()
    ranks = run_ranks(train_with_control, 4, argv)
    decisions = [r for r in read_metrics(str(metrics)) if r["kind"] == "decision"]
    assert decisions and {(d["stage"], d["action"]) for d in decisions} == {(1, "resize")}
    last = max(ranks[0]["seen"])
    assert [r["seen"][last][1] for r in ranks[:2]] == [(0.0, 0.0)] * 2
    shares = ranks[2]["seen"][last][1]
    assert shares[0] == 0.0 and shares[1] > 0 and ranks[3]["seen"][last][1] == shares
    common = dist_checkpointing.load_common_state_dict(str(save / f"iter_{last:07d}"))
    saved = SavedPlan.from_dict(common["het_tp_plan"])
    assert saved.stage_shares == ((0.0, 0.0), shares) and saved.shares == (0.0, 0.0)
    argv = (
        TIMED.replace("--train-iters 14", f"--train-iters {last + 2}")
        + f" {TP2_PP2} --het-tp-policy resize --load {save} --use-checkpoint-opt_param-scheduler"
    ).split()
    resumed = run_ranks(train_with_control, 4, argv)
    assert [r["seen"][last + 1][1] for r in resumed] == [(0.0, 0.0)] * 2 + [shares] * 2


def test_layer_moves_under_resizing_policies_are_refused_by_name():
    from megatron.hetero.arguments import ArgumentError, build_parser, validate_args

    args = build_parser().parse_args(
        _argv(
            f"--train-iters 6 {TP2_PP2} --het-tp --het-tp-policy hybrid "
            "--het-tp-pipeline-moves layers"
        )
    )
    with pytest.raises(
        ArgumentError, match="layers: --het-tp-policy hybrid resizes, and layers stay"
    ):
        validate_args(args, 4, cuda_available=False)


def test_a_stage_s_pace_is_its_slowest_rank_s_layers_and_what_stays_with_the_stage():
    """What the layer balancer weighs (hettp.stages.balance_layers): the rank with the most
    layer compute (its compute past the optimizer's fixed part), and the least busy time past
    the timed compute of the stage's ranks (the embedding, output layer and loss: the same on
    each, and they stay whatever layers move). One rank's rest once read 0.143 s beside its
    peer's 0.033 (a spell of its own, in a local full-suite run) and moved a layer a report
    early."""
    from hettp.loop import TimingReport
    from megatron.hetero.runtime import _stage_pace

    report = TimingReport(
        iteration=8,
        compute=(1.0, 1.6),
        work=(1.0, 1.0),
        step=2.5,
        fixed=(0.2, 0.2),
        busy=(2.0, 2.1),
    )
    pace = _stage_pace(report)
    assert pace.layers == pytest.approx(1.4) and pace.rest == pytest.approx(0.5)
    spell = TimingReport(
        iteration=4,
        compute=(0.133, 0.118),
        work=(1.0, 1.0),
        step=0.44,
        fixed=(0.009, 0.008),
        busy=(0.276, 0.151),
    )
    assert _stage_pace(spell).rest == pytest.approx(0.033)
    unknown = TimingReport(iteration=8, compute=(1.0, 1.6), work=(1.0, 1.0), step=2.5)
    assert _stage_pace(unknown).layers == pytest.approx(1.6) and _stage_pace(unknown).rest == 0
