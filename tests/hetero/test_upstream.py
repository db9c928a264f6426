"""hettp inside an upstream Megatron-LM checkout: the glue the patch calls (megatron/hetero/
upstream.py), driven in the order and places the patch puts its calls, on real gloo ranks; and
the patch itself against a Megatron-LM core_v0.16.1 checkout when one is given."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess

import pytest

from tests.utils import ROOT, run_ranks, train_like_upstream

PATCH = os.path.join(ROOT, "patches", "megatron-lm-core_v0.16.1.patch")
PATCHED = ("pretrain_gpt.py", "gpt_builders.py", "megatron/training/training.py")
MODEL = (
    "--tensor-model-parallel-size 2 --num-layers 2 --hidden-size 64 --num-attention-heads 4 "
    "--seq-length 32 --max-position-embeddings 32 --micro-batch-size 2 "
    "--global-batch-size 2 --lr 1e-3 --mock-data --vocab-size 255 --hidden-dropout 0 "
    "--attention-dropout 0 --train-iters 12 --log-interval 100"
).split()


def test_extra_args_provider_adds_the_group_after_upstreams():
    from megatron.hetero import upstream

    def theirs(parser):
        parser.add_argument("--their-flag", type=int, default=0)
        return parser

    parser = upstream.extra_args_provider(theirs)(argparse.ArgumentParser())
    args = parser.parse_args(
        ["--their-flag", "3", "--het-tp-policy", "hybrid", "--het-tp-interval", "7"]
    )
    assert (args.their_flag, args.het_tp_policy, args.het_tp_interval) == (3, "hybrid", 7)
    assert (
        upstream.extra_args_provider(None)(argparse.ArgumentParser()).parse_args([]).het_tp is False
    )


def _upstream_args(argv=(), **overrides):
    """Args as upstream's parser leaves them for our glue: the --het-tp group from
    extra_args_provider with argparse's defaults, and upstream's own model flags (it keeps
    --num-query-groups at 1 without --group-query-attention)."""
    from megatron.hetero import upstream

    args = upstream.extra_args_provider(None)(argparse.ArgumentParser()).parse_args(list(argv))
    model = dict(
        tensor_model_parallel_size=2,
        num_layers=2,
        num_attention_heads=4,
        num_query_groups=1,
        group_query_attention=False,
        ffn_hidden_size=256,
        normalization="LayerNorm",
        num_experts=None,
        mtp_num_layers=None,
        multi_latent_attention=False,
        use_distributed_optimizer=False,
        virtual_pipeline_model_parallel_size=None,
    )
    for name, value in {**model, **overrides}.items():
        setattr(args, name, value)
    return args


@pytest.mark.parametrize(
    "argv, overrides, message",
    [
        (
            ["--het-tp-policy", "migrate", "--het-tp-interval", "0"],
            {},
            "--het-tp-interval must be positive",
        ),
        (
            ["--het-tp-policy", "migrate"],
            {"num_experts": 8},
            "no mixture of experts layers: drop --num-experts",
        ),
        (["--het-tp"], {"use_distributed_optimizer": True}, "drop --use-distributed-optimizer"),
        (["--het-tp-plan", "attn=4,1;mlp=128,128"], {}, "--het-tp-plan"),
    ],
)
def test_create_runtime_checks_the_flags_on_upstream_args(argv, overrides, message):
    from megatron.hetero import upstream

    with pytest.raises(SystemExit, match=re.escape(message)):
        upstream.create_runtime(_upstream_args(argv, **overrides))


def test_a_resizing_policy_starts_on_upstream_args_without_extra_flags():
    """Upstream's args keep argparse's None for --het-tp-priority-sample-interval: the runtime
    reads the validated config, so every resizer-building policy starts (it crashed before)."""
    from megatron.hetero import upstream

    for policy in ("resize", "migrate", "hybrid", "zero"):
        args = _upstream_args(["--het-tp-policy", policy])
        before = dict(vars(args))
        runtime = upstream.create_runtime(args)
        assert runtime.config.het_tp and runtime.config.sample_interval == 8
        assert vars(args) == before  # nothing written back into upstream's args
        assert upstream.layer_spec(runtime, "theirs") is not None
        assert upstream.layer_spec(runtime, "theirs") != "theirs"


def test_create_runtime_counts_query_groups_as_upstream_does():
    from megatron.hetero import upstream

    # without --group-query-attention upstream leaves --num-query-groups at 1: 4 heads = 4 units
    runtime = upstream.create_runtime(_upstream_args(["--het-tp-plan", "attn=3,1;mlp=192,64"]))
    assert runtime.config.partition_plan.counts(0, "attn") == (3, 1)
    assert upstream.create_runtime(_upstream_args(["--het-tp-policy", "static"])) is None
    assert upstream.layer_spec(None, "theirs") == "theirs"  # vanilla keeps upstream's spec


def test_hook_migrates_losslessly_in_upstreams_loop():
    straggler = run_ranks(
        train_like_upstream,
        2,
        MODEL
        + [
            "--het-tp-policy",
            "migrate",
            "--het-tp-interval",
            "3",
            "--het-tp-emulate",
            "persistent:rank=1,factor=3",
        ],
    )
    steady = run_ranks(train_like_upstream, 2, MODEL + ["--het-tp", "--het-tp-policy", "static"])
    first = straggler[0]
    # 3x slow from the start; 3 warm-up steps, then the window of 3 is full at step 6
    assert first["hook"] and "het-TP decision at iteration 6: migrate" in first["stdout"]
    assert "het-TP repartition at iteration 6" in first["stdout"]
    assert first["replaced"]  # end_step handed back the rebuilt model chunk and optimizer
    assert first["plan"] != steady[0]["plan"]  # units moved off rank 1
    for it, loss in steady[0]["losses"].items():
        assert first["losses"][it] == pytest.approx(loss, rel=1e-5)


def test_the_patch_calls_what_the_glue_defines():
    from megatron.hetero import upstream

    text = open(PATCH).read()
    added = "\n".join(line for line in text.splitlines() if line.startswith("+"))
    calls = set(re.findall(r"het_tp\.(\w+(?:\.\w+)?)\(", added))
    calls |= {f"het_tp_hook.{m}" for m in re.findall(r"het_tp_hook\.(\w+)\(", added)}
    assert calls == {
        "extra_args_provider",
        "create_runtime",
        "layer_spec",
        "StepHook.create",
        "before_optimizer_step",
        "after_optimizer_step",
        "het_tp_hook.begin_step",
        "het_tp_hook.end_step",
    }
    assert "het_tp_runtime.install(model)" in added
    for name in calls:
        owner, _, attr = name.rpartition(".")
        target = upstream.StepHook if owner in ("StepHook", "het_tp_hook") else upstream
        assert callable(getattr(target, attr or name)), name
    for path in ("pretrain_gpt.py", "gpt_builders.py", "megatron/training/training.py"):
        assert f"diff --git a/{path} b/{path}" in text


@pytest.mark.skipif(
    not os.environ.get("HETTP_MEGATRON_LM"),
    reason="set HETTP_MEGATRON_LM to a Megatron-LM checkout at core_v0.16.1 "
    "(CI extracts ../shared/upstream's)",
)
def test_the_patch_applies_to_a_fresh_copy_of_megatron_lm(tmp_path):
    """On a copy of the given tree (it may be patched already, or shared): apply, byte-compile
    the patched files, and find the glue's calls where the patch puts them."""
    tree = tmp_path / "Megatron-LM"
    shutil.copytree(os.environ["HETTP_MEGATRON_LM"], tree, symlinks=True)
    # as extracted, whether or not the given tree was patched already
    if (
        subprocess.run(
            ["git", "apply", "-R", "--check", PATCH], cwd=tree, capture_output=True
        ).returncode
        == 0
    ):
        subprocess.run(["git", "apply", "-R", PATCH], cwd=tree, check=True)
    apply = os.path.join(ROOT, "patches", "apply.sh")
    out = subprocess.run(["bash", apply, "--check", str(tree)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    out = subprocess.run(["bash", apply, str(tree)], capture_output=True, text=True)
    assert out.returncode == 0 and "patched" in out.stdout, out.stdout + out.stderr
    for path in PATCHED:
        source = (tree / path).read_text()
        compile(source, str(tree / path), "exec")  # still valid Python
        assert "from megatron.hetero import upstream as het_tp" in source, path
    assert "het_tp_runtime.install(model)" in (tree / "gpt_builders.py").read_text()
    # a second apply is refused (the patch no longer applies), leaving the tree as it is
    again = subprocess.run(["bash", apply, str(tree)], capture_output=True, text=True)
    assert again.returncode != 0
