"""hettp inside an upstream Megatron-LM checkout: what patches/megatron-lm-core_v0.16.1.patch calls.

The patch adds a few calls to upstream's own code; each drives the het-TP runtime
(runtime.py) through the same lifecycle as this project's trainer, on upstream's args, model
chunk and optimizer (all megatron-core objects):

    pretrain_gpt.py   extra_args_provider=het_tp.extra_args_provider(<upstream's provider>)
    gpt_builders.py   het_tp_runtime = het_tp.create_runtime(args) (checks the --het-tp group);
                      spec = het_tp.layer_spec(het_tp_runtime, spec); after GPTModel(...):
                      het_tp.install(het_tp_runtime, model, args) (starts in the plan of the
                      checkpoint at --load, if any)
    training.py       pretrain(): model, optimizer = het_tp.current(model, optimizer) after
                      train(), so the final save and evaluation use what a migration rebuilt;
                      train(): het_tp_hook = het_tp.StepHook.create(model, optimizer,
                      opt_param_scheduler, config); hook.begin_step(iteration + 1) before
                      train_step(); model, optimizer = hook.end_step(iteration) after it;
                      train_step(): het_tp.before_optimizer_step(model) /
                      het_tp.after_optimizer_step(model) around optimizer.step()
    checkpointing.py  save_checkpoint(): het_tp.add_checkpoint_state(state_dict, model): the
                      plan (common) and each TP rank's runtime state; StepHook.create takes the
                      state back after upstream's load_checkpoint

The runtime travels with the model chunk it was installed on (runtime.runtime_of), so nothing
here is global. Supported there as here: one model chunk (no virtual pipeline), no distributed
optimizer, megatron-core's local layers, torch_dist checkpoints.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from hettp.config import HetTPConfig

from . import checkpointing
from .arguments import ArgumentError
from .partition import comm_device
from .runtime import HetTPRuntime, SavedPlan, TrainState, runtime_of

# Upstream flags het-TP layers cannot honour: (attribute, refused when, what to do). Checked
# before any model is built; each is refused by name instead of silently replaced.
_REFUSED = (
    (
        "transformer_impl",
        lambda v: v not in (None, "local"),
        "--transformer-impl {value}: het-TP builds megatron-core's local layers; "
        "pass --transformer-impl local",
    ),
    ("use_kitchen", bool, "--use-kitchen: het-TP builds megatron-core's local layers"),
    ("spec", lambda v: v is not None, "--spec: het-TP replaces the layer spec by its own"),
    (
        "heterogeneous_layers_config_path",
        lambda v: v is not None,
        "--heterogeneous-layers-config-path: het-TP needs one layer spec for every layer",
    ),
    (
        "experimental_attention_variant",
        lambda v: v is not None,
        "--experimental-attention-variant: het-TP shards standard self-attention only",
    ),
    (
        "ckpt_format",
        lambda v: v not in (None, "torch_dist"),
        "--ckpt-format {value}: its per-rank files would hold this plan's uneven shards, "
        "which no other plan or vanilla can load; use --ckpt-format torch_dist",
    ),
    (
        "cuda_graph_impl",
        lambda v: v not in (None, "none"),
        "--cuda-graph-impl {value}: captured graphs would keep the pre-migration layers",
    ),
    (
        "enable_cuda_graph",
        bool,
        "--enable-cuda-graph: captured graphs would keep the pre-migration layers",
    ),
    (
        "external_cuda_graph",
        bool,
        "--external-cuda-graph: captured graphs would keep the pre-migration layers",
    ),
    (
        "use_distributed_optimizer",
        bool,
        "--use-distributed-optimizer: upstream's checkpoints save its state as flat ranges of "
        "each parameter, which het-TP's per-unit shards cannot describe; hettp's own "
        "pretrain_gpt.py supports it (saved in the plain optimizer's layout)",
    ),
    (
        "ckpt_assume_constant_structure",
        bool,
        "--ckpt-assume-constant-structure: a migration changes which rank holds which shard, "
        "so the structure of the checkpoint is not constant",
    ),
)


def extra_args_provider(other=None):
    """Upstream's extra_args_provider plus the --het-tp argument group."""

    def provider(parser):
        if other is not None:
            parser = other(parser)
        HetTPConfig.add_arguments(parser)
        return parser

    return provider


