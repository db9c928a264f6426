"""How het-TP layers describe a unit-sharded tensor to dist-checkpointing: a piece per stretch
of consecutive unit ids, at its canonical offset, whatever the local order (pure, no process
group); and, on one gloo rank, that checkpoints in the regular pieces of earlier versions load
into them and theirs into vanilla's regular pieces."""

from __future__ import annotations

import os

import torch

from hettp.units import UnitLayout
from megatron.hetero.layers import unit_sharded_factory
from tests.utils import run_ranks

# SwiGLU's fc1: two parts (gate rows of all local units, then up rows), 3 rows a unit
LAYOUT = UnitLayout(axis=0, width=3, parts=2)
NUM_UNITS = 8


def _local(units):
    """A local shard whose rows say which (part, unit) they belong to: 100 * part + unit."""
    rows = [100 * part + u for part in range(2) for u in units for _ in range(3)]
    return torch.tensor(rows, dtype=torch.float32)[:, None].repeat(1, 4)


def test_a_piece_per_stretch_of_ids_in_id_order_merged_back_into_the_local_order():
    units = (5, 4, 6, 0, 1)  # a resized rank keeps priority order, not id order
    data = _local(units)
    factory = unit_sharded_factory("fc1", data, LAYOUT, units, NUM_UNITS, (), 0)
    pieces = factory.build()
    # per part, the stretches 0-1 and 4-6, 3 rows a unit: as uneven as the plan
    assert [p.local_shape for p in pieces] == [(6, 4), (9, 4)] * 2
    assert [p.global_offset[0] for p in pieces] == [0, 12, 24, 36]  # (part * 8 + first) * 3
    assert all(p.global_shape == (48, 4) and not p.has_regular_grid for p in pieces)
    want = [[0, 1], [4, 5, 6], [100, 101], [104, 105, 106]]
    for piece, ids in zip(pieces, want):
        assert piece.data[::3, 0].tolist() == ids
    merged = factory.merge_fn([p.data.clone() for p in pieces])
    assert torch.equal(merged, data)
    # optimizer states go through the same functions, in their own dtype
    merged = factory.merge_fn([p.data.double() for p in pieces])
    assert merged.dtype == torch.float64 and torch.equal(merged, data.double())


def test_the_layer_axis_is_an_axis_of_each_piece():
    """megatron-core's uneven pieces take no prepended axes: the layer's is the data's first,
    at the layer's offset, and merge drops it again."""
    units = (2, 3)
    data = _local(units)
    factory = unit_sharded_factory("fc1", data, LAYOUT, units, NUM_UNITS, ((0, 5, 12),), 0)
    pieces = factory.build()
    assert [p.local_shape for p in pieces] == [(1, 6, 4)] * 2
    assert [p.global_offset for p in pieces] == [(5, 6, 0), (5, 30, 0)]
    assert all(p.global_shape == (12, 48, 4) and p.prepend_axis_num == 0 for p in pieces)
    assert torch.equal(factory.merge_fn([p.data for p in pieces]), data)


def test_a_rank_without_units_offers_a_replica_of_the_first_unit():
    empty = torch.zeros(0, 4)
    (piece,) = unit_sharded_factory("w", empty, LAYOUT, (), NUM_UNITS, (), 0).build()
    assert piece.local_shape == (3, 4) and piece.global_offset[0] == 0 and piece.replica_id == 1


def test_head_fragments_back_to_back_in_both_layouts_are_one_piece():
    """Head units' QKV: fragments consecutive in the canonical tensor and locally are one piece
    (a group's query heads; its K and V), others apart."""
    from megatron.hetero.layers import fragment_factory

    width = 2
    data = torch.arange(5 * width, dtype=torch.float32)[:, None].repeat(1, 3)
    # local rows: heads at fragments 4, 5, 6, then 9, then 1 (out of 12)
    placements = [(0, 4), (2, 5), (4, 6), (6, 9), (8, 1)]
    factory = fragment_factory("qkv", data, width, placements, 12, ((0, 1, 3),), 0)
    pieces = factory.build()
    assert [(p.global_offset[1], p.local_shape) for p in pieces] == [
        (2, (1, 2, 3)),
        (8, (1, 6, 3)),
        (18, (1, 2, 3)),
    ]
    assert all(p.global_shape == (3, 24, 3) and p.global_offset[0] == 1 for p in pieces)
    assert pieces[1].data[0, :, 0].tolist() == [0, 1, 2, 3, 4, 5]
    merged = factory.merge_fn([p.data.clone() for p in pieces])
    assert torch.equal(merged, data)


def _layouts_read_each_other(folder: str) -> dict:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron.hetero import cpu_compat

    cpu_compat.activate()  # megatron-core's CUDA calls, on CPU (as the trainer's initialize)
    dist.init_process_group("gloo")  # from the environment run_ranks sets
    for name in ("old", "new"):
        os.makedirs(os.path.join(folder, name))

    layers, run = 2, 2
    rows = LAYOUT.parts * NUM_UNITS * LAYOUT.width
    full = torch.randn(layers, rows, 4, generator=torch.Generator().manual_seed(0))
    held = {0: (5, 4, 6, 0), 1: (1, 2, 7)}  # scattered, out of id order

    def local(layer, units):  # a rank's shard: part-major, in its local order
        return torch.cat(
            [
                full[layer, (part * NUM_UNITS + u) * 3 : (part * NUM_UNITS + u + 1) * 3]
                for part in range(LAYOUT.parts)
                for u in units
            ]
        )

    def regular(name, pieces):  # vanilla's (and earlier het-TP's) pieces: one shape a key
        return {
            f"{name}{layer}.{k}": ShardedTensor.from_rank_offsets(
                "w",
                full[layer, k * rows // pieces : (k + 1) * rows // pieces].clone(),
                (0, layer, layers),
                (1, k, pieces),
                prepend_axis_num=1,
            )
            for layer in range(layers)
            for k in range(pieces)
        }

    def het(units, data):
        return {
            f"het{layer}": unit_sharded_factory(
                "w", data(layer, units[layer]), LAYOUT, units[layer], NUM_UNITS, ((0, layer, 2),), 0
            )
            for layer in units
        }

    # a checkpoint of 2-unit runs, as saved until 2026-12-07, into irregular pieces
    dist_checkpointing.save(regular("old", rows // (run * 3)), f"{folder}/old")
    loaded = dist_checkpointing.load(
        het(held, lambda layer, u: torch.zeros(2 * len(u) * 3, 4)), f"{folder}/old"
    )
    old = [torch.equal(loaded[f"het{layer}"], local(layer, held[layer])) for layer in held]
    # irregular pieces (every unit, scattered order) into vanilla's halves
    every = {0: (3, 0, 1, 2, 7, 6, 4, 5), 1: tuple(range(8))}
    dist_checkpointing.save(het(every, local), f"{folder}/new")
    request = regular("vanilla", 2)
    for piece in request.values():
        piece.data.zero_()
    loaded = dist_checkpointing.load(request, f"{folder}/new")
    new = [
        torch.equal(loaded[f"vanilla{layer}.{k}"], full[layer, k * rows // 2 : (k + 1) * rows // 2])
        for layer in range(layers)
        for k in range(2)
    ]
    dist.destroy_process_group()
    return {"old": old, "new": new}


def test_earlier_regular_checkpoints_and_vanilla_read_irregular_pieces(tmp_path):
    (result,) = run_ranks(_layouts_read_each_other, 1, str(tmp_path))
    assert result == {"old": [True, True], "new": [True] * 4}
