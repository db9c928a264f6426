"""Where a checkpoint's optimizer state keeps its parameter groups, in each of megatron-core's
layouts, and the flag-set values carried from one optimizer's groups to another's."""

from __future__ import annotations

import types

import pytest

from megatron.hetero.portable_optimizer import saved_param_groups, set_group_values

GROUPS = [{"max_lr": 1e-3, "eps": 1e-8, "lr": 5e-4}, {"max_lr": 2e-3, "eps": 1e-8, "lr": 1e-3}]


def test_groups_are_found_in_every_layout():
    assert saved_param_groups({"param_groups": GROUPS, "state": {}}) == GROUPS  # fp32
    assert saved_param_groups({"optimizer": {"param_groups": GROUPS}}) == GROUPS  # bf16 / fp16
    chained = {0: {"optimizer": {"param_groups": GROUPS[:1]}}, 1: {"param_groups": GROUPS[1:]}}
    assert saved_param_groups(chained) == GROUPS
    assert saved_param_groups({"state": {}}) is None and saved_param_groups(None) is None


def test_flag_values_move_but_not_the_scheduled_rate():
    live = types.SimpleNamespace(
        param_groups=[{"max_lr": 9.0, "eps": 9.0, "lr": 7.0} for _ in GROUPS]
    )
    set_group_values(live, GROUPS)
    assert [g["max_lr"] for g in live.param_groups] == [1e-3, 2e-3]
    assert [g["lr"] for g in live.param_groups] == [7.0, 7.0]  # the scheduler's to set
    with pytest.raises(ValueError, match="2 parameter groups to take values from, 1 here"):
        set_group_values(types.SimpleNamespace(param_groups=[{}]), GROUPS)


def test_a_fused_adam_s_step_count_comes_from_the_groups_that_hold_parameters():
    """FusedAdam counts steps per group and never advances an empty one (a DP rank's share of
    a group under the distributed optimizer can be none): its stale count must not reach the
    rebuilt optimizer's groups, nor a checkpoint's."""
    from megatron.hetero.unit_state import carry_group_steps

    param = object()
    source = types.SimpleNamespace(
        param_groups=[{"params": [param], "step": 20}, {"params": [], "step": 3}]
    )
    target = types.SimpleNamespace(param_groups=[{"params": [param]}, {"params": [param]}])
    carry_group_steps(source, target)
    assert [g["step"] for g in target.param_groups] == [20, 20]
    # torch's Adam counts per parameter: nothing to carry here
    plain = types.SimpleNamespace(param_groups=[{"params": [param]}])
    carry_group_steps(plain, target := types.SimpleNamespace(param_groups=[{"params": []}]))
    assert "step" not in target.param_groups[0]
