"""Executes a transfer schedule over a process group, transactionally.

Every rank sends what it owes each destination in the layout of hettp.wire, receivers stage
it in one buffer per source and verify its checksum, and all ranks vote. Only when every rank
of the group packed, exchanged and verified everything do the received payloads come back to
the caller, who commits them; otherwise every rank raises TransferError naming the failed ranks
and stages, with its own state as it was (senders only read their tensors). A rank whose pack
or exchange failed still reaches the vote, so no peer blocks on it.

Point-to-point, the usual choice, streams: receives are posted first, then a sender hands each
message to the process group as soon as it is ready, straight from its own tensor where that
is contiguous, so packing the next one overlaps sending the last. A rank that fails to pack
sends zeros in place of what it could not, and the vote aborts. On NCCL a pair's sends and
receives run in order on one stream, so two ranks that swap units would each wait in a receive
whose matching send is queued behind the peer's own receive: there every rank packs first and
posts all its operations as one group (`_groups_p2p`). The collectives need whole
buffers: their ranks pack, vote (nothing was sent yet), then exchange.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .plan import PartitionPlan
from .transfer import KV_REPLICA, TransferSchedule, UnitMove, minimum_bytes
from .wire import (
    MESSAGE_BYTES,
    BundleLayout,
    TensorSpec,
    as_bytes,
    checksum_bytes,
    pack,
    payload_nbytes,
    word_sum,
)

__all__ = [
    "Migration",
    "TensorSpec",
    "TransferError",
    "TransferResult",
    "measure_costs",
    "payload_nbytes",
    "run_transfer",
]

STAGES = ("pack", "exchange", "verify")


class TransferError(RuntimeError):
    """A transfer was aborted on every rank; no rank changed its state."""


@dataclass
class TransferResult:
    received: dict  # UnitMove -> list of tensors (staging views)
    primitive: str
    payload_bytes: int  # the units' own bytes: the minimum the plan change requires
    wire_bytes: int  # what the buffers carried: payload + alignment + one checksum per buffer
    seconds: float
    stages: dict[str, float] = field(default_factory=dict)  # STAGES -> seconds on this rank


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
        sizes = {m.block: m.nbytes - m.replica_nbytes for m in self.schedule.moves}
        sizes[KV_REPLICA] = max((m.replica_nbytes for m in self.schedule.moves), default=0)
        return minimum_bytes(self.before, self.after, lambda block: sizes.get(block, 0))


def run_transfer(
    schedule: TransferSchedule,
    group,
    primitive: str,
    payload: Callable[[tuple[UnitMove, ...]], Sequence[torch.Tensor]],
    specs: Callable[[UnitMove], Sequence[TensorSpec]],
    device: torch.device | str = "cpu",
    step: int | None = None,
    fault: Callable[[str], None] | None = None,
    message_bytes: int = MESSAGE_BYTES,
    agree_over=None,
) -> TransferResult:
    """Move every unit of `schedule` within `group` (ranks are group ranks).

    `agree_over`: the process group whose ranks all learn whether any transfer failed (default
    `group`): the whole job where other groups transfer at the same boundary and all of them
    must commit, or none (a rebuilt optimizer runs collectives over every rank).

    specs(move) gives the shapes and dtypes of a unit's tensors (known to every rank);
    payload(run) the sender's tensors for a run of moves (hettp.wire.runs), each its units'
    tensors joined along the spec's axis: a view of the sender's shard where it can be.
    `fault(stage)`, for tests, may raise at each stage; `message_bytes`, for tests, sets
    where small segments stop sharing a message.
    """
    rank = dist.get_rank(group)
    start = time.perf_counter()
    layouts = {
        pair: BundleLayout.of(moves, specs, message_bytes)
        for pair, moves in schedule.bundles().items()
    }
    failures: list[str] = []
    stages: dict[str, float] = {}
    sums: dict[int, torch.Tensor] = {}

    if primitive == "p2p":
        recv, sums = _stream(layouts, group, rank, payload, device, fault, failures, stages)
        # as many votes as the collectives' path: groups that agree over the whole job may
        # have chosen different primitives
        vote(failures, group, device, step, agree_over)
    else:
        send: dict[int, torch.Tensor] = {}
        try:
            if fault:
                fault("pack")
            for (src, dst), layout in layouts.items():
                if src == rank:
                    send[dst] = _packed(layout, payload, device)
        except Exception as err:  # noqa: BLE001 - every failure aborts the transaction
            failures.append(f"pack: {type(err).__name__}: {err}")
        stages["pack"] = time.perf_counter() - start
        vote(failures, group, device, step, agree_over)
        mark = time.perf_counter()
        recv = {
            src: torch.empty(layout.size, dtype=torch.uint8, device=device)
            for (src, dst), layout in layouts.items()
            if dst == rank
        }
        sizes = {pair: layout.size for pair, layout in layouts.items()}
        try:
            _EXCHANGES[primitive](schedule, group, rank, send, recv, sizes, device)
        except Exception as err:  # noqa: BLE001
            failures.append(f"exchange: {type(err).__name__}: {err}")
        stages["exchange"] = time.perf_counter() - mark
    if fault:
        try:
            fault("exchange")
        except Exception as err:  # noqa: BLE001
            failures.append(f"exchange: {type(err).__name__}: {err}")

    # verify and unpack
    mark = time.perf_counter()
    received = {}
    try:
        if fault:
            fault("verify")
        for src, buffer in recv.items():
            total = sums[src] if src in sums else word_sum(buffer[:-8])
            if not torch.equal(buffer[-8:], checksum_bytes(total)):
                raise ValueError(f"checksum mismatch on the buffer from rank {src}")
            received.update(layouts[(src, rank)].unpack(buffer))
    except Exception as err:  # noqa: BLE001
        failures.append(f"verify: {type(err).__name__}: {err}")
    stages["verify"] = time.perf_counter() - mark

    vote(failures, group, device, step, agree_over)
    return TransferResult(
        received,
        primitive,
        schedule.total_bytes,
        sum(layout.size for layout in layouts.values()),
        time.perf_counter() - start,
        stages,
    )


def _packed(layout: BundleLayout, payload, device) -> torch.Tensor:
    """A whole bundle in one buffer, its checksum in the last 8 bytes."""
    buffer = torch.empty(layout.size, dtype=torch.uint8, device=device)
    for segment, tensor in layout.filled(payload):
        pack(segment, tensor, buffer)
    buffer[-8:] = checksum_bytes(word_sum(buffer[:-8]))
    return buffer


def _groups_p2p(group) -> bool:
    """Whether point-to-point operations must go out as one group (NCCL; see the module
    docstring). Gloo matches them as they come, so they stream."""
    return "nccl" in str(dist.get_backend(group))


def _stream(layouts, group, rank, payload, device, fault, failures, stages):
    """Point-to-point, packing overlapped with sending (see the module docstring). Returns the
    staging buffers and, per source, the sum of what arrived, taken as each message landed
    (grouped: none, the verify stage sums the buffers)."""
    start = time.perf_counter()
    recv, arrivals = {}, {}
    grouped = [] if _groups_p2p(group) else None  # the group's operations, posted together
    try:
        for (src, dst), layout in layouts.items():
            if dst == rank:
                buffer = torch.empty(layout.size, dtype=torch.uint8, device=device)
                peer = _global(group, src)
                recv[src] = buffer
                if grouped is not None:
                    grouped += [
                        dist.P2POp(dist.irecv, buffer[lo:hi], peer, group, tag)
                        for tag, (lo, hi) in enumerate(layout.spans)
                    ]
                    continue
                arrivals[src] = [
                    (dist.irecv(buffer[lo:hi], peer, group=group, tag=tag), lo, hi)
                    for tag, (lo, hi) in enumerate(layout.spans)
                ]
    except Exception as err:  # noqa: BLE001
        failures.append(f"exchange: {type(err).__name__}: {err}")

    works, packing = [], 0.0
    for (src, dst), layout in layouts.items():
        if src == rank:
            t0 = time.perf_counter()
            out = _Outbox(layout, _global(group, dst), group, works, device, grouped)
            try:
                if failures:
                    raise RuntimeError("an earlier stage failed on this rank")
                if fault:
                    fault("pack")
                out.send_all(payload)
            except Exception as err:  # noqa: BLE001 - every failure aborts the transaction
                if not any(f.startswith("pack") for f in failures):
                    failures.append(f"pack: {type(err).__name__}: {err}")
                out.fill()
            packing += time.perf_counter() - t0

    sums = {}
    try:
        if grouped:
            works += dist.batch_isend_irecv(grouped)
        for src, pieces in arrivals.items():  # in order: sum each while later ones arrive
            buffer, total = recv[src], torch.zeros((), dtype=torch.int64, device=device)
            for work, lo, hi in pieces[:-1]:
                work.wait()
                total += word_sum(buffer[lo:hi])
            pieces[-1][0].wait()
            sums[src] = total
        for work in works:
            work.wait()
    except Exception as err:  # noqa: BLE001
        failures.append(f"exchange: {type(err).__name__}: {err}")
    stages.update(pack=packing, exchange=time.perf_counter() - start - packing)
    return recv, sums


class _Outbox:
    """One destination's messages, each sent as soon as it is ready; the checksum last."""

    def __init__(self, layout: BundleLayout, peer: int, group, works: list, device, grouped=None):
        self.layout = layout
        self.peer, self.group = peer, group
        self.works = works  # shared by every outbox of the transfer: waited on together
        self.grouped = grouped  # where sends are posted as one group: the group's operations
        self.device = device
        self.sent = 0  # messages handed to the process group
        self.keep: list[torch.Tensor] = []  # staging buffers in flight

    def _send(self, data: torch.Tensor) -> None:
        if self.grouped is not None:
            self.grouped.append(dist.P2POp(dist.isend, data, self.peer, self.group, self.sent))
        else:
            self.works.append(dist.isend(data, self.peer, group=self.group, tag=self.sent))
        self.keep.append(data)
        self.sent += 1

    def send_all(self, payload) -> None:
        total = torch.zeros((), dtype=torch.int64, device=self.device)
        filled = self.layout.filled(payload)
        for message in self.layout.messages:
            pieces = list(itertools.islice(filled, len(message.segments)))
            data = as_bytes(pieces[0][1], pieces[0][0].spec) if len(pieces) == 1 else None
            if data is None:
                data = torch.empty(message.hi - message.lo, dtype=torch.uint8, device=self.device)
                for segment, tensor in pieces:
                    pack(segment, tensor, data, base=message.lo)
            total += word_sum(data)
            self._send(data)
        self._send(checksum_bytes(total).clone())

    def fill(self) -> None:
        """After a failure: zeros for every message not sent yet, so the receiver completes."""
        sizes = [hi - lo for lo, hi in self.layout.spans]
        filler = torch.zeros(max(sizes[self.sent :]), dtype=torch.uint8, device=self.device)
        while self.sent < len(sizes):
            self._send(filler[: sizes[self.sent]])


def vote(failures, group, device, step, agree_over=None):
    """All ranks of `agree_over` (default: `group`) learn whether any rank failed; on failure
    all raise the same error, naming the TP ranks (ranks of `group`) that failed. Also the
    last step of a move's transaction: whether every rank built its new shards."""
    voters = group if agree_over is None else agree_over
    mine = torch.tensor(
        [0 if failures else 1, dist.get_rank(group)], dtype=torch.int64, device=device
    )
    votes = [torch.empty_like(mine) for _ in range(dist.get_world_size(voters))]
    dist.all_gather(votes, mine, group=voters)
    failed = sorted({int(v[1].item()) for v in votes if v[0].item() == 0})
    if failed:
        where = f" at iteration {step}" if step is not None else ""
        detail = f"; this rank: {'; '.join(failures)}" if failures else ""
        raise TransferError(
            f"unit transfer{where} aborted: TP rank(s) {failed} failed{detail}. "
            "Every rank keeps its previous partition and state."
        )


def _global(group, rank):
    return dist.get_global_rank(group, rank) if group is not None else rank


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
            run_transfer(schedule, group, primitive, lambda run: data, lambda m: spec[size], device)
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
