"""The pretraining loop: Megatron-LM's train / evaluate / checkpoint cycle on megatron-core.

Steps are driven by megatron-core's `get_forward_backward_func`, so pipeline parallelism can be
switched on later without restructuring the loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import random
import time
from datetime import datetime, timedelta
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel as DDP
from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.timers import Timers
from megatron.core.transformer.module import Float16Module

from hettp.metrics import MetricsWriter

from . import checkpointing, child_processes, cpu_compat
from .arguments import SEED_STRIDE, local_rank, same_folder
from .batch_schedule import BatchSchedule, StepBatch
from .data import build_datasets, build_loader, get_batch, tokenizer_from_args
from .ddp import HetDDP, gathered_params
from .flops import model_flops_per_sample
from .log import Logger, configure_logging
from .model import build_gpt_model, transformer_config
from .param_norm import params_l2_norm
from .partition import comm_device
from .profiling import StepProfiler
from .progress_log import ProgressLog
from .runtime import HetTPRuntime, SavedPlan, TrainState
from .save_lock import SaveLock, SaveLockError
from .stopping import ExitWatch, check_finite


@dataclasses.dataclass(frozen=True)
class StepResult:
    """One optimizer step, as the iteration line reports it."""

    loss: float  # lm loss, token mean over the global batch
    grad_norm: float | None  # None where gradients are not clipped
    skipped: bool  # the update was not applied (fp16 overflow)
    loss_scale: float  # 1.0 unless fp16's scaler is on
    num_zeros: float | None = None  # zero gradient elements (--log-num-zeros-in-grad)
    params_norm: float | None = None  # after the step (--log-params-norm)


@dataclasses.dataclass
class TrainResult:
    iteration: int
    consumed_train_samples: int
    losses: dict  # iteration -> lm loss
    eval_losses: dict  # iteration -> lm loss on the validation split
    metrics_file: str | None
    test_loss: float | None = None  # on the test split, after the last iteration


def initialize(args) -> None:
    """Process group, megatron-core parallel state, seeds. CPU shims first when there is no CUDA;
    child processes (checkpoint writers, loader workers) set to die with this rank."""
    cpu_compat.activate()
    child_processes.install()
    configure_logging(args)
    if not dist.is_initialized():
        _default_single_process_env()
        if torch.cuda.is_available():
            torch.cuda.set_device(local_rank(args))
        dist.init_process_group(
            args.distributed_backend, timeout=timedelta(minutes=args.distributed_timeout_minutes)
        )
    if dist.get_world_size() != args.world_size:
        raise RuntimeError(
            f"validated for world size {args.world_size}, "
            f"but the process group has {dist.get_world_size()} ranks"
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
    )
    set_seed(args.seed)


def _default_single_process_env() -> None:
    """Let `python pretrain_gpt.py ...` run as a world of one, without torchrun."""
    if "RANK" in os.environ:
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )


def set_seed(seed: int) -> None:
    """Megatron-LM's seeding: the same seed on every rank of a pipeline stage.

    torch.manual_seed on every rank matters on CPU: with --use-cpu-initialization each rank
    builds the full weight and keeps its slice, so all ranks must draw the same numbers.
    """
    seed += SEED_STRIDE * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def optimizer_config(args, timers: Timers | None = None) -> OptimizerConfig:
    return OptimizerConfig(
        timers=timers,
        barrier_with_L1_time=args.barrier_with_L1_time,
        optimizer=args.optimizer,
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum,
        clip_grad=args.clip_grad,
        fp16=args.fp16,
        bf16=args.bf16,
        params_dtype=args.params_dtype,
        loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis,
        decoupled_lr=args.decoupled_lr,
        decoupled_min_lr=args.decoupled_min_lr,
        use_distributed_optimizer=args.use_distributed_optimizer,
        overlap_param_gather=args.overlap_param_gather,
        log_num_zeros_in_grad=args.log_num_zeros_in_grad,
    )


def scheduler_kwargs(args) -> dict:
    """OptimizerParamScheduler's arguments, counted in samples (Megatron-LM's; each step
    advances it by the global batch)."""
    return dict(
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_steps,
        lr_decay_steps=args.lr_decay_steps,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.start_wd,
        end_wd=args.end_wd,
        wd_incr_steps=args.train_samples_total,
        wd_incr_style=args.weight_decay_incr_style,
        wsd_decay_steps=args.wsd_decay_steps,
        lr_wsd_decay_style=args.lr_wsd_decay_style,
    )


def setup_model_and_optimizer(args, vocab_size, runtime=None, saved_plan=None) -> TrainState:
    """megatron-core's DDP-wrapped GPTModel, its optimizer and LR scheduler, wired together.

    With a het-TP runtime the layers come from its spec, and it takes the units over (moving
    them to its starting plan, or `saved_plan`'s) before the optimizer exists.
    """
    config = transformer_config(args)
    # --timing-log-level: megatron-core's schedule, gradient sync and optimizer time their
    # phases through the configs' timers (a rebuilt optimizer keeps its config's)
    config.timers = Timers(args.timing_log_level, args.timing_log_option)
    config.barrier_with_L1_time = args.barrier_with_L1_time
    if runtime is not None:
        runtime.configure(config, saved_plan)  # a checkpoint's split of layers over stages
    module = build_gpt_model(
        args, config, vocab_size, runtime.layer_spec() if runtime is not None else None
    )
    if runtime is not None:
        runtime.install(module, saved_plan)
    if args.fp16 or args.bf16:
        module = Float16Module(config, module)  # as Megatron-LM: half weights, fp32 loss
    # het-TP layers: the DP reduction of TP-replicated gradients must not depend on the plan
    compress = getattr(args, "het_dp_compress", "none")
    if runtime is None and compress == "none":
        model = DDP(config, ddp_config(args), module)
    else:
        model = HetDDP(config, ddp_config(args), module, compress=compress)
    optimizer = get_megatron_optimizer(optimizer_config(args, config.timers), [model])
    # At --load, checkpointing.load_checkpoint refuses a changed schedule unless a flag says
    # whose to follow; megatron-core then takes that one.
    scheduler = OptimizerParamScheduler(
        optimizer,
        **scheduler_kwargs(args),
        use_checkpoint_opt_param_scheduler=not args.override_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
    )
    config.no_sync_func = model.no_sync
    if args.overlap_grad_reduce:  # as Megatron-LM's train() (a rebuild rebinds both)
        config.grad_sync_func = model.start_grad_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss if (args.fp16 or args.bf16) else None
    return TrainState(model, optimizer, scheduler, config)


def ddp_config(args) -> DistributedDataParallelConfig:
    return DistributedDataParallelConfig(
        # Megatron-LM's: bf16 gradients are reduced in fp32 unless asked otherwise, fp16 ones
        # only when asked
        grad_reduce_in_fp32=(args.bf16 and not args.grad_reduce_in_bf16)
        or args.accumulate_allreduce_grads_in_fp32,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        bucket_size=_bucket_size(args),
    )


def _bucket_size(args) -> int | None:
    """Megatron-LM's gradient bucket size: none without overlap (one reduce after backward),
    else --ddp-bucket-size or max(40M, 1M x data-parallel size) elements."""
    if not args.overlap_grad_reduce:
        return None
    if args.ddp_bucket_size is not None:
        return args.ddp_bucket_size
    return max(40_000_000, 1_000_000 * args.data_parallel_size)


def loss_func(loss_mask, output_tensor, weight: float = 1.0):
    """Sum of masked token losses, its token count, and both for reporting (Megatron-LM's).
    `weight` scales the loss that is backpropagated, not the report (--het-dp: a replica's
    share of the global batch)."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().detach().to(torch.int)
    report = torch.stack([loss.detach().clone(), mask.sum().detach()])
    if weight != 1.0:
        loss = loss * weight
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model, loss_weight: float = 1.0):
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    timers = getattr(model, "config", None) and model.config.timers
    if timers is not None:
        timers("batch-generator", log_level=2).start()
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator, device)
    if timers is not None:
        timers("batch-generator").stop()
    output = model(tokens, position_ids, attention_mask, labels=labels)
    return output, partial(loss_func, loss_mask, weight=loss_weight)