# Refused for any het-TP runtime (also timing only): its per-TP-rank checkpoint state and its
# decisions assume one pipeline stage and no context parallelism.
_REFUSED_ALWAYS = (
    (
        "pipeline_model_parallel_size",
        lambda v: (v or 1) > 1,
        "--pipeline-model-parallel-size {value}: het-TP runs in one pipeline stage for now",
    ),
    (
        "context_parallel_size",
        lambda v: (v or 1) > 1,
        "--context-parallel-size {value}: het-TP has no context parallelism yet",
    ),
    (
        "non_persistent_save_interval",
        lambda v: v is not None,
        "--non-persistent-save-interval: het-TP keeps its plan in persistent checkpoints only",
    ),
)


def _first_refusal(args, table) -> str | None:
    for attr, refused, message in table:
        value = getattr(args, attr, None)
        if refused(value):
            return message.format(value=value)
    return None


def create_runtime(args) -> HetTPRuntime | None:
    """The het-TP runtime for upstream's args (None when no het-TP flag asks for anything);
    a bad flag exits with one line naming it, before any model exists."""
    try:
        compress = getattr(args, "het_dp_compress", "none")
        if compress != "none":
            raise ArgumentError(
                f"--het-dp-compress {compress}: upstream's DDP reduces the gradients itself; "
                "hettp's own pretrain_gpt.py compresses them"
            )
        runtime = HetTPRuntime.from_args(args)
        if runtime is not None:
            refused = _first_refusal(args, _REFUSED_ALWAYS)
            if refused is None and runtime.config.rebatches:
                refused = (
                    "--het-dp (and --het-tp-policy rebatch or joint): upstream's data loader "
                    "gives every data-parallel replica the same micro-batches; hettp's own "
                    "pretrain_gpt.py splits them unevenly"
                )
            if refused is None and runtime.config.het_tp:
                refused = _first_refusal(args, _REFUSED)
            if refused is not None:
                raise ArgumentError(refused)
    except ArgumentError as err:
        raise SystemExit(f"het-TP: error: {err}") from None
    return runtime


def layer_spec(runtime: HetTPRuntime | None, spec):
    """The runtime's het-TP layer spec, or upstream's own `spec` when it has none."""
    het = runtime.layer_spec() if runtime is not None else None
    return het if het is not None else spec


def _checkpoint_to_resume(args, iteration: int | None = None) -> str | None:
    """The checkpoint folder upstream's load_checkpoint reads from --load, if any: at
    `iteration` (what it loaded), else --ckpt-step, else the newest any rank reads from the
    tracker, as upstream takes it (collective). Read per rank, a job loading from a folder
    another job saves into could start ranks in different plans."""
    root = getattr(args, "load", None)
    if not root or getattr(args, "finetune", False):
        return None
    if iteration is None:
        iteration = getattr(args, "ckpt_step", None)
    if iteration is None:
        iteration = _newest_over_ranks(root)
    if iteration is None:
        return None
    path = checkpointing.checkpoint_dir(root, iteration)
    from megatron.core import dist_checkpointing

    # a torch or torch_dcp checkpoint (--auto-detect-ckpt-format) holds no het-TP plan
    return path if dist_checkpointing.check_is_distributed_checkpoint(path) else None


def _newest_over_ranks(root: str) -> int | None:
    """The largest iteration any rank reads from `root`'s tracker (upstream's read_metadata
    takes the same maximum); None where none reads one ('release', or no tracker)."""
    try:
        mine = checkpointing.latest_iteration(root)
    except checkpointing.CheckpointError:  # e.g. 'release': no het-TP state to resume
        mine = None
    newest = torch.tensor([-1 if mine is None else mine], dtype=torch.long, device=comm_device())
    dist.all_reduce(newest, op=dist.ReduceOp.MAX)
    return None if newest.item() < 0 else int(newest.item())


