"""Query heads as attention units (--het-tp-attn-granularity), on real gloo groups.

Models with one query group per TP rank: a plan may split a group's heads over ranks, which
then hold its K and V as replicas. Numerics against vanilla megatron-core at TP=1 (dense, same
weights), training against vanilla at the same TP size, migrations, resizing, checkpoints.
"""

from __future__ import annotations

import pytest
import torch

from hettp.plan import PartitionPlan
from hettp.policy import ZERO_IMPUTED_GRAD
from hettp.resize import skipped_units
from tests.utils import (
    COMMON,
    GEMM_BACKWARD,
    close,
    het_numerics,
    resume_misfit,
    resumed_misfits,
    run_ranks,
    train,
    train_and_read_norms,
    train_pricing_a_layer_move,
    train_with_layer_moves,
    train_with_repartitions,
    train_with_resizes,
)

# TP=2, one group per rank: 8 heads in 2 groups of 4, SwiGLU, RoPE, RMSNorm, no biases
GQA2 = (
    COMMON + " --num-attention-heads 8 --group-query-attention --num-query-groups 2 --swiglu"
    " --ffn-hidden-size 128 --disable-bias-linear --position-embedding-type rope"
    " --normalization RMSNorm --het-tp-granularity 2"
)
# TP=4, one group per rank: 16 heads in 4 groups of 4, GELU, biases (K/V bias replicas too)
GQA4 = COMMON + " --num-attention-heads 16 --group-query-attention --num-query-groups 4"

NUMERICS = {
    # one head per unit: 3/5 splits group 0 (heads 0-3) over both ranks; 8/0 gives all to rank 0
    "tp2": (GQA2, 2, "--het-tp-attn-granularity 1", [None, "attn=3,5", "attn=8,0"]),
    # two heads per unit (8 units), sequence parallel: groups 0, 1 and 2 are split
    "tp4-sp": (
        GQA4 + " --sequence-parallel",
        4,
        "--het-tp-attn-granularity 2",
        [None, "attn=1,3,2,2", "attn=3,0,4,1"],
    ),
    # --qk-layernorm: RMSNorm on query heads and on K replicas two ranks hold (3/5), and a rank
    # with no head (8/0); LayerNorm with biases under sequence parallelism
    "tp2-qk-layernorm": (
        GQA2 + " --qk-layernorm",
        2,
        "--het-tp-attn-granularity 1",
        [None, "attn=3,5", "attn=8,0"],
    ),
    # Qwen2's QKV-only bias: the K/V replicas two ranks hold carry their bias rows
    "tp2-qkv-bias": (
        GQA2 + " --add-qkv-bias",
        2,
        "--het-tp-attn-granularity 1",
        [None, "attn=3,5"],
    ),
    "tp4-sp-qk-layernorm": (
        GQA4 + " --sequence-parallel --qk-layernorm",
        4,
        "--het-tp-attn-granularity 2",
        [None, "attn=1,3,2,2", "attn=3,0,4,1"],
    ),
}


@pytest.fixture(scope="module")
def references():
    models = {case[0].replace(" --sequence-parallel", "") for case in NUMERICS.values()}
    return {m: run_ranks(het_numerics, 1, m.split(), [None])[0][0] for m in sorted(models)}


@pytest.mark.parametrize("case", list(NUMERICS))
def test_split_groups_match_the_dense_reference(references, case):
    model, tp, flags, plans = NUMERICS[case]
    argv = (model + f" --tensor-model-parallel-size {tp} --het-tp {flags}").split()
    results = run_ranks(het_numerics, tp, argv, plans)[0]
    reference = references[model.replace(" --sequence-parallel", "")]
    # a key norm's bias gets no gradient in exact arithmetic (softmax ignores a shift common to
    # one query's logits): both runs hold rounding noise there, held to the gradients' scale
    scale = max(v.abs().max().item() for k, v in reference.items() if k.startswith("grad:"))
    assert len(results) == len(plans)
    for plan, result in zip(plans, results):
        # megatron-core's GEMM: its input-gradient all-reduce overlaps the weight gradient's
        assert result.pop("column_backward") == {GEMM_BACKWARD}, plan
        assert set(result) == set(reference)
        for key, want in reference.items():
            if key.startswith("grad:") and key.endswith("k_layernorm.bias"):
                assert max(result[key].abs().max(), want.abs().max()) < 1e-6 * scale, key
                continue
            close(result[key], want, f"{case} plan {plan} {key}")


