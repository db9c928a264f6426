"""Each rank's own compute time in the work its units carry, per step: each layer's attention
and MLP blocks, entry to exit (the TP-sharded linears and what runs between them: core attention
over the rank's heads, the rotary embedding, the MLP's activation), and (started and stopped by
the runtime around optimizer.step()) the update of the rank's parameters.

What a slow GPU stretches is its share of the sharded work, not its wall time: collectives make
every rank wait for the slowest, so wall times look equal. Identity autograd functions mark each
block's input and output, so the timer runs from entry to exit in the forward and from exit to
entry in the backward, the block's collectives' waits left out. That time scales with the units
a rank computes (hettp/costfit.py says how closely). Timed per linear instead, the activation and
the rotary embedding were left out: the fast rank that took a straggler's units spent time the
planner did not see, and an emulated straggler's share of it was not slowed.

On CPU the timer reads the thread's CPU time by default: waiting in a gloo collective costs
none, and time-sharing a core with other ranks does not inflate it, but neither does real
contention. `--het-tp-timer wall` reads perf_counter instead and leaves the TP collectives'
waits out (it sees a noisy neighbour; use it with no more ranks than cores). On GPU, CUDA
events on the current stream.

Emulation: with a slowdown factor f, the rank sleeps (f - 1) x the compute it just did in
each timed region, and that delay counts as compute: a rank with less work is delayed less.
Where a region holds a collective (a row-parallel linear's all-reduce in the forward, a
column-parallel one's in the backward), the delay for the work before it is slept just before
it: a slow device reaches the collective late, and its peers wait there. Slept at the region's
end instead, the delay fell into the next block, where the peers were busy with their own work,
so a split that balanced the ranks' totals paid it as per-block imbalance (results/sync_waits/).

Dilation (`--het-tp-emulate-dilation D`, CPU time only): each sharded region is stretched by
sleeping until its wall time (TP collective waits left out) is D x f x its CPU time. With more
ranks than cores a region's wall time is up to ranks/cores x its CPU time, because ranks take
turns on a core; with D above that, every region lasts what its own work and factor say, as if
each rank had a device of its own, and a sleeping straggler no longer lends its core to the
others. The dilated time counts as compute, so C and T_fast stay consistent. As with the
emulated delay, the work before a collective inside a region is stretched before it: every rank
reaches the collective at its own dilated time, rather than when the shared cores let it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
import os
import time

import torch

from .model import unwrap_model


class _Mark(torch.autograd.Function):
    """Identity that calls timer.<on_forward>() when the forward passes it and
    timer.<on_backward>() when the gradient does."""

    @staticmethod
    def forward(ctx, x, timer, on_forward, on_backward):
        ctx.timer, ctx.on_backward = timer, on_backward
        getattr(timer, on_forward)()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        getattr(ctx.timer, ctx.on_backward)()
        return grad, None, None, None


class _PausingWork:
    """An async collective's handle whose wait() does not count as compute (for the patch's
    timers running when it waits, wherever the collective was started)."""

    def __init__(self, work, patch):
        self._work, self._patch = work, patch

    def wait(self, *args, **kwargs):
        with self._patch.paused():
            return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


# The collectives a step's compute is cut by: megatron-core's TP, DP and loss reductions, the
# sequence-parallel all-gathers and reduce-scatters, and the controller's own gather and
# broadcast, as (module, attribute). megatron-core looks torch.distributed's up at each call;
# its sequence-parallel ones it binds at import, so those module attributes are wrapped too.
_COLLECTIVES = (
    ("torch.distributed", "all_reduce"),
    ("torch.distributed", "barrier"),  # --timing-log-level 1's, before each timed phase
    ("torch.distributed", "all_gather"),
    ("torch.distributed", "broadcast"),
    ("torch.distributed", "all_gather_into_tensor"),
    ("torch.distributed", "reduce_scatter_tensor"),
    ("megatron.core.tensor_parallel.mappings", "dist_all_gather_func"),
    ("megatron.core.tensor_parallel.mappings", "dist_reduce_scatter_func"),
    ("megatron.core.tensor_parallel.layers", "dist_all_gather_func"),
    ("megatron.core.tensor_parallel.layers", "dist_reduce_scatter_func"),
)


class _CollectivePatch:
    """torch.distributed's collectives wrapped, for as long as timers need it: a collective
    pauses the running timers while it waits (wall-clock timers must not count the wait), and
    device-mode timers slow the compute since the last collective just before it."""

    def __init__(self):
        self.timers = []  # registered timers
        self.originals = {
            (module, name): getattr(importlib.import_module(module), name)
            for module, name in _COLLECTIVES
        }
        self.wrappers = {key: self._wrap(original) for key, original in self.originals.items()}
        for (module, name), wrapper in self.wrappers.items():
            setattr(importlib.import_module(module), name, wrapper)

    def _wrap(self, original):
        def collective(*args, **kwargs):
            with self.paused():
                for timer in self.timers:
                    timer.before_collective()
                work = original(*args, **kwargs)
                for timer in self.timers:
                    timer.after_collective()
            return _PausingWork(work, self) if kwargs.get("async_op") else work

        return collective

    @contextlib.contextmanager
    def paused(self):
        running = [t for t in self.timers if t.running]
        for timer in running:
            timer.pause()
        try:
            yield
        finally:
            for timer in running:
                timer.resume()

    def restore(self) -> None:
        """Put the originals back, unless something wrapped one after us (then ours stays in
        its chain, with no timers: a pass-through)."""
        for (module, name), wrapper in self.wrappers.items():
            owner = importlib.import_module(module)
            if getattr(owner, name) is wrapper:
                setattr(owner, name, self.originals[(module, name)])


_PATCH = None  # the installed _CollectivePatch while a timer needs it; None otherwise


def _register(timer) -> None:
    """Let collectives pause `timer` and slow it in device mode; the first such timer installs
    the patch."""
    global _PATCH
    if _PATCH is None:
        _PATCH = _CollectivePatch()
    _PATCH.timers.append(timer)


def _unregister(timer) -> None:
    """Undo _register(timer); the last timer out restores the wrapped collectives."""
    global _PATCH
    if _PATCH is None or timer not in _PATCH.timers:
        return
    _PATCH.timers.remove(timer)
    if not _PATCH.timers:
        _PATCH.restore()
        _PATCH = None


class ComputeTimer:
    """Seconds this rank spent computing since `reset()`: in the work its units carry, and of
    that, in regions started with `fixed=True`; and all of its compute in the step (`busy`).

    clock "cpu": the thread's CPU time (blind to waiting, and to time-sharing a core, so also
    to real contention); "wall": perf_counter with collectives' waits left out (sees real
    contention; meant for no more ranks than cores). On GPU, CUDA events.

    `device`: emulated slowdowns slow all of the rank's compute (the emulation's device mode),
    not only the timed regions. `emulated`: the run emulates a straggler (on any rank), so the
    delays are placed before the collectives inside the regions.

    `remove()` it when done: a wall-clock, dilated, emulating or device-mode timer keeps
    torch.distributed's collectives wrapped while it exists."""

    def __init__(
        self,
        model,
        clock: str = "cpu",
        dilation: float = 1.0,
        device: bool = False,
        emulated: bool = False,
    ):
        if clock not in ("cpu", "wall"):
            raise ValueError(f"unknown timer clock '{clock}'")
        if not 1.0 <= dilation < math.inf or (dilation > 1.0 and clock != "cpu"):
            raise ValueError(f"dilation {dilation} needs the cpu clock and must be >= 1")
        if device and (clock != "cpu" or dilation > 1.0):
            raise ValueError("the device emulation mode needs the cpu clock and no dilation")
        self.factor = 1.0  # emulated slowdown of this rank (CPU only)
        self.cuda = torch.cuda.is_available()
        if dilation > 1.0 and self.cuda:
            raise RuntimeError("dilation emulates a device per rank on CPU; GPUs have one")
        self.clock = clock
        self.dilation = dilation
        self.device = device
        # A rank pinned to one core, with no dilation, has that core to itself (the launcher
        # gave every rank one): its emulated delays spin there rather than sleep, so the core
        # neither idles (a virtual CPU that idles computes slower for a while after) nor
        # oversleeps.
        self.spin = dilation == 1.0 and len(os.sched_getaffinity(0)) == 1
        self._now = time.perf_counter if clock == "wall" else time.thread_time
        if (clock == "wall" or dilation > 1.0 or device or emulated) and not self.cuda:
            _register(self)
        self._seconds = 0.0
        self._fixed = 0.0  # of which in regions started with fixed=True
        self._attention = 0.0  # ... and in the attention modules' regions
        self._in_fixed = self._in_attention = False
        self._overslept = 0.0  # seconds the last sleeps ran past what they were asked for
        self._events = []
        self._t0 = None
        self._w0 = 0.0
        self._paused = 0.0  # wall seconds of the running region spent in collectives
        self._delayed = 0.0  # of the running region's elapsed time, what was already delayed
        self._paused_clock = 0.0  # the same on the timer's clock
        self._stretched = 0.0  # wall seconds of the running region's dilation slept in a pause
        self._step0 = time.thread_time()  # CPU time at reset()
        self._spun = 0.0  # CPU seconds of emulated delays spun since reset()
        self._emulated = 0.0  # seconds of emulated delay since reset()
        self._mark = self._step0  # device mode: CPU time at the last collective
        self._handles = []
        self._hook(model)

    def rehook(self, model) -> None:
        """Time the layers `model` holds now (layers moved between pipeline stages)."""
        self.unhook()
        self._hook(model)

    def unhook(self) -> None:
        """Stop timing the layers (until `rehook`); collectives stay wrapped, unlike remove()."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, model) -> None:
        for layer in unwrap_model(model).decoder.layers:
            for block, start in ((layer.self_attention, "start_attention"), (layer.mlp, "start")):
                self._handles.append(
                    block.register_forward_pre_hook(
                        functools.partial(self._enter, start=start), with_kwargs=True
                    )
                )
                self._handles.append(
                    block.register_forward_hook(functools.partial(self._exit, start=start))
                )

    def reset(self, factor: float = 1.0) -> None:
        if factor != 1.0 and self.cuda:
            raise RuntimeError(
                "emulated slowdowns are implemented for CPU runs; on GPUs create "
                "real contention (scripts/noisy_neighbor.py)"
            )
        self.factor = factor
        self._seconds, self._fixed, self._attention, self._events = 0.0, 0.0, 0.0, []
        self._step0 = self._mark = time.thread_time()
        self._spun = self._emulated = 0.0

    def read(self) -> float:
        """Seconds of compute in the timed regions since `reset()`."""
        if self._events:
            torch.cuda.synchronize()
            for a, b, fixed, attention in self._events:
                seconds = a.elapsed_time(b) / 1e3
                self._seconds += seconds
                self._fixed += seconds if fixed else 0.0
                self._attention += seconds if attention else 0.0
            self._events = []
        return self._seconds

    def read_fixed(self) -> float:
        """Of `read()`, the seconds in regions started with `fixed=True`."""
        self.read()
        return self._fixed

    def read_attention(self) -> float:
        """Of `read()`, the seconds in the attention modules (the rest of the unfixed ones
        are the MLP's): what prices core attention against the GEMMs."""
        self.read()
        return self._attention

    def read_busy(self) -> float:
        """All of this rank's compute since `reset()`: its thread's CPU time with the emulated
        delays counted as compute (on GPU: the timed regions only)."""
        if self.cuda:
            return self.read()
        return time.thread_time() - self._step0 - self._spun + self._emulated

    def end_step(self) -> None:
        """Device mode: slow the compute since the last collective, as that of a step's tail."""
        self.before_collective()
        self.after_collective()

    def remove(self) -> None:
        self.unhook()
        _unregister(self)

    @property
    def running(self) -> bool:
        return self._t0 is not None

    def pause(self) -> None:
        self._paused_at = (time.perf_counter(), self._now())

    def resume(self) -> None:
        wall, clock = self._paused_at
        self._paused += time.perf_counter() - wall
        self._paused_clock += self._now() - clock

    def before_collective(self) -> None:
        if self.dilation > 1.0:
            if self._t0 is not None:
                self._stretch_before_collective()
            return
        if self.factor <= 1.0:
            return
        if self.device:
            self._delay((self.factor - 1.0) * (time.thread_time() - self._mark))
        elif self._t0 is not None:
            # sharded mode: the region's work so far is late to this collective
            elapsed = self._elapsed()
            self._delay((self.factor - 1.0) * (elapsed - self._delayed))
            self._delayed = elapsed

    def _stretch_before_collective(self) -> None:
        """Dilation: the region so far lasts its dilated time before the collective starts, so
        every rank reaches it when a device of its own would have (the pause around the
        collective began at `_paused_at`, so this sleep is measured here, not as wall time)."""
        wall = self._paused_at[0] - self._w0 - self._paused + self._stretched
        want = self._elapsed() * self.factor * self.dilation - wall
        if want > 0.0:
            start = time.perf_counter()
            time.sleep(want)
            self._stretched += time.perf_counter() - start

    def after_collective(self) -> None:
        if self.device:
            self._mark = time.thread_time()

    # ---- marks ------------------------------------------------------------------------

    def start(self, fixed: bool = False) -> None:
        """Open a region; `fixed`: its time does not scale with the rank's units (the optimizer
        step, whose cost on these models is per tensor far more than per element)."""
        self._in_fixed, self._in_attention = fixed, False
        if self.cuda:
            self._t0 = torch.cuda.Event(enable_timing=True)
            self._t0.record()
        else:
            self._t0, self._w0 = self._now(), time.perf_counter()
            self._paused = self._paused_clock = self._delayed = self._stretched = 0.0

    def start_attention(self) -> None:
        """Open a region in an attention module."""
        self.start()
        self._in_attention = True

    def stop(self) -> None:
        if self._t0 is None:
            return
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._t0, end, self._in_fixed, self._in_attention))
        else:
            wall = time.perf_counter() - self._w0 - self._paused + self._stretched
            elapsed = self._elapsed()
            seconds = elapsed * self.factor * self.dilation
            if self.dilation > 1.0:
                if seconds > wall:
                    self._sleep(seconds - wall)
            elif self.factor > 1.0 and not self.device:
                self._delay((self.factor - 1.0) * (elapsed - self._delayed))
            self._seconds += seconds
            self._fixed += seconds if self._in_fixed else 0.0
            self._attention += seconds if self._in_attention else 0.0
        self._t0 = None

    def _elapsed(self) -> float:
        """The running region's time on the timer's clock, collectives' waits left out."""
        if self.clock == "wall":
            return time.perf_counter() - self._w0 - self._paused
        return self._now() - self._t0 - self._paused_clock

    def _delay(self, seconds: float) -> None:
        """An emulated delay: spun on a core of the rank's own, else slept."""
        self._emulated += seconds
        if not self.spin:
            self._sleep(seconds)
            return
        cpu = time.thread_time()
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            pass
        self._spun += time.thread_time() - cpu

    def _sleep(self, seconds: float) -> None:
        """Sleep `seconds` on average: time.sleep overshoots by tens of microseconds a call,
        which over the many short regions of a step would make an emulated factor F read as
        more than F, so what it overslept is taken off the next sleep."""
        want = seconds - self._overslept
        if want <= 0.0:
            self._overslept = -want
            return
        start = time.perf_counter()
        time.sleep(want)
        self._overslept = time.perf_counter() - start - want

    def _enter(self, module, args, kwargs, start="start"):
        if not (module.training and torch.is_grad_enabled()):
            return None
        if args:
            return (_Mark.apply(args[0], self, start, "stop"), *args[1:]), kwargs
        marked = _Mark.apply(kwargs["hidden_states"], self, start, "stop")
        return args, dict(kwargs, hidden_states=marked)

    def _exit(self, module, args, output, start="start"):
        if not (module.training and torch.is_grad_enabled()):
            return None
        if isinstance(output, tuple):
            return (_Mark.apply(output[0], self, "stop", start), *output[1:])
        return _Mark.apply(output, self, "stop", start)