def _add_reports(total, losses_reduced):
    for entry in losses_reduced:
        total += entry["lm loss"].double().cpu()
    return total


def _token_mean(total) -> float:
    """Token-weighted mean lm loss from summed [loss sum, tokens] over all DP replicas, on
    every rank (only the last pipeline stage computes losses; the others add zeros)."""
    if torch.cuda.is_available():
        total = total.cuda()
    dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
    return (total[0] / total[1].clamp(min=1)).item()


def token_mean_loss(losses_reduced) -> float:
    """The step's token-weighted mean lm loss from the schedule's reports (every DP replica)."""
    return _token_mean(_add_reports(torch.zeros(2, dtype=torch.float64), losses_reduced))


def _schedule(
    args, model, data_iterator, forward_only: bool, num_microbatches: int, loss_weight=1.0
):
    """One global batch through megatron-core's forward-backward schedule: its loss reports."""
    step = forward_step if loss_weight == 1.0 else partial(forward_step, loss_weight=loss_weight)
    return get_forward_backward_func()(
        forward_step_func=step,
        data_iterator=data_iterator,
        model=[model],
        num_microbatches=num_microbatches,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        forward_only=forward_only,
    )


def _empty_cache(args, level: int) -> None:
    """--empty-unused-memory-level: hand cached GPU memory back (CPU runs have none)."""
    if args.empty_unused_memory_level >= level and torch.cuda.is_available():
        torch.cuda.empty_cache()


