"""When the training loop stops before --train-iters: an error (a non-finite loss or gradient
norm) or a clean exit with a save (a signal, the time budget), as Megatron-LM's flags say.

A clean exit must happen at the same step on every rank, or one rank would save while the others
train on and the job would hang: `ExitWatch.due` agrees on it with one all-reduce of two flags
per step, so a SIGTERM delivered to any one rank (or to all, as Slurm does) stops them all at the
next step boundary. Signal handlers only set a flag: a migration or a save that is under way
when the signal lands finishes first.
"""

from __future__ import annotations

import math
import os
import signal
import time

import torch
import torch.distributed as dist

EXIT_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")  # --exit-signal's choices


def process_start_time() -> float:
    """When this process started, in wall-clock seconds (Linux: from /proc; elsewhere the
    moment this module was imported). A job's time budget counts from its start, as
    Megatron-LM's does: building the model and loading a checkpoint spend it too."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _IMPORTED
    # never in the future (a container's /proc/uptime may count from its own start; then the
    # budget counts from install). Not clamped to the import: a rank forked from a server
    # that imported this long ago started when it was forked.
    return min(time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK"), time.time())


_IMPORTED = time.time()


class NonFiniteError(RuntimeError):
    """The loss or gradient norm of a step was NaN or Inf; nothing was saved after it."""


def check_finite(iteration: int, loss: float, grad_norm) -> None:
    """Raise NonFiniteError naming the value. The loss is the DP-reduced token mean and the
    gradient norm is global, so every rank sees the same numbers and stops at the same step."""
    bad = []
    if not math.isfinite(loss):
        bad.append(f"lm loss is {loss}")
    if grad_norm is not None and not math.isfinite(float(grad_norm)):
        bad.append(f"grad norm is {float(grad_norm)}")
    if bad:
        raise NonFiniteError(
            f"iteration {iteration}: {' and '.join(bad)}; stopping before anything is saved, "
            "so the last checkpoint and its tracker are unchanged (a smaller --lr or "
            "--clip-grad usually helps; --no-check-for-nan-in-loss-and-grad trains on)"
        )


class ExitWatch:
    """--exit-signal-handler (on --exit-signal) and --exit-duration-in-mins. `install()` before
    training, `due()` at every step boundary, `close()` after (restores the previous
    handlers)."""

    def __init__(
        self,
        signal_handler: bool,
        duration_mins: float | None,
        device="cpu",
        exit_signal: str = "SIGTERM",
    ):
        self.signal_handler = signal_handler
        self.signal = signal.Signals[exit_signal]
        self.duration_s = duration_mins * 60.0 if duration_mins is not None else None
        self.device = device
        self.received: int | None = None  # the signal this rank got
        self._previous = {}
        self._start = time.time()

    @property
    def active(self) -> bool:
        return self.signal_handler or self.duration_s is not None

    def install(self) -> ExitWatch:
        """Collective where a time budget is set: it counts from the earliest rank's start."""
        if self.duration_s is not None:
            start = torch.tensor([process_start_time()], dtype=torch.float64, device=self.device)
            dist.all_reduce(start, op=dist.ReduceOp.MIN)
            self._start = float(start.item())
        if self.signal_handler:
            self._previous[self.signal] = signal.signal(self.signal, self._on_signal)
        return self

    def _on_signal(self, signum, frame) -> None:
        self.received = signum

    def due(self) -> str | None:
        """Why every rank stops now, or None; the same answer on every rank (collective when
        active, so call it on every rank at every step boundary)."""
        if not self.active:
            return None
        over = self.duration_s is not None and time.time() - self._start > self.duration_s
        got = self.received is not None
        flags = torch.tensor(
            [float(self.received or 0), float(dist.get_rank() + 1 if got else 0), float(over)],
            device=self.device,
        )
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        signum, rank, over = (int(x) for x in flags.tolist())
        if signum:
            return f"{signal.Signals(signum).name} received by rank {rank - 1}"
        if over:
            return f"--exit-duration-in-mins {self.duration_s / 60.0:g} reached"
        return None

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
