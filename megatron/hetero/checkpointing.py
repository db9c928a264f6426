"""Checkpoints through megatron-core dist_checkpointing, in Megatron-LM's directory layout.

<save>/iter_0000010/ holds one dist-checkpoint (model, optimizer, LR scheduler, RNG, progress);
<save>/latest_checkpointed_iteration.txt names the newest complete one. A checkpoint is written
to iter_XXXXXXX.tmp and renamed only after every rank finished, so a failure while saving never
leaves a half-written checkpoint behind the tracker, and never touches training state.
"""

from __future__ import annotations

import dataclasses
import os
import random
import shutil

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.serialization import (
    get_default_load_sharded_strategy,
    get_default_save_sharded_strategy,
)
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)

from . import ckpt_integrity
from .portable_optimizer import (
    checkpoint_optimizer,
    restore_from,
    saved_param_groups,
    set_group_values,
)

TRACKER_FILE = "latest_checkpointed_iteration.txt"

# Flags that fix tensor shapes: a checkpoint only loads into a model built with the same values.
SHAPE_ARGS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "swiglu",
    "add_bias_linear",
    "untie_embeddings_and_output_weights",
    "position_embedding_type",
    "max_position_embeddings",
    "normalization",
    "apply_layernorm_1p",
    "add_qkv_bias",
    "qk_layernorm",
)
# The model's flags a checkpoint records for --use-checkpoint-args (Megatron-LM's list, where
# this trainer has the flag, and its own model flags); the shape flags are among them. Values
# after validation: derived ones (--ffn-hidden-size, --kv-channels) as the run used them.
MODEL_ARGS = (
    *SHAPE_ARGS,
    "seq_length",
    "group_query_attention",
    "add_position_embedding",
    "use_rotary_position_embeddings",
    "rotary_base",
    "rotary_percent",
    "rotary_interleaved",
    "rotary_seq_len_interpolation_factor",
    "use_rope_scaling",
    "rope_scaling_factor",
    "squared_relu",
    "qk_l2_norm",
    "norm_epsilon",
    "apply_query_key_layer_scaling",
    "attention_dropout",
    "hidden_dropout",
)
# Of MODEL_ARGS, those the command line keeps over a checkpoint's where it gives them (as
# Megatron-LM's --use-checkpoint-args: the sizes); the others are the checkpoint's.
COMMAND_LINE_FIRST = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "seq_length",
    "num_attention_heads",
    "kv_channels",
    "max_position_embeddings",
)
# Shape flags added after checkpoints existed: what an older checkpoint was saved with, from
# its other saved args (one not listed, e.g. qk_layernorm, saved for a while before it was
# recorded, is not checked on checkpoints without it).
SHAPE_DEFAULTS = {
    "apply_layernorm_1p": lambda saved: False,
    # biases on every linear or none: the QKV's went with them
    "add_qkv_bias": lambda saved: saved.get("add_bias_linear", True),
}
# The tokenizer's vocabulary before padding. The padded embedding may differ between TP sizes
# (megatron-core re-pads it at load), so its shape cannot catch a changed tokenizer; this can.
# Checkpoints from before it was saved are not checked.
VOCAB_KEY = "tokenizer_vocab_size"

# The learning-rate scheduler counts samples (Megatron-LM's unit); checkpoints without this
# mark counted iterations.
SCHEDULER_UNITS = "samples"

# Generators are saved for every rank ("rng_states": stage x TP rank x DP replica), under this
# mark in the saved args; checkpoints without it hold one "rng_state" per stage and TP rank,
# DP replica 0's.
RNG_KEY = "rng_layout"
# Whether the checkpoint holds the optimizer state (with its schedule) and the generators
# (--no-save-optim, --no-save-rng); checkpoints without the marks hold both.
OPTIMIZER_KEY = "optimizer_saved"
RNG_SAVED_KEY = "rng_saved"
RNG_PER_RANK = "per-rank"