def test_resized_heads_equal_the_reference_with_those_heads_zeroed():
    """Units of 2 heads; rank 0 holds unit 0, rank 1 units 1-3 (group 0 split) and skips its
    last one, unit 3: the skipped heads' rows get no gradient, and the replicas' gradients are
    those of the heads still computed."""
    argv = GQA2.split() + ["--het-tp", "--het-tp-attn-granularity", "2"]
    spec, shares = "attn=1,3", (0.0, 0.5)
    plan = PartitionPlan.parse(spec, 2, 2, 4, 64, 2)
    zeroed = {}
    for (layer, block, _), units in skipped_units(plan, shares).items():
        zeroed.setdefault((layer, block), []).extend(sorted(units))
    assert zeroed[(0, "attn")] == [3]  # skipped_count(3, 0.5) == 1: the last unit
    resized = run_ranks(
        het_numerics, 2, argv + ["--tensor-model-parallel-size", "2"], [spec], shares, None, zeroed
    )[0][0]
    reference = run_ranks(het_numerics, 1, argv, [None], None, zeroed, zeroed)[0][0]
    assert resized.pop("skipped_grads_zero") is True
    assert resized.pop("column_backward") == {GEMM_BACKWARD}  # resized, too
    reference.pop("skipped_grads_zero")
    reference.pop("column_backward")
    for key, want in reference.items():
        close(resized[key], want, key)


TRAINING = {
    # TP=2 x DP=2 under the distributed optimizer: replicas' gradients are made whole over DP
    # before their TP sum; with --qk-layernorm (the key norm runs on the K/V replicas) and
    # Qwen2's QKV-only bias (a moved head and a group's K/V carry their bias rows)
    "tp2-dp2-distopt": (
        GQA2 + " --qk-layernorm --add-qkv-bias",
        4,
        "--tensor-model-parallel-size 2 --use-distributed-optimizer",
        "--het-tp-attn-granularity 1",
        "attn=3,5",
        {3: "attn=3,5", 6: "attn=7,1", 8: "attn=4,4"},
        # a moved head carries its query rows and output columns (head_dim 8 x hidden 64);
        # the first head of a group that moves to a rank holding none of it also carries the
        # group's K and V; with Adam's two moments, fp32, in both layers. At 3: head 3 brings
        # group 0's K/V to rank 1; at 6: heads 3-6 go to rank 0, which holds group 0 already,
        # so only head 4 brings group 1's
        (
            2 * (8 * 64 + 8 + 64 * 8 + 16 * 64 + 16) * 4 * 3,
            2 * (4 * (8 * 64 + 8 + 64 * 8) + 16 * 64 + 16) * 4 * 3,
        ),
    ),
    "tp4-sp": (
        GQA4,
        4,
        "--tensor-model-parallel-size 4 --sequence-parallel",
        "--het-tp-attn-granularity 2",
        "attn=1,3,2,2",
        {3: "attn=1,3,2,2", 6: "attn=3,0,4,1", 8: "attn=2,2,2,2"},
        # at 3: unit 1 (2 heads of 4 rows) moves 0 -> 1 with rows, biases and its group's K/V;
        # at 6: units 1, 2, 3 and 6 move, and K/V go with unit 2 (to rank 0), 3 (to rank 2)
        # and 6 (to rank 2), not with unit 1 (rank 0 holds group 0)
        (
            2 * (8 * 64 + 8 + 64 * 8 + 8 * 64 + 8) * 4 * 3,
            2 * (4 * (8 * 64 + 8 + 64 * 8) + 3 * (8 * 64 + 8)) * 4 * 3,
        ),
    ),
}


