"""What attention costs a rank per call, whatever heads it holds: timed once, in plain torch,
at the run's shapes.

A rank that holds any query head runs attention's per-call work (the split of the QKV output,
RoPE, the K/V gather, the score buffer, mask and softmax set-up, the reshapes), forward and
backward, however few its heads; a rank holding none skips it. The probe runs core attention
the way het-TP's layers do, megatron-core's unfused DotProductAttention (scaled scores by
baddbmm, masked softmax, bmm), written here in plain torch. The step model weighs
units by their parameters and FLOPs, so a split that gives a slow rank its first head looked
cheaper than it ran (results/notes.md). Timings of the run itself cannot price this part:
until a move, every rank holds the same heads, and a per-call cost and a per-head one read the
same. So the probe times attention at three sizes, none, one unit (with its group's K/V) and
1 + MORE_UNITS units (each in its own group), and what the first unit cost beyond the others'
average is the call's: `call = t(1) - t(0) - (t(1 + k) - t(1)) / k`. A GEMM of the MLP's shape
gives the rate that turns seconds into the planner's unit of work (parameters).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Rounds of the three sizes and the GEMM, interleaved so that a slow spell of a shared machine
# falls on all of them; each size keeps its fastest round.
ROUNDS = 12
WARMUP_ROUNDS = 2

# Sets of ROUNDS rounds, each pricing the call from its own fastest rounds; the price is the
# median set's. The call is a difference of differences of the sizes' fastest rounds, and a
# fast spell that one size alone catches moves it. Over interleaved probes the price's
# standard deviation fell from 28% of its median to 20% (results/attention_call/
# probe_spread.txt), for 4x the probe's time, once a run.
SETS = 5

# Units past the first that a unit's own cost is averaged over. A unit's marginal cost grows
# with the units (larger GEMMs): the average over several is nearer what the cost fit's
# per-unit rate sees, and it divides the larger size's noise by as many (results/notes.md).
MORE_UNITS = 4


@dataclass(frozen=True)
class ProbeShape:
    """One micro-batch's attention on one rank: `seq` x `batch` tokens of `hidden`, query
    heads of `head_dim` in units of `heads_per_unit` (a unit's heads share one group's K/V),
    and the rank's MLP rows (`mlp_rows` x `hidden`, the GEMM the rate is read from)."""

    seq: int
    batch: int
    hidden: int
    head_dim: int
    heads_per_unit: int
    mlp_rows: int
    rope: bool = True
    device: str | torch.device = "cpu"
    dtype: torch.dtype = torch.float32

    def __post_init__(self):
        for name in ("seq", "batch", "hidden", "head_dim", "heads_per_unit", "mlp_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"ProbeShape.{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class CallPrice:
    """Seconds of attention's per-call part (forward and backward, one layer), and seconds per
    parameter of a GEMM's forward and backward at the same tokens."""

    call_s: float
    gemm_s_per_param: float
    sizes_s: tuple[float, float, float]  # none, one unit, 1 + MORE_UNITS: the call's source

    @property
    def work(self) -> float:
        """The call in the planner's unit of work (a GEMM's parameters)."""
        return self.call_s / self.gemm_s_per_param


def call_seconds(none: float, one: float, more: float, units: int = MORE_UNITS) -> float:
    """The per-call part of timings of attention with no unit, one, and `units` more (each
    unit with its own group's K/V): what the first unit cost beyond the others' average.
    Never negative: timings that noise inverted price the call at nothing, not at a saving."""
    if units < 1:
        raise ValueError(f"units must be >= 1, got {units}")
    return max(0.0, one - none - (more - one) / units)


def _random(shape: ProbeShape):
    """The probe's own generator: it runs on one rank of a TP group, and a draw from the
    default one would leave that rank's dropout masks out of step with its peers'."""
    return {
        "device": shape.device,
        "dtype": shape.dtype,
        "generator": torch.Generator(device=shape.device).manual_seed(0),
    }


class _Attention:
    """Tensors for one size: `units` units, each in its own group."""

    def __init__(self, shape: ProbeShape, units: int):
        s = shape
        self.shape, self.heads, self.groups = s, units * s.heads_per_unit, units
        kw = {"device": s.device, "dtype": s.dtype}
        rows = (self.heads + 2 * self.groups) * s.head_dim
        drawn = _random(s)
        self.x = torch.randn(s.seq, s.batch, s.hidden, **drawn, requires_grad=True)
        self.qkv = torch.randn(rows, s.hidden, **drawn).mul_(0.02).requires_grad_()
        self.proj = torch.randn(s.hidden, self.heads * s.head_dim, **drawn).mul_(0.02)
        self.proj.requires_grad_()
        angle = torch.arange(s.seq, **kw)[:, None] * torch.ones(s.head_dim // 2, **kw)
        self.cos = angle.cos().repeat(1, 2)[:, None, None, :]
        self.sin = angle.sin().repeat(1, 2)[:, None, None, :]
        self.index = torch.arange(self.groups, device=s.device).repeat_interleave(s.heads_per_unit)
        self.causal = torch.ones(s.seq, s.seq, device=s.device, dtype=torch.bool).triu(1)

    def _rope(self, t):
        half = t.size(-1) // 2
        rotated = torch.cat((-t[..., half:], t[..., :half]), dim=-1)
        return t * self.cos + rotated * self.sin

    def step(self) -> None:
        s = self.shape
        mixed = F.linear(self.x, self.qkv)
        if self.heads == 0:
            out = F.linear(mixed.reshape(s.seq, s.batch, 0), self.proj)
        else:
            query, kv = torch.split(
                mixed, [self.heads * s.head_dim, 2 * self.groups * s.head_dim], dim=2
            )
            query = query.reshape(s.seq, s.batch, self.heads, s.head_dim)
            kv = kv.reshape(s.seq, s.batch, self.groups, 2, s.head_dim)
            key, value = kv[:, :, :, 0], kv[:, :, :, 1]
            if s.rope:
                query, key = self._rope(query), self._rope(key)
            key, value = key.index_select(2, self.index), value.index_select(2, self.index)
            out = F.linear(self._core(query, key, value), self.proj)
        out.sum().backward()
        for t in (self.x, self.qkv, self.proj):
            t.grad = None

    def _core(self, query, key, value):
        """[s, b, heads, dim] -> [s, b, heads * dim], as megatron-core's DotProductAttention."""
        s, b, heads, dim = query.shape
        rows = b * heads
        scores = torch.baddbmm(
            torch.empty(rows, s, s, device=query.device, dtype=query.dtype),
            query.reshape(s, rows, dim).transpose(0, 1),
            key.reshape(s, rows, dim).transpose(0, 1).transpose(1, 2),
            beta=0.0,
            alpha=dim**-0.5,
        )
        probs = scores.view(b, heads, s, s).masked_fill(self.causal, -10000.0).softmax(-1)
        context = torch.bmm(probs.view(rows, s, s), value.reshape(s, rows, dim).transpose(0, 1))
        return context.view(b, heads, s, dim).permute(2, 0, 1, 3).reshape(s, b, heads * dim)


class _Gemm:
    def __init__(self, shape: ProbeShape):
        drawn = _random(shape)
        self.x = torch.randn(shape.seq * shape.batch, shape.hidden, **drawn, requires_grad=True)
        self.weight = torch.randn(shape.mlp_rows, shape.hidden, **drawn).mul_(0.02)
        self.weight.requires_grad_()
        self.params = shape.mlp_rows * shape.hidden

    def step(self) -> None:
        F.linear(self.x, self.weight).sum().backward()
        self.x.grad = self.weight.grad = None


def _timed(run, device) -> float:
    synchronize = torch.cuda.synchronize if torch.device(device).type == "cuda" else None
    if synchronize:
        synchronize()
    start = time.perf_counter()
    run()
    if synchronize:
        synchronize()
    return time.perf_counter() - start


def probe(shape: ProbeShape, rounds: int = ROUNDS, sets: int = SETS) -> CallPrice:
    """Time attention at none, one and 1 + MORE_UNITS units and the MLP's GEMM, interleaved,
    in `sets` sets of `rounds` rounds; price the call by the set whose fastest rounds price
    it at the median (the GEMM by its fastest round of all)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if sets < 1:
        raise ValueError(f"sets must be >= 1, got {sets}")
    sizes = [_Attention(shape, units) for units in (0, 1, 1 + MORE_UNITS)]
    gemm = _Gemm(shape)
    runs = [size.step for size in sizes] + [gemm.step]
    for _ in range(WARMUP_ROUNDS):
        for run in runs:
            _timed(run, shape.device)
    priced, gemm_s = [], float("inf")
    for _ in range(sets):
        best = [float("inf")] * len(sizes)
        for _ in range(rounds):
            for i, run in enumerate(runs[: len(sizes)]):
                best[i] = min(best[i], _timed(run, shape.device))
            gemm_s = min(gemm_s, _timed(gemm.step, shape.device))
        priced.append((call_seconds(*best), tuple(best)))
    call, best = sorted(priced)[len(priced) // 2]
    return CallPrice(call, gemm_s / gemm.params, best)
