"""hettp inside an upstream Megatron-LM checkout: what patches/megatron-lm-core_v0.16.1.patch calls.

The patch adds four calls to upstream's own code, and everything else happens here on upstream's
args, model chunk and optimizer (all megatron-core objects, as in this project's trainer):

    pretrain_gpt.py   extra_args_provider=upstream.extra_args_provider(<upstream's provider>)
    gpt_builders.py   spec = upstream.layer_spec(args) (validates the --het-tp group); after
                      GPTModel(...): upstream.install_partition(args, model)
    training.py       train(): hook = upstream.StepHook.create(args, model, optimizer,
                      opt_param_scheduler, config); hook.begin_step(iteration + 1) before
                      train_step(); model, optimizer = hook.end_step(iteration) after it;
                      train_step(): upstream.before_optimizer_step() / after_optimizer_step()
                      around optimizer.step()

Supported there as here: one model chunk (no virtual pipeline), no distributed optimizer.
"""

from __future__ import annotations

import copy
import time
from types import SimpleNamespace

import torch

from .arguments import ArgumentError, _add_het_tp_args, validate_het_tp_args
from .log import Logger
from .training import (TrainState, het_tp_step_begin, het_tp_step_end, make_controller,
                       make_resizer, wants_controller)

_PARTITION = None  # the HetPartition of the model built in this process
_HOOK = None  # the StepHook of the running train()


def extra_args_provider(other=None):
    """Upstream's extra_args_provider plus the --het-tp argument group."""

    def provider(parser):
        if other is not None:
            parser = other(parser)
        _add_het_tp_args(parser)
        return parser

    return provider


def layer_spec(args):
    """Check the --het-tp flags (exit with an error naming the flag, before any model
    exists); the het-TP layer spec when --het-tp, else None (upstream keeps its own)."""
    # upstream keeps --num-query-groups at 1 unless --group-query-attention
    view = copy.copy(args)
    if not getattr(args, "group_query_attention", True):
        view.num_query_groups = args.num_attention_heads
    try:
        validate_het_tp_args(view, torch.cuda.is_available())
        for derived in ("het_tp", "het_tp_plan_obj", "het_tp_resize_shares"):
            setattr(args, derived, getattr(view, derived))
        if args.het_tp and getattr(args, "virtual_pipeline_model_parallel_size", None):
            raise ArgumentError("--het-tp supports one model chunk: drop "
                                "--num-layers-per-virtual-pipeline-stage")
        for flag, what in (("num_experts", "mixture of experts"), ("mtp_num_layers",
                                                                    "multi-token prediction"),
                           ("multi_latent_attention", "multi-latent attention")):
            if args.het_tp and getattr(args, flag, None):
                raise ArgumentError(f"--het-tp has no {what} layers: drop "
                                    f"--{flag.replace('_', '-')}")
        if args.het_tp and getattr(args, "use_distributed_optimizer", False):
            raise ArgumentError("--het-tp migrates Adam state of the plain optimizer: drop "
                                "--use-distributed-optimizer")
    except ArgumentError as err:
        raise SystemExit(f"het-TP: error: {err}") from None
    if not args.het_tp:
        return None
    from .spec import get_het_gpt_layer_spec

    return get_het_gpt_layer_spec(args.normalization, args.het_tp_granularity)


def install_partition(args, model) -> None:
    """Right after the GPTModel is built (before Float16Module, DDP and the optimizer): own its
    units and move them to --het-tp-plan."""
    global _PARTITION
    if not args.het_tp:
        return
    from .partition import HetPartition

    _PARTITION = HetPartition(model)
    if args.het_tp_plan_obj is not None:
        _PARTITION.install(model, args.het_tp_plan_obj)


class StepHook:
    """hettp's step boundary in upstream's train(): timing, resizing around the optimizer step,
    and the control loop, which may replace the model chunk and the optimizer."""

    def __init__(self, args, model, optimizer, scheduler, config):
        if len(model) != 1:
            raise SystemExit("het-TP: error: one model chunk is supported (no virtual pipeline)")
        self.state = TrainState(model[0], optimizer, scheduler, config, _PARTITION)
        self.state.resizer = make_resizer(args, _PARTITION, model[0]) if _PARTITION else None
        self.logger = Logger(SimpleNamespace(tensorboard_dir=None))  # upstream logs the rest
        if self.state.resizer is not None and args.het_tp_resize_shares is not None:
            self.state.resizer.resize(self.state, args.het_tp_resize_shares)  # after --load
            self.logger.resize(0, self.state.resizer, "initial")
        self.controller = make_controller(args, self.state)
        self._start = None

    @classmethod
    def create(cls, args, model, optimizer, scheduler, config):
        """The hook when --het-tp or a het-TP policy is on, else None (vanilla upstream)."""
        global _HOOK
        _HOOK = None
        if args.het_tp or wants_controller(args):
            _HOOK = cls(args, model, optimizer, scheduler, config)
        return _HOOK

    def begin_step(self, iteration: int) -> None:
        het_tp_step_begin(iteration, self.state, self.controller)
        self._start = time.perf_counter()

    def end_step(self, iteration: int):
        """After the step that was `iteration`: returns upstream's (model, optimizer), new ones
        when units migrated."""
        elapsed = time.perf_counter() - (self._start or time.perf_counter())
        het_tp_step_end(iteration, self.state, self.controller, self.logger, elapsed)
        return [self.state.model], self.state.optimizer


def before_optimizer_step() -> None:
    if _HOOK is not None and _HOOK.state.resizer is not None:
        _HOOK.state.resizer.before_step(_HOOK.state)


def after_optimizer_step() -> None:
    if _HOOK is not None and _HOOK.state.resizer is not None:
        _HOOK.state.resizer.after_step(_HOOK.state)
