"""How het-TP layers describe a unit-sharded tensor to dist-checkpointing: pieces of aligned
runs of units at their canonical offsets, whatever the local order; pure, no process group."""

from __future__ import annotations

import pytest
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


def test_pieces_are_aligned_runs_in_id_order_and_merge_back_into_the_local_order():
    units = (5, 4, 0, 1)  # a resized rank keeps priority order, not id order
    data = _local(units)
    factory = unit_sharded_factory("fc1", data, LAYOUT, units, NUM_UNITS, (), 0, run=2)
    pieces = factory.build()
    # per part, runs 0 (units 0, 1) and 2 (units 4, 5), 2 units x 3 rows each
    assert [p.local_shape for p in pieces] == [(6, 4)] * 4
    assert [p.global_offset[0] for p in pieces] == [0, 12, 24, 36]  # part * 24 + run * 6
    assert all(p.global_shape == (48, 4) for p in pieces)
    want = [[0, 1], [4, 5], [100, 101], [104, 105]]
    for piece, ids in zip(pieces, want):
        assert piece.data[::3, 0].tolist() == ids
    merged = factory.merge_fn([p.data.clone() for p in pieces])
    assert torch.equal(merged, data)
    # optimizer states go through the same functions, in their own dtype
    merged = factory.merge_fn([p.data.double() for p in pieces])
    assert merged.dtype == torch.float64 and torch.equal(merged, data.double())


def test_one_unit_runs_are_always_valid_and_bad_runs_are_refused():
    units = (3, 6)
    pieces = unit_sharded_factory("w", _local(units), LAYOUT, units, NUM_UNITS, (), 0).build()
    assert len(pieces) == 4 and [p.global_offset[0] for p in pieces] == [9, 18, 33, 42]
    with pytest.raises(ValueError, match="a checkpoint run of 3 units does not divide 8"):
        unit_sharded_factory("w", _local(units), LAYOUT, units, NUM_UNITS, (), 0, run=3)
    with pytest.raises(
        ValueError, match=r"units \[0, 1, 2\] of the checkpoint run 0 are not held here"
    ):
        unit_sharded_factory("w", _local(units), LAYOUT, units, NUM_UNITS, (), 0, run=4)


def test_a_rank_without_units_offers_a_replica_of_the_first_run():
    empty = torch.zeros(0, 4)
    (piece,) = unit_sharded_factory("w", empty, LAYOUT, (), NUM_UNITS, (), 0, run=4).build()
    assert piece.local_shape == (12, 4) and piece.global_offset[0] == 0 and piece.replica_id == 1