def full_batch(args) -> StepBatch:
    """The step batch of a run without ramp-up (and of every evaluation, as Megatron-LM)."""
    return StepBatch(args.global_batch_size, args.num_microbatches)


def train_step(
    args,
    state: TrainState,
    data_iterator,
    runtime=None,
    batch: StepBatch | None = None,
    loss_weight: float = 1.0,
):
    """One optimizer step on `batch` (default: the full global batch; its micro-batch count is
    this replica's); `loss_weight`: this replica's (--het-dp)."""
    batch = batch or full_batch(args)
    model, optimizer = state.model, state.optimizer
    model.zero_grad_buffer()
    optimizer.zero_grad()
    losses_reduced = _schedule(
        args,
        model,
        data_iterator,
        forward_only=False,
        num_microbatches=batch.num_microbatches,
        loss_weight=loss_weight,
    )
    _empty_cache(args, 1)
    # as Megatron-LM's train_step, the timer's barrier comes before the step (and before
    # het-TP's timing of it)
    timers = state.config.timers
    if timers is not None:
        timers("optimizer", log_level=1).start(barrier=args.barrier_with_L1_time)
    if runtime is not None:
        runtime.before_optimizer_step()
    update_successful, grad_norm, num_zeros = optimizer.step()
    if runtime is not None:
        runtime.after_optimizer_step()
    if timers is not None:
        timers("optimizer").stop()
    _empty_cache(args, 2)
    if update_successful:
        state.scheduler.step(increment=batch.global_batch_size)
    return StepResult(
        loss=token_mean_loss(losses_reduced),
        grad_norm=grad_norm,
        skipped=not update_successful,
        loss_scale=float(optimizer.get_loss_scale()),  # read after the step: fp16 updates it
        num_zeros=float(num_zeros) if num_zeros is not None else None,
        params_norm=params_l2_norm(optimizer) if args.log_params_norm else None,
    )


def evaluate(args, model, valid_dataset) -> float:
    """Mean lm loss over the first `eval_iters` global batches of the validation split.

    The same batches every time, so evaluations are comparable across iterations and runs.
    """
    loader = build_loader(
        valid_dataset,
        0,
        args,
        parallel_state.get_data_parallel_rank(),
        parallel_state.get_data_parallel_world_size(),
    )
    data_iterator = iter(loader)
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    # as Megatron-LM: evaluation's passes stay out of the training timers (--timing-log-level),
    # which divide by training steps
    config = model.config
    timers, config.timers = config.timers, None
    try:
        with torch.no_grad():
            for _ in range(args.eval_iters):
                reports = _schedule(
                    args,
                    model,
                    data_iterator,
                    forward_only=True,
                    num_microbatches=args.num_microbatches,
                )
                _add_reports(total, reports)
    finally:
        config.timers = timers
    model.train()
    return _token_mean(total)


def _default_metrics_file(args) -> str:
    if args.save:
        return os.path.join(args.save, "metrics.jsonl")
    return os.path.join("logs", f"metrics-{datetime.now():%Y%m%d-%H%M%S}.jsonl")


def freeze_imported_objects() -> None:
    """Take what the imports created (torch's and megatron-core's modules, functions and
    classes: most of the objects the process will ever hold, none of them garbage) out of the
    garbage collector's full collections. Each full collection walked them all, wherever a
    rank's allocations crossed the threshold: mid-step on one rank (a straggle of its own
    making), and in the first migrations, whose allocations cross it (results/notes.md). What
    is built from here on stays collectable: a wrapper a migration replaces, with its
    reference cycles, is freed as before. No collection first: it would cost the very walk
    this avoids, once per rank, for the few cycles the imports leave."""
    gc.freeze()