# The scheduler's values a resumed run's flags set, and the flags that set them.
SCHEDULE_FLAGS = {
    "max_lr": "--lr",
    "min_lr": "--min-lr",
    "lr_warmup_steps": "--lr-warmup-iters/-samples/-fraction",
    "lr_decay_style": "--lr-decay-style",
    "lr_decay_steps": "--lr-decay-iters/-samples (or the run's length)",
    "start_wd": "--weight-decay (or --start-weight-decay)",
    "end_wd": "--weight-decay (or --end-weight-decay)",
    "wd_incr_style": "--weight-decay-incr-style",
    "wd_incr_steps": "the run's length",
    "wsd_decay_steps": "--lr-wsd-decay-iters/-samples",
    "lr_wsd_decay_style": "--lr-wsd-decay-style",
}

# The flags behind the optimizer's parameter-group values (portable_optimizer.FLAG_GROUP_KEYS): a
# loaded optimizer state brings the checkpoint's.
GROUP_FLAGS = {
    "max_lr": "--decoupled-lr",
    "min_lr": "--decoupled-min-lr",
    "betas": "--adam-beta1/--adam-beta2",
    "eps": "--adam-eps",
}


class CheckpointError(RuntimeError):
    pass


def _group_values(groups, key) -> list:
    return sorted({tuple(v) if isinstance(v, list) else v for g in groups if (v := g.get(key))})


def group_changes(saved_groups, groups, schedule: list[str]) -> list[str]:
    """How the optimizer's parameter groups' flag values differ from a checkpoint's (the group
    rates only where the schedule's own did not change: --lr moves them all)."""
    changes = []
    for key, flag in GROUP_FLAGS.items():
        if key in ("max_lr", "min_lr") and any(
            c.startswith(("--lr ", "--min-lr ")) for c in schedule
        ):
            continue
        before, now = _group_values(saved_groups, key), _group_values(groups, key)
        if before != now:
            changes.append(f"{flag} {before} (this run: {now})")
    return changes


def schedule_changes(saved: dict, current: dict) -> list[str]:
    """How this run's learning-rate and weight-decay schedule differs from a checkpoint's, in
    what changes the rates: a decay length under a constant rate, or the length of a constant
    weight decay's ramp, does not (so a run may be extended without a flag)."""
    constant_lr = saved["lr_decay_style"] == current["lr_decay_style"] == "constant"
    constant_wd = saved.get("start_wd") == saved.get("end_wd") and (
        current["start_wd"] == current["end_wd"]
    )
    moot = {"lr_decay_steps"} if constant_lr else set()
    moot |= {"wd_incr_steps", "wd_incr_style"} if constant_wd else set()
    if "WSD" not in (saved["lr_decay_style"], current["lr_decay_style"]):
        moot |= set(WSD_KEYS)  # (checkpoints from before WSD hold neither)
    changes = {}
    for key, flag in SCHEDULE_FLAGS.items():
        if saved.get(key) == current[key] or flag in changes or key in moot:
            continue
        changes[flag] = f"{flag} {saved.get(key)} (this run: {current[key]})"
    return list(changes.values())


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


@dataclasses.dataclass(frozen=True)
class SavedModelArgs:
    """The model flags a checkpoint recorded (--use-checkpoint-args)."""

    path: str  # the checkpoint folder they were read from
    values: dict  # flag attribute -> value, as the run that saved it validated it
    missing: tuple[str, ...]  # of MODEL_ARGS, what it predates (older checkpoints)


def recorded_args(saved: dict, names) -> dict:
    """Of `names`, what a checkpoint's saved args tell: recorded values, and for a shape flag
    an older checkpoint did not record, what it was saved with (SHAPE_DEFAULTS)."""
    return {
        name: saved[name] if name in saved else SHAPE_DEFAULTS[name](saved)
        for name in names
        if name in saved or name in SHAPE_DEFAULTS
    }


