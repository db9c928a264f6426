"""Megatron-LM's checkpoint flags on real gloo ranks: --finetune and --pretrained-checkpoint
(the model only, from iteration 0, in this run's plan), --no-load-optim (moments and schedule
start over, fp32 masters from the loaded weights, the plan and iteration carry on),
--no-save-optim / --no-save-rng and loading such a checkpoint, --ckpt-step and
--exit-on-missing-checkpoint. (--no-load-rng: tests/hetero/test_training.py.)"""

from __future__ import annotations

import re

import pytest
import torch
from megatron.core import dist_checkpointing

from megatron.hetero.checkpointing import OPTIMIZER_KEY, RNG_SAVED_KEY
from tests.utils import MHA, run_ranks, train, train_with_resizes

LR, BETAS, EPS = 1e-2, (0.9, 0.999), 1e-8
# TP=2 het-TP under --bf16 (fp32 masters); the resizer idle (the worker reads its priorities);
# a constant rate without weight decay, so a step's update is Adam's alone
ARGV = (
    MHA + f" --global-batch-size 4 --tensor-model-parallel-size 2 --bf16 --lr {LR}"
    " --lr-decay-style constant --weight-decay 0 --het-tp-resize 0,0"
).split()
MIGRATED = "rebalance:attn=3,1;mlp=160,96"


def _iters(n: int) -> list[str]:
    return ["--train-iters", str(n)]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """4 steps, migrated to 3 : 1 query groups at 2, saved at 2 and 4; unit values at 4."""
    folder = tmp_path_factory.mktemp("pretrained")
    argv = ARGV + _iters(4) + ["--save", str(folder), "--save-interval", "2"]
    ranks = run_ranks(train_with_resizes, 2, argv, {2: [("migrate", MIGRATED)]}, {4})
    return folder, ranks


def _saved_keys(path: str) -> set:
    """The sharded entries a checkpoint folder holds (its torch_dist metadata)."""
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(path).read_metadata().state_dict_metadata)


def _values(ranks, it: int) -> dict:
    """(layer, block, unit) -> that unit's recorded values at step `it`, from its holder."""
    out = {}
    for rank in ranks:
        for key, block in rank["records"][it]["blocks"].items():
            for unit, values in block["values"].items():
                out[(*key, unit)] = values
    return out


def _attention_units(rank, it: int) -> list:
    return list(rank["records"][it]["blocks"][(0, "attn")]["units"])


def _check_fresh_adam_step_from(ranks, it: int, loaded: dict) -> None:
    """At step `it` every unit took a fresh Adam's first step (m^2/v = (1-b1)^2/(1-b2)) from
    the loaded bf16 weights (`loaded`: the values recorded where they were saved): its fp32
    master is that weight, minus the step's update."""
    (beta1, beta2), keys = BETAS, ranks[0]["records"][it]["state_keys"]
    assert keys == ["master", "exp_avg", "exp_avg_sq"]
    assert ranks[0]["records"][it]["count"] == 1
    now = _values(ranks, it)
    assert now.keys() == loaded.keys()
    for unit, values in now.items():
        for i in range(0, len(values), 4):  # per tensor: weight, master, exp_avg, exp_avg_sq
            master, m, v = (values[i + j].double() for j in (1, 2, 3))
            ratio = (m**2)[v > 0] / v[v > 0]
            want = torch.full_like(ratio, (1 - beta1) ** 2 / (1 - beta2))
            torch.testing.assert_close(ratio, want, rtol=1e-5, atol=0)
            update = (m / (1 - beta1)) / ((v / (1 - beta2)).sqrt() + EPS)
            want = loaded[unit][i].double() - LR * update
            torch.testing.assert_close(master, want, rtol=0, atol=1e-6, msg=str(unit))