@pytest.mark.parametrize("case", list(TRAINING))
def test_split_plans_and_migrations_train_as_vanilla(case):
    """10 steps, gradient clipping on (megatron's default 1.0: a replica counted twice in the
    gradient norm would change every clipped step): vanilla megatron-core, a plan splitting
    groups from the start, and the even plan migrated three times, creating and dropping
    K/V replicas; at 7 the third move fails to build its optimizer on TP rank 1 after its
    shards and replicas were installed, and every rank puts back its old ones."""
    model, world, parallel, flags, split, plans, moved_bytes = TRAINING[case]
    argv = (
        model.replace("--train-iters 1", "--train-iters 10")
        + f" --global-batch-size 8 --eval-iters 0 --log-interval 5 {parallel}"
    ).split()
    het = ["--het-tp", *flags.split()]
    vanilla = run_ranks(train, world, argv)[0]
    split_run = run_ranks(train, world, argv + het + ["--het-tp-plan", split])[0]
    fault = {"iteration": 7, "rank": 1, "stage": "optimizer"}
    migrated = run_ranks(
        train_with_repartitions, world, argv + het, {**plans, 7: plans[8]}, (fault,)
    )
    for step in range(1, 11):
        want = vanilla["losses"][step]
        for got in [split_run["losses"][step]] + [r["losses"][step] for r in migrated]:
            assert abs(got - want) <= 1e-6 * abs(want), f"{case} step {step}: {got} vs {want}"
    for result in migrated:
        events = result["events"]
        assert [e["iteration"] for e in events] == [3, 6, 7, 8]
        failed = events[2]
        assert "rebuild of the optimizer at iteration 7 aborted" in failed["error"]
        assert failed["unchanged"] and failed["plan_kept"] and failed["stray_buffers"] == 0
    assert (events[0]["bytes"], events[1]["bytes"]) == moved_bytes


def test_query_key_norms_stay_replicated_under_the_distributed_optimizer():
    """TP=2 x DP=2, --qk-layernorm, the distributed optimizer and an uneven plan: the TP ranks'
    gradient buffers differ, so each DP rank owns other parts of a replicated norm's gradient
    on each TP rank; the query/key norms' gradients must be made whole over DP before
    megatron-core sums them over TP (by name), or the TP ranks' copies drift apart."""
    argv = (
        GQA2.replace("--train-iters 1", "--train-iters 4")
        + " --global-batch-size 8 --eval-iters 0 --log-interval 5 --qk-layernorm"
        " --tensor-model-parallel-size 2 --use-distributed-optimizer --het-tp"
        " --het-tp-attn-granularity 1 --het-tp-plan attn=1,7;mlp=0,64"
    ).split()
    ranks = run_ranks(train_and_read_norms, 4, argv)
    qk = {
        n: v for n, (_, v) in ranks[0]["norms"].items() if "q_layernorm" in n or "k_layernorm" in n
    }
    assert len(qk) == 4  # q and k, two layers
    for rank in ranks[1:]:
        for name, value in qk.items():
            assert torch.equal(rank["norms"][name][1], value), name


# with --qk-layernorm: its per-head norms are replicated weights, saved once
CKPT = (
    GQA2.replace("--train-iters 1", "--train-iters 10")
    + " --global-batch-size 8 --eval-iters 0 --log-interval 5 --qk-layernorm"
).split()


def test_checkpoint_of_split_groups_loads_anywhere(tmp_path):
    """Saved with group 0 split 3/1 over the ranks (its K/V saved once), step 5; resumed under
    another split, under query-group units, and into vanilla megatron-core at TP=1, query/key
    layernorms included."""
    heads = ["--het-tp", "--het-tp-attn-granularity", "1"]
    saved = run_ranks(
        train,
        2,
        CKPT
        + heads
        + ["--tensor-model-parallel-size", "2", "--het-tp-plan", "attn=3,5"]
        + ["--save", str(tmp_path / "ckpt"), "--save-interval", "5"],
    )[0]
    only5 = tmp_path / "only5"
    only5.mkdir()
    (only5 / "iter_0000005").symlink_to(tmp_path / "ckpt" / "iter_0000005")
    (only5 / "latest_checkpointed_iteration.txt").write_text("5")
    for world, flags in (
        (2, heads + ["--tensor-model-parallel-size", "2", "--het-tp-plan", "attn=6,2"]),
        (2, ["--het-tp", "--tensor-model-parallel-size", "2"]),
        (1, []),
    ):
        resumed = run_ranks(train, world, CKPT + flags + ["--load", str(only5)])[0]
        assert sorted(resumed["losses"]) == [6, 7, 8, 9, 10], flags
        for step in range(6, 11):
            got, want = resumed["losses"][step], saved["losses"][step]
            assert abs(got - want) <= 1e-5 * abs(want), f"{flags} step {step}: {got} vs {want}"


