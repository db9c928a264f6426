"""Heterogeneous TP layers on real gloo groups: numerics against a dense single-process
reference, equality with vanilla megatron-core, lossless migration, transactional transfers,
and checkpoints that load under any plan, TP size, or vanilla megatron-core."""

from __future__ import annotations

import json

import pytest
import torch

from tests.utils import (
    GEMM_BACKWARD,
    GQA,
    MHA,
    close,
    het_numerics,
    run_ranks,
    train,
    train_with_repartitions,
    using_group_step_adam,
)

QWEN_LIKE = (
    MHA + " --disable-bias-linear --add-qkv-bias --squared-relu --position-embedding-type rope"
    " --rotary-interleaved --rotary-seq-len-interpolation-factor 2 --use-rope-scaling"
)
CASES = {
    "tp2-mha": (MHA, 2, 2, [None, "attn=3,1;mlp=200,56", "attn=4,0;mlp=0,256"]),
    "tp4-gqa-swiglu": (
        GQA,
        4,
        4,
        [None, "attn=2,1,1,0;mlp=30,2,0,32", "attn=0,0,4,0;mlp=1,1,1,61"],
    ),
    "dp2xtp2-mha": (MHA, 4, 2, ["attn=1,3;mlp=0,256"]),
    # --qk-layernorm: replicated per-head norms whose gradients are summed over unequal heads
    "tp2-gqa-qk-layernorm": (
        GQA + " --qk-layernorm",
        2,
        2,
        [None, "attn=3,1;mlp=50,14", "attn=0,4;mlp=64,0"],
    ),
    # --qk-l2-norm: megatron-core's weightless L2Norm in the norms' place
    "tp2-gqa-qk-l2-norm": (GQA + " --qk-l2-norm", 2, 2, [None, "attn=1,3;mlp=14,50"]),
    # Qwen2's QKV-only bias, squared ReLU, interleaved and interpolated rotary with Llama 3's
    # frequency scaling
    "tp2-mha-qkv-bias-squared-relu-rope": (QWEN_LIKE, 2, 2, [None, "attn=3,1;mlp=200,56"]),
    # sequence parallelism: the sequence split stays even while the GEMM split is the plan's
    "tp4-gqa-swiglu-sp": (
        GQA + " --sequence-parallel",
        4,
        4,
        [None, "attn=2,1,1,0;mlp=30,2,0,32", "attn=0,0,4,0;mlp=1,1,1,61"],
    ),
}


@pytest.fixture(scope="module")
def references():
    """Dense single-process references: vanilla megatron-core at TP=1, same seed, same weights."""
    models = {case[0].replace(" --sequence-parallel", "") for case in CASES.values()}
    return {model: run_ranks(het_numerics, 1, model.split(), [None])[0][0] for model in models}


@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_gradients_match_dense_reference(references, case):
    model, world, tp, plans = CASES[case]
    argv = (model + f" --tensor-model-parallel-size {tp} --het-tp").split()
    results = run_ranks(het_numerics, world, argv, plans)[0]
    reference = references[model.replace(" --sequence-parallel", "")]  # TP=1: no SP
    assert len(results) == len(plans)
    for plan, result in zip(plans, results):
        assert result.pop("column_backward") == {GEMM_BACKWARD}, plan
        assert set(result) == set(reference)
        for key, want in reference.items():
            close(result[key], want, f"{case} plan {plan} {key}")


def test_model_flags_change_the_dense_reference(references):
    """With --qk-layernorm or --qk-l2-norm the reference is not plain GQA's, nor the QKV-bias,
    squared-ReLU, scaled-rope model's plain MHA's: the het-TP runs above, which match them, run
    those features too."""
    assert not torch.allclose(references[QWEN_LIKE]["losses"], references[MHA]["losses"])
    plain = references[GQA]["losses"]
    for flag in (" --qk-layernorm", " --qk-l2-norm"):
        assert not torch.allclose(references[GQA + flag]["losses"], plain), flag