def test_finetune_loads_the_model_alone_into_this_runs_plan(pretrained):
    folder, saved = pretrained
    assert len(_attention_units(saved[0], 4)) == 3  # the migrated plan was saved
    ranks = run_ranks(
        train_with_resizes, 2, ARGV + _iters(2) + ["--load", str(folder), "--finetune"], {}, {1}
    )
    assert sorted(ranks[0]["losses"]) == [1, 2]
    assert (
        f"loaded checkpoint from {folder} at iteration 4, the model only (--finetune): "
        "starting from iteration 0" in ranks[0]["stdout"]
    )
    # the data from its start, the schedule from its start (one step of 4 samples)
    assert re.search(r"iteration\s+1/\s+2 \| consumed samples:\s+4 \|", ranks[0]["stdout"])
    assert ranks[0]["records"][1]["scheduler_steps"] == 4
    assert _attention_units(ranks[0], 1) == [0, 1]  # this run's (even) plan
    _check_fresh_adam_step_from(ranks, 1, _values(saved, 4))


def test_no_load_optim_keeps_plan_and_iteration_and_a_checkpoint_without_optimizer_or_rng(
    pretrained, tmp_path
):
    folder, saved = pretrained
    again = tmp_path / "again"
    argv = ARGV + ["--load", str(folder), "--no-load-optim", "--no-load-rng"]
    argv += ["--save", str(again), "--no-save-optim", "--no-save-rng"]
    ranks = run_ranks(train_with_resizes, 2, argv + _iters(6), {}, {5})
    assert sorted(ranks[0]["losses"]) == [5, 6]
    assert _attention_units(ranks[0], 5) == _attention_units(saved[0], 4)  # the checkpoint's plan
    assert re.search(r"iteration\s+5/\s+6 \| consumed samples:\s+20 \|", ranks[0]["stdout"])
    assert ranks[0]["records"][5]["scheduler_steps"] == 4  # the schedule started over
    assert (
        "optimizer state and learning-rate schedule not loaded (--no-load-optim)"
        in ranks[0]["stdout"]
    )
    _check_fresh_adam_step_from(ranks, 5, _values(saved, 4))
    path = str(again / "iter_0000006")
    common = dist_checkpointing.load_common_state_dict(path)
    assert common["args"][OPTIMIZER_KEY] is False and common["args"][RNG_SAVED_KEY] is False
    assert "opt_param_scheduler" not in common

    def kinds(path):  # optimizer.* (moments, masters), rng_states/*, model weights, ...
        return {key.split(".")[0].split("/")[0] for key in _saved_keys(path)}

    assert {"optimizer", "rng_states"} <= kinds(str(folder / "iter_0000004"))
    assert not {"optimizer", "rng_states"} & kinds(path), kinds(path)

    # as Megatron-LM: loading it needs --no-load-optim, and the generators start over
    plain = ARGV + _iters(7) + ["--load", str(again)]
    with pytest.raises(AssertionError, match="holds no optimizer state .* --no-load-optim"):
        run_ranks(train_with_resizes, 2, plain, {}, ())
    resumed = run_ranks(train_with_resizes, 2, plain + ["--no-load-optim"], {}, {7})
    assert sorted(resumed[0]["losses"]) == [7]
    assert "RNG states not loaded (saved with --no-save-rng)" in resumed[0]["stdout"]
    assert resumed[0]["records"][7]["count"] == 1


