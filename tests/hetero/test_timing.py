"""The compute timer's arithmetic on a scripted clock: emulated slowdowns, dilation, and
collective waits left out (no process group, no model, no real sleeping)."""

from __future__ import annotations

import importlib
import time
import types

import pytest
import torch
import torch.distributed as dist

from megatron.hetero import timing
from megatron.hetero.timing import ComputeTimer


class Clock:
    """Thread CPU time and wall time that advance only when told; sleep() advances the wall."""

    def __init__(self):
        self.cpu = self.wall = 0.0
        self.slept = []
        self.overshoot = 0.0  # what every sleep runs past its request, as time.sleep does

    def work(self, cpu: float, wall: float) -> None:
        self.cpu += cpu
        self.wall += wall

    def sleep(self, seconds: float) -> None:
        self.slept.append(round(seconds, 9))
        self.wall += seconds + self.overshoot


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    fake = types.SimpleNamespace(
        thread_time=lambda: clock.cpu, perf_counter=lambda: clock.wall, sleep=clock.sleep
    )
    monkeypatch.setattr(timing, "time", fake)
    # a timer a test leaves registered does not outlive it: no patch, all_reduce as it was
    monkeypatch.setattr(timing, "_PATCH", None)
    for module, name in timing._COLLECTIVES:
        owner = importlib.import_module(module)
        monkeypatch.setattr(owner, name, getattr(owner, name))
    return clock


class Collectives:
    """torch.distributed.all_reduce as a stand-in that waits `wait` seconds of the scripted wall
    clock (at once, or in wait() when async); the timer's patch wraps it."""

    def __init__(self, clock):
        self.clock, self.wait = clock, 0.0
        self.slept_before = []  # per call: the sleeps done before it

    def all_reduce(self, tensor, op=None, group=None, async_op=False):
        self.slept_before.append(list(self.clock.slept))
        if not async_op:
            self.clock.work(0.0, self.wait)
            return None
        return types.SimpleNamespace(wait=lambda: self.clock.work(0.0, self.wait))


@pytest.fixture
def collectives(clock, monkeypatch):
    fake = Collectives(clock)
    monkeypatch.setattr(dist, "all_reduce", fake.all_reduce)  # restored after the test
    return fake


def _timer(clock_name="cpu", dilation=1.0, device=False, emulated=False):
    model = types.SimpleNamespace(decoder=types.SimpleNamespace(layers=[]))
    timer = ComputeTimer(model, clock_name, dilation, device, emulated)
    timer.cuda, timer.spin = False, False  # the scripted clock sleeps; it cannot spin
    return timer


def _region(timer, clock, cpu, wall, wait=0.0):
    timer.start()
    clock.work(cpu, wall)
    if wait:  # a TP collective inside the region: waiting costs wall time, no CPU time
        timer.pause()
        clock.work(0.0, wait)
        timer.resume()
    timer.stop()


def test_emulated_slowdown_sleeps_in_proportion_to_the_work(clock):
    timer = _timer()
    timer.reset(factor=2.0)
    _region(timer, clock, cpu=0.010, wall=0.025)  # time-shared: wall > CPU time
    assert clock.slept == [0.010]  # (f - 1) x the CPU time, whatever the wall clock did
    assert timer.read() == pytest.approx(0.020)


def test_sleep_overshoot_is_taken_off_the_next_sleep(clock):
    """Many short regions: a 0.5 ms overshoot per sleep would add 50% to a 3x straggler's
    2 ms delays; carried over, the delay stays within one overshoot of (f - 1) x the work."""
    clock.overshoot = 0.0005
    timer = _timer()
    timer.reset(factor=3.0)
    for _ in range(20):
        _region(timer, clock, cpu=0.001, wall=0.001)
    assert clock.wall == pytest.approx(0.020 + 0.040, abs=0.0006)  # the last one stays
    assert timer.read() == pytest.approx(0.060)  # the counted compute is the nominal one
    dilated = _timer(dilation=2.0)
    dilated.reset()
    start = clock.wall
    for _ in range(20):
        _region(dilated, clock, cpu=0.001, wall=0.001)
    assert clock.wall - start == pytest.approx(0.040, abs=0.0006)


def test_dilation_stretches_each_region_to_d_times_its_cpu_time(clock):
    timer = _timer(dilation=3.0)
    timer.reset(factor=2.0)
    _region(timer, clock, cpu=0.010, wall=0.025)
    assert clock.slept == [pytest.approx(0.035)]  # until 3 x 2 x 10 ms of wall time
    assert clock.wall == pytest.approx(0.060)
    _region(timer, clock, cpu=0.010, wall=0.070)  # already past the target: no sleep
    assert len(clock.slept) == 1
    assert timer.read() == pytest.approx(0.120)  # the dilated time counts as compute


