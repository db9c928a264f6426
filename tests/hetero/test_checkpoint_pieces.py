"""How het-TP layers describe a unit-sharded tensor to dist-checkpointing: a piece per stretch
of consecutive unit ids, at its canonical offset, whatever the local order; pure, no process
group."""

from __future__ import annotations

import torch

from hettp.units import UnitLayout
from megatron.hetero.layers import unit_sharded_factory

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