def test_ckpt_step_pretrained_checkpoint_and_a_missing_checkpoint(pretrained, tmp_path):
    """Vanilla TP=1 ranks load the het-TP checkpoint (any plan, any TP size)."""
    folder, _ = pretrained
    vanilla = [a for a in ARGV if a not in ("--het-tp-resize", "0,0")]
    vanilla[vanilla.index("--tensor-model-parallel-size") + 1] = "1"
    # --use-checkpoint-args: the model's sizes and flags from the checkpoint (--swiglu given
    # here yields to its plain GELU MLP)
    sized = " ".join(vanilla)
    for flag in (
        "--num-layers 2",
        "--hidden-size 64",
        "--seq-length 32",
        "--num-attention-heads 4",
    ):
        assert flag in sized
        sized = sized.replace(flag, "")
    argv = sized.split() + ["--swiglu", "--use-checkpoint-args"]
    older = run_ranks(train, 1, argv + _iters(3) + ["--load", str(folder), "--ckpt-step", "2"])
    assert sorted(older[0]["losses"]) == [3]
    assert f"loaded checkpoint from {folder} at iteration 2" in older[0]["stdout"]
    assert (
        f"model flags from checkpoint {folder}/iter_0000002 (--use-checkpoint-args): "
        "--num-layers 2, --hidden-size 64, --ffn-hidden-size 256, --num-attention-heads 4, "
        "--num-query-groups 4, --kv-channels 16, --swiglu False, --max-position-embeddings 32, "
        "--seq-length 32\n" in older[0]["stdout"]
    )
    with pytest.raises(AssertionError, match="--ckpt-step 3: --load .* holds no"):
        run_ranks(train, 1, vanilla + _iters(4) + ["--load", str(folder), "--ckpt-step", "3"])

    # Megatron-LM's finetuning pattern: --load and --save one folder, empty at first
    mine = str(tmp_path / "mine")
    argv = vanilla + ["--load", mine, "--save", mine, "--pretrained-checkpoint", str(folder)]
    first = run_ranks(train, 1, argv + _iters(2) + ["--ckpt-step", "2"])[0]
    assert sorted(first["losses"]) == [1, 2]
    assert (
        f"from {folder} at iteration 2, the model only (--pretrained-checkpoint): starting "
        "from iteration 0" in first["stdout"]
    )
    second = run_ranks(train, 1, argv + _iters(3))[0]  # from its own checkpoint now
    assert sorted(second["losses"]) == [3]
    assert f"loaded checkpoint from {mine} at iteration 2" in second["stdout"]

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(AssertionError, match="holds no checkpoint \\(--exit-on-missing"):
        run_ranks(
            train, 1, vanilla + _iters(2) + ["--load", str(empty), "--exit-on-missing-checkpoint"]
        )


def test_use_checkpoint_args_reads_the_checkpoint_the_load_will(pretrained, tmp_path, capsys):
    """--use-checkpoint-args reads what the load will: the older copy a save killed mid-way
    left aside, common.pt only after its manifest entry checks; an older checkpoint's
    unrecorded flags are named, and a size it lacks must be given."""
    import shutil

    from megatron.hetero.arguments import parse_args
    from megatron.hetero.checkpointing import MODEL_ARGS, SHAPE_ARGS

    folder, _ = pretrained
    root = tmp_path / "copy"
    shutil.copytree(folder, root)
    unsized = " ".join(ARGV)
    for flag in (
        "--num-layers 2",
        "--hidden-size 64",
        "--seq-length 32",
        "--num-attention-heads 4",
    ):
        unsized = unsized.replace(flag, "")
    argv = unsized.split() + ["--use-checkpoint-args", "--load", str(root)]

    def parsed(extra=()):
        try:
            args = parse_args(argv + list(extra), world_size=2)
        except SystemExit as done:
            assert done.code == 2
            return capsys.readouterr().err
        return args, capsys.readouterr().out

    (root / "iter_0000004").rename(root / "iter_0000004.replaced")
    args, out = parsed()
    assert args.hidden_size == 64 and f"checkpoint {root}/iter_0000004 (--use" in out
    (root / "iter_0000004.replaced").rename(root / "iter_0000004")

    common = root / "iter_0000004" / "common.pt"
    state = torch.load(common, weights_only=False)
    state["args"] = {
        k: v for k, v in state["args"].items() if k not in MODEL_ARGS[len(SHAPE_ARGS) :]
    }
    torch.save(state, common)
    assert parsed() == (
        f"pretrain_gpt.py: error: --use-checkpoint-args: {common} is damaged: it differs from the "
        "manifest\n"
    )
    (root / "iter_0000004" / "manifest.json").unlink()  # as saved before manifests
    assert parsed().endswith(
        "error: the following arguments are required: --seq-length (--use-checkpoint-args: "
        f"{root}/iter_0000004 predates recording them)\n"
    )
    args, out = parsed(["--seq-length", "32"])
    assert args.num_layers == 2 and args.seq_length == 32
    assert out.endswith(
        "; not recorded in it (an older checkpoint), as given: --seq-length, "
        "--group-query-attention, --add-position-embedding, --use-rotary-position-embeddings, "
        "--rotary-base, --rotary-percent, --rotary-interleaved, "
        "--rotary-seq-len-interpolation-factor, --use-rope-scaling, --rope-scaling-factor, "
        "--squared-relu, --qk-l2-norm, --norm-epsilon, --apply-query-key-layer-scaling, "
        "--attention-dropout, --hidden-dropout\n"
    )