def pretrain(args, on_step_end=None) -> TrainResult:
    """Megatron-LM's pretrain(): initialize, build, optionally resume, train, evaluate, save.

    `on_step_end(iteration, state, runtime)`, when given, runs on every rank at every step
    boundary, after het-TP's own decisions were applied there.
    """
    started = time.time()  # --log-progress's job throughput counts from here, as Megatron-LM's
    freeze_imported_objects()
    runtime = HetTPRuntime.from_args(args)
    initialize(args)
    # Claim --save before anything is built or written there (metrics default to it too).
    lock, lock_warning = _claim_save_folder(args.save) if args.save else (None, None)
    try:
        return _pretrain(args, runtime, lock, lock_warning, on_step_end, started)
    finally:
        if lock is not None:
            lock.release()


def _claim_save_folder(folder):
    """Rank 0 takes the --save lock; every rank learns the outcome (and raises alike)."""
    outcome = [None]
    if dist.get_rank() == 0:
        lock = SaveLock(folder)
        try:
            outcome = [(lock.holder, lock.acquire())]
        except (SaveLockError, OSError) as err:
            outcome = [str(err) if isinstance(err, SaveLockError) else f"--save {folder}: {err}"]
    dist.broadcast_object_list(outcome, src=0)
    if isinstance(outcome[0], str):
        raise SaveLockError(outcome[0])
    holder, warning = outcome[0]
    if dist.get_rank() == 0:
        return lock, warning
    return SaveLock(folder, holder), warning  # not held: its staging names only


def _pretrain(args, runtime, lock, lock_warning, on_step_end, started) -> TrainResult:
    tokenizer = tokenizer_from_args(args)
    # read once: the same on every rank
    source = _checkpoint_source(args)
    load_warning = checkpointing.verify_latest(source.root, source.iteration)  # before reading
    saved = None
    if runtime is not None and not source.finetune:  # a finetune starts in this run's plan
        saved = SavedPlan.from_dict(checkpointing.saved_plan(source.root, source.iteration))
    state = setup_model_and_optimizer(args, tokenizer.vocab_size, runtime, saved)

    iteration, consumed, rng_warning, notes, loaded = 0, 0, None, (), None
    if source.iteration is not None:  # else nothing to load (yet: the auto-resume pattern)
        restored = checkpointing.load_checkpoint(
            source.root,
            state.model,
            state.optimizer,
            state.scheduler,
            args,
            runtime,
            vocab_size=tokenizer.vocab_size,
            iteration=source.iteration,
            finetune=source.finetune,
        )
        if restored is not None:
            iteration, consumed = restored.iteration, restored.consumed_train_samples
            rng_warning, notes = restored.warning, restored.notes
            loaded = f"{source.root} at iteration {source.iteration}"
            if source.finetune:
                loaded += f", the model only ({source.why}): starting from iteration 0"

    rank = dist.get_rank()
    metrics_file = args.metrics_file or _default_metrics_file(args)
    if rank == 0:
        metrics_file = os.path.abspath(metrics_file)
    metrics = MetricsWriter(metrics_file) if rank == 0 else None
    logger = Logger(args, metrics, state.config.timers)
    logger.run_start(state.model, tokenizer, iteration, loaded)
    progress = None
    if args.log_progress and args.save:
        progress = ProgressLog(
            args.save,
            args.world_size,
            model_flops_per_sample(args, tokenizer.vocab_size),
            args.seq_length,
            consumed,
            started,
            writer=rank == 0,
        )
        progress.job_started()
    for note in notes:
        logger.info(f"> {note}")
    for warning in (lock_warning, load_warning, rng_warning):
        if warning:
            logger.info(f"WARNING: {warning}")
    try:
        if runtime is not None:
            runtime.attach(state, iteration, logger.events)
        result = _train(
            args,
            state,
            runtime,
            logger,
            tokenizer,
            iteration,
            consumed,
            on_step_end,
            lock,
            progress,
        )
    finally:
        if runtime is not None:
            runtime.close()
        logger.close()  # TensorBoard's and wandb's, where run_end did not
        if metrics is not None:
            metrics.close()
    return dataclasses.replace(result, metrics_file=metrics_file if rank == 0 else None)


