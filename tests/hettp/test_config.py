"""The --het-tp flags as a typed config: the generated argparse group, validation in one place,
and what each policy makes the runtime build (hettp.config, hettp.policy): pure."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from hettp.config import ConfigError, HetTPConfig, ModelShape
from hettp.plan import PartitionPlan
from hettp.planner import Planner
from hettp.policy import POLICIES, VANILLA, Policy, compared_policies

SHAPE = ModelShape(tp_size=2, num_layers=2, query_groups=4, ffn_hidden_size=256)


def _parse(argv=()):
    parser = argparse.ArgumentParser()
    HetTPConfig.add_arguments(parser)
    return parser, parser.parse_args(list(argv))


def test_every_field_is_a_flag_with_its_docstring_as_help():
    parser, args = _parse()
    actions = {a.dest: a for a in parser._actions}
    for f in HetTPConfig.flag_fields():
        action = actions[HetTPConfig.dest(f.name)]
        assert HetTPConfig.flag(f.name) in action.option_strings
        assert action.help and len(action.help) > 20, f.name  # the field's docstring
        assert getattr(args, HetTPConfig.dest(f.name)) == f.default
    assert "Cap on the share of its units" in actions["het_tp_max_resize"].help
    # choices come from the tables: the policies and the registered scorers
    assert tuple(actions["het_tp_policy"].choices) == tuple(POLICIES)
    assert "dw" in actions["het_tp_priority"].choices
    for p in POLICIES.values():
        assert f"{p.name}: " in actions["het_tp_policy"].help
    # derived fields are not flags
    assert "het_tp_partition_plan" not in actions and "het_tp_scenario" not in actions


def test_validation_returns_the_config_and_leaves_args_alone():
    _, args = _parse(
        [
            "--het-tp-policy",
            "migrate",
            "--het-tp-plan",
            "attn=3,1;mlp=200,56",
            "--het-tp-emulate",
            "persistent:rank=1,factor=2",
        ]
    )
    before = dict(vars(args))
    config = HetTPConfig.from_args(args).validated(SHAPE)
    assert vars(args) == before  # nothing written back
    assert config.het_tp  # implied by the policy
    assert config.partition_plan == PartitionPlan.parse("attn=3,1;mlp=200,56", 2, 2, 4, 256)
    assert config.scenario.factor(1, 5) == 2.0 and config.sample_interval == 8
    assert config.validated_for == SHAPE
    with pytest.raises(ConfigError, match="--het-tp-granularity 3 does not divide"):
        dataclasses.replace(config, granularity=3).validated(SHAPE)


def test_from_args_reads_what_another_parser_left_and_keeps_defaults_for_the_rest():
    config = HetTPConfig.from_args(
        argparse.Namespace(het_tp_policy="hybrid", het_tp_interval=7, unrelated=1)
    )
    assert (config.policy, config.interval, config.onset) == ("hybrid", 7, 1.3)


@pytest.mark.parametrize(
    "policy, resize, decides, timed, resizes, het_tp",
    [
        ("none", None, False, True, False, False),
        ("static", None, False, False, False, False),
        ("static", "0,0.25", False, False, True, True),
        ("resize", None, True, True, True, True),
        ("migrate", None, True, True, False, True),
        ("hybrid", None, True, True, True, True),
        ("zero", None, True, True, True, True),
        ("zero", "0,0.5", False, False, True, True),  # fixed shares replace the planner
    ],
)
def test_what_each_policy_needs(policy, resize, decides, timed, resizes, het_tp):
    config = HetTPConfig(policy=policy, resize=resize).validated(SHAPE)
    assert (config.decides, config.timed, config.resizes, config.het_tp) == (
        decides,
        timed,
        resizes,
        het_tp,
    )
    assert config.active == (het_tp or timed)


def test_emulation_alone_asks_for_timing():
    config = HetTPConfig(emulate="persistent:rank=1,factor=2").validated(SHAPE)
    assert config.timed and not config.decides and not config.het_tp


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"policy": "none", "het_tp": True},
            "--het-tp-policy none runs vanilla megatron-core layers; drop --het-tp",
        ),
        ({"policy": "migrate", "resize": "0,0.5"}, "--het-tp-policy migrate decides them itself"),
        (
            {"policy": "zero", "priority": "wg"},
            "--het-tp-policy zero ranks units by --het-tp-priority dw; drop --het-tp-priority wg",
        ),
        ({"emulate": "persistent:rank=1,factor=2"}, "--het-tp-emulate is implemented for CPU runs"),
        ({"plan": "attn=4,4;mlp=128,128"}, "--het-tp-plan: plan attn: counts [4, 4] sum to 8"),
        (
            {"emulate": "persistent:rank=1,factor=2,mode=device", "timer": "wall"},
            "mode=device slows each rank between its collectives by its own CPU time; it needs "
            "--het-tp-timer cpu and no --het-tp-emulate-dilation",
        ),
        (
            {"emulate": "persistent:rank=1,factor=2,mode=gpu"},
            "--het-tp-emulate 'persistent:rank=1,factor=2,mode=gpu': mode 'gpu' is not one of "
            "sharded, device",
        ),
        (
            {"policy": "zero", "max_resize": 0.25},
            "--het-tp-policy zero cuts a straggler's units by a fixed 50%, above "
            "--het-tp-max-resize 0.25",
        ),
        (
            {"emulate": "persistent:global=2,factor=2"},
            "--het-tp-emulate persistent:global=2,factor=2: global rank 2 is not below the "
            "world size (2)",
        ),
        ({"patience": 0}, "--het-tp-patience must be positive, got 0"),
        ({"end_patience": 0}, "--het-tp-end-patience must be positive, got 0"),
        (
            {"policy": "migrate", "memory_cap": 0.8},
            "--het-tp-memory-cap must be a finite number >= 1 (the even split's unit state), "
            "got 0.8",
        ),
        (
            {"policy": "resize", "memory_cap": 1.2},
            "--het-tp-memory-cap limits the units a migrating policy moves onto a rank; "
            "--het-tp-policy resize moves none",
        ),
    ],
)
def test_errors_name_the_flag(kwargs, message):
    cuda = kwargs.get("emulate") == "persistent:rank=1,factor=2"
    with pytest.raises(ConfigError, match=None) as err:
        HetTPConfig(**kwargs).validated(SHAPE, cuda_available=cuda)
    assert message in str(err.value)


def test_adding_a_policy_touches_the_table_and_the_planner(monkeypatch):
    """A new row in POLICIES is a flag choice, a compared policy, and a planner rule away."""
    row = Policy(
        "halve",
        "every straggler skips half its units",
        layers="het",
        times=False,
        decides=True,
        resizes=True,
        migrates=False,
        fixed_shares=False,
    )
    monkeypatch.setitem(POLICIES, "halve", row)
    with pytest.raises(ValueError, match="policy 'halve' decides, but the planner has no rule"):
        Planner("halve", {"attn": 1.0, "mlp": 1.0})

    def halve(planner, iteration, detection, model, plan, shares, before):
        new = tuple(0.5 if r in detection.stragglers else 0.0 for r in range(plan.tp_size))
        return planner._resize(new, plan, model, before, "resize", "halve")

    monkeypatch.setitem(Planner.RULES, "halve", halve)
    assert Planner("halve", {"attn": 1.0, "mlp": 1.0}).policy is row
    _, args = _parse(["--het-tp-policy", "halve"])
    config = HetTPConfig.from_args(args).validated(SHAPE)
    assert config.decides and config.resizes and config.het_tp
    assert "halve" in compared_policies()


def test_compared_policies_are_the_baseline_and_the_deciders():
    assert compared_policies() == [
        VANILLA,
        "resize",
        "migrate",
        "hybrid",
        "zero",
        "rebatch",
        "joint",
    ]
    assert POLICIES[VANILLA].vanilla


@pytest.mark.parametrize(
    "policy", [p.name for p in POLICIES.values() if p.decides and not p.rebatches]
)
def test_a_deciding_policy_at_tp_1_is_refused_by_name(policy):
    _, args = _parse(["--het-tp-policy", policy])
    config = HetTPConfig.from_args(args)
    with pytest.raises(ConfigError, match=f"--het-tp-policy {policy} decides .* TP > 1"):
        config.validated(dataclasses.replace(SHAPE, tp_size=1))
    assert config.validated(SHAPE).decides  # the same flags at TP=2 are fine


def test_at_tp_1_a_migrating_policy_needs_pipeline_stages_to_move_layers_between():
    single = ModelShape(tp_size=1, num_layers=4, query_groups=4, ffn_hidden_size=256)
    staged = dataclasses.replace(single, pipeline_stages=2)
    assert HetTPConfig(policy="migrate").validated(staged).validated_for == staged
    with pytest.raises(ConfigError, match="has nothing to split: use TP > 1 or drop the policy$"):
        HetTPConfig(policy="migrate").validated(single)
    for config in (
        HetTPConfig(policy="migrate", pipeline_moves="units"),
        HetTPConfig(policy="hybrid"),
    ):
        with pytest.raises(ConfigError, match="migrate moves layers between them"):
            config.validated(staged)
    # a layer a stage: none can move (a stage keeps at least one)
    with pytest.raises(ConfigError, match="leaves every stage its one layer: nothing can move"):
        HetTPConfig(policy="migrate").validated(dataclasses.replace(staged, num_layers=2))


def test_data_parallel_flags_are_checked_by_name():
    replicas = dataclasses.replace(SHAPE, data_parallel=2)
    _, args = _parse(["--het-dp", "--het-tp-policy", "migrate"])
    config = HetTPConfig.from_args(args)
    assert config.het_dp and config.validated(replicas).rebatches
    assert HetTPConfig(policy="rebatch").validated(replicas).rebatches  # implied
    assert HetTPConfig(policy="joint").validated(replicas).budget == 0.05
    refused = {
        "splits each global batch unevenly .* the data-parallel size is 1": (
            HetTPConfig(het_dp=True, policy="migrate"),
            SHAPE,
        ),
        "--het-tp-policy rebatch splits each global batch": (HetTPConfig(policy="rebatch"), SHAPE),
        "--het-tp-policy static decides nothing: use rebatch, joint": (
            HetTPConfig(het_dp=True),
            replicas,
        ),
        "--het-tp-policy none decides nothing": (HetTPConfig(het_dp=True, policy="none"), replicas),
        "--tensor-model-parallel-size 1 has nothing to move: use --het-tp-policy rebatch": (
            HetTPConfig(policy="joint"),
            dataclasses.replace(replicas, tp_size=1),
        ),
        "joint is not built for pipeline stages": (
            HetTPConfig(policy="joint"),
            dataclasses.replace(replicas, pipeline_stages=2, num_layers=4),
        ),
        "--het-migration-budget budgets --het-tp-policy joint's moves; --het-tp-policy "
        "migrate does not": (HetTPConfig(policy="migrate", migration_budget=0.1), SHAPE),
        r"--het-migration-budget must be within \[0, 1\], got 1.5": (
            HetTPConfig(policy="joint", migration_budget=1.5),
            replicas,
        ),
    }
    for message, (config, shape) in refused.items():
        with pytest.raises(ConfigError, match=message):
            config.validated(shape)
    assert HetTPConfig(policy="rebatch").validated(dataclasses.replace(replicas, tp_size=1))


def test_a_memory_cap_with_pipeline_stages_keeps_layers_in_their_stages():
    staged = ModelShape(
        tp_size=2, num_layers=4, query_groups=4, ffn_hidden_size=256, pipeline_stages=2
    )
    with pytest.raises(ConfigError, match="add --het-tp-pipeline-moves units"):
        HetTPConfig(policy="hybrid", memory_cap=1.2).validated(staged)
    ok = HetTPConfig(policy="hybrid", memory_cap=1.2, pipeline_moves="units").validated(staged)
    assert ok.memory_cap == 1.2


@pytest.mark.parametrize(
    "kwargs,warned",
    [
        ({}, []),
        ({"attn_granularity": 1}, ["--het-tp-attn-granularity is ignored: --het-tp-policy static"]),
        ({"attn_granularity": 1, "het_tp": True}, []),
        ({"granularity": 4, "policy": "migrate"}, []),
        ({"priority": "magnitude", "policy": "migrate"}, ["--het-tp-priority is ignored: no rank"]),
        ({"max_resize": 0.3, "policy": "hybrid"}, []),
        ({"max_resize": 0.3, "het_tp": True, "resize": "0,0.25"}, []),
        (
            {"onset": 1.5, "window": 5, "het_tp": True},
            ["--het-tp-onset is ignored: nothing is timed", "--het-tp-window is ignored"],
        ),
        ({"onset": 1.5, "emulate": "persistent:rank=1,factor=2"}, []),
        ({"interval": 10, "granularity": 1}, []),  # given at their defaults
    ],
)
def test_flags_the_run_never_reads_are_named(kwargs, warned):
    given = HetTPConfig(**kwargs)
    ignored = given.ignored(given.validated(SHAPE))
    assert len(ignored) == len(warned), ignored
    for line, start in zip(ignored, warned):
        assert line.startswith(start), ignored
