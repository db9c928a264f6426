"""Moving whole transformer layers between neighbouring pipeline stages at a step boundary.

Megatron fixes each stage's layers when it builds the model. Here a layer leaves the end (or the
start) of one stage's `decoder.layers` and is built again at the start (or the end) of its
neighbour's, under the same global layer number; its weights, fp32 masters and optimizer moments
travel point to point from each TP rank to the TP rank at the same position of the other stage
(a layer keeps its unit plan, so the shards match). The config's
`pipeline_model_parallel_layout` then tells megatron-core the new split, so layer offsets,
checkpoint keys and recomputation follow it; the DDP wrapper and optimizer are rebuilt on every
rank (building an optimizer runs collectives over the whole job), with the training state of
every parameter carried over, so training stays on its trajectory.

All or nothing: every rank prepares (builds the incoming layers, packs the outgoing ones) and
votes before anything is sent, and again after the transfer (a transport failure shows on the
ranks of its link only); the rebuild of DDP and the optimizer agrees over the job as a unit
move's does (partition._build). A failure at any of these raises TransferError on every rank
with the model, optimizer and config as they were (after a failed rebuild each rank puts its
layer list and split back). A collective that itself fails is the transport's.

Lossless at dropout 0: a moved layer draws its dropout masks from its new stage's RNG stream.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from hettp.exchange import TransferError
from hettp.plan import PartitionPlan
from hettp.stages import StageError, adjacent, check_split, stage_of_layers

from .ddp import gathered_params
from .layers import _DDP_PARAM_ATTRS, UnitBlock
from .model import unwrap_model
from .partition import _rebuild, comm_device
from .unit_state import OptimizerView

# The config fields that say how megatron-core splits the layers over the stages.
_SPLIT_FIELDS = (
    "pipeline_model_parallel_layout",
    "num_layers_in_first_pipeline_stage",
    "num_layers_in_last_pipeline_stage",
)


@dataclasses.dataclass(frozen=True)
class LayerMigration:
    """What one layer move did on this rank's stage."""

    before: tuple[int, ...]  # layers per stage
    after: tuple[int, ...]
    sent: tuple[int, ...]  # global layer indices this stage gave away
    received: tuple[int, ...]  # and took in
    bytes: int  # this rank's payload, sent plus received
    seconds: float  # the whole move, rebuild included


def stage_layout(counts) -> PipelineParallelLayerLayout:
    """megatron-core's layout for `counts` layers per stage (embedding first, loss last)."""
    last = len(counts) - 1
    rows = [
        ["embedding"] * (stage == 0) + ["decoder"] * n + ["loss"] * (stage == last)
        for stage, n in enumerate(counts)
    ]
    return PipelineParallelLayerLayout(rows, len(counts))


def set_split(config, counts) -> None:
    """Make megatron-core split the layers as `counts` from now on (offsets, checkpoint keys)."""
    config.num_layers_in_first_pipeline_stage = None
    config.num_layers_in_last_pipeline_stage = None
    config.pipeline_model_parallel_layout = stage_layout(counts)


def split_of(config) -> tuple[int, ...]:
    """Layers per stage as megatron-core splits them under `config` (no process group)."""
    pp, total = config.pipeline_model_parallel_size, config.num_layers
    layout = config.pipeline_model_parallel_layout
    if layout is not None:  # megatron-core reads this rank's offset from it, whatever pp_rank
        return tuple(layout.get_num_layers_to_build(pp_rank=r) for r in range(pp))
    offsets = [get_transformer_layer_offset(config, pp_rank=r) for r in range(pp)] + [total]
    return tuple(b - a for a, b in zip(offsets, offsets[1:]))


def _split_fields(config) -> dict:
    return {name: getattr(config, name) for name in _SPLIT_FIELDS}


def _restore_split(config, fields: dict) -> None:
    for name, value in fields.items():
        setattr(config, name, value)


@contextlib.contextmanager
def _split_as(config, counts):
    saved = _split_fields(config)
    set_split(config, counts)
    try:
        yield
    finally:
        _restore_split(config, saved)


@contextlib.contextmanager
def _no_initialisation(config):
    """Build without drawing random numbers (the weights are overwritten), so the RNG streams
    stay where the unmoved run has them. megatron-core then skips setting its tensor-parallel
    attributes too: _build copies them from a layer built normally."""
    before = config.perform_initialization
    config.perform_initialization = False
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        config.perform_initialization = before