def test_even_plan_reproduces_vanilla_training(tmp_path):
    """Same seed, same data: het-TP layers with Megatron's even partition give vanilla's losses
    exactly. They run vanilla's own kernels (core attention included: HetDotProductAttention),
    so a het-TP run differs from the vanilla one it is compared with only in the split."""
    argv = (
        MHA.replace("--train-iters 1", "--train-iters 10") + " --global-batch-size 8"
        " --tensor-model-parallel-size 2 --eval-iters 0 --log-interval 5"
    ).split()
    vanilla = run_ranks(train, 2, argv + ["--metrics-file", str(tmp_path / "v.jsonl")])[0]
    het = run_ranks(train, 2, argv + ["--het-tp", "--metrics-file", str(tmp_path / "h.jsonl")])[0]
    for step in range(1, 11):
        want, got = vanilla["losses"][step], het["losses"][step]
        assert got == want, f"step {step}: {got} vs {want}"
    assert (
        "het-TP plan at iteration 0 (initial): TP=2 layers 0-1: attn 2/2 mlp 128/128"
        in het["stdout"]
    )


def _migrate_argv(tp=2, iters=30):
    """AdamW with weight decay; MLP units of 4 neurons (64 per layer)."""
    return (
        MHA.replace("--train-iters 1", f"--train-iters {iters}") + " --global-batch-size 8"
        f" --weight-decay 0.1 --het-tp --het-tp-granularity 4 --tensor-model-parallel-size {tp}"
        " --eval-iters 0 --log-interval 10"
    ).split()


MIGRATE = _migrate_argv()  # TP=2 x DP=2 on 4 ranks, 30 steps


def _two_layer_plan(layer0_attn, layer0_mlp) -> str:
    """A TP=2 plan (4 attention units, 64 MLP units of 4) whose layer 1 is even."""
    return json.dumps(
        {
            "version": 1,
            "tp_size": 2,
            "attn_units": 4,
            "mlp_units": 64,
            "mlp_unit_size": 4,
            "layers": [
                {"attn": layer0_attn, "mlp": layer0_mlp},
                {"attn": [[0, 1], [2, 3]], "mlp": [list(range(0, 32)), list(range(32, 64))]},
            ],
        }
    )


SHUFFLED = _two_layer_plan([[3, 0], [1, 2]], [list(range(1, 64, 2)), list(range(0, 64, 2))])
PLANS = {7: "attn=4,0;mlp=64,0", 15: "attn=1,3;mlp=10,54", 22: SHUFFLED}
# from the even plan: layer 0's attention units change order only, its MLP units move
REORDERED = _two_layer_plan([[1, 0], [3, 2]], [list(range(0, 64, 2)), list(range(1, 64, 2))])
# One unit's payload: its parameters plus Adam's two moments, fp32 (computed from the shapes,
# independently of the implementation). attention: QKV rows 3 x 16 of 64 + their bias + 16
# output-projection columns of 64; MLP: 4 fc1 rows of 64 + their bias + 4 fc2 columns of 64.
UNIT_BYTES = {"attn": (48 * 64 + 48 + 64 * 16) * 4 * 3, "mlp": (4 * 64 + 4 + 64 * 4) * 4 * 3}


@pytest.fixture(scope="module")
def unmigrated():
    return run_ranks(train_with_repartitions, 4, MIGRATE, {})[0]


def _owners(spec_or_json):
    from hettp.plan import PartitionPlan

    plan = PartitionPlan.parse(spec_or_json, 2, 2, 4, 64, 4)
    return {
        (layer, block): plan.owner_map(layer, block)
        for layer in range(2)
        for block in ("attn", "mlp")
    }


def test_migration_is_lossless_and_moves_the_minimum(unmigrated):
    migrated = run_ranks(train_with_repartitions, 4, MIGRATE, PLANS)
    baseline = unmigrated["losses"]
    for rank, result in enumerate(migrated):
        for step in range(1, 31):
            got, want = result["losses"][step], baseline[step]
            assert abs(got - want) <= 1e-5 * abs(want), f"rank {rank} step {step}: {got} vs {want}"
    events = migrated[0]["events"]
    assert [e["iteration"] for e in events] == [7, 15, 22]
    previous = _owners("attn=2,2;mlp=32,32")
    for event in events:
        owners = _owners(PLANS[event["iteration"]])
        changed = [
            (layer, block, unit)
            for (layer, block), owner in owners.items()
            for unit, rank in owner.items()
            if previous[(layer, block)][unit] != rank
        ]
        assert sorted(m[:3] for m in event["moves"]) == sorted(changed)
        assert all(
            src == previous[(layer, b)][u] and dst == owners[(layer, b)][u]
            for layer, b, u, src, dst in event["moves"]
        )  # straight from old to new owner
        assert event["bytes"] == sum(UNIT_BYTES[block] for _, block, _ in changed)
        previous = owners
    # rank 1 gave everything away at step 7, then got units back at 15
    rank1 = migrated[1]["events"]
    assert rank1[0]["local_units"]["0.attn"] == [] and rank1[0]["local_units"]["1.mlp"] == []
    assert rank1[1]["local_units"]["0.attn"] == [1, 2, 3]
    assert rank1[2]["local_units"]["0.attn"] == [1, 2]
    assert migrated[0]["events"][2]["local_units"]["0.mlp"] == list(range(1, 64, 2))
    lines = [x for x in migrated[0]["stdout"].splitlines() if "het-TP repartition" in x]
    assert len(lines) == 3 and "via p2p" in lines[0] and f"{events[0]['bytes']} bytes" in lines[0]


