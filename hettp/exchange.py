"""Executes a transfer schedule over a process group, transactionally.

Every rank packs what it sends into one byte buffer per destination (copies: its own tensors
are not touched), the chosen primitive moves the buffers into staging buffers, receivers verify
a checksum per buffer, and all ranks vote. Only when every rank of the group packed, exchanged
and verified everything do the received payloads come back to the caller, who commits them;
otherwise every rank raises TransferError naming the failed ranks and stages, with its own
state as it was. Ranks vote after packing (so nothing is sent when a rank could not pack) and
after verifying; a rank whose exchange failed still reaches the vote, so no peer blocks on it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .plan import PartitionPlan
from .transfer import TransferSchedule, UnitMove, minimum_bytes

_ALIGN = 8  # bytes; keeps every tensor in a buffer aligned for a dtype view
STAGES = ("pack", "exchange", "verify")


class TransferError(RuntimeError):
    """A transfer was aborted on every rank; no rank changed its state."""


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize

    @property
    def padded(self) -> int:
        return -(-self.nbytes // _ALIGN) * _ALIGN


def payload_nbytes(specs: Sequence[TensorSpec]) -> int:
    return sum(s.padded for s in specs)


def _pack(
    tensors: Sequence[torch.Tensor], specs: Sequence[TensorSpec], out: torch.Tensor, offset: int
) -> int:
    for tensor, spec in zip(tensors, specs, strict=True):
        if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
            raise ValueError(
                f"payload tensor {tuple(tensor.shape)}/{tensor.dtype} does not match "
                f"{spec.shape}/{spec.dtype}"
            )
        raw = tensor.detach().contiguous().view(-1).view(torch.uint8)
        out[offset : offset + raw.numel()].copy_(raw)
        offset += spec.padded
    return offset


def _unpack(buffer: torch.Tensor, specs: Sequence[TensorSpec], offset: int):
    tensors = []
    for spec in specs:
        tensors.append(buffer[offset : offset + spec.nbytes].view(spec.dtype).view(spec.shape))
        offset += spec.padded
    return tensors, offset


def _checksum(buffer: torch.Tensor) -> torch.Tensor:
    """Wrapping sum of the buffer's 8-byte words, as 8 bytes: catches lost and corrupted data
    at memory speed (buffers are multiples of 8 bytes)."""
    return buffer.view(torch.int64).sum().reshape(1).view(torch.uint8)


@dataclass
class TransferResult:
    received: dict  # UnitMove -> list of tensors (staging views)
    primitive: str
    payload_bytes: int  # the units' own bytes: the minimum the plan change requires
    wire_bytes: int  # what the buffers carried: payload + alignment + one checksum per buffer
    seconds: float


@dataclass(frozen=True)
class Migration:
    """One applied plan change: what moved, how, what it cost, and what was predicted."""

    before: PartitionPlan
    after: PartitionPlan
    schedule: TransferSchedule
    result: TransferResult
    predictions: dict  # primitive -> predicted seconds

    @property
    def units_moved(self) -> int:
        return len(self.schedule.moves)

    def minimum_bytes(self) -> int:
        """What the count change alone requires: the floor for "bytes vs minimum"."""
        sizes = {m.block: m.nbytes for m in self.schedule.moves}
        return minimum_bytes(self.before, self.after, lambda block: sizes.get(block, 0))


def run_transfer(
    schedule: TransferSchedule,
    group,
    primitive: str,
    payload: Callable[[UnitMove], Sequence[torch.Tensor]],
    specs: Callable[[UnitMove], Sequence[TensorSpec]],
    device: torch.device | str = "cpu",
    step: int | None = None,
    fault: Callable[[str], None] | None = None,
) -> TransferResult:
    """Move every unit of `schedule` within `group` (ranks are group ranks).

    payload(move) gives the sender's tensors for a unit, specs(move) their shapes and dtypes
    (known to every rank). `fault(stage)`, for tests, may raise at each stage.
    """
    rank = dist.get_rank(group)
    start = time.perf_counter()
    bundles = schedule.bundles()
    sizes = {
        pair: sum(payload_nbytes(specs(m)) for m in moves) + 8 for pair, moves in bundles.items()
    }
    failures: list[str] = []

    # 1. pack into per-destination buffers (copies)
    send: dict[int, torch.Tensor] = {}
    try:
        if fault:
            fault("pack")
        for (src, dst), moves in bundles.items():
            if src != rank:
                continue
            buffer = torch.zeros(sizes[(src, dst)], dtype=torch.uint8, device=device)
            offset = 0
            for move in moves:
                offset = _pack(payload(move), specs(move), buffer, offset)
            buffer[-8:] = _checksum(buffer[:-8])
            send[dst] = buffer
    except Exception as err:  # noqa: BLE001 - every failure aborts the transaction
        failures.append(f"pack: {type(err).__name__}: {err}")
    _vote(failures, group, device, step)  # nothing was sent yet: abort cheaply

    # 2. exchange into staging buffers
    recv = {
        src: torch.empty(sizes[(src, dst)], dtype=torch.uint8, device=device)
        for (src, dst) in bundles
        if dst == rank
    }
    try:
        _EXCHANGES[primitive](schedule, group, rank, send, recv, sizes, device)
        if fault:
            fault("exchange")
    except Exception as err:  # noqa: BLE001
        failures.append(f"exchange: {type(err).__name__}: {err}")

    # 3. verify and unpack
    received = {}
    try:
        if fault:
            fault("verify")
        for src, buffer in recv.items():
            if not torch.equal(buffer[-8:], _checksum(buffer[:-8])):
                raise ValueError(f"checksum mismatch on the buffer from rank {src}")
            offset = 0
            for move in bundles[(src, rank)]:
                received[move], offset = _unpack(buffer, specs(move), offset)
    except Exception as err:  # noqa: BLE001
        failures.append(f"verify: {type(err).__name__}: {err}")

    _vote(failures, group, device, step)
    return TransferResult(
        received, primitive, schedule.total_bytes, sum(sizes.values()), time.perf_counter() - start
    )


def _vote(failures, group, device, step):
    """All ranks learn whether any rank failed; on failure all raise the same error."""
    ok = torch.tensor([0 if failures else 1], dtype=torch.int64, device=device)
    flags = [torch.empty_like(ok) for _ in range(dist.get_world_size(group))]
    dist.all_gather(flags, ok, group=group)
    failed = [r for r, flag in enumerate(flags) if flag.item() == 0]
    if failed:
        where = f" at iteration {step}" if step is not None else ""
        mine = f"; this rank: {'; '.join(failures)}" if failures else ""
        raise TransferError(
            f"unit transfer{where} aborted: TP rank(s) {failed} failed{mine}. "
            "Every rank keeps its previous partition and state."
        )


def _global(group, rank):
    return dist.get_global_rank(group, rank) if group is not None else rank


def _p2p(schedule, group, rank, send, recv, sizes, device):
    ops = [
        dist.P2POp(dist.isend, buf, _global(group, dst), group) for dst, buf in sorted(send.items())
    ]
    ops += [
        dist.P2POp(dist.irecv, buf, _global(group, src), group) for src, buf in sorted(recv.items())
    ]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _all_to_all(schedule, group, rank, send, recv, sizes, device):
    n = dist.get_world_size(group)
    in_splits = [send[d].numel() if d in send else 0 for d in range(n)]
    out_splits = [recv[s].numel() if s in recv else 0 for s in range(n)]
    inp = (
        torch.cat([send[d] for d in range(n) if d in send])
        if send
        else torch.empty(0, dtype=torch.uint8, device=device)
    )
    out = torch.empty(sum(out_splits), dtype=torch.uint8, device=device)
    dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)
    offset = 0
    for src in range(n):
        if src in recv:
            recv[src].copy_(out[offset : offset + out_splits[src]])
        offset += out_splits[src]


def _scatter(schedule, group, rank, send, recv, sizes, device):
    (src,) = schedule.sources()
    n = dist.get_world_size(group)
    chunk = max(sizes.values())  # gloo scatters equal chunks: pad
    out = torch.empty(chunk, dtype=torch.uint8, device=device)
    chunks = None
    if rank == src:
        chunks = [torch.zeros(chunk, dtype=torch.uint8, device=device) for _ in range(n)]
        for dst, buf in send.items():
            chunks[dst][: buf.numel()].copy_(buf)
    dist.scatter(out, chunks, src=_global(group, src), group=group)
    if src in recv:
        recv[src].copy_(out[: recv[src].numel()])


def _broadcast(schedule, group, rank, send, recv, sizes, device):
    (src,) = schedule.sources()
    order = sorted(dst for (_, dst) in sizes)
    total = sum(sizes[(src, d)] for d in order)
    buf = torch.empty(total, dtype=torch.uint8, device=device)
    if rank == src:
        torch.cat([send[d] for d in order], out=buf)
    dist.broadcast(buf, src=_global(group, src), group=group)
    offset = 0
    for dst in order:
        if dst == rank:
            recv[src].copy_(buf[offset : offset + sizes[(src, dst)]])
        offset += sizes[(src, dst)]


_EXCHANGES = {
    "p2p": _p2p,
    "all_to_all": _all_to_all,
    "scatter": _scatter,
    "broadcast": _broadcast,
    "none": lambda *args: None,
}


def measure_costs(group, device="cpu", sizes=(1024, 4 << 20), repeats=5):
    """Fit per-primitive CostModel constants on `group` with real transfers.

    Two patterns: one pair (rank 0 -> 1) and a fan-out (rank 0 -> every rank), each at a small
    and a large size. The slope gives beta; the small-size intercepts give the fixed cost (call)
    and, for p2p whose message count varies with the pattern, the per-message alpha. The
    collectives always involve n-1 peers, so their alpha folds into `call`.
    """
    from .transfer import CostModel, PrimitiveCost

    n = dist.get_world_size(group)
    spec = {s: [TensorSpec((s // 4,), torch.float32)] for s in sizes}

    def timed(primitive, dsts, size):
        schedule = TransferSchedule(
            n, tuple(UnitMove(0, "mlp", i, 0, d, size) for i, d in enumerate(dsts))
        )
        data = [torch.ones(size // 4, dtype=torch.float32, device=device)]
        times = []
        for _ in range(repeats):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            run_transfer(schedule, group, primitive, lambda m: data, lambda m: spec[size], device)
            times.append(time.perf_counter() - t0)
        times = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
        return times.median().item()

    small, large = sizes
    fits = {}
    for primitive in ("p2p", "all_to_all", "scatter", "broadcast"):
        fan = list(range(1, n))
        t_small, t_large = timed(primitive, fan, small), timed(primitive, fan, large)
        volume = (n - 1) if primitive != "broadcast" else (n - 1) * max(1, (n - 1).bit_length())
        beta = volume * (large - small) / max(t_large - t_small, 1e-9)
        intercept = max(t_small - volume * small / beta, 0.0)
        alpha = 0.0
        if primitive == "p2p" and n > 2:
            pair = max(timed("p2p", [1], small) - small / beta, 0.0)
            alpha = max((intercept - pair) / (n - 2), 0.0)
            intercept = max(pair - alpha, 0.0)
        fits[primitive] = PrimitiveCost(call=intercept, alpha=alpha, beta=beta)
    return CostModel(**fits)