def saved_model_args(args) -> SavedModelArgs | None:
    """For --use-checkpoint-args, before any process group, on this rank: the model flags of
    the checkpoint training will start from, as _checkpoint_source picks it (--load's, else
    --pretrained-checkpoint's; --ckpt-step's iteration, else the tracker's newest, or the older
    copy a killed save over it left aside), its common.pt checked against the manifest first.
    None where neither folder holds a checkpoint yet. Training loads rank 0's reading, and
    refuses a model that differs from the one built from these (load_checkpoint)."""
    for root in (args.load, args.pretrained_checkpoint):
        newest = latest_iteration(root) if root else None
        if newest is None:
            continue
        if args.ckpt_step is not None:
            path = checkpoint_dir(root, args.ckpt_step)
            if not os.path.isdir(path):
                raise CheckpointError(f"--ckpt-step {args.ckpt_step}: {root} holds no {path}")
        else:
            path = checkpoint_dir(root, newest)
            if not os.path.isdir(path) and os.path.isdir(path + ".replaced"):
                path += ".replaced"  # what restore_replaced puts back before the load
            if not os.path.isdir(path):
                raise CheckpointError(f"{path} is missing (named by the checkpoint's tracker)")
        try:
            ckpt_integrity.verify_file(path, "common.pt")
            saved = dist_checkpointing.load_common_state_dict(path)["args"]
        except ckpt_integrity.UnsafeCheckpointError as err:
            raise CheckpointError(str(err)) from None
        except Exception as err:  # noqa: BLE001 - a damaged checkpoint: named, not a traceback
            raise CheckpointError(f"{path}: its recorded flags cannot be read ({err})") from None
        values = recorded_args(saved, MODEL_ARGS)
        missing = tuple(name for name in MODEL_ARGS if name not in values)
        return SavedModelArgs(path.removesuffix(".replaced"), values, missing)
    return None


def latest_iteration(root: str) -> int | None:
    tracker = os.path.join(root, TRACKER_FILE)
    if not os.path.isfile(tracker):
        return None
    text = open(tracker).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{tracker} holds '{text}', not an iteration number")
    return int(text)


def _device_kind() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _rng_state() -> dict:
    state = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        # CUDA generator states on GPUs; on CPU ranks (cpu_compat) CPU ones, of another size
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
        "device": _device_kind(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> bool:
    """Restores the generators; the tracker's and CUDA's only where they were saved on the
    same kind of device (a CPU state fails as CUDA's at the first forward; checkpoints from
    before the kind was saved tell it by the states' sizes). False then."""
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    here = tensor_parallel.get_cuda_rng_tracker().get_states()
    sizes = all(
        name not in here or saved.numel() == here[name].numel()
        for name, saved in state["tracker"].items()
    )
    if state.get("device", _device_kind()) != _device_kind() or not sizes:
        return False
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    return True


def _rng_entry(saved_dp_size: int | None = None) -> ShardedObject:
    """This rank's generators, one object per rank: plain data-parallel replicas draw alike,
    but --het-dp's run different micro-batch counts and so draw different numbers of dropout
    masks. `saved_dp_size`: at load, the checkpoint's DP size; where it is not this run's,
    every replica takes replica 0's."""
    return _per_rank("rng_states", _rng_state(), saved_dp_size)


def _per_rank(key: str, value, saved_dp_size: int | None = None) -> ShardedObject:
    """One object per rank (pipeline stage x TP rank x DP replica), for state that differs
    between data-parallel replicas. `saved_dp_size`: at load, the checkpoint's DP size; where
    it is not this run's, the object of replica 0 at this rank's stage and TP rank, which
    every replica then reads (replica ids apart, so that --ckpt-fully-parallel-load has
    each replica take its own, not one replica's exchanged)."""
    ps = parallel_state
    dp, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    replica = 0
    if saved_dp_size is not None and saved_dp_size != dp_size:
        dp, dp_size, replica = 0, saved_dp_size, dp
    return ShardedObject(
        key,
        value,
        (
            ps.get_pipeline_model_parallel_world_size(),
            ps.get_tensor_model_parallel_world_size(),
            dp_size,
        ),
        (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(), dp),
        replica_id=replica,
    )


def _per_tp_rank(key: str, value) -> ShardedObject:
    """One object per model-parallel position (pipeline stage x TP rank; at PP=1 the layout of
    checkpoints from before pipelines); data-parallel replicas share it (replica_id = DP
    rank)."""
    return ShardedObject(
        key,
        value,
        (
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_world_size(),
        ),
        (
            parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_rank(),
        ),
        replica_id=parallel_state.get_data_parallel_rank(),
    )


def _residues(model) -> ShardedObject | None:
    """--het-dp-compress's error-feedback residues: one object per rank (they differ between
    data-parallel replicas too); None without compression."""
    reducer = getattr(model, "reducer", None)
    if reducer is None:
        return None
    return _per_rank("het_dp_residues", reducer.state_dict())


def _compression(model) -> str:
    reducer = getattr(model, "reducer", None)
    return reducer.kind if reducer is not None else "none"


def runtime_state(runtime) -> ShardedObject:
    """The het-TP runtime's per-TP-rank state as a checkpoint holds it (to save, or to request
    at load)."""
    return _per_tp_rank("het_tp_state", runtime.state_dict())


def runtime_entries(runtime) -> dict:
    """What a checkpoint keeps of the het-TP runtime: its plan (common, the same on every rank)
    and its per-TP-rank state, under the keys this trainer and the upstream glue share."""
    saved = runtime.checkpoint_plan()
    return {
        "het_tp_state": runtime_state(runtime),
        "het_tp_plan": saved.to_dict() if saved is not None else None,
    }


def _sharded_state(model, optimizer, scheduler, *, is_loading: bool) -> dict:
    """`optimizer`: the one checkpoint_optimizer gives (the plain optimizer's layout), or None
    for the model alone (--no-save-optim, or a load without the optimizer)."""
    model_sd = model.module.sharded_state_dict()
    if optimizer is None:
        return {"model": model_sd}
    return {
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading),
        "opt_param_scheduler": scheduler_state(scheduler),
    }