def _common_state(path: str) -> dict:
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load_common_state_dict(path)


def install(runtime: HetTPRuntime | None, model, args) -> None:
    """Right after GPTModel(...): the runtime owns the units and starts in the plan of the
    checkpoint upstream will load (when it fits), else --het-tp-plan, else the even split."""
    if runtime is None:
        return
    saved = None
    path = _checkpoint_to_resume(args)
    if path is not None and runtime.config.het_tp:
        saved = SavedPlan.from_dict(_common_state(path).get("het_tp_plan"))
    runtime.install(model, saved)


def _saved_tp_size(common: dict) -> int | None:
    saved = common.get("args")
    if isinstance(saved, dict):
        return saved.get("tensor_model_parallel_size")
    return getattr(saved, "tensor_model_parallel_size", None)


def _load_runtime_state(runtime: HetTPRuntime, args) -> None:
    """The runtime's per-TP-rank state from the checkpoint upstream just loaded (when it was
    saved by a het-TP run of the same TP size); collective, like upstream's load."""
    if not getattr(args, "iteration", 0):
        return
    path = _checkpoint_to_resume(args, iteration=args.iteration)
    if path is None:
        return
    common = _common_state(path)
    if "het_tp_plan" not in common or _saved_tp_size(common) != args.tensor_model_parallel_size:
        return
    from megatron.core import dist_checkpointing

    request = {"het_tp_state": checkpointing.runtime_state(runtime)}
    runtime.load_state_dict(dist_checkpointing.load(request, path)["het_tp_state"])


def add_checkpoint_state(state_dict: dict, model) -> None:
    """In upstream's save_checkpoint: the plan the checkpoint is saved in (common) and each TP
    rank's runtime state, under the keys this project's trainer uses; vanilla ignores both."""
    runtime = runtime_of(model)
    if runtime is not None and runtime.state is not None:
        state_dict.update(checkpointing.runtime_entries(runtime))


def current(model, optimizer):
    """What upstream's pretrain() should use after train(): the model chunks and optimizer a
    migration rebuilt (the ones given when nothing was rebuilt, or without het-TP)."""
    runtime = runtime_of(model)
    if runtime is None or runtime.state is None:
        return model, optimizer
    return [runtime.state.model], runtime.state.optimizer


def _asks_for_het_tp(args) -> bool:
    return HetTPConfig.from_args(args).active


class StepHook:
    """hettp's step boundary in upstream's train(): the runtime's begin and end of a step,
    where a migration may replace the model chunk and the optimizer."""

    def __init__(self, runtime: HetTPRuntime):
        self.runtime = runtime
        self._start = None

    @classmethod
    def create(cls, model, optimizer, scheduler, config) -> StepHook | None:
        """The hook of the runtime installed on `model` (None: vanilla upstream)."""
        from megatron.training import get_args

        args = get_args()
        runtime = runtime_of(model)
        if runtime is None:
            if getattr(args, "use_legacy_models", False) and _asks_for_het_tp(args):
                raise SystemExit(
                    "het-TP: error: --use-legacy-models builds no megatron-core GPTModel for "
                    "het-TP to shard: drop it"
                )
            return None
        if len(model) != 1:
            raise SystemExit("het-TP: error: one model chunk is supported (no virtual pipeline)")
        _load_runtime_state(runtime, args)
        state = TrainState(model[0], optimizer, scheduler, config)
        runtime.attach(state, iteration=getattr(args, "iteration", 0) or 0)
        return cls(runtime)

    def begin_step(self, iteration: int) -> None:
        # upstream's train() has updated megatron-core's global calculator for this step
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        self.runtime.begin_step(iteration, get_num_microbatches())
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
