"""The byte layout of a bundle: runs, segments, messages, packing and unpacking (no process
group)."""

from __future__ import annotations

import pytest
import torch

from hettp.transfer import UnitMove
from hettp.units import UnitLayout
from hettp.wire import BundleLayout, TensorSpec, as_bytes, pack, runs, word_sum

SPECS = {
    # a column-sharded weight (units along axis 1) and a row-sharded one with an odd byte count
    "attn": [TensorSpec((4, 3), torch.float32, axis=1), TensorSpec((3, 2), torch.float16)],
    "mlp": [TensorSpec((2, 8), torch.float32, axis=0)],
}


def _moves(*keys):
    return [UnitMove(layer, block, unit, 0, 1, 0) for layer, block, unit in keys]


def _unit(move):
    """Distinct values per move and tensor."""
    seed = move.layer * 100 + move.unit * 10
    return [
        (torch.arange(spec.shape[0] * spec.shape[1]).reshape(spec.shape) + seed + i).to(spec.dtype)
        for i, spec in enumerate(SPECS[move.block])
    ]


def _payload(run):
    specs = SPECS[run[0].block]
    return [torch.cat([_unit(m)[i] for m in run], dim=spec.axis) for i, spec in enumerate(specs)]


MOVES = _moves(
    (0, "attn", 0), (0, "attn", 1), (0, "attn", 5), (0, "mlp", 2), (0, "mlp", 3), (1, "attn", 0)
)


def test_runs_are_consecutive_moves_of_one_layers_block():
    got = [[(m.layer, m.block, m.unit) for m in run] for run in runs(MOVES)]
    assert got == [
        [(0, "attn", 0), (0, "attn", 1), (0, "attn", 5)],
        [(0, "mlp", 2), (0, "mlp", 3)],
        [(1, "attn", 0)],
    ]


@pytest.mark.parametrize("message_bytes", [1, 40, 100, 1 << 20])
def test_messages_tile_the_bundle_in_order_and_a_large_segment_travels_alone(message_bytes):
    layout = BundleLayout.of(MOVES, lambda m: SPECS[m.block], message_bytes)
    assert [s.offset % 8 for s in layout.segments] == [0] * len(layout.segments)
    bounds = [(m.lo, m.hi) for m in layout.messages]
    assert bounds[0][0] == 0 and bounds[-1][1] == layout.size - 8
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))  # no gap, no overlap
    for message in layout.messages:
        sizes = [s.spec.padded for s in message.segments]
        assert message.hi - message.lo == sum(sizes)
        if any(size >= message_bytes for size in sizes):
            assert len(sizes) == 1
    if message_bytes == 1:
        assert len(layout.messages) == len(layout.segments)
    if message_bytes == 1 << 20:
        assert len(layout.messages) == 1


def test_packed_bundle_unpacks_to_every_units_tensors():
    layout = BundleLayout.of(MOVES, lambda m: SPECS[m.block], message_bytes=40)
    buffer = torch.full((layout.size,), 0xAB, dtype=torch.uint8)  # padding must be zeroed
    for run in runs(MOVES):
        tensors = _payload(run)
        for segment in layout.segments:
            if segment.run == run:
                # pack into the message that holds the segment, as the sender does
                message = next(m for m in layout.messages if segment in m.segments)
                staged = buffer[message.lo : message.hi]
                pack(segment, tensors[segment.index], staged, base=message.lo)
    got = layout.unpack(buffer)
    assert list(got) == MOVES
    for move in MOVES:
        for have, want in zip(got[move], _unit(move), strict=True):
            assert torch.equal(have, want), move
    # the odd-sized float16 segment (12 bytes) was padded with zeros, not left as it was
    odd = next(s for s in layout.segments if s.unit.dtype == torch.float16 and len(s.run) == 1)
    assert buffer[odd.offset + odd.spec.nbytes : odd.offset + odd.spec.padded].eq(0).all()


def test_pack_refuses_a_tensor_that_does_not_match_its_spec():
    layout = BundleLayout.of(MOVES[:1], lambda m: SPECS[m.block])
    out = torch.empty(layout.size, dtype=torch.uint8)
    with pytest.raises(ValueError, match="does not match"):
        pack(layout.segments[0], torch.zeros(4, 2), out)


def test_a_contiguous_aligned_tensor_goes_on_the_wire_without_a_copy():
    shard = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    rows = shard.narrow(0, 2, 4)  # a run of row units: contiguous
    raw = as_bytes(rows, TensorSpec((4, 8), torch.float32))
    assert raw is not None and raw.data_ptr() == rows.data_ptr() and raw.numel() == 128
    assert word_sum(raw) == rows.contiguous().view(torch.int64).sum()
    columns = shard.narrow(1, 2, 4)  # a run of column units: strided, must be packed
    assert as_bytes(columns, TensorSpec((8, 4), torch.float32)) is None
    odd = torch.zeros(3, dtype=torch.float16)  # 6 bytes: not a whole number of words
    assert as_bytes(odd, TensorSpec((3,), torch.float16)) is None
    assert as_bytes(rows, TensorSpec((4, 8), torch.float64)) is None  # wrong spec


def test_unit_layout_run_is_a_view_when_units_are_consecutive():
    local = torch.arange(5 * 2 * 3, dtype=torch.float32).reshape(3, 10)  # 5 units of width 2
    layout = UnitLayout(axis=1, width=2)
    view = layout.run(local, 5, [1, 2, 3])
    assert view.data_ptr() == local[:, 2:].data_ptr() and torch.equal(view, local[:, 2:8])
    gathered = layout.run(local, 5, [3, 0])
    assert torch.equal(
        gathered, torch.cat([layout.payload(local, 5, 3), layout.payload(local, 5, 0)], dim=1)
    )
    gated = UnitLayout(axis=0, width=1, parts=2)  # SwiGLU: gate rows, then up rows
    rows = torch.arange(8, dtype=torch.float32).reshape(4, 2)  # 2 units: gate 0 1, up 2 3
    assert torch.equal(gated.run(rows, 2, [0, 1]), rows[[0, 2, 1, 3]])


def test_each_run_is_asked_for_once_and_spans_end_with_the_checksum():
    layout = BundleLayout.of(MOVES, lambda m: SPECS[m.block], message_bytes=40)
    asked = []

    def payload(run):
        asked.append(run)
        return _payload(run)

    pairs = list(layout.filled(payload))
    assert asked == runs(MOVES)  # one call per run, in order
    assert [s for s, _ in pairs] == list(layout.segments)
    assert all(tuple(t.shape) == s.spec.shape for s, t in pairs)
    assert layout.spans == [(m.lo, m.hi) for m in layout.messages] + [
        (layout.size - 8, layout.size)
    ]