def move_layers(state, module, before, after, whole: PartitionPlan, fault=None) -> LayerMigration:
    """Every rank of the job, at one step boundary: move to `after` layers per stage.

    `state` is the runtime's TrainState (model, optimizer, scheduler and config are replaced),
    `module` the GPTModel of this stage and `whole` the whole model's unit plan (a moved layer
    keeps its units). `fault(stage_name)` lets tests fail a rank at "pack" (before anything
    is built), "built" (the incoming layers built, before the vote), "exchanged" (after the
    transfer, before the second vote), or in the rebuild ("wrapper", "optimizer": after each
    build, before its vote)."""
    before, after = tuple(before), tuple(after)
    pp = len(before)
    check_split(after, sum(before), pp)
    if not adjacent(before, after):
        raise StageError(
            f"layer split {list(before)} -> {list(after)}: a layer would skip a stage; "
            "layers move to neighbour stages only"
        )
    start = time.perf_counter()
    stage = parallel_state.get_pipeline_model_parallel_rank()
    old_stage, new_stage = stage_of_layers(before), stage_of_layers(after)
    first = sum(before[:stage])
    outgoing = [g for g in range(first, first + before[stage]) if new_stage[g] != stage]
    incoming = [
        g for g in range(sum(after[:stage]), sum(after[: stage + 1])) if old_stage[g] != stage
    ]
    model = unwrap_model(module)
    decoder = model.decoder
    config = model.config
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    ok, error = True, None
    with gathered_params(state):
        view = OptimizerView(state.optimizer)
        view.gather()  # whole masters and moments under the distributed optimizer
        try:
            if fault is not None:
                fault("pack")
            sends = [
                (tensor, _peer(new_stage[g] - stage))
                for g in outgoing
                for tensor in _payload(decoder.layers[g - first], view)
            ]
            built = {g: _build(decoder, config, after, g, whole, tp_rank) for g in incoming}
            if fault is not None:
                fault("built")
            reference = _references(decoder)
            receives, carried = [], {}
            for g, layer in built.items():
                tensors, carried_layer = _receivers(layer, reference, view)
                receives.extend((t, _peer(old_stage[g] - stage)) for t in tensors)
                carried.update(carried_layer)
        except Exception as err:  # noqa: BLE001 - every rank must learn of it
            ok, error = False, err
        if not _all_agree(ok):
            raise TransferError(
                f"layer move {list(before)} -> {list(after)} aborted before any transfer"
                + (f": {error}" if error is not None else " (failed on another rank)")
            ) from error
        ops = [dist.P2POp(dist.isend, t, peer) for t, peer in sends]
        ops += [dist.P2POp(dist.irecv, t, peer) for t, peer in receives]
        try:
            requests = dist.batch_isend_irecv(ops) if ops else []
        except Exception as err:  # noqa: BLE001 - nothing was changed here yet
            ok, error, requests = False, err, []
        for request in requests:  # every one, failed or not: none is left pending
            try:
                request.wait()
            except Exception as err:  # noqa: BLE001 - the first one is named
                ok, error = False, error or err
        if ok and fault is not None:
            try:
                fault("exchanged")
            except Exception as err:  # noqa: BLE001 - as a transport failure
                ok, error = False, err
        # A transport failure shows on the ranks of its link only; the others would commit and
        # enter the rebuild's job-wide collectives alone: a second vote, before anything changes
        if not _all_agree(ok):
            raise TransferError(
                f"layer move {list(before)} -> {list(after)} aborted in the transfer, nothing "
                "changed" + (f": {error}" if error is not None else " (failed on another rank)")
            ) from error
        moved_bytes = sum(t.numel() * t.element_size() for t, _ in sends + receives)
        # commit: the new layer list, the split, then DDP and the optimizer, whose rebuild
        # votes over the job: a failure there on any rank (one of its collectives failing
        # aside, which is the transport's) undoes it on every rank, each putting back its
        # layer list and split here
        saved = (
            decoder.layers,
            decoder.num_layers_per_pipeline_rank,
            decoder.submodules.layer_specs,
        )
        split = _split_fields(config)
        kept = [layer for g, layer in enumerate(decoder.layers, first) if g not in outgoing]
        layers = sorted(kept + list(built.values()), key=lambda layer: layer.layer_number)
        try:
            decoder.layers = torch.nn.ModuleList(layers)
            decoder.num_layers_per_pipeline_rank = len(layers)
            decoder.submodules.layer_specs = [decoder.submodules.layer_specs[0]] * len(layers)
            set_split(config, after)
            _rebuild(state, {}, carried, old=view, fault=fault)
        except BaseException:
            decoder.layers, decoder.num_layers_per_pipeline_rank = saved[0], saved[1]
            decoder.submodules.layer_specs = saved[2]
            _restore_split(config, split)
            raise
    return LayerMigration(
        before,
        after,
        tuple(outgoing),
        tuple(incoming),
        moved_bytes,
        time.perf_counter() - start,
    )


def _peer(direction: int) -> int:
    """The global rank of this rank's counterpart in the next (+1) or previous (-1) stage."""
    if direction == 1:
        return parallel_state.get_pipeline_model_parallel_next_rank()
    if direction == -1:
        return parallel_state.get_pipeline_model_parallel_prev_rank()
    raise StageError(f"layers move to neighbour stages only (direction {direction})")


def _state_tensors(param, view) -> list[torch.Tensor]:
    """What travels with a parameter: its fp32 master (mixed precision) and moments, in the
    order the receiver allocates them."""
    out = []
    if view.has_master(param):
        out.append(view.master(param))
    state = view.state.get(param, {})
    out.extend(state[k] for k in view.moment_keys(param))
    return out


