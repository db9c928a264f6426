"""hettp inside an upstream Megatron-LM checkout: the glue the patch calls (megatron/hetero/
upstream.py), driven in the order and places the patch puts its calls, on real gloo ranks; and
the patch itself against a Megatron-LM core_v0.16.1 checkout when one is given."""

from __future__ import annotations

import argparse
import os
import re
import subprocess

import pytest

from tests.utils import ROOT, run_ranks, train_like_upstream

PATCH = os.path.join(ROOT, "patches", "megatron-lm-core_v0.16.1.patch")
MODEL = ("--tensor-model-parallel-size 2 --num-layers 2 --hidden-size 64 --num-attention-heads 4 "
         "--seq-length 32 --max-position-embeddings 32 --micro-batch-size 2 "
         "--global-batch-size 2 --lr 1e-3 --mock-data --vocab-size 255 --hidden-dropout 0 "
         "--attention-dropout 0 --train-iters 12 --log-interval 100").split()


def test_extra_args_provider_adds_the_group_after_upstreams():
    from megatron.hetero import upstream

    def theirs(parser):
        parser.add_argument("--their-flag", type=int, default=0)
        return parser

    parser = upstream.extra_args_provider(theirs)(argparse.ArgumentParser())
    args = parser.parse_args(["--their-flag", "3", "--het-tp-policy", "hybrid",
                              "--het-tp-interval", "7"])
    assert (args.their_flag, args.het_tp_policy, args.het_tp_interval) == (3, "hybrid", 7)
    assert upstream.extra_args_provider(None)(argparse.ArgumentParser()).parse_args([]).het_tp \
        is False


def _upstream_args(**overrides):
    base = dict(het_tp=False, het_tp_plan=None, het_tp_granularity=1, het_tp_policy="migrate",
                het_tp_interval=10, het_tp_onset=1.3, het_tp_end=1.15, het_tp_patience=2,
                het_tp_onset_at_once=1.6,
                het_tp_window=1, het_tp_timer="cpu", het_tp_emulate=None,
                het_tp_emulate_dilation=1.0, het_tp_resize=None,
                het_tp_max_resize=0.5, het_tp_priority="dw", het_tp_priority_interval=50,
                het_tp_priority_sample_interval=None,
                tensor_model_parallel_size=2, num_layers=2, num_attention_heads=4,
                num_query_groups=1, group_query_attention=False, ffn_hidden_size=256,
                normalization="LayerNorm", num_experts=None, mtp_num_layers=None,
                multi_latent_attention=False, use_distributed_optimizer=False,
                virtual_pipeline_model_parallel_size=None)
    base.update(overrides)
    return argparse.Namespace(**base)


@pytest.mark.parametrize("overrides, message", [
    ({"het_tp_interval": 0}, "--het-tp-interval must be positive"),
    ({"num_experts": 8}, "no mixture of experts layers: drop --num-experts"),
    ({"use_distributed_optimizer": True}, "drop --use-distributed-optimizer"),
    ({"het_tp_plan": "attn=4,1;mlp=128,128"}, "--het-tp-plan"),
])
def test_layer_spec_checks_the_flags_on_upstream_args(overrides, message):
    from megatron.hetero import upstream

    with pytest.raises(SystemExit, match=re.escape(message)):
        upstream.layer_spec(_upstream_args(**overrides))


def test_layer_spec_counts_query_groups_as_upstream_does():
    from megatron.hetero import upstream

    # without --group-query-attention upstream leaves --num-query-groups at 1: 4 heads = 4 units
    args = _upstream_args(het_tp_plan="attn=3,1;mlp=192,64")
    assert upstream.layer_spec(args) is not None and args.het_tp
    assert args.het_tp_plan_obj.counts(0, "attn") == (3, 1)
    assert upstream.layer_spec(_upstream_args(het_tp_policy="static")) is None  # vanilla


def test_hook_migrates_losslessly_in_upstreams_loop():
    straggler = run_ranks(train_like_upstream, 2, MODEL + [
        "--het-tp-policy", "migrate", "--het-tp-interval", "3",
        "--het-tp-emulate", "persistent:rank=1,factor=3"])
    steady = run_ranks(train_like_upstream, 2, MODEL + ["--het-tp", "--het-tp-policy", "static"])
    first = straggler[0]
    assert first["hook"] and "het-TP decision at iteration 3: migrate" in first["stdout"]
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
    assert calls == {"extra_args_provider", "layer_spec", "install_partition", "StepHook.create",
                     "before_optimizer_step", "after_optimizer_step", "het_tp_hook.begin_step",
                     "het_tp_hook.end_step"}
    for name in calls:
        owner, _, attr = name.rpartition(".")
        target = upstream.StepHook if owner in ("StepHook", "het_tp_hook") else upstream
        assert callable(getattr(target, attr or name)), name
    for path in ("pretrain_gpt.py", "gpt_builders.py", "megatron/training/training.py"):
        assert f"diff --git a/{path} b/{path}" in text


@pytest.mark.skipif(not os.environ.get("HETTP_MEGATRON_LM"),
                    reason="set HETTP_MEGATRON_LM to a Megatron-LM checkout at core_v0.16.1")
def test_the_patch_applies_to_megatron_lm():
    out = subprocess.run(["bash", os.path.join(ROOT, "patches", "apply.sh"), "--check",
                          os.environ["HETTP_MEGATRON_LM"]], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