# WSD's two settings, which megatron-core's scheduler keeps but leaves out of its state_dict
WSD_KEYS = ("wsd_decay_steps", "lr_wsd_decay_style")


def scheduler_state(scheduler) -> dict:
    """The scheduler's state as a checkpoint keeps it: megatron-core's, and WSD's settings."""
    return {**scheduler.state_dict(), **{key: getattr(scheduler, key) for key in WSD_KEYS}}


def restore_scheduler(scheduler, saved: dict, override: bool) -> None:
    """megatron-core's load (the checkpoint's values unless `override`), WSD's settings
    alike: a checkpoint's WSD decay with this run's other schedule would fail mid-run."""
    if not override:  # first: the load steps the scheduler to its count
        for key in WSD_KEYS:
            if key in saved:
                setattr(scheduler, key, saved[key])
    scheduler.load_state_dict(saved)


@dataclasses.dataclass(frozen=True)
class SavedCheckpoint:
    path: str
    retired: int | None  # the iteration whose checkpoint the save deleted (rank 0 knows it)


def save_checkpoint(
    root: str,
    iteration: int,
    consumed_train_samples: int,
    model,
    optimizer,
    scheduler,
    args,
    runtime=None,
    staging: str | None = None,
    *,
    vocab_size: int | None = None,
) -> SavedCheckpoint:
    """`runtime`: the het-TP runtime, whose plan (common) and per-TP-rank state (priorities,
    detector) the checkpoint keeps, so a resumed run starts where this one stands. `staging`:
    this job's name for the folder being written (SaveLock.staging), the same on every rank.
    `vocab_size`: the tokenizer's, unpadded, which a load checks."""
    saved = None if args.no_save_optim else checkpoint_optimizer(optimizer, model, is_loading=False)
    state = _sharded_state(model, saved, scheduler, is_loading=False)
    if not args.no_save_rng:
        state["rng_states"] = _rng_entry()
    if runtime is not None:
        state.update(runtime_entries(runtime))
    state["iteration"] = iteration
    state["consumed_train_samples"] = consumed_train_samples
    state["scheduler_units"] = SCHEDULER_UNITS
    state["args"] = {name: getattr(args, name) for name in MODEL_ARGS}
    state["args"]["tensor_model_parallel_size"] = args.tensor_model_parallel_size
    state["args"]["pipeline_model_parallel_size"] = args.pipeline_model_parallel_size
    state["args"]["het_tp_state"] = runtime is not None
    state["args"]["data_parallel_size"] = parallel_state.get_data_parallel_world_size()
    state["args"]["het_dp_compress"] = _compression(model)
    state["args"][VOCAB_KEY] = vocab_size
    state["args"][RNG_KEY] = RNG_PER_RANK
    state["args"][OPTIMIZER_KEY] = not args.no_save_optim
    state["args"][RNG_SAVED_KEY] = not args.no_save_rng
    residues = _residues(model)
    if residues is not None:
        state["het_dp_residues"] = residues

    final = checkpoint_dir(root, iteration)
    staging = staging or final + ".tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
    dist.barrier()
    dist_checkpointing.save(state, staging, sharded_strategy=_save_strategy(args))
    dist.barrier()
    ckpt_integrity.write_manifest(staging)  # collective; rank 0 writes it
    dist.barrier()
    retired = None
    if dist.get_rank() == 0:
        # An older save of this iteration is moved aside, not deleted, until the new one is in
        # place: deleting first left the tracker naming a half-deleted folder if killed then.
        # (not a ".tmp-" name: the next job's lock clears those as dead staging)
        aside = final + ".replaced" if os.path.exists(final) else None
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)  # a crashed job's, older than `final`
            os.rename(final, aside)
        os.rename(staging, final)
        tracker = os.path.join(root, TRACKER_FILE)
        previous = latest_iteration(root)
        with open(tracker + ".tmp", "w") as f:
            f.write(str(iteration))
        os.replace(tracker + ".tmp", tracker)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
        retired = _retire(root, previous, iteration, args.save_retain_interval)
    dist.barrier()
    return SavedCheckpoint(final, retired)


