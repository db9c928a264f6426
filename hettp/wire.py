"""How the units one rank sends another are laid out in bytes.

A bundle (the moves of one source-destination pair, canonical order) is cut into runs: the
consecutive moves of one layer's block that carry the same tensors. A run travels as one
segment per tensor of a unit: the run's units concatenated along the tensor's unit axis, so a
sender whose units sit next to each other sends a view of its shard (one strided copy, or
none) instead of one slice per unit. Segments are padded to 8 bytes and grouped into messages:
a large segment is a message of its own, small neighbours share one. The layout follows from
the moves and specs alone, so every rank computes the same one; the last 8 bytes of a bundle
are the wrapping sum of its 8-byte words.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from .transfer import UnitMove

ALIGN = 8  # bytes; every segment starts aligned for any dtype view
MESSAGE_BYTES = 256 << 10  # segments below this share a message: a message has a fixed cost


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor of a unit; `axis` is where a run's units are joined."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    axis: int = 0

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize

    @property
    def padded(self) -> int:
        return -(-self.nbytes // ALIGN) * ALIGN

    def repeated(self, count: int) -> TensorSpec:
        """The spec of `count` such tensors joined along the axis."""
        shape = list(self.shape)
        shape[self.axis] *= count
        return replace(self, shape=tuple(shape))


def payload_nbytes(specs: Sequence[TensorSpec]) -> int:
    return sum(s.padded for s in specs)


def runs(moves: Sequence[UnitMove]) -> list[tuple[UnitMove, ...]]:
    """Maximal stretches of consecutive moves of one (layer, block) whose units carry the same
    tensors (head units: all bringing their group's K/V replica, or none)."""

    def kind(move):
        return move.layer, move.block, move.brings_replica

    out: list[list[UnitMove]] = []
    for move in moves:
        if out and kind(out[-1][-1]) == kind(move):
            out[-1].append(move)
        else:
            out.append([move])
    return [tuple(run) for run in out]


@dataclass(frozen=True)
class Segment:
    run: tuple[UnitMove, ...]
    index: int  # which tensor of the unit
    unit: TensorSpec  # one unit's
    offset: int

    @property
    def spec(self) -> TensorSpec:
        return self.unit.repeated(len(self.run))


@dataclass(frozen=True)
class Message:
    lo: int
    hi: int
    segments: tuple[Segment, ...]


@dataclass(frozen=True)
class BundleLayout:
    segments: tuple[Segment, ...]
    messages: tuple[Message, ...]
    size: int  # bytes, the trailing 8-byte checksum included

    @classmethod
    def of(
        cls,
        moves: Sequence[UnitMove],
        specs: Callable[[UnitMove], Sequence[TensorSpec]],
        message_bytes: int = MESSAGE_BYTES,
    ) -> BundleLayout:
        segments, offset = [], 0
        for run in runs(moves):
            for index, unit in enumerate(specs(run[0])):
                segments.append(Segment(run, index, unit, offset))
                offset += segments[-1].spec.padded
        messages: list[Message] = []
        group: list[Segment] = []
        for segment in segments:
            size = segment.spec.padded
            if size >= message_bytes:
                if group:
                    messages.append(_message(group))
                    group = []
                messages.append(Message(segment.offset, segment.offset + size, (segment,)))
                continue
            group.append(segment)
            if group[-1].offset + size - group[0].offset >= message_bytes:
                messages.append(_message(group))
                group = []
        if group:
            messages.append(_message(group))
        return cls(tuple(segments), tuple(messages), offset + 8)

    @property
    def spans(self) -> list[tuple[int, int]]:
        """The byte ranges sent one by one point-to-point: each message, then the checksum."""
        return [(m.lo, m.hi) for m in self.messages] + [(self.size - 8, self.size)]

    def filled(self, payload: Callable[[tuple[UnitMove, ...]], Sequence[torch.Tensor]]):
        """(segment, the sender's tensor for it) in layout order; payload(run) is called once
        per run (a run's segments are consecutive)."""
        run, tensors = None, []
        for segment in self.segments:
            if segment.run is not run:
                run, tensors = segment.run, list(payload(segment.run))
            yield segment, tensors[segment.index]

    def unpack(self, buffer: torch.Tensor) -> dict[UnitMove, list[torch.Tensor]]:
        """Per move, views into `buffer` of its tensors (strided where a run joined them)."""
        out: dict[UnitMove, list[torch.Tensor]] = {}
        for segment in self.segments:
            spec, width = segment.spec, segment.unit.shape[segment.unit.axis]
            joined = view(buffer, segment.offset, spec)
            for i, move in enumerate(segment.run):
                out.setdefault(move, []).append(joined.narrow(spec.axis, i * width, width))
        return out


def _message(group: list[Segment]) -> Message:
    return Message(group[0].offset, group[-1].offset + group[-1].spec.padded, tuple(group))


def view(buffer: torch.Tensor, offset: int, spec: TensorSpec) -> torch.Tensor:
    return buffer[offset : offset + spec.nbytes].view(spec.dtype).view(spec.shape)


def pack(segment: Segment, tensor: torch.Tensor, out: torch.Tensor, base: int = 0) -> None:
    """Copy a run's tensor into `out`, whose byte 0 is layout byte `base` (one copy, also from
    a strided view), zeroing the padding."""
    spec = segment.spec
    if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
        raise ValueError(
            f"payload tensor {tuple(tensor.shape)}/{tensor.dtype} does not match "
            f"{spec.shape}/{spec.dtype}"
        )
    start = segment.offset - base
    view(out, start, spec).copy_(tensor)
    if spec.padded > spec.nbytes:
        out[start + spec.nbytes : start + spec.padded].zero_()


def as_bytes(tensor: torch.Tensor, spec: TensorSpec) -> torch.Tensor | None:
    """`tensor` itself as bytes when it can go on the wire without a copy: contiguous, of the
    spec's shape and dtype, 8-byte aligned and a multiple of 8 bytes long."""
    if (
        tensor.is_contiguous()
        and tuple(tensor.shape) == spec.shape
        and tensor.dtype == spec.dtype
        and spec.nbytes == spec.padded
        and tensor.data_ptr() % ALIGN == 0
    ):
        raw = tensor.reshape(-1).view(torch.uint8)
        try:
            raw.view(torch.int64)  # what word_sum needs
        except RuntimeError:
            return None
        return raw
    return None


def word_sum(buffer: torch.Tensor) -> torch.Tensor:
    """Wrapping sum of the 8-byte words of `buffer` (0-d int64): catches lost and corrupted
    data at memory speed, and adds up piecewise (every message is a multiple of 8 bytes)."""
    return buffer.view(torch.int64).sum()


def checksum_bytes(total: torch.Tensor) -> torch.Tensor:
    return total.reshape(1).view(torch.uint8)