def test_dilation_leaves_collective_waits_out_of_the_stretch(clock):
    timer = _timer(dilation=2.0)
    assert timer in timing._PATCH.timers  # the all_reduce patch pauses it
    timer.reset()
    _region(timer, clock, cpu=0.010, wall=0.012, wait=0.500)
    # a long wait for a slower rank does not count as this rank's own time
    assert clock.slept == [pytest.approx(0.008)]
    assert timer.read() == pytest.approx(0.020)


def test_wall_clock_counts_wall_time_minus_waits(clock):
    timer = _timer("wall")
    timer.reset(factor=1.5)
    _region(timer, clock, cpu=0.010, wall=0.020, wait=0.300)
    assert clock.slept == [pytest.approx(0.010)]
    assert timer.read() == pytest.approx(0.030)


@pytest.mark.parametrize("name,dilation", [("wall", 2.0), ("cpu", 0.5)])
def test_dilation_needs_the_cpu_clock_and_at_least_one(clock, name, dilation):
    with pytest.raises(ValueError, match="dilation"):
        _timer(name, dilation)


def test_dilation_leaves_out_waits_in_real_collectives(clock, collectives):
    """Through the all_reduce patch, as megatron-core calls it: a blocking all-reduce in the
    forward, an async one waited on in the backward, and one started before the region."""
    timer = _timer(dilation=2.0)
    timer.reset()
    early = dist.all_reduce(None, async_op=True)  # started outside any region
    timer.start()
    clock.work(0.010, 0.012)
    collectives.wait = 0.500
    dist.all_reduce(None)
    handle = dist.all_reduce(None, async_op=True)
    clock.work(0.005, 0.006)
    handle.wait()
    early.wait()  # ... but waited on inside it
    timer.stop()
    # 2 x 15 ms CPU, 18 ms of own wall: 2 x 10 ms - 12 ms before the first collective, the
    # rest at the region's end
    assert collectives.slept_before[1] == [pytest.approx(0.008)]
    assert clock.slept == [pytest.approx(0.008), pytest.approx(0.030 - 0.018 - 0.008)]
    assert timer.read() == pytest.approx(0.030)


def test_a_dilated_region_is_stretched_before_the_collective_inside_it(clock, collectives):
    """Each rank reaches a row-parallel linear's all-reduce at its own dilated time (D x f x the
    work before it), whatever the shared cores let it do; the rest at the region's end."""
    timer = _timer(dilation=3.0)
    timer.reset(factor=2.0)
    timer.start()
    clock.work(0.010, 0.015)  # the GEMM, time-shared
    collectives.wait = 0.100  # the peers are later still: no stretch for the wait
    dist.all_reduce(None)
    clock.work(0.002, 0.002)
    timer.stop()
    assert collectives.slept_before == [[pytest.approx(0.060 - 0.015)]]
    assert clock.slept == [pytest.approx(0.045), pytest.approx(0.072 - 0.062)]
    assert timer.read() == pytest.approx(0.072)
    # a region already past its dilated time at the collective sleeps nothing there
    timer.start()
    clock.work(0.010, 0.070)
    dist.all_reduce(None)
    timer.stop()
    assert len(clock.slept) == 2
    assert timer.read() == pytest.approx(0.072 + 0.060)
    timer.remove()


def test_a_wall_timer_wraps_all_reduce_until_it_is_removed(clock, collectives):
    original = dist.all_reduce
    timer = _timer("wall")
    assert dist.all_reduce is not original
    assert dist.all_reduce is timing._PATCH.wrappers[("torch.distributed", "all_reduce")]
    timer.remove()
    assert dist.all_reduce is original
    assert timing._PATCH is None  # nothing left behind
    timer.remove()  # twice is harmless
    assert dist.all_reduce is original


def test_the_last_timer_removed_restores_all_reduce(clock, collectives):
    original = dist.all_reduce
    first, second = _timer("wall"), _timer(dilation=2.0)
    wrapper = dist.all_reduce
    assert wrapper is not original
    first.remove()
    assert dist.all_reduce is wrapper  # still needed by the second
    second.reset()  # ... and it still leaves the second's waits out
    second.start()
    clock.work(0.010, 0.010)
    collectives.wait = 0.500
    dist.all_reduce(None)
    second.stop()
    assert clock.slept == [pytest.approx(0.010)]
    second.remove()
    assert dist.all_reduce is original
    assert timing._PATCH is None


