"""megatron-core TP layers whose shard is an uneven, changeable list of units.

The modules are built exactly like megatron-core's (same shapes, same initialisation, so the
same random stream): a fresh model holds Megatron's even partition. HetPartition.install
(partition.py) then moves units to the plan's owners, and HetPartition.repartition moves them
again while training runs. Each block knows its units' layout; the linears only hold "these
units, in this order" and describe them to dist-checkpointing in the canonical global layout, so
checkpoints load under any plan, TP size, or vanilla megatron-core.

Units: attention = one query group (its query heads plus its K and V heads, which Megatron's
QKV weight lays out per group as [q..q k v]) and the matching columns of the output projection,
or with `--het-tp-attn-granularity N` N query heads of a group (their query rows and output
columns), the group's K and V rows then held as a replica by every rank holding one of its heads
(HetQKVLinear); MLP = `--het-tp-granularity` ffn neurons: their fc1 rows (gate and up rows
together with SwiGLU) and fc2 columns. A rank may own no unit of a block; it still joins the
all-reduce.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.layers import linear_with_grad_accumulation_and_async_allreduce
from megatron.core.tensor_parallel.mappings import (
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.module import MegatronModule

from hettp.plan import HeadUnits
from hettp.units import UnitLayout

# Attributes DDP attaches to parameters for its own grad buffers; a re-shaped parameter gets
# fresh ones from the next DDP wrapper.
_DDP_PARAM_ATTRS = ("main_grad", "grad_added_to_main_grad")


class UnitShardedLinear:
    """Mixin for a TP linear whose sharded parameters hold a list of units."""

    units: tuple = ()
    num_units: int = 0
    unit_layouts: dict = {}
    # Resizing: compute only the first `active` local units (None: all). The skipped ones are a
    # suffix of the shard, so the active weights are views and the GEMMs are smaller.
    active: int | None = None

    def bind_units(self, units, num_units: int, layouts: dict) -> None:
        self.units = tuple(units)
        self.num_units = num_units
        self.unit_layouts = dict(layouts)
        for name, layout in self.unit_layouts.items():
            size = getattr(self, name).shape[layout.axis]
            if size != layout.local_size(len(self.units)):
                raise ValueError(
                    f"{type(self).__name__}.{name}: {size} elements along axis "
                    f"{layout.axis}, expected {layout.local_size(len(self.units))} "
                    f"for {len(self.units)} units"
                )

    def set_shard(self, units, tensors: dict) -> None:
        """Replace the sharded parameters with new tensors holding `units` in that order.

        New Parameter objects: the old ones carry autograd and DDP hooks sized for the old shape.
        """
        for name, tensor in tensors.items():
            old = getattr(self, name)
            new = torch.nn.Parameter(tensor, requires_grad=old.requires_grad)
            for attr, value in vars(old).items():
                if attr not in _DDP_PARAM_ATTRS:
                    setattr(new, attr, value)
            setattr(self, name, new)
        self.units = tuple(units)
        self._update_local_size(len(self.units))

    def _update_local_size(self, num_local_units: int) -> None:
        raise NotImplementedError

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        for name, layout in self.unit_layouts.items():
            key = f"{prefix}{name}"
            if key in state:
                state[key] = unit_sharded_factory(
                    state[key].key,
                    getattr(self, name),
                    layout,
                    self.units,
                    self.num_units,
                    sharded_offsets,
                    state[key].replica_id,
                )
        return state

    def _active_views(self, name):
        tensor = getattr(self, name)
        if tensor is None or name not in self.unit_layouts:
            return None
        return self.unit_layouts[name].prefix(tensor, len(self.units), self.active)


class HetColumnParallelLinear(UnitShardedLinear, ColumnParallelLinear):
    def _update_local_size(self, num_local_units):
        self.output_size_per_partition = self.unit_layouts["weight"].local_size(num_local_units)

    def forward(self, input_, weight=None, runtime_gather_output=None):
        if self.active is None:
            return super().forward(input_, weight, runtime_gather_output)
        # Resized: the same math on the active prefix (each SwiGLU half's, joined). The weight
        # gradient of the skipped suffix stays zero.
        if weight is not None or runtime_gather_output or self.gather_output:
            raise NotImplementedError(
                "a resized het-TP column linear takes its own weight and does not gather its output"
            )
        weights = self._active_views("weight")
        biases = self._active_views("bias") or [None] * len(weights)
        add = [None] * len(weights) if self.skip_bias_add else biases
        # megatron-core's own GEMM, so this rank runs the same collectives in the same order
        # as its unresized peers: the active rows as one weight
        weight = weights[0] if len(weights) == 1 else torch.cat(weights)
        output = _column_gemm(self, input_, weight)
        if add[0] is not None:
            output = output + (add[0] if len(add) == 1 else torch.cat(add))
        output_bias = None
        if self.skip_bias_add and biases[0] is not None:
            output_bias = biases[0] if len(biases) == 1 else torch.cat(biases)
        return output, output_bias


def _column_gemm(linear, input_, weight):
    """A column-parallel GEMM on a weight the caller assembled, through megatron-core's own
    function with ColumnParallelLinear's choice of collectives: the input all-gathered under
    sequence parallelism, else its gradient all-reduced while the weight gradient's GEMM
    runs. (As F.linear after a copy to the TP region, that all-reduce waited for both GEMMs.)"""
    return linear_with_grad_accumulation_and_async_allreduce(
        input_,
        weight,
        None,
        gradient_accumulation_fusion=False,
        allreduce_dgrad=linear.allreduce_dgrad,
        sequence_parallel=linear.sequence_parallel,
        tp_group=linear.tp_group,
    )


def _param_like(tensor, template) -> torch.nn.Parameter:
    """A new Parameter holding `tensor`, with the attributes megatron-core set on `template`
    (tensor_model_parallel, partition_dim, ...), not the DDP ones."""
    new = torch.nn.Parameter(tensor, requires_grad=template.requires_grad)
    for attr, value in vars(template).items():
        if attr not in _DDP_PARAM_ATTRS:
            setattr(new, attr, value)
    return new


class HetQKVLinear(HetColumnParallelLinear):
    """linear_qkv. With query groups as units, a HetColumnParallelLinear. With query heads as
    units (`split_heads`), `weight` (and `bias`) hold only the query rows of this rank's heads,
    and each group one of them belongs to has its K and V rows in `kv_weight[str(group)]`
    (`kv_bias`): a replica, one Parameter per group. HetPartition marks them after every change
    of owners: the lowest holder's is the main one, the others are `shared` (megatron-core's
    gradient norm skips them; a checkpoint saves the main one), and those of groups held twice
    or more are `het_replicated` (their gradients are summed once per step)."""

    heads: HeadUnits | None = None
    head_dim: int = 0

    def split_heads(self, heads: HeadUnits, head_dim: int, units) -> None:
        """At build: from megatron-core's even shard ([q..q k v] per local group) to this
        rank's query rows of `units` (the even head units) and its groups' K/V replicas."""
        hpg, dim = heads.heads_per_group, head_dim
        groups = heads.groups_of(units)
        per_group = (hpg + 2) * dim
        tensors, replicas = {}, {}
        for name in ("weight", "bias"):
            param = getattr(self, name, None)
            if param is None:
                continue
            data = param.data
            tensors[name] = torch.cat(
                [data.narrow(0, i * per_group, hpg * dim) for i in range(len(groups))]
            )
            replicas[name] = {
                g: data.narrow(0, i * per_group + hpg * dim, 2 * dim).clone()
                for i, g in enumerate(groups)
            }
        self.heads, self.head_dim = heads, dim
        layouts = {name: UnitLayout(0, heads.heads_per_unit * dim) for name in tensors}
        self.unit_layouts = layouts
        self.set_replicas(replicas)
        self.set_shard(units, {name: t.contiguous() for name, t in tensors.items()})
        self.bind_units(units, heads.units, layouts)

    @property
    def replica_groups(self) -> tuple[int, ...]:
        return tuple(int(g) for g in self.kv_weight) if self.heads is not None else ()

    def set_replicas(self, replicas: dict) -> None:
        """replicas[parameter name][group]: a tensor (a new replica) or the Parameter already
        held (kept as it is)."""
        for name, by_group in replicas.items():
            template = getattr(self, name)
            store = torch.nn.ParameterDict()
            for group, tensor in sorted(by_group.items()):
                store[str(group)] = (
                    tensor
                    if isinstance(tensor, torch.nn.Parameter)
                    else _param_like(tensor, template)
                )
            setattr(self, f"kv_{name}", store)
        if self.heads is not None:
            self._update_local_size(len(self.units))

    def mark_replicas(self, holders: dict, rank: int) -> None:
        """holders[group]: the ranks holding its K/V (ascending); the lowest holds the main."""
        for name in ("weight", "bias"):
            for group, param in getattr(self, f"kv_{name}", {}).items():
                param.shared = holders[int(group)][0] != rank
                param.het_replicated = len(holders[int(group)]) > 1

    def replica_params(self, name: str = "weight") -> dict:
        """{group: Parameter} of the K/V replicas of `name` (empty with group units)."""
        store = getattr(self, f"kv_{name}", None) if self.heads is not None else None
        return {int(g): p for g, p in store.items()} if store is not None else {}

    def _update_local_size(self, num_local_units):
        super()._update_local_size(num_local_units)
        if self.heads is not None:
            self.output_size_per_partition += 2 * self.head_dim * len(self.replica_groups)

    def forward(self, input_, weight=None, runtime_gather_output=None):
        if self.heads is None:
            return super().forward(input_, weight, runtime_gather_output)
        if weight is not None or runtime_gather_output or self.gather_output:
            raise NotImplementedError(
                "het-TP head units: linear_qkv takes its own weight and does not gather its output"
            )
        # the query rows of the active heads, then K and V per group: one GEMM
        active = len(self.units) if self.active is None else self.active
        rows = active * self.heads.heads_per_unit * self.head_dim
        groups = [str(g) for g in self.replica_groups]
        weight = torch.cat([self.weight[:rows]] + [self.kv_weight[g] for g in groups])
        output = _column_gemm(self, input_, weight)
        bias = None
        if self.bias is not None:
            bias = torch.cat([self.bias[:rows]] + [self.kv_bias[g] for g in groups])
            if not self.skip_bias_add:
                output, bias = output + bias, None
        return output, bias

    def canonical_fragments(self, name: str, of=lambda param: param) -> list:
        """(view, fragment, main) of every head-sized piece of `name` this rank holds, by its
        place in megatron-core's canonical QKV tensor (query heads, then each replica's K and V;
        `main`: the replica a checkpoint saves). `of` maps a parameter to the tensor to view
        (e.g. its gradient)."""
        heads, dim = self.heads, self.head_dim
        local = of(getattr(self, name))
        out = []
        for position, unit in enumerate(self.units):
            for i, fragment in enumerate(heads.query_fragments(unit)):
                start = (position * heads.heads_per_unit + i) * dim
                out.append((local.narrow(0, start, dim), fragment, True))
        for group, param in self.replica_params(name).items():
            main = not getattr(param, "shared", False)
            k, v = heads.kv_fragments(group)
            out.append((of(param).narrow(0, 0, dim), k, main))
            out.append((of(param).narrow(0, dim, dim), v, main))
        return out

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        if self.heads is None:
            return super().sharded_state_dict(prefix, sharded_offsets, metadata)
        state = ColumnParallelLinear.sharded_state_dict(self, prefix, sharded_offsets, metadata)
        fragments = self.heads.fragments
        for name in ("weight", "bias"):
            base = state.get(f"{prefix}{name}")
            if base is None:
                continue
            queries = [
                (position * self.head_dim, fragment)
                for position, fragment in enumerate(
                    f for unit in self.units for f in self.heads.query_fragments(unit)
                )
            ]
            state[f"{prefix}{name}"] = fragment_factory(
                base.key,
                getattr(self, name),
                self.head_dim,
                queries,
                fragments,
                sharded_offsets,
                base.replica_id,
            )
            for group, param in self.replica_params(name).items():
                k, v = self.heads.kv_fragments(group)
                main = not getattr(param, "shared", False)
                state[f"{prefix}kv_{name}.{group}"] = fragment_factory(
                    base.key,
                    param,
                    self.head_dim,
                    [(0, k), (self.head_dim, v)],
                    fragments,
                    sharded_offsets,
                    base.replica_id if main else _non_main(base.replica_id),
                )
        return state


class HetRowParallelLinear(UnitShardedLinear, RowParallelLinear):
    def _update_local_size(self, num_local_units):
        self.input_size_per_partition = self.unit_layouts["weight"].local_size(num_local_units)

    def forward(self, input_):
        if self.active is None:
            return super().forward(input_)
        if not self.input_is_parallel:
            raise NotImplementedError("a resized het-TP row linear needs a parallel input")
        (weight,) = self._active_views("weight")
        partial = F.linear(input_, weight)
        if self.sequence_parallel:  # summed over the TP group, each rank keeps its sequence part
            output = reduce_scatter_to_sequence_parallel_region(partial, group=self.tp_group)
        else:
            output = reduce_from_tensor_model_parallel_region(partial, group=self.tp_group)
        if self.skip_bias_add:
            return output, self.bias
        return (output + self.bias if self.bias is not None else output), None


def unit_sharded_factory(
    key, data, layout: UnitLayout, units, num_units, sharded_offsets, replica_id
) -> ShardedTensorFactory:
    """One ShardedTensor per stretch of consecutive unit ids this rank holds (per part), at its
    offset in the canonical full tensor.

    A function of (key, tensor) only, so megatron-core applies it to optimizer states too. The
    pieces are as uneven as the plan (dist-checkpointing's irregular sharding, read back by
    overlap), so a key has about one piece per rank and layer whatever the plan: pieces of one
    shape had to be as short as the plan's finest owner change, down to one unit, and every
    piece is planned, validated, written and read on its own. The pieces hold the units in id
    order whatever the local order (a resized rank keeps its units in priority order). A rank
    without units of the block offers a non-main replica of the first unit instead (never
    written, loaded and dropped), because dist-checkpointing expects every rank to hold
    something for every key.
    """
    units = tuple(units)
    empty_shape = list(data.shape)
    empty_shape[layout.axis] = 0
    position = {unit: i for i, unit in enumerate(units)}
    n = len(units)
    prepend = len(sharded_offsets)
    piece = _irregular_piece(sharded_offsets, layout.axis, layout.parts * num_units * layout.width)
    # per stretch (first id, count): where its units sit locally, the first local position
    # where they sit back to back in id order (the usual case: one narrow, a view where it
    # is contiguous), else the local positions (a gather)
    stretches = []
    for first, count in _stretches(sorted(units)):
        local = torch.tensor([position[u] for u in range(first, first + count)])
        back_to_back = bool(torch.equal(local, torch.arange(count) + local[0]))
        stretches.append((first, count, int(local[0]) if back_to_back else local))

    def build(key, tensor, replica_id, flattened_range):
        _whole_tensors_only(flattened_range)
        if not units:
            shape = list(tensor.shape)
            shape[layout.axis] = layout.width
            return [piece(key, tensor.new_zeros(shape), 0, _non_main(replica_id))]
        pieces = []
        for part in range(layout.parts):
            for first, count, local in stretches:
                if isinstance(local, int):
                    start = (part * n + local) * layout.width
                    # a column slice (fc2, proj) is not contiguous: a copy, since a parallel
                    # load broadcasts the piece one replica read as its bare memory
                    view = tensor.narrow(layout.axis, start, count * layout.width).contiguous()
                else:
                    rows = layout.part_indices(n, local, part, tensor.device)
                    view = tensor.index_select(layout.axis, rows)
                row = (part * num_units + first) * layout.width
                pieces.append(piece(key, view, row, replica_id))
        return pieces

    def merge(pieces):
        if not units:
            return torch.empty(empty_shape, dtype=data.dtype, device=data.device)
        pieces = iter(pieces)
        out = None
        for part in range(layout.parts):
            for _, count, local in stretches:
                loaded = next(pieces)
                loaded = loaded.reshape(loaded.shape[prepend:])  # the layer axis's, dropped
                if out is None:  # the pieces' dtype: optimizer states differ
                    out = loaded.new_empty(tuple(data.shape))
                if isinstance(local, int):
                    start = (part * n + local) * layout.width
                    out.narrow(layout.axis, start, count * layout.width).copy_(loaded)
                else:
                    rows = layout.part_indices(n, local, part, out.device)
                    out.index_copy_(layout.axis, rows, loaded)
        return out

    return ShardedTensorFactory(key, data, build, merge, replica_id)


def _stretches(ids: list[int]) -> list[tuple[int, int]]:
    """(first, count) of each run of consecutive ids in sorted `ids`."""
    out = []
    for unit in ids:
        if out and out[-1][0] + out[-1][1] == unit:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((unit, 1))
    return out


def fragment_factory(
    key, data, width, placements, fragments, sharded_offsets, replica_id
) -> ShardedTensorFactory:
    """The rows of `data` that `placements` (local start, fragment) place, `width` rows each
    along axis 0, at those fragments of the canonical tensor (of `fragments` such): a piece per
    run of consecutive fragments that sit back to back locally too (irregular, as
    unit_sharded_factory's). Head units use it for the QKV weight, whose query heads and K/V
    replicas sit apart locally. A rank holding nothing offers a non-main replica of fragment 0
    (see unit_sharded_factory)."""
    runs = []  # (local start, first fragment, count)
    for start, fragment in sorted(placements, key=lambda p: p[1]):
        if (
            runs
            and runs[-1][1] + runs[-1][2] == fragment
            and (runs[-1][0] + runs[-1][2] * width == start)
        ):
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((start, fragment, 1))
    prepend = len(sharded_offsets)
    piece = _irregular_piece(sharded_offsets, 0, fragments * width)

    def build(key, tensor, replica_id, flattened_range):
        _whole_tensors_only(flattened_range)
        if not runs:
            shape = (width, *tensor.shape[1:])
            return [piece(key, tensor.new_zeros(shape), 0, _non_main(replica_id))]
        return [  # rows of a contiguous tensor: views (contiguous, as a broadcast needs)
            piece(key, tensor.narrow(0, s, n * width).contiguous(), f * width, replica_id)
            for s, f, n in runs
        ]

    def merge(pieces):
        pieces = list(pieces)
        if not runs:
            return torch.empty(tuple(data.shape), dtype=data.dtype, device=data.device)
        out = pieces[0].new_empty(tuple(data.shape))
        for (start, _, n), loaded in zip(runs, pieces):
            out.narrow(0, start, n * width).copy_(loaded.reshape(loaded.shape[prepend:]))
        return out

    return ShardedTensorFactory(key, data, build, merge, replica_id)


def _irregular_piece(sharded_offsets, axis: int, rows: int):
    """piece(key, tensor, first row, replica): a ShardedTensor for `tensor` at that row of
    `axis` (of `rows`) of the canonical tensor, of any length (megatron-core's sharding without
    a grid, which torch's checkpoint reads back by overlap). The axes that `sharded_offsets`
    prepend (e.g. the layer's) are placed as ShardedTensor.from_rank_offsets places them, but as
    axes of the data: megatron-core's irregular pieces take no prepended axes."""
    prepend = len(sharded_offsets)
    for at, chunk, chunks in sharded_offsets:  # megatron-core's layer axis, say
        if at >= prepend or not 0 <= chunk < chunks:
            raise ValueError(f"het-TP pieces take prepended axes only, got {sharded_offsets}")

    def piece(key, tensor, first_row, replica):
        shape, offset = [1] * prepend + list(tensor.shape), [0] * (prepend + tensor.ndim)
        for at, chunk, chunks in sharded_offsets:
            shape[at], offset[at] = chunks, chunk
        shape[axis + prepend], offset[axis + prepend] = rows, first_row
        data = tensor.reshape((1,) * prepend + tuple(tensor.shape))
        return ShardedTensor(
            key,
            data,
            data.dtype,
            tuple(data.shape),
            tuple(shape),
            tuple(offset),
            None,  # no grid: pieces of any length
            replica_id=replica,
        )

    return piece


def _whole_tensors_only(flattened_range) -> None:
    if flattened_range is not None:
        raise NotImplementedError(
            "het-TP checkpoints do not support flattened (distributed optimizer) shards"
        )


def _non_main(replica_id):
    if isinstance(replica_id, int):
        return replica_id + 1
    return (1, *replica_id[1:]) if replica_id else 1


class HetDotProductAttention(DotProductAttention):
    """megatron-core's DotProductAttention over however many query heads this rank holds (zero
    included). It runs vanilla's own kernels, mask, softmax and dropout, so that a het-TP run
    and the vanilla one it is compared with differ only in how the heads are split (a faster
    kernel here would pass for het-TP's gain). With head units, `head_groups` says which of the
    rank's K/V heads each query head reads."""

    head_groups: torch.Tensor | None = None

    def __init__(self, config, *args, **kwargs):
        if config.softmax_type != "vanilla":
            raise NotImplementedError(
                f"het-TP: --softmax-type {config.softmax_type} keeps a per-head offset that "
                "het-TP does not shard; use the vanilla softmax"
            )
        super().__init__(config, *args, **kwargs)

    def forward(self, query, key, value, attention_mask, *args, **kwargs):
        sq, b, heads, dim = query.shape
        if heads == 0:
            # Stay on the autograd graph: linear_qkv's backward all-reduce must run on every rank.
            return query.reshape(sq, b, 0)
        groups = key.size(2)
        if self.head_groups is not None:  # head units: each query head reads its group's K/V
            index = self.head_groups
            if index.device != key.device:  # the module moved after the units last changed
                index = self.head_groups = index.to(key.device)
            key, value, groups = key.index_select(2, index), value.index_select(2, index), heads
        # megatron-core sizes its reshapes from these, fixed at build for an even split
        self.num_attention_heads_per_partition = heads
        self.num_query_groups_per_partition = groups
        self.hidden_size_per_partition = heads * dim
        return super().forward(query, key, value, attention_mask, *args, **kwargs)


def _even_units(num_units):
    tp = get_tensor_model_parallel_world_size()
    per_rank = num_units // tp
    start = get_tensor_model_parallel_rank() * per_rank
    return range(start, start + per_rank)


@dataclasses.dataclass(frozen=True)
class _LinearShards:
    units: tuple
    params: dict  # unit-sharded parameter name -> Parameter
    stores: dict  # with head units: "kv_weight"/"kv_bias" -> ParameterDict of the replicas


@dataclasses.dataclass(frozen=True)
class InstalledShards:
    """One block's shards as UnitBlock.installed() found them (`active`: its resize, None for
    every unit)."""

    active: int | None
    linears: dict  # linear name -> _LinearShards

    @property
    def units(self) -> tuple:
        return next(iter(self.linears.values())).units


class UnitBlock:
    """Mixin for an attention or MLP block made of units; `block` names it in plans."""

    block: str
    linear_names: tuple
    heads: HeadUnits | None = None  # attention units of query heads (K/V replicas)
    _resized_to: int | None = None  # the active count a resize set, while evaluating

    def train(self, mode: bool = True):
        """Evaluation runs every unit. A resize skips units to keep pace while training; the
        model evaluated, as the one saved, is all of them (evaluated at the resize, a run's
        validation loss was a smaller network's, and its checkpoint loaded into vanilla gave
        another). Back to training, the resize is as it was."""
        if not mode and self.training and self.active < len(self.units):
            self._resized_to = self.active
            self.set_active(None)
        elif mode and not self.training and self._resized_to is not None:
            count, self._resized_to = self._resized_to, None
            self.set_active(count)
        return super().train(mode)

    def replica_tensors(self) -> list:
        """(parameter name, {group: Parameter}, payload shape) per tensor a rank holds once per
        group of its units (head units' K/V); none for other blocks."""
        return []

    @property
    def units(self) -> tuple:
        return getattr(self, self.linear_names[0]).units

    @property
    def num_units(self) -> int:
        return getattr(self, self.linear_names[0]).num_units

    def unit_tensors(self):
        """(linear name, parameter name, parameter, layout) of every unit-sharded tensor."""
        for name in self.linear_names:
            linear = getattr(self, name)
            for param_name, layout in linear.unit_layouts.items():
                yield name, param_name, getattr(linear, param_name), layout

    def set_units(self, units, tensors: dict) -> None:
        """Install new shards: tensors[linear name][parameter name] holds `units` in order.

        Clears any resize: the caller re-applies it to the new units."""
        for name in self.linear_names:
            getattr(self, name).set_shard(units, tensors[name])
        self.set_active(None)

    def installed(self) -> InstalledShards:
        """The shards in place now. A move whose DDP and optimizer rebuild fails puts them back
        (reinstall): the very Parameter objects the old wrapper and optimizer still hold."""
        linears = {}
        for name in self.linear_names:
            linear = getattr(self, name)
            params = {p: getattr(linear, p) for p in linear.unit_layouts}
            stores = {
                attr: getattr(linear, attr)
                for attr in ("kv_weight", "kv_bias")
                if isinstance(getattr(linear, attr, None), torch.nn.ParameterDict)
            }
            linears[name] = _LinearShards(linear.units, params, stores)
        active = self.active
        return InstalledShards(None if active == len(self.units) else active, linears)

    def reinstall(self, shards: InstalledShards) -> None:
        """Put back what installed() returned: parameters, K/V replicas, units and resize, as
        they were (no allocation: reference swaps)."""
        for name, kept in shards.linears.items():
            linear = getattr(self, name)
            for attr, value in {**kept.params, **kept.stores}.items():
                setattr(linear, attr, value)
            linear.units = kept.units
            linear._update_local_size(len(kept.units))
        self.set_active(shards.active)

    def reorder(self, units) -> None:
        """Record a new local order whose tensors the caller has permuted in place."""
        if sorted(units) != sorted(self.units):
            raise ValueError(f"reorder must keep the units; {self.units} -> {tuple(units)}")
        for name in self.linear_names:
            getattr(self, name).units = tuple(units)

    @property
    def active(self) -> int:
        """How many local units run (a prefix of the local order)."""
        active = getattr(self, self.linear_names[0]).active
        return len(self.units) if active is None else active

    def set_active(self, count: int | None) -> None:
        """Compute only the first `count` local units (None or all of them: no resize)."""
        if count is not None and not 0 <= count <= len(self.units):
            raise ValueError(f"active count {count} is not within 0..{len(self.units)}")
        if count == len(self.units):
            count = None
        for name in self.linear_names:
            getattr(self, name).active = count
        self._units_changed(len(self.units) if count is None else count)

    def _units_changed(self, num_local_units: int) -> None:
        pass


class HetSelfAttention(UnitBlock, SelfAttention):
    """SelfAttention whose rank holds any number of query groups, or with `head_units` any
    number of units of that many query heads (and the K/V of their groups)."""

    block = "attn"
    linear_names = ("linear_qkv", "linear_proj")

    def __init__(
        self,
        config,
        submodules,
        layer_number,
        attn_mask_type=None,
        cp_comm_type=None,
        pg_collection=None,
        head_units: int = 0,
        **kwargs,
    ):
        if attn_mask_type is not None:
            kwargs["attn_mask_type"] = attn_mask_type
        super().__init__(
            config=config,
            submodules=submodules,
            layer_number=layer_number,
            cp_comm_type=cp_comm_type,
            pg_collection=pg_collection,
            **kwargs,
        )
        if config.num_query_groups < get_tensor_model_parallel_world_size():
            raise ValueError("het-TP needs at least one query group per TP rank in the even plan")
        # --qk-layernorm's weights: replicated, their gradient summed over the TP group by
        # finalize_model_grads, which finds them by name; HetDDP needs the mark (ddp.py)
        for norm in (self.q_layernorm, self.k_layernorm):
            for param in norm.parameters() if norm is not None else ():
                param.het_tp_summed = True
        self.heads_per_group = config.num_attention_heads // config.num_query_groups
        dim = self.hidden_size_per_attention_head
        self.heads = None
        if head_units and head_units < self.heads_per_group:
            self._init_head_units(config, head_units)
            return
        units = _even_units(config.num_query_groups)
        qkv = {"weight": UnitLayout(0, (self.heads_per_group + 2) * dim)}
        if self.linear_qkv.bias is not None:
            qkv["bias"] = UnitLayout(0, (self.heads_per_group + 2) * dim)
        self.linear_qkv.bind_units(units, config.num_query_groups, qkv)
        self.linear_proj.bind_units(
            units, config.num_query_groups, {"weight": UnitLayout(1, self.heads_per_group * dim)}
        )

    def _init_head_units(self, config, head_units: int) -> None:
        if not isinstance(self.linear_qkv, HetQKVLinear):
            raise TypeError("head units need the het-TP spec's linear_qkv (HetQKVLinear)")
        self.heads = HeadUnits(head_units, self.heads_per_group, config.num_query_groups)
        dim = self.hidden_size_per_attention_head
        units = _even_units(self.heads.units)
        self.linear_qkv.split_heads(self.heads, dim, units)
        self.linear_proj.bind_units(
            units, self.heads.units, {"weight": UnitLayout(1, head_units * dim)}
        )
        self._units_changed(len(units))

    def set_units(self, units, tensors: dict, replicas: dict | None = None) -> None:
        """As UnitBlock's; with head units `replicas` gives the K/V replicas of the groups of
        `units` (HetQKVLinear.set_replicas)."""
        if self.heads is not None:
            if replicas is None:
                raise ValueError("head units: set_units needs the K/V replicas of the new units")
            self.linear_qkv.set_replicas(replicas)
        super().set_units(units, tensors)

    def reorder(self, units) -> None:
        super().reorder(units)
        self._units_changed(self.active)

    def replica_tensors(self):
        """(parameter name, {group: Parameter}, payload shape) per K/V replica tensor of
        linear_qkv: what travels with a head unit besides its own rows (none with group
        units)."""
        if self.heads is None:
            return []
        out = []
        for name in ("weight", "bias"):
            template = getattr(self.linear_qkv, name, None)
            if template is not None:
                shape = (2 * self.hidden_size_per_attention_head, *template.shape[1:])
                out.append((name, self.linear_qkv.replica_params(name), shape))
        return out

    def _units_changed(self, num_local_units):
        if self.heads is None:
            self.num_query_groups_per_partition = num_local_units
            self.num_attention_heads_per_partition = num_local_units * self.heads_per_group
            return
        per_unit = self.heads.heads_per_unit
        groups = self.linear_qkv.replica_groups
        self.num_query_groups_per_partition = len(groups)
        self.num_attention_heads_per_partition = num_local_units * per_unit
        place = {g: i for i, g in enumerate(groups)}
        self.core_attention.head_groups = torch.tensor(
            [place[self.heads.group_of(u)] for u in self.units[:num_local_units]],
            dtype=torch.long,
            device=self.linear_qkv.weight.device,
        ).repeat_interleave(per_unit)

    def get_query_key_value_tensors(
        self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True
    ):
        if output_gate or not split_qkv:
            raise NotImplementedError(
                "het-TP attention supports neither an output gate nor fused QKV rope"
            )
        mixed_qkv, _ = self.linear_qkv(hidden_states)
        sq, b = mixed_qkv.shape[:2]
        groups, dim = self.num_query_groups_per_partition, self.hidden_size_per_attention_head
        if self.heads is not None:  # the active heads' query rows, then K and V per group
            heads = self.num_attention_heads_per_partition
            query, kv = torch.split(mixed_qkv, [heads * dim, groups * 2 * dim], dim=2)
            kv = kv.reshape(sq, b, groups, 2, dim)
            query, key, value = query.reshape(sq, b, heads, dim), kv[:, :, :, 0], kv[:, :, :, 1]
        else:
            mixed_qkv = mixed_qkv.view(sq, b, groups, (self.heads_per_group + 2) * dim)
            split = [self.heads_per_group * dim, dim, dim]
            query, key, value = torch.split(mixed_qkv, split, dim=3)
            query = query.reshape(sq, b, groups * self.heads_per_group, dim)
        # --qk-layernorm: per head, as megatron-core does (IdentityOp without it); a rank
        # holding no (active) head has nothing to normalise, which some fused kernels refuse
        if self.q_layernorm is not None and query.numel():
            query = self.q_layernorm(query)
        if self.k_layernorm is not None and key.numel():
            key = self.k_layernorm(key)
        return query, key, value


class HetMLP(UnitBlock, MLP):
    """MLP whose rank holds any number of ffn units (gate and up rows together with SwiGLU)."""

    block = "mlp"
    linear_names = ("linear_fc1", "linear_fc2")

    def __init__(
        self,
        config,
        submodules,
        is_expert=False,
        input_size=None,
        ffn_hidden_size=None,
        tp_group=None,
        unit_size: int = 1,
    ):
        super().__init__(
            config=config,
            submodules=submodules,
            is_expert=is_expert,
            input_size=input_size,
            ffn_hidden_size=ffn_hidden_size,
            tp_group=tp_group,
        )
        ffn = config.ffn_hidden_size
        if ffn % unit_size:
            raise ValueError(
                f"--het-tp-granularity {unit_size} does not divide --ffn-hidden-size {ffn}"
            )
        num_units = ffn // unit_size
        units = _even_units(num_units)
        parts = 2 if config.gated_linear_unit else 1
        fc1 = {"weight": UnitLayout(0, unit_size, parts)}
        if self.linear_fc1.bias is not None:
            fc1["bias"] = UnitLayout(0, unit_size, parts)
        self.linear_fc1.bind_units(units, num_units, fc1)
        self.linear_fc2.bind_units(units, num_units, {"weight": UnitLayout(1, unit_size)})

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        # The linears describe SwiGLU's gate/up halves themselves (UnitLayout.parts), so skip
        # MLP's own swiglu factory and take the children's state as they give it.
        return MegatronModule.sharded_state_dict(self, prefix, sharded_offsets, metadata)