def test_migration_where_some_ranks_keep_their_units():
    """TP=4: the first change moves units between ranks 0 and 3 only; ranks 1 and 2 must still
    rebuild their optimizer with the others (it runs collectives)."""
    argv = _migrate_argv(tp=4, iters=12)
    plans = {
        4: "rebalance:attn=2,1,1,0;mlp=20,16,16,12",
        8: "rebalance:attn=1,1,1,1;mlp=16,16,16,16",
    }
    plain = run_ranks(train_with_repartitions, 4, argv, {})[0]
    moved = run_ranks(train_with_repartitions, 4, argv, plans)
    assert [e["units_moved"] for e in moved[0]["events"]] == [2 * (1 + 4), 2 * (1 + 4)]
    assert moved[1]["events"][0]["local_units"]["0.attn"] == [1]  # rank 1 kept its unit
    for step in range(1, 13):
        want = plain["losses"][step]
        assert all(abs(r["losses"][step] - want) <= 1e-5 * abs(want) for r in moved), step


def test_failed_transfer_leaves_every_rank_intact(unmigrated):
    """Each stage of a move's transaction, the building of the new shards after the data has
    arrived ("commit": where a rank runs out of memory) and the rebuild of the DDP wrapper and
    the optimizer that follows the install included (the optimizer failing after its build or
    between its collectives), aborts the move on every rank, each keeping its state: weights,
    masters, moments and replica marks (the rebuild's failures put back the
    installed shards), with no buffer of the failed wrapper left alive."""
    faults = (
        {"iteration": 7, "rank": 1, "stage": "pack"},
        {"iteration": 15, "rank": 0, "stage": "verify"},
        {"iteration": 22, "rank": 1, "stage": "exchange"},
        {"iteration": 24, "rank": 0, "stage": "commit"},
        {"iteration": 25, "rank": 1, "stage": "wrapper"},
        {"iteration": 26, "rank": 0, "stage": "optimizer"},
        # between megatron-core's collectives in the optimizer build: the others, still in
        # it, learn of the failure in their next one
        {"iteration": 27, "rank": 1, "stage": "param groups"},
    )
    plans = {
        7: PLANS[7],
        15: PLANS[15],
        22: PLANS[22],
        24: PLANS[15],
        25: REORDERED,  # some blocks only change order: permuted back
        26: PLANS[7],
        27: PLANS[22],
        28: PLANS[7],
    }
    results = run_ranks(train_with_repartitions, 4, MIGRATE, plans, faults)
    # TP=2 x DP=2: a TP rank's fault fails it in both replicas, the rebuild names global ranks
    expected = (
        "unit transfer at iteration 7 aborted: TP rank(s) [1] failed",
        "unit transfer at iteration 15 aborted: TP rank(s) [0] failed",
        "unit transfer at iteration 22 aborted: TP rank(s) [1] failed",
        "unit transfer at iteration 24 aborted: TP rank(s) [0] failed",
        "rebuild of the DDP wrapper at iteration 25 aborted: rank(s) [1, 3] failed",
        "rebuild of the optimizer at iteration 26 aborted: rank(s) [0, 2] failed",
        "rebuild of the optimizer at iteration 27 aborted: rank(s) [1, 3] failed",
    )
    for rank, result in enumerate(results):
        failed = [e for e in result["events"] if "error" in e]
        assert [e["iteration"] for e in failed] == [7, 15, 22, 24, 25, 26, 27]
        for event, message in zip(failed, expected):
            assert event["unchanged"] and event["plan_kept"], event
            assert event["stray_buffers"] == 0, event
            assert message in event["error"], event["error"]
        # training went on, then a later re-partition still worked
        assert [e["iteration"] for e in result["events"] if "error" not in e] == [28]
        # one backward hook a parameter, after the rebuilds that failed and the one that did not
        hooks = [e["post_hooks"] for e in result["events"]]
        assert all(h == {"others": 0, "one_each": True} for h in hooks), hooks
        for step in range(1, 31):
            got, want = result["losses"][step], unmigrated["losses"][step]
            assert abs(got - want) <= 1e-5 * abs(want), f"rank {rank} step {step}"