def _save_strategy(args):
    """--ckpt-fully-parallel-save (the default): what the data-parallel replicas hold alike is
    written by all of them, a share each, instead of by data-parallel rank 0 alone. The
    distribution is worked out at every save: a plan's layout changes as units move."""
    if not args.ckpt_fully_parallel_save or parallel_state.get_data_parallel_world_size() == 1:
        return None  # megatron-core's default torch_dist strategy
    return FullyParallelSaveStrategyWrapper(
        get_default_save_sharded_strategy(), parallel_state.get_data_parallel_group()
    )


def _load_strategy(args, path: str):
    """--ckpt-fully-parallel-load: what the data-parallel replicas hold alike is read from
    storage once, a share by each, and exchanged over the data-parallel group (megatron-core's
    broadcasts) instead of read by every replica."""
    if not args.ckpt_fully_parallel_load or parallel_state.get_data_parallel_world_size() == 1:
        return None
    return FullyParallelLoadStrategyWrapper(
        get_default_load_sharded_strategy(path), parallel_state.get_data_parallel_group()
    )


def _retire(root: str, previous: int | None, iteration: int, retain: int | None) -> int | None:
    """--save-retain-interval, as Megatron-LM's: once the tracker names `iteration`, the
    checkpoint it named before goes unless it is at a multiple of `retain` (or a link, which
    someone made on purpose). Returns the iteration deleted, if any."""
    if retain is None or not previous or previous == iteration or previous % retain == 0:
        return None
    old = checkpoint_dir(root, previous)
    if not os.path.isdir(old) or os.path.islink(old):
        return None
    shutil.rmtree(old, ignore_errors=True)
    return previous


def restore_replaced(root: str, iteration: int) -> bool:
    """Put back the older copy of checkpoint `iteration` that a save over it moved aside, where
    the save was killed before its own copy took the name (the tracker names it either way)."""
    final = checkpoint_dir(root, iteration)
    if os.path.exists(final) or not os.path.isdir(final + ".replaced"):
        return False
    os.rename(final + ".replaced", final)
    return True


def agreed_iteration(root: str | None, *, ours: bool = False) -> int | None:
    """The newest iteration under `root` as rank 0 reads its tracker, on every rank
    (collective): a job loading from a folder another job still saves into would otherwise
    verify one iteration and load the next, or load different ones on different ranks.
    `ours`: `root` is this job's locked --save folder, where a save killed mid-way is mended."""
    found = [None]
    if dist.get_rank() == 0 and root:
        try:
            found = [latest_iteration(root)]
            if ours and found[0] is not None:
                restore_replaced(root, found[0])
        except Exception as err:  # noqa: BLE001 - an unreadable tracker: every rank raises
            found = [str(err) if isinstance(err, CheckpointError) else f"{root}: {err}"]
    dist.broadcast_object_list(found, src=0)
    if isinstance(found[0], str):
        raise CheckpointError(found[0])
    return found[0]


def verify_latest(root: str | None, iteration: int | None) -> str | None:
    """Before anything of checkpoint `iteration` (agreed_iteration's) under `root` is read:
    its manifest and safe metadata (ckpt_integrity.verify; collective). Returns a warning, or
    None."""
    if not root or iteration is None:
        return None
    return ckpt_integrity.verify(checkpoint_dir(root, iteration))