def test_layers_with_split_groups_move_between_pipeline_stages():
    """TP=2 x PP=2, four layers whose group 0 is split 3/1: layers move to the last stage at 3
    and back at 5, each built there with its K/V replicas (at 4 the move back fails to
    build its DDP wrapper on one rank, and every rank keeps its layers); the losses stay
    vanilla's."""
    argv = (
        GQA2.replace("--num-layers 2", "--num-layers 4").replace("--train-iters 1", "")
        + " --train-iters 7 --global-batch-size 8 --eval-iters 0 --log-interval 1"
        " --lr-decay-iters 8 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2"
        " --qk-layernorm"  # a moved layer's query/key norms are built and carried too
    ).split()
    vanilla = run_ranks(train, 4, argv)[0]["losses"]
    heads = argv + "--het-tp --het-tp-attn-granularity 1 --het-tp-plan attn=3,5".split()
    fault = {"iteration": 4, "global_rank": 3, "stage": "wrapper"}  # the rebuild fails
    ranks = run_ranks(train_with_layer_moves, 4, heads, {3: (1, 3), 4: (3, 1), 5: (3, 1)}, (fault,))
    for rank, result in enumerate(ranks):
        assert [e["iteration"] for e in result["events"] if "sent" in e] == [3, 5], rank
        failed = next(e for e in result["events"] if e["iteration"] == 4)
        assert "rebuild of the DDP wrapper aborted: rank(s) [3]" in failed["error"]
        assert failed["kept"] and failed["stray_buffers"] == 0
        assert result["seen"][4][0] == ([1] if rank < 2 else [2, 3, 4])
        assert result["seen"][5][0] == ([1, 2, 3] if rank < 2 else [4])
        for step in range(1, 8):
            got, want = result["losses"][step], vanilla[step]
            assert abs(got - want) <= 1e-6 * abs(want), f"rank {rank} step {step}"