# GQA + SwiGLU + biases: exercises the gate/up halves and per-group QKV rows in checkpoints
CKPT = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention "
    "--num-query-groups 2 --swiglu --ffn-hidden-size 128 --seq-length 32 --micro-batch-size 2 "
    "--global-batch-size 8 --mock-data --vocab-size 255 --make-vocab-size-divisible-by 64 "
    "--hidden-dropout 0 --attention-dropout 0 --lr 1e-3 --weight-decay 0.1 --train-iters 10 "
    "--eval-iters 0 --log-interval 5"
).split()


@pytest.mark.parametrize(
    "world,flags",
    [
        (2, "--tensor-model-parallel-size 2 --het-tp-plan attn=0,2;mlp=100,28"),
        (1, "--het-tp"),
        (1, ""),
        (2, "--tensor-model-parallel-size 2"),
    ],
    ids=["other-plan", "het-tp1", "vanilla-tp1", "vanilla-tp2"],
)
def test_checkpoint_loads_under_another_plan_tp_size_and_vanilla(tmp_path_factory, world, flags):
    saved = _saved_under_plan_a(tmp_path_factory)
    resumed = run_ranks(
        train,
        world,
        CKPT
        + flags.split()
        + ["--load", saved["dir"], "--metrics-file", str(tmp_path_factory.mktemp("m") / "m.jsonl")],
    )[0]
    assert sorted(resumed["losses"]) == [6, 7, 8, 9, 10]
    for step in range(6, 11):
        got, want = resumed["losses"][step], saved["losses"][step]
        assert abs(got - want) <= 1e-5 * abs(want), f"step {step}: {got} vs {want}"


_SAVED = {}


def _saved_under_plan_a(tmp_path_factory):
    """Plan A: TP=2, rank 0 holds both query groups and most MLP units; saved at step 5."""
    if not _SAVED:
        root = tmp_path_factory.mktemp("plan_a")
        result = run_ranks(
            train,
            2,
            CKPT
            + [
                "--tensor-model-parallel-size",
                "2",
                "--het-tp-plan",
                "attn=2,0;mlp=120,8",
                "--save",
                str(root / "ckpt"),
                "--save-interval",
                "5",
            ],
        )[0]
        only5 = root / "only5"
        only5.mkdir()
        (only5 / "iter_0000005").symlink_to(root / "ckpt" / "iter_0000005")
        (only5 / "latest_checkpointed_iteration.txt").write_text("5")
        _SAVED.update(dir=str(only5), losses=result["losses"])
    return _SAVED


def test_bf16_migration_carries_fp32_master_weights():
    """--bf16 (fp32 master weights in the optimizer): moving units away and back at one step
    boundary must restore the exact training state, so the run matches one that never moved;
    a run that stays on an uneven plan differs only by bf16 rounding of the partial sums."""
    argv = _migrate_argv(iters=10) + ["--bf16"]
    uneven = "attn=3,1;mlp=50,14"
    plain = run_ranks(train_with_repartitions, 4, argv, {})[0]
    there_and_back = run_ranks(
        train_with_repartitions,
        4,
        argv,
        {3: [uneven, "attn=2,2;mlp=32,32"], 6: ["attn=4,0;mlp=64,0", "attn=2,2;mlp=32,32"]},
    )
    stays = run_ranks(train_with_repartitions, 4, argv, {3: uneven})[0]
    assert [e["iteration"] for e in there_and_back[0]["events"]] == [3, 3, 6, 6]
    assert [e["iteration"] for e in stays["events"]] == [3]  # it did move, and stayed
    for result in there_and_back:
        assert result["losses"] == plain["losses"]
        # one backward hook a parameter after four rebuilds (fp32 masters: no view of a
        # parameter holds its gradient accumulator)
        hooks = [e["post_hooks"] for e in result["events"]]
        assert all(h == {"others": 0, "one_each": True} for h in hooks), hooks
    assert plain["losses"][10] < plain["losses"][1] - 0.05
    # bf16 rounding of the partial sums: 2.6e-5 relative at most, measured; one step's
    # training moves the loss by 0.3%, which 1e-3 still catches
    for step in range(1, 11):
        want = plain["losses"][step]
        assert abs(stays["losses"][step] - want) <= 1e-3 * abs(want), step