@dataclasses.dataclass(frozen=True)
class _Source:
    """The checkpoint a run starts from: none (`iteration` None), --load's, or one to finetune
    from."""

    root: str | None
    iteration: int | None
    finetune: bool = False
    why: str = ""  # the flag that made it a finetune


def _checkpoint_source(args) -> _Source:
    """As Megatron-LM: --load's checkpoint (--ckpt-step's iteration, else the tracker's
    newest), loaded whole or, with --finetune, the model only; where --load holds none (no
    tracker), --pretrained-checkpoint's (--ckpt-step's, else its newest), to finetune from;
    else none, or an error with --exit-on-missing-checkpoint. Collective: every rank gets rank
    0's reading."""
    ours = bool(args.load and args.save and same_folder(args.load, args.save))  # locked
    newest = None
    if args.load is not None:  # the tracker's (a save killed mid-way mended first)
        newest = checkpointing.agreed_iteration(args.load, ours=ours)
    if newest is not None:
        newest = checkpointing.iteration_to_load(args.load, args.ckpt_step, newest)
        return _Source(args.load, newest, args.finetune, "--finetune")
    if args.pretrained_checkpoint is not None:
        root = args.pretrained_checkpoint
        pretrained = checkpointing.agreed_iteration(root)
        if pretrained is not None:
            pretrained = checkpointing.iteration_to_load(
                root, args.ckpt_step, pretrained, "--pretrained-checkpoint"
            )
        if pretrained is None:
            raise checkpointing.CheckpointError(
                f"--pretrained-checkpoint {args.pretrained_checkpoint} holds no checkpoint"
                + (f" (nor does --load {args.load})" if args.load else "")
            )
        return _Source(root, pretrained, True, "--pretrained-checkpoint")
    if args.ckpt_step is not None:
        raise checkpointing.CheckpointError(
            f"--ckpt-step {args.ckpt_step}: --load {args.load} holds no checkpoint"
        )
    if args.exit_on_missing_checkpoint:
        raise checkpointing.CheckpointError(
            f"--load {args.load} holds no checkpoint (--exit-on-missing-checkpoint)"
        )
    return _Source(args.load, None)


class IterationClock:
    """Megatron-LM's "elapsed time per iteration": the wall time from one iteration's line to
    the next, with evaluation, checkpoint saves and test hooks left out. The step boundary's
    work (het-TP's report, decisions and migrations, which run after an iteration's line)
    counts in the next iteration, so throughput and comparisons include what moving costs."""

    def __init__(self):
        self._mark = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        elapsed, self._mark = now - self._mark, now
        return elapsed

    @contextlib.contextmanager
    def paused(self):
        start = time.perf_counter()
        try:
            yield
        finally:
            self._mark += time.perf_counter() - start