def test_replicas_no_rank_computes_with_stay_frozen():
    """TP=2, 4 groups of 2 heads, a head per unit: rank 1 holds groups 2 and 3 and skips half
    its units from step 3 to 5, the last two of its order, all of one group. No rank computes
    with that group's K/V: its weights and Adam moments stay as they were (like the skipped
    heads'), while the other group's go on training; restored, they resume alike."""
    argv = (
        COMMON.replace("--train-iters 1", "--train-iters 6")
        + " --num-attention-heads 8 --group-query-attention --num-query-groups 4"
        " --disable-bias-linear --global-batch-size 4 --weight-decay 0.1"
        " --tensor-model-parallel-size 2 --het-tp-attn-granularity 1 --het-tp-resize 0,0"
    ).split()
    actions = {2: [("resize", (0.0, 0.5))], 5: [("resize", (0.0, 0.0))]}
    ranks = run_ranks(train_with_resizes, 2, argv, actions, {2, 5, 6})
    records = ranks[1]["records"]
    keys = records[2]["state_keys"]
    for layer in range(2):
        at2, at5 = records[2]["blocks"][(layer, "attn")], records[5]["blocks"][(layer, "attn")]
        assert at2["active"] == 2 and set(at2["units"]) == {4, 5, 6, 7}
        skipped = set(at2["units"][2:])
        idle = [g for g in (2, 3) if {2 * g, 2 * g + 1} <= skipped]
        assert len(idle) == 1, at2["units"]  # the precondition: one whole group skipped
        live = ({2, 3} - set(idle)).pop()
        per_kv = 1 + len(keys)  # the K/V weight, then its moments
        for unit in at2["units"]:
            kv2, kv5 = at2["values"][unit][-per_kv:], at5["values"][unit][-per_kv:]
            same = all(torch.equal(a, b) for a, b in zip(kv2, kv5))
            assert same == (unit // 2 == idle[0]), (layer, unit)
        assert live in {u // 2 for u in at2["units"][:2]}
        # restored at 5: the idle group's K/V moments, frozen after step 2, are rescaled for
        # Adam's count before step 6, as its heads' are
        kv5 = at5["values"][2 * idle[0]][-per_kv:]
        kv6 = records[6]["blocks"][(layer, "attn")]["values"][2 * idle[0]][-per_kv:]
        m, v = 1 + keys.index("exp_avg"), 1 + keys.index("exp_avg_sq")
        misfit = resume_misfit((kv5[m], kv5[v]), (kv6[m], kv6[v]), 2, records[5]["count"])
        assert misfit < 1e-5, (layer, misfit)
    resumes = resumed_misfits(ranks)
    assert {(since, it) for _, _, since, it, _ in resumes} == {(2, 5)}
    assert max(misfit for *_, misfit in resumes) < 1e-5, resumes


def test_replicas_no_rank_computes_with_get_the_imputed_gradient_under_zero():
    """The same resize under `--het-tp-policy zero` (the paper's baseline: skipped units get a
    tiny constant gradient and are updated): the idle group's K/V gets that gradient too, as its
    skipped heads do. Without clipping, four imputed Adam steps take each exp_avg element from
    m to beta1^4 m + (1 - beta1^4) c."""
    argv = (
        COMMON.replace("--train-iters 1", "--train-iters 6")
        + " --num-attention-heads 8 --group-query-attention --num-query-groups 4"
        " --disable-bias-linear --global-batch-size 4 --clip-grad 0"
        " --tensor-model-parallel-size 2 --het-tp-attn-granularity 1 --het-tp-resize 0,0"
        " --het-tp-policy zero"
    ).split()
    ranks = run_ranks(train_with_resizes, 2, argv, {2: [("resize", (0.0, 0.5))]}, {2, 6})
    records = ranks[1]["records"]
    keys = records[2]["state_keys"]
    assert keys == ["exp_avg", "exp_avg_sq"]
    decay = 0.9**4
    imputed = (1 - decay) * ZERO_IMPUTED_GRAD
    for layer in range(2):
        at2, at6 = records[2]["blocks"][(layer, "attn")], records[6]["blocks"][(layer, "attn")]
        skipped = at2["units"][2:]
        assert {u // 2 for u in skipped} == {skipped[0] // 2}  # one whole group idle
        for unit in skipped:
            # [query rows, their moments, projection columns, theirs, the group's K/V, theirs]
            values2, values6 = at2["values"][unit], at6["values"][unit]
            assert len(values2) == 3 * (1 + len(keys))
            for tensor in range(3):
                at = tensor * (1 + len(keys)) + 1  # exp_avg
                residual = values6[at].double() - decay * values2[at].double()
                # fp32 Adam rounds each exp_avg to ~1e-7 of its size, four steps running
                slack = 0.05 * imputed + 1e-6 * values2[at].double().abs()
                off = (residual - imputed).abs() > slack
                assert not off.any(), (layer, unit, tensor, residual[off][:4].tolist())


def test_every_stage_prices_a_layer_move_alike(tmp_path):
    """TP=2 x PP=2 with head units: the first stage's layers split group 0 (a K/V replica on
    each rank), the last stage's do not. A layer move's predicted cost decides whether it
    pays; priced from each stage's own layers, the stages would disagree and one would wait
    in a move the other never starts. Every rank prices it from the whole model's plan."""
    from hettp.plan import PartitionPlan

    stages = [(3, 5), (3, 5), (4, 4), (4, 4)]  # heads per rank, layer by layer
    plan = PartitionPlan.joined(
        [PartitionPlan.from_counts(2, 1, 8, 64, attn, (32, 32), 2) for attn in stages]
    )
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    argv = (
        GQA2.replace("--num-layers 2", "--num-layers 4").replace("--train-iters 1", "")
        + " --train-iters 2 --global-batch-size 4 --eval-iters 0"
        " --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2"
        f" --het-tp --het-tp-attn-granularity 1 --het-tp-plan {path}"
    ).split()
    ranks = run_ranks(train_pricing_a_layer_move, 4, argv)
    priced = [r["priced"][1] for r in ranks]
    assert priced[0] > 0 and priced == [priced[0]] * 4, priced