def test_a_cpu_timer_leaves_all_reduce_alone(clock, collectives):
    original = dist.all_reduce
    cpu = _timer()
    assert dist.all_reduce is original
    wall = _timer("wall")
    cpu.remove()  # not registered: the wall timer's patch stays
    assert dist.all_reduce is not original
    wall.remove()
    assert dist.all_reduce is original


def test_the_optimizer_step_is_timed_and_slowed_as_a_ranks_own_work(clock):
    """The update of a rank's units moves with them: the runtime times optimizer.step() (and
    an emulated straggler's is slowed) like the sharded layers."""
    from hettp.config import HetTPConfig, ModelShape
    from megatron.hetero.runtime import HetTPRuntime

    runtime = HetTPRuntime(HetTPConfig(policy="none").validated(ModelShape(2, 2, 4, 256)))
    timer = _timer()
    runtime.controller = types.SimpleNamespace(timer=timer)
    timer.reset(factor=2.0)
    runtime.before_optimizer_step()
    clock.work(cpu=0.010, wall=0.010)
    runtime.after_optimizer_step()
    assert timer.read() == pytest.approx(0.020) and clock.slept == [0.010]


def test_device_mode_slows_all_compute_between_collectives(clock, collectives):
    """A slow device is slow at everything: the CPU time between two collectives (inside a
    timed region or not) is stretched just before the second, and the step's tail at its end;
    the delay inside a region is not counted twice."""
    timer = _timer(device=True)
    timer.reset(factor=3.0)
    clock.work(0.004, 0.004)  # untimed: the embedding, say
    timer.start()
    clock.work(0.010, 0.010)  # a row-parallel linear ...
    dist.all_reduce(None)  # ... and its all-reduce: 2 x 14 ms of delay first
    timer.stop()
    clock.work(0.006, 0.006)  # norms, the loss
    timer.end_step()  # the tail: 2 x 6 ms
    assert clock.slept == [pytest.approx(0.028), pytest.approx(0.012)]
    assert timer.read() == pytest.approx(0.030)  # the region: 3 x its 10 ms
    assert timer.read_busy() == pytest.approx(3 * 0.020)  # all of it, 3x
    timer.reset(factor=1.0)  # unslowed: no delay, busy is the CPU time
    clock.work(0.005, 0.005)
    dist.all_reduce(None)
    timer.end_step()
    assert len(clock.slept) == 2 and timer.read_busy() == pytest.approx(0.005)
    timer.remove()


def test_device_mode_needs_the_cpu_clock_without_dilation(clock):
    with pytest.raises(ValueError, match="device emulation mode needs the cpu clock"):
        _timer("wall", device=True)
    with pytest.raises(ValueError, match="device emulation mode needs the cpu clock"):
        _timer(dilation=2.0, device=True)


def test_the_patch_wraps_every_collective_a_step_is_cut_by(clock, collectives):
    def current():
        return {(m, n): getattr(importlib.import_module(m), n) for m, n in timing._COLLECTIVES}

    originals = current()
    assert ("megatron.core.tensor_parallel.layers", "dist_reduce_scatter_func") in originals
    timer = _timer(device=True)
    assert all(current()[key] is not o for key, o in originals.items())
    timer.remove()
    assert current() == originals


def test_sharded_mode_busy_counts_the_emulated_delay(clock):
    timer = _timer()
    timer.reset(factor=2.0)
    clock.work(0.005, 0.005)  # untimed, not slowed in sharded mode
    _region(timer, clock, 0.010, 0.010)
    assert clock.slept == [pytest.approx(0.010)]
    assert timer.read_busy() == pytest.approx(0.015 + 0.010)


def test_a_rank_with_a_core_of_its_own_spins_its_delays():
    """Real clocks: the delay lasts its time in wall clock, and its CPU time does not count
    as the rank's compute."""
    import time

    model = types.SimpleNamespace(decoder=types.SimpleNamespace(layers=[]))
    timer = ComputeTimer(model)
    timer.cuda, timer.spin = False, True
    timer.reset(factor=2.0)
    start = time.perf_counter()
    timer._delay(0.02)
    assert time.perf_counter() - start >= 0.02
    assert timer.read_busy() == pytest.approx(0.02, abs=0.005)  # the delay, not the spinning
    timer.remove()


