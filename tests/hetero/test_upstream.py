"""hettp inside an upstream Megatron-LM checkout: the glue the patch calls (megatron/hetero/
upstream.py), driven in the order and places the patch puts its calls, on real gloo ranks; and
the patch itself against a Megatron-LM core_v0.16.1 checkout when one is given."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

import pytest
import torch

from tests.utils import PATCH, ROOT, fresh_megatron_lm, run_ranks, upstream_resume_paths

PATCHED = (
    "pretrain_gpt.py",
    "gpt_builders.py",
    "megatron/training/training.py",
    "megatron/training/checkpointing.py",
)


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
        (
            ["--het-tp"],
            {"use_distributed_optimizer": True},
            "--use-distributed-optimizer: upstream's checkpoints",
        ),
        (["--het-tp-plan", "attn=4,1;mlp=128,128"], {}, "--het-tp-plan"),
        # upstream flags het-TP layers cannot honour are refused by name, not replaced
        (["--het-tp"], {"transformer_impl": "transformer_engine"}, "pass --transformer-impl local"),
        (["--het-tp"], {"spec": ["my.module", "spec"]}, "--spec: het-TP replaces"),
        (["--het-tp"], {"ckpt_format": "torch"}, "--ckpt-format torch: its per-rank files"),
        (["--het-tp"], {"ckpt_format": "torch_dcp"}, "--ckpt-format torch_dcp"),
        (["--het-tp"], {"cuda_graph_impl": "local"}, "--cuda-graph-impl local"),
        (["--het-tp"], {"ckpt_assume_constant_structure": True}, "assume-constant-structure"),
        (["--het-tp"], {"transformer_impl": "inference_optimized"}, "inference_optimized"),
        # a slowed rank the run does not have (upstream's args: TP 2 x DP 1)
        (
            ["--het-tp-policy", "migrate", "--het-tp-emulate", "persistent:global=2,factor=2"],
            {"data_parallel_size": 1},
            "global rank 2 is not below the world size (2)",
        ),
        # any runtime, timing only too
        (["--het-tp-policy", "none"], {"pipeline_model_parallel_size": 2}, "one pipeline stage"),
        (["--het-tp-policy", "none"], {"context_parallel_size": 2}, "--context-parallel-size 2"),
        (["--het-tp"], {"non_persistent_save_interval": 5}, "--non-persistent-save-interval"),
        (["--het-dp", "--het-tp-policy", "migrate"], {"data_parallel_size": 2}, "--het-dp (and"),
        (["--het-tp-policy", "rebatch"], {"data_parallel_size": 2}, "upstream's data loader"),
        (["--het-dp-compress", "int8"], {"data_parallel_size": 2}, "upstream's DDP reduces"),
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


def test_upstreams_defaults_pass_the_refusals():
    from megatron.hetero import upstream

    defaults = dict(
        transformer_impl="local",
        spec=None,
        qk_layernorm=False,
        qk_l2_norm=False,
        ckpt_format="torch_dist",
        cuda_graph_impl="none",
        enable_cuda_graph=False,
        external_cuda_graph=False,
        ckpt_assume_constant_structure=False,
    )
    assert upstream.create_runtime(_upstream_args(["--het-tp"], **defaults)) is not None
    # a runtime without het layers (timing only) keeps upstream's layers: nothing to refuse
    timed = _upstream_args(["--het-tp-policy", "none"], transformer_impl="transformer_engine")
    assert upstream.layer_spec(upstream.create_runtime(timed), "theirs") == "theirs"


def test_current_is_what_the_runtime_holds_after_a_rebuild():
    from megatron.hetero import upstream
    from megatron.hetero.runtime import TrainState

    class Chunk(torch.nn.Module):
        pass

    chunk, rebuilt = Chunk(), Chunk()
    assert upstream.current([chunk], "optimizer") == ([chunk], "optimizer")  # vanilla
    runtime = upstream.create_runtime(_upstream_args(["--het-tp-policy", "none"]))
    runtime.install(chunk)
    assert upstream.current([chunk], "optimizer") == ([chunk], "optimizer")  # not attached yet
    runtime.state = TrainState(rebuilt, "rebuilt optimizer", None, None)
    assert upstream.current([chunk], "optimizer") == ([rebuilt], "rebuilt optimizer")
    runtime.close()


def test_create_runtime_counts_query_groups_as_upstream_does():
    from megatron.hetero import upstream

    # without --group-query-attention upstream leaves --num-query-groups at 1: 4 heads = 4 units
    runtime = upstream.create_runtime(_upstream_args(["--het-tp-plan", "attn=3,1;mlp=192,64"]))
    assert runtime.config.partition_plan.counts(0, "attn") == (3, 1)
    assert upstream.create_runtime(_upstream_args(["--het-tp-policy", "static"])) is None
    assert upstream.layer_spec(None, "theirs") == "theirs"  # vanilla keeps upstream's spec


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
        "install",
        "current",
        "add_checkpoint_state",
        "StepHook.create",
        "before_optimizer_step",
        "after_optimizer_step",
        "het_tp_hook.begin_step",
        "het_tp_hook.end_step",
    }
    for name in calls:
        owner, _, attr = name.rpartition(".")
        target = upstream.StepHook if owner in ("StepHook", "het_tp_hook") else upstream
        assert callable(getattr(target, attr or name)), name
    for path in PATCHED:
        assert f"diff --git a/{path} b/{path}" in text


needs_upstream = pytest.mark.skipif(
    not os.environ.get("HETTP_MEGATRON_LM"),
    reason="set HETTP_MEGATRON_LM to a Megatron-LM checkout at core_v0.16.1 "
    "(CI extracts ../shared/upstream's)",
)


@needs_upstream
def test_the_patch_applies_to_a_fresh_copy_of_megatron_lm(tmp_path):
    """Apply, byte-compile the patched files, and find the glue's calls where the patch puts
    them; the CPU shims' upstream lines are found in the fresh and the patched tree."""
    from megatron.hetero import upstream_cpu

    # an extracted tree inside another git repository (a project's own checkout): git apply
    # run there patched nothing, silently, and apply.sh said "patched"
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    tree = fresh_megatron_lm(str(tmp_path / "Megatron-LM"))
    upstream_cpu.check(tree)
    apply = os.path.join(ROOT, "patches", "apply.sh")
    out = subprocess.run(["bash", apply, "--check", tree], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    out = subprocess.run(["bash", apply, tree], capture_output=True, text=True)
    assert out.returncode == 0 and "patched" in out.stdout, out.stdout + out.stderr
    for path in PATCHED:
        source = open(os.path.join(tree, path)).read()
        compile(source, path, "exec")  # still valid Python
        assert "from megatron.hetero import upstream as het_tp" in source, path
    assert (
        "het_tp.install(het_tp_runtime, model, args)"
        in open(os.path.join(tree, "gpt_builders.py")).read()
    )
    upstream_cpu.check(tree)
    # a second apply is refused (the patch no longer applies), leaving the tree as it is
    again = subprocess.run(["bash", apply, tree], capture_output=True, text=True)
    assert again.returncode != 0


def test_every_rank_resumes_the_checkpoint_upstream_loads(tmp_path):
    """Ranks that read the tracker apart (another job saving into --load between their reads)
    take the newest any rank read, as upstream's read_metadata does: each rank read its own,
    and ranks could start in different plans. After the load, the iteration upstream loaded."""
    for iteration in (3, 6):
        folder = tmp_path / f"iter_{iteration:07d}"
        folder.mkdir()
        (folder / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    paths = run_ranks(upstream_resume_paths, 2, str(tmp_path), [3, 6], 6)
    assert (
        {p["before"] for p in paths}
        == {p["after"] for p in paths}
        == {str(tmp_path / "iter_0000006")}
    )
    paths = run_ranks(upstream_resume_paths, 2, str(tmp_path), [None, None], 0)
    assert [p["before"] for p in paths] == [None, None]


def test_upstream_s_qk_norms_reach_the_het_layer_spec():
    """--qk-layernorm or --qk-l2-norm on upstream's args: the runtime built from them gives
    het-TP's attention those query and key norms (megatron-core's IdentityOp without)."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.torch_norm import L2Norm

    from megatron.hetero import upstream

    for flags, want in (
        ({"qk_layernorm": True}, lambda norm: norm not in (IdentityOp, L2Norm)),
        ({"qk_l2_norm": True}, lambda norm: norm is L2Norm),
        ({}, lambda norm: norm is IdentityOp),
    ):
        runtime = upstream.create_runtime(_upstream_args(["--het-tp"], **flags))
        attention = upstream.layer_spec(runtime, "theirs").submodules.self_attention.submodules
        for norm in (attention.q_layernorm, attention.k_layernorm):
            assert want(norm), (flags, norm)


@needs_upstream
@pytest.mark.skipif(torch.cuda.is_available(), reason="upstream's parser imports on CPU hosts")
def test_the_megatron_lm_flag_list_is_the_checkout_s():
    """pretrain_gpt.py tells an unsupported Megatron-LM flag from a typo by
    megatron/hetero/megatron_lm_flags.py: it must be the checkout's own parser's list."""
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "scripts", "megatron_lm_flags.py"),
            os.environ["HETTP_MEGATRON_LM"],
            "--check",
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"),
    )
    assert out.returncode == 0 and "up to date" in out.stdout, out.stdout + out.stderr