def saved_plan(root: str | None, iteration: int | None) -> dict | None:
    """The het-TP plan checkpoint `iteration` under `root` was saved in (its common part; None
    without one), read before the model is built so it can start in that plan."""
    if not root or iteration is None:
        return None
    return dist_checkpointing.load_common_state_dict(checkpoint_dir(root, iteration)).get(
        "het_tp_plan"
    )


def scheduler_state_in_samples(state: dict, global_batch_size: int) -> dict:
    """A scheduler state saved when it counted iterations, in samples: its step counts times
    the global batch (without this, a resumed run would decay the learning rate that many
    times too fast)."""
    converted = dict(state)
    for key in (
        "num_steps",
        "lr_warmup_steps",
        "lr_decay_steps",
        "wd_incr_steps",
        "wsd_decay_steps",
    ):
        if converted.get(key) is not None:
            converted[key] = converted[key] * global_batch_size
    return converted


@dataclasses.dataclass(frozen=True)
class Restored:
    """Where a loaded checkpoint leaves training."""

    iteration: int
    consumed_train_samples: int
    warning: str | None = None  # what of the saved state did not carry over, for the log
    notes: tuple[str, ...] = ()  # what the flags (or the checkpoint) left out, for the log


def iteration_to_load(root: str, step: int | None, newest: int, flag: str = "--load") -> int:
    """The iteration to load under `root` (`flag`'s folder), whose tracker names `newest`
    (agreed_iteration): `step` (--ckpt-step), which must be there (collective), else
    `newest`."""
    if step is None:
        return newest
    folder = checkpoint_dir(root, step)
    found = [os.path.isdir(folder)] if dist.get_rank() == 0 else [None]
    dist.broadcast_object_list(found, src=0)
    if not found[0]:
        raise CheckpointError(f"--ckpt-step {step}: {flag} {root} holds no {folder}")
    return step