def _payload(layer, view) -> list[torch.Tensor]:
    tensors = []
    for param in layer.parameters():
        tensors.append(param.data.contiguous())
        tensors.extend(t.detach().contiguous() for t in _state_tensors(param, view))
    return tensors


def _build(decoder, config, after, global_index, whole, tp_rank):
    """The layer `global_index` as this stage will hold it: megatron-core's own layer from the
    block's spec, numbered for the new split, with the units the whole plan gives this TP rank
    (tensors uninitialised: the sender's fill them)."""
    stage = parallel_state.get_pipeline_model_parallel_rank()
    local_number = global_index - sum(after[:stage]) + 1
    with _split_as(config, after), _no_initialisation(config):
        layer = build_module(
            decoder.submodules.layer_specs[0],
            config=config,
            layer_number=local_number,
            pg_collection=decoder.pg_collection,
            vp_stage=decoder.vp_stage,
        )
    if layer.layer_number != global_index + 1:
        raise StageError(f"layer {global_index} was built as layer {layer.layer_number - 1}")
    for block in (layer.self_attention, layer.mlp):
        if isinstance(block, UnitBlock):
            units = whole.units(global_index, block.block, tp_rank)
            replicas = _empty_replicas(block, units)
            if replicas:  # head units: the K/V replicas of the units' groups, marked now (the
                # optimizer built next copies the marks onto its fp32 masters)
                block.set_units(units, _empty_shards(block, len(units)), replicas)
                holders = block.heads.holders(whole.layers[global_index]["attn"])
                block.linear_qkv.mark_replicas(holders, tp_rank)
            else:
                block.set_units(units, _empty_shards(block, len(units)))
    reference = _references(decoder)
    device = next(iter(reference.values())).device
    with torch.no_grad():
        for name, param in layer.named_parameters():
            like = _like(reference, name)
            param.data = torch.empty(param.shape, dtype=like.dtype, device=device)
            # what megatron-core sets while initialising (tensor_model_parallel, partition_dim,
            # ...: gradient clipping counts TP duplicates by them), and what later wrappers set
            for attr, value in vars(like).items():
                if attr not in _DDP_PARAM_ATTRS and not hasattr(param, attr):
                    setattr(param, attr, value)
    return layer


def _empty_replicas(block, units) -> dict:
    """Uninitialised K/V replicas of the groups of `units` (head units), else {}."""
    if not block.heads:
        return {}
    template = next(iter(block.unit_tensors()))[2]
    return {
        name: {
            g: torch.empty(shape, dtype=template.dtype, device=template.device)
            for g in block.heads.groups_of(units)
        }
        for name, _, shape in block.replica_tensors()
    }


_REPLICA = re.compile(r"\.kv_(weight|bias)\.\d+$")


def _kind(name: str) -> str:
    """A layer's parameter name without its K/V replica's group."""
    return _REPLICA.sub(r".kv_\1", name)


def _references(decoder) -> dict:
    """A parameter of each kind the stage's layers hold (by _kind): what a built layer's
    parameters take their attributes and optimizer state layout from."""
    out = {}
    for layer in decoder.layers:
        for name, param in layer.named_parameters():
            out.setdefault(_kind(name), param)
    return out


def _like(reference: dict, name: str):
    """The reference of parameter `name`; a K/V replica kind that no local layer holds takes
    the query rows' (same dtype, same megatron-core attributes)."""
    kind = _kind(name)
    return reference[kind] if kind in reference else reference[kind.replace(".kv_", ".")]


def _empty_shards(block, count) -> dict:
    shards = {}
    for name, param_name, param, layout in block.unit_tensors():
        shape = list(param.shape)
        shape[layout.axis] = layout.local_size(count)
        shards.setdefault(name, {})[param_name] = torch.empty(
            shape, dtype=param.dtype, device=param.device
        )
    return shards


def _receivers(layer, reference, view):
    """Tensors to receive a built layer's payload into (the order of _payload), and the
    optimizer state they become: {parameter: (fp32 master or None, moments)}."""
    tensors, carried = [], {}
    for name, param in layer.named_parameters():
        like = _like(reference, name)  # every parameter of a kind has the same state layout
        tensors.append(param.data)
        master = None
        if view.has_master(like):
            master = torch.empty(param.shape, dtype=torch.float32, device=param.device)
            tensors.append(master)
        moments = {}
        for key in view.moment_keys(like):
            template = view.state[like][key]
            moments[key] = torch.empty(param.shape, dtype=template.dtype, device=param.device)
            tensors.append(moments[key])
        step = view.state.get(like, {}).get("step")
        if step is not None:  # the optimizer's step count, the same for every parameter
            moments["step"] = step.clone() if isinstance(step, torch.Tensor) else step
        carried[param] = (master, moments)
    return tensors, carried


def _all_agree(ok: bool) -> bool:
    flag = torch.tensor([int(ok)], dtype=torch.int32, device=comm_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