def _train(
    args, state, runtime, logger, tokenizer, iteration, consumed, on_step_end, lock, progress
):
    """The loop of pretrain(): train, evaluate, save, until --train-iters or --exit-interval."""
    train_ds, valid_ds, test_ds = build_datasets(args, tokenizer)
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    loader_for = None  # under --het-dp: the (counts, global batch) the loader deals
    train_iterator = None
    if runtime is None or runtime.replicas is None:  # else built at the first step's split
        train_iterator = iter(build_loader(train_ds, consumed, args, dp_rank, dp_size))

    def save(iteration):
        with clock.paused(), gathered_params(state):
            return _save(iteration)

    def _save(iteration):
        saved = checkpointing.save_checkpoint(
            args.save,
            iteration,
            consumed,
            state.model,
            state.optimizer,
            state.scheduler,
            args,
            runtime,
            staging=lock.staging(checkpointing.checkpoint_dir(args.save, iteration)),
            vocab_size=tokenizer.vocab_size,
        )
        logger.saved(iteration, saved.path)
        if progress is not None:
            if saved.retired is not None:
                progress.deleted(saved.retired)
            progress.saved(iteration, consumed)
        return iteration

    losses, eval_losses = {}, {}
    # a run resumed from --save's own newest checkpoint has it saved already
    resumed_here = args.load and args.save and same_folder(args.load, args.save)
    saved_at = iteration if resumed_here and iteration > 0 else None
    batches = BatchSchedule.from_args(args)
    batch = batches.at(consumed)
    state.model.train()
    watch = ExitWatch(
        args.exit_signal_handler, args.exit_duration_in_mins, comm_device(), args.exit_signal
    )
    watch.install()
    profiler = StepProfiler(args)
    if args.manual_gc:  # as Megatron-LM: no automatic collection pauses mid-step
        gc.disable()
        gc.collect()
    clock = IterationClock()
    exited = False  # by --exit-interval, a signal or the time budget
    try:
        while iteration < args.train_iters:
            previous, batch = batch, batches.at(consumed)
            if batch != previous:
                logger.info(
                    f"ramping up batch size from {previous.global_batch_size} to "
                    f"{batch.global_batch_size}"
                )
                # Megatron-LM checkpoints every change of the micro-batch count
                if args.save and saved_at != iteration:
                    saved_at = save(iteration)
            lr = state.optimizer.param_groups[0]["lr"]  # the rate this step applies
            split = None
            if runtime is not None:
                split = runtime.data_split(
                    batch.num_microbatches, args.calculate_per_token_loss, iteration
                )
            here, weight = batch, 1.0
            if split is not None:  # --het-dp: this replica's share of the global batch
                if loader_for != (split.counts, batch.global_batch_size):
                    loader_for = (split.counts, batch.global_batch_size)
                    train_iterator = iter(
                        build_loader(train_ds, consumed, args, dp_rank, dp_size, split.counts)
                    )
                here, weight = StepBatch(batch.global_batch_size, split.here), split.loss_weight
            if runtime is not None:
                runtime.begin_step(iteration + 1, batch.num_microbatches)
            profiler.before_step(iteration + 1)
            start = time.perf_counter()
            step = train_step(args, state, train_iterator, runtime, here, weight)
            step_seconds = time.perf_counter() - start  # the control loop's: the step alone
            elapsed = clock.lap()
            iteration += 1
            profiler.after_step(iteration)
            if args.manual_gc and args.manual_gc_interval:
                if iteration % args.manual_gc_interval == 0:
                    gc.collect()
            consumed += batch.global_batch_size
            losses[iteration] = step.loss
            logger.train_step(iteration, consumed, batch.global_batch_size, step, lr, elapsed)
            if args.check_for_nan_in_loss_and_grad:
                check_finite(iteration, step.loss, step.grad_norm)  # before any decision or save
            # The step boundary: decisions first, so that a checkpoint taken here holds them
            # (as in upstream's train(), where the hook runs right after the step).
            if runtime is not None:
                runtime.end_step(iteration, step_seconds)  # a migration replaces model/optimizer
            if on_step_end is not None:
                with clock.paused(), gathered_params(state):
                    on_step_end(iteration, state, runtime)

            if args.eval_iters and valid_ds is not None and iteration % args.eval_interval == 0:
                with clock.paused():
                    if args.manual_gc and args.manual_gc_eval:
                        gc.collect()
                    with gathered_params(state):
                        eval_losses[iteration] = evaluate(args, state.model, valid_ds)
                    if args.manual_gc and args.manual_gc_eval:
                        gc.collect()
                    _empty_cache(args, 1)
                    logger.evaluation(iteration, eval_losses[iteration])
            if args.save and args.save_interval and iteration % args.save_interval == 0:
                saved_at = save(iteration)
            if args.exit_interval and iteration % args.exit_interval == 0:
                logger.info(f"exiting program at iteration {iteration} (--exit-interval)")
                exited = True
                break
            why = watch.due()
            if why is not None:
                logger.info(f"exiting program at iteration {iteration}: {why}")
                exited = True
                break
    finally:
        watch.close()
        profiler.close()
        if args.manual_gc:
            gc.enable()

    if args.save and saved_at != iteration and iteration > 0:
        save(iteration)
    test_loss = None
    # as Megatron-LM, whose train() exits the program on any exit condition, even at the last
    # iteration: only a run that finished without one evaluates at its end
    if not exited and iteration >= args.train_iters and args.eval_iters:
        # as Megatron-LM: the validation split once more, then the test split
        for split, dataset in (("validation", valid_ds), ("test", test_ds)):
            if dataset is None:
                continue
            loss = eval_losses.get(iteration) if split == "validation" else None
            if loss is None:  # the same batches as an evaluation at this iteration
                with gathered_params(state):
                    loss = evaluate(args, state.model, dataset)
            test_loss = loss if split == "test" else test_loss
            logger.evaluation(iteration, loss, split)
    logger.run_end(iteration)
    return TrainResult(iteration, consumed, losses, eval_losses, None, test_loss)


def shutdown() -> None:
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