def load_checkpoint(
    root: str,
    model,
    optimizer,
    scheduler,
    args,
    runtime=None,
    *,
    vocab_size: int | None = None,
    iteration: int | None = None,
    finetune: bool | None = None,
) -> Restored | None:
    """Restores checkpoint `iteration` (default: agreed_iteration's) under `root`, or returns
    None when `root` holds no checkpoint yet (training then starts from scratch).

    `runtime` gets its saved per-TP-rank state when the checkpoint has one of the same TP
    size. `vocab_size`: this run's tokenizer's, checked against the saved one. As Megatron-LM:
    `finetune` (default --finetune) loads the model alone and starts at iteration 0;
    --no-load-optim leaves out the optimizer state and the learning-rate schedule (which a
    checkpoint saved with --no-save-optim needs), --no-load-rng the generators (as does a
    checkpoint saved without them); the fp32 masters of an optimizer not loaded are taken from
    the loaded weights."""
    finetune = args.finetune if finetune is None else finetune
    if iteration is None:
        iteration = agreed_iteration(root)
    if iteration is None:
        return None
    path = checkpoint_dir(root, iteration)
    common = dist_checkpointing.load_common_state_dict(path)
    saved = common["args"]
    shapes = recorded_args(saved, SHAPE_ARGS)  # the checkpoint's model, where it can tell
    mismatched = [
        f"--{name.replace('_', '-')} {value} (this run: {getattr(args, name)})"
        for name, value in shapes.items()
        if value != getattr(args, name)
    ]
    if None not in (saved.get(VOCAB_KEY), vocab_size) and saved[VOCAB_KEY] != vocab_size:
        mismatched.append(
            f"a vocabulary of {saved[VOCAB_KEY]} entries (this run's --tokenizer-type and "
            f"--vocab-size give {vocab_size})"
        )
    if mismatched:
        raise CheckpointError(
            f"checkpoint {path} was saved with a different model: " + ", ".join(mismatched)
        )
    notes = []
    with_optimizer = not finetune and not args.no_load_optim
    if with_optimizer and not saved.get(OPTIMIZER_KEY, True):  # as Megatron-LM: refused
        raise CheckpointError(
            f"checkpoint {path} holds no optimizer state (saved with --no-save-optim): pass "
            "--no-load-optim to start it over, or --finetune"
        )
    if args.no_load_optim and not finetune:
        notes.append(
            "optimizer state and learning-rate schedule not loaded (--no-load-optim): Adam's "
            "moments, its step count and the schedule start over; fp32 masters from the "
            "loaded weights"
        )
    saved_scheduler = common.get("opt_param_scheduler")
    if with_optimizer and common.get("scheduler_units") != SCHEDULER_UNITS and common["iteration"]:
        batch = common["consumed_train_samples"] // common["iteration"]
        saved_scheduler = scheduler_state_in_samples(saved_scheduler, batch)
    changes = (
        schedule_changes(saved_scheduler, scheduler_state(scheduler)) if with_optimizer else []
    )
    saved_groups = saved_param_groups(common.get("optimizer")) if with_optimizer else None
    if saved_groups is not None:
        changes += group_changes(saved_groups, optimizer.param_groups, changes)
    if changes and not (
        args.override_opt_param_scheduler or args.use_checkpoint_opt_param_scheduler
    ):
        raise CheckpointError(
            f"checkpoint {path} was saved with a different learning-rate schedule or "
            "optimizer (steps in samples): "
            + ", ".join(changes)
            + "; pass --override-opt_param-scheduler to "
            "follow this run's flags, or --use-checkpoint-opt_param-scheduler to keep the "
            "checkpoint's"
        )
    # RNG states (and the runtime's) are per TP rank and stage: they only carry over to the
    # same TP and PP sizes.
    same_layout = (
        saved["tensor_model_parallel_size"] == args.tensor_model_parallel_size
        and saved.get("pipeline_model_parallel_size", 1) == args.pipeline_model_parallel_size
    )
    with_rng = same_layout and not finetune and not args.no_load_rng
    if with_rng and not saved.get(RNG_SAVED_KEY, True):
        with_rng = False
        notes.append("RNG states not loaded (saved with --no-save-rng): they start from --seed")
    # this run's per-group values, which an override puts back over the checkpoint's
    fresh = [dict(g) for g in optimizer.param_groups]
    loading = checkpoint_optimizer(optimizer, model, is_loading=True) if with_optimizer else None
    state = _sharded_state(model, loading, scheduler, is_loading=True)
    if with_rng and saved.get(RNG_KEY) == RNG_PER_RANK:
        state["rng_states"] = _rng_entry(saved["data_parallel_size"])
    elif with_rng:  # the older layout: replica 0's, per stage and TP rank
        state["rng_states"] = _per_tp_rank("rng_state", _rng_state())
    with_runtime = (
        runtime is not None and same_layout and not finetune and saved.get("het_tp_state", False)
    )
    if with_runtime:
        state["het_tp_state"] = runtime_state(runtime)
    # compression residues are per rank: same TP, PP and DP sizes and the same compression
    with_residues = (
        same_layout
        and not finetune
        and _compression(model) != "none"
        and saved.get("het_dp_compress") == _compression(model)
        and saved.get("data_parallel_size") == parallel_state.get_data_parallel_world_size()
    )
    if with_residues:
        state["het_dp_residues"] = _residues(model)
    loaded = dist_checkpointing.load(state, path, sharded_strategy=_load_strategy(args, path))
    model.module.load_state_dict(loaded["model"])
    if with_optimizer:
        loading.load_state_dict(loaded["optimizer"])
        restore_from(loading, optimizer)
        # Whose group values hold from here, whatever the optimizer's layout carried over (the
        # distributed optimizer's restore carries per-parameter state only).
        if args.override_opt_param_scheduler:
            set_group_values(optimizer, fresh)
        elif saved_groups is not None and len(saved_groups) == len(optimizer.param_groups):
            set_group_values(optimizer, saved_groups)
        restore_scheduler(scheduler, saved_scheduler, args.override_opt_param_scheduler)
    else:
        optimizer.reload_model_params()  # the masters were made from the initial weights
    warning = None
    if with_rng and not _set_rng_state(loaded["rng_states"]):
        saved_on = loaded["rng_states"].get("device", "another kind of")
        warning = (
            f"checkpoint {path} was saved on {saved_on} ranks, this run is on "
            f"{_device_kind()}: the model-parallel (dropout) generators start from --seed"
        )
    if with_runtime:
        runtime.load_state_dict(loaded["het_tp_state"])
    if with_residues:
        model.reducer.load_state_dict(loaded["het_dp_residues"])
    if finetune:
        return Restored(0, 0, warning, tuple(notes))
    return Restored(loaded["iteration"], loaded["consumed_train_samples"], warning, tuple(notes))
