"""hettp inside an upstream Megatron-LM checkout: what patches/megatron-lm-core_v0.16.1.patch calls.

The patch adds a few calls to upstream's own code; each drives the het-TP runtime
(runtime.py) through the same lifecycle as this project's trainer, on upstream's args, model
chunk and optimizer (all megatron-core objects):

    pretrain_gpt.py   extra_args_provider=het_tp.extra_args_provider(<upstream's provider>)
    gpt_builders.py   het_tp_runtime = het_tp.create_runtime(args) (checks the --het-tp group);
                      spec = het_tp.layer_spec(het_tp_runtime, spec); after GPTModel(...):
                      het_tp_runtime.install(model)
    training.py       train(): het_tp_hook = het_tp.StepHook.create(model, optimizer,
                      opt_param_scheduler, config); hook.begin_step(iteration + 1) before
                      train_step(); model, optimizer = hook.end_step(iteration) after it;
                      train_step(): het_tp.before_optimizer_step(model) /
                      het_tp.after_optimizer_step(model) around optimizer.step()

The runtime travels with the model chunk it was installed on (runtime.runtime_of), so nothing
here is global. Supported there as here: one model chunk (no virtual pipeline), no distributed
optimizer.
"""

from __future__ import annotations

import time

from hettp.config import HetTPConfig

from .arguments import ArgumentError
from .runtime import HetTPRuntime, TrainState, runtime_of


def extra_args_provider(other=None):
    """Upstream's extra_args_provider plus the --het-tp argument group."""

    def provider(parser):
        if other is not None:
            parser = other(parser)
        HetTPConfig.add_arguments(parser)
        return parser

    return provider


def create_runtime(args) -> HetTPRuntime | None:
    """The het-TP runtime for upstream's args (None when no het-TP flag asks for anything);
    a bad flag exits with one line naming it, before any model exists."""
    try:
        return HetTPRuntime.from_args(args)
    except ArgumentError as err:
        raise SystemExit(f"het-TP: error: {err}") from None


def layer_spec(runtime: HetTPRuntime | None, spec):
    """The runtime's het-TP layer spec, or upstream's own `spec` when it has none."""
    het = runtime.layer_spec() if runtime is not None else None
    return het if het is not None else spec


class StepHook:
    """hettp's step boundary in upstream's train(): the runtime's begin and end of a step,
    where a migration may replace the model chunk and the optimizer."""

    def __init__(self, runtime: HetTPRuntime):
        self.runtime = runtime
        self._start = None

    @classmethod
    def create(cls, model, optimizer, scheduler, config) -> StepHook | None:
        """The hook of the runtime installed on `model` (None: vanilla upstream)."""
        runtime = runtime_of(model)
        if runtime is None:
            return None
        if len(model) != 1:
            raise SystemExit("het-TP: error: one model chunk is supported (no virtual pipeline)")
        runtime.attach(TrainState(model[0], optimizer, scheduler, config))
        return cls(runtime)

    def begin_step(self, iteration: int) -> None:
        self.runtime.begin_step(iteration)
        self._start = time.perf_counter()

    def end_step(self, iteration: int):
        """After the step that was `iteration`: upstream's (model, optimizer), new ones when
        units migrated."""
        elapsed = time.perf_counter() - (self._start or time.perf_counter())
        end = self.runtime.end_step(iteration, elapsed)
        return [end.model], end.optimizer


def before_optimizer_step(model) -> None:
    runtime = runtime_of(model)
    if runtime is not None and runtime.state is not None:
        runtime.before_optimizer_step()


def after_optimizer_step(model) -> None:
    runtime = runtime_of(model)
    if runtime is not None and runtime.state is not None:
        runtime.after_optimizer_step()