def test_bf16_checkpoint_resumes_exactly_and_loads_into_vanilla(tmp_path):
    """Mixed precision: the fp32 masters and moments go through the same per-unit pieces."""
    argv = CKPT + ["--bf16"]
    full = run_ranks(
        train,
        2,
        argv
        + [
            "--tensor-model-parallel-size",
            "2",
            "--het-tp-plan",
            "attn=2,0;mlp=120,8",
            "--save",
            str(tmp_path / "ckpt"),
            "--exit-interval",
            "5",
        ],
    )[0]
    assert sorted(full["losses"]) == [1, 2, 3, 4, 5]
    straight = run_ranks(
        train,
        2,
        argv + ["--tensor-model-parallel-size", "2", "--het-tp-plan", "attn=2,0;mlp=120,8"],
    )[0]
    same_plan = run_ranks(
        train,
        2,
        argv
        + [
            "--tensor-model-parallel-size",
            "2",
            "--het-tp-plan",
            "attn=2,0;mlp=120,8",
            "--load",
            str(tmp_path / "ckpt"),
        ],
    )[0]
    vanilla = run_ranks(train, 1, argv + ["--load", str(tmp_path / "ckpt")])[0]
    # both resumed at step 6 (a load that started over would give the same losses here)
    assert sorted(same_plan["losses"]) == sorted(vanilla["losses"]) == [6, 7, 8, 9, 10]
    for step in range(6, 11):
        want = straight["losses"][step]
        assert same_plan["losses"][step] == want, step
        # vanilla's own bf16 GEMMs: 1.2e-5 relative at most, measured; a step moves it 0.3%
        assert abs(vanilla["losses"][step] - want) <= 1e-3 * abs(want), step


def test_core_attention_refuses_a_per_head_softmax_offset():
    """megatron-core keeps a learnable or off-by-one softmax offset per head of an even split:
    refused at build, naming the flag, rather than mis-sized under a het plan."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from megatron.hetero.layers import HetDotProductAttention

    for softmax in ("learnable", "off-by-one"):
        config = TransformerConfig(
            num_layers=1, hidden_size=64, num_attention_heads=4, softmax_type=softmax
        )
        with pytest.raises(NotImplementedError, match=f"--softmax-type {softmax}"):
            HetDotProductAttention(config, 1, AttnMaskType.causal, "self")


def test_a_fused_adam_s_group_step_count_survives_a_migration_and_a_resume(tmp_path):
    """Transformer Engine's and apex's FusedAdam (megatron-core's choice wherever one is
    installed) count steps per parameter group: a rebuilt optimizer, after a migration or under
    the distributed optimizer after a load, must not restart Adam's bias correction on warm
    moments. tests/utils/fused_adam.py stands in for FusedAdam here."""
    argv = _migrate_argv(iters=8) + ["--use-distributed-optimizer"]
    plain = run_ranks(using_group_step_adam, 2, train_with_repartitions, argv, {})[0]
    ckpt = str(tmp_path / "ckpt")
    moved = run_ranks(
        using_group_step_adam,
        2,
        train_with_repartitions,
        argv + ["--save", ckpt, "--exit-interval", "5"],
        {3: "attn=3,1;mlp=48,16"},
    )[0]
    assert [e["iteration"] for e in moved["events"]] == [3]
    _same_losses(moved["losses"], plain["losses"], range(1, 6))
    resumed = run_ranks(using_group_step_adam, 2, train, argv + ["--load", ckpt])[0]
    assert sorted(resumed["losses"]) == [6, 7, 8]  # resumed, not started over
    _same_losses(resumed["losses"], plain["losses"], range(6, 9))


def _same_losses(got: dict, want: dict, steps) -> None:
    for step in steps:
        assert abs(got[step] - want[step]) <= 1e-5 * abs(want[step]), (step, got, want)
