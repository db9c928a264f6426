"""Each rank's own compute time in the TP-sharded linears (QKV, projection, fc1, fc2), per step.

What a slow GPU stretches is its share of the sharded work, not its wall time: collectives make
every rank wait for the slowest, so wall times look equal. Identity autograd functions mark each
sharded linear's input and output, so the timer runs from entry to exit in the forward and from
exit to entry in the backward (its two GEMMs). Time in the GEMMs scales with the units a rank
computes, which the planner relies on; per-call overheads do not, so models whose linears are
tiny time poorly. On CPU it reads the thread's CPU time, which waiting in a gloo
collective does not consume (and which time-sharing a core with other ranks does not inflate);
on GPU, CUDA events on the current stream.

Emulation: with a slowdown factor f, the rank sleeps (f - 1) x the compute it just did after
each sharded GEMM, and that delay counts as compute: a rank with less work is delayed less.
"""

from __future__ import annotations

import time

import torch

from .model import unwrap_model


class _Enter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, timer):
        ctx.timer = timer
        timer.start()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.timer.stop()
        return grad, None


class _Exit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, timer):
        ctx.timer = timer
        timer.stop()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.timer.start()
        return grad, None


class ComputeTimer:
    """Seconds this rank spent computing in its sharded blocks since `reset()`."""

    def __init__(self, model):
        self.factor = 1.0  # emulated slowdown of this rank (CPU only)
        self.cuda = torch.cuda.is_available()
        self._seconds = 0.0
        self._events = []
        self._t0 = None
        self._handles = []
        for layer in unwrap_model(model).decoder.layers:
            for block in (layer.self_attention, layer.mlp):
                for name in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"):
                    linear = getattr(block, name, None)
                    if linear is not None:
                        self._handles.append(linear.register_forward_pre_hook(
                            self._enter, with_kwargs=True))
                        self._handles.append(linear.register_forward_hook(self._exit))

    def reset(self, factor: float = 1.0) -> None:
        if factor != 1.0 and self.cuda:
            raise RuntimeError("emulated slowdowns are implemented for CPU runs; on GPUs create "
                               "real contention (scripts/noisy_neighbor.py)")
        self.factor = factor
        self._seconds, self._events = 0.0, []

    def read(self) -> float:
        if self._events:
            torch.cuda.synchronize()
            self._seconds += sum(a.elapsed_time(b) for a, b in self._events) / 1e3
            self._events = []
        return self._seconds

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    # ---- marks ------------------------------------------------------------------------

    def start(self) -> None:
        if self.cuda:
            self._t0 = torch.cuda.Event(enable_timing=True)
            self._t0.record()
        else:
            self._t0 = time.thread_time()

    def stop(self) -> None:
        if self._t0 is None:
            return
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._t0, end))
        else:
            elapsed = time.thread_time() - self._t0
            if self.factor > 1.0:
                time.sleep((self.factor - 1.0) * elapsed)
            self._seconds += elapsed * self.factor
        self._t0 = None

    def _enter(self, module, args, kwargs):
        if not (module.training and torch.is_grad_enabled()):
            return None
        if args:
            return (_Enter.apply(args[0], self), *args[1:]), kwargs
        kwargs = dict(kwargs, hidden_states=_Enter.apply(kwargs["hidden_states"], self))
        return args, kwargs

    def _exit(self, module, args, output):
        if not (module.training and torch.is_grad_enabled()):
            return None
        if isinstance(output, tuple):
            return (_Exit.apply(output[0], self), *output[1:])
        return _Exit.apply(output, self)