def test_unhook_stops_timing_the_layers_and_keeps_collectives_wrapped():
    """What a benchmark of the timer's own cost toggles: hooks off (nothing is timed) while
    the wall clock's collective patch stays; rehook times the layers again."""
    layer = torch.nn.Module()
    layer.self_attention, layer.mlp = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    model = types.SimpleNamespace(decoder=types.SimpleNamespace(layers=[layer]))
    original = dist.all_reduce
    timer = ComputeTimer(model, "wall")
    try:
        x = torch.randn(2, 4, requires_grad=True)

        def timed() -> float:
            timer.reset()
            layer.self_attention(x).sum().backward()
            return timer.read()

        assert timed() > 0.0
        timer.unhook()
        assert timed() == 0.0
        assert dist.all_reduce is not original  # still wrapped for the wall clock
        timer.rehook(model)
        assert timed() > 0.0
    finally:
        timer.remove()
    assert dist.all_reduce is original


@pytest.mark.parametrize("clock_name", ["cpu", "wall"])
def test_a_regions_delay_comes_before_the_collective_inside_it(clock, collectives, clock_name):
    """A slow device reaches a row-parallel linear's all-reduce late: the delay for the GEMM
    before it is slept before it (where the peers wait for this rank), the delay for what
    follows it at the region's end; in all, (f - 1) x the region's work, as before."""
    timer = _timer(clock_name, emulated=True)
    timer.reset(factor=3.0)
    timer.start()
    clock.work(0.010, 0.010)  # the GEMM
    collectives.wait = 0.050  # waiting for the peers: no delay for it
    dist.all_reduce(None)
    clock.work(0.002, 0.002)  # the bias add after it
    timer.stop()
    assert collectives.slept_before == [[pytest.approx(0.020)]]
    assert clock.slept == [pytest.approx(0.020), pytest.approx(0.004)]
    assert timer.read() == pytest.approx(0.036)  # 3 x 12 ms of work
    assert timer.read_busy() == pytest.approx(0.036)
    # an async collective (the backward's) is late at its launch; waited on later, no delay
    timer.start()
    clock.work(0.005, 0.005)
    handle = dist.all_reduce(None, async_op=True)
    clock.work(0.005, 0.005)
    handle.wait()
    timer.stop()
    assert collectives.slept_before[-1][-1] == pytest.approx(0.010)
    assert clock.slept[-2:] == [pytest.approx(0.010), pytest.approx(0.010)]
    assert timer.read() == pytest.approx(0.036 + 0.030)
    # outside a region, or unslowed, a collective delays nothing
    dist.all_reduce(None)
    timer.reset(factor=1.0)
    timer.start()
    clock.work(0.010, 0.010)
    dist.all_reduce(None)
    timer.stop()
    assert len(clock.slept) == 4
    timer.remove()
    assert timing._PATCH is None


def _burn(seconds: float) -> None:
    """Compute (thread CPU time) for `seconds`."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class _Burn(torch.autograd.Function):
    """Identity that computes for `seconds` in the forward and again in the backward: the
    work a block does between its linears (an activation, a rotary embedding)."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        _burn(seconds)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _burn(ctx.seconds)
        return grad, None


class _MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear_fc1, self.linear_fc2 = torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)

    def forward(self, hidden_states, padding_mask=None):
        hidden = _Burn.apply(self.linear_fc1(hidden_states), 0.02)  # the activation
        return self.linear_fc2(hidden), None


def test_the_work_between_a_blocks_linears_is_timed():
    """The MLP's activation and attention's rotary embedding run between the sharded linears
    and scale with the units a rank holds, so the timed region is the whole block (forward
    and backward): timed per linear, the fast rank that took a straggler's units spent time
    the planner did not see, and the slow rank's share of that work was not slowed."""
    layer = torch.nn.Module()
    layer.self_attention, layer.mlp = torch.nn.Linear(4, 4), _MLP()
    model = types.SimpleNamespace(decoder=types.SimpleNamespace(layers=[layer]))
    timer = ComputeTimer(model)
    try:
        timer.reset()
        out, _ = layer.mlp(torch.randn(2, 4, requires_grad=True), padding_mask=None)
        assert 0.02 <= timer.read() < 0.035  # the forward's activation
        out.sum().backward()
        assert 0.04 <= timer.read() < 0.07  # and its backward
        assert timer.read_attention() == 0.0
    finally:
        timer.remove()


def test_a_wall_timer_leaves_a_barrier_s_wait_out(clock, monkeypatch):
    """--timing-log-level 1 puts a barrier before each timed phase (megatron-core's optimizer
    phases inside het-TP's update timing): a rank's wait there is not its compute."""
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: clock.work(0.0, 0.200))
    timer = _timer("wall")
    timer.reset()
    timer.start()
    clock.work(0.010, 0.010)
    dist.barrier()
    timer.stop()
    assert timer.read() == pytest.approx(0.010)
    timer.remove()
