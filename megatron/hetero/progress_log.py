"""--log-progress: Megatron-LM's `<save>/progress.txt`, one tab-separated line per job start,
saved checkpoint and retired checkpoint, in its format, so the tools that read Megatron-LM's
progress logs read ours. A job's throughput counts the model FLOPs of the samples it trained
(megatron/hetero/flops.py) over its wall time since it started; the cumulative throughput
counts from the first job of the same world size in the file."""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass
from datetime import datetime

FILE = "progress.txt"
_TIME_FORMAT = "%Y-%m-%d %H:%M:%S"


@dataclass(frozen=True)
class Origin:
    """Where the cumulative throughput counts from: the first "Starting job" of the run of
    jobs with this world size, and the FLOPs saved before it."""

    time: datetime
    flops: float


def origin(lines: list[str], world_size: int) -> Origin | None:
    """Megatron-LM's reading of a progress log: a line of another world size starts the
    search over. None when no job of this world size started in the current run of them. A
    line that does not parse (edited, or of another tool) is passed over."""
    found, latest_flops = None, 0.0
    for line in lines:
        fields = line.strip().split("\t")
        try:
            if fields[3] == "Saved checkpoint":
                latest_flops = float(fields[7].split(": ")[1])
            if int(fields[2].split(": ")[1]) != world_size:
                found = None
            elif fields[3] == "Starting job" and found is None:
                found = Origin(datetime.strptime(fields[0], _TIME_FORMAT), latest_flops)
        except (IndexError, ValueError):
            continue
    return found


class ProgressLog:
    """Rank 0's appender (other ranks hold one that writes nothing). `flops_per_sample`: the
    model's, forward and backward; `consumed`: samples trained when this job started."""

    def __init__(
        self,
        save: str,
        world_size: int,
        flops_per_sample: float,
        seq_length: int,
        consumed: int,
        started: float,
        writer: bool,
    ):
        self.path = os.path.join(save, FILE)
        self.world_size = world_size
        self.flops_per_sample = flops_per_sample
        self.seq_length = seq_length
        self._start_flops = flops_per_sample * consumed
        self._started = started  # time.time() when the job started
        self.writer = writer

    def job_started(self) -> None:
        self._append("Starting job", datetime.fromtimestamp(self._started))

    def saved(self, iteration: int, consumed: int) -> None:
        if not self.writer:
            return
        flops = self.flops_per_sample * consumed
        per_gpu = 1e12 * self.world_size
        job = (flops - self._start_flops) / ((time.time() - self._started) * per_gpu)
        lines = []
        try:
            with open(self.path) as f:
                lines = f.readlines()
        except OSError:
            pass  # gone or unreadable: counted from this job's start below
        # this job's own start, if someone removed the file or its line meanwhile
        first = origin(lines, self.world_size) or Origin(
            datetime.fromtimestamp(self._started), self._start_flops
        )
        elapsed = max((datetime.now() - first.time).total_seconds(), 1.0)
        cumulative = (flops - first.flops) / (elapsed * per_gpu)
        self._append(
            f"Saved checkpoint\tIteration: {iteration}\t"
            f"Job throughput: {job:.1f} TFLOP/s/GPU\t"
            f"Cumulative throughput: {cumulative:.1f} TFLOP/s/GPU\t"
            f"Floating-point operations: {flops:.2e}\t"
            f"Tokens (in billions): {consumed * self.seq_length / 1e9:.2f}"
        )

    def deleted(self, iteration: int) -> None:
        self._append(f"Deleted checkpoint\tIteration: {iteration}")

    def _append(self, what: str, when: datetime | None = None) -> None:
        """A side file: one that cannot be written is warned of, not raised (rank 0 alone
        writes it; training goes on)."""
        if not self.writer:
            return
        try:
            with open(self.path, "a") as f:
                f.write(
                    f"{(when or datetime.now()).strftime(_TIME_FORMAT)}\t"
                    f"Job ID: {os.environ.get('SLURM_JOB_ID', '')}\t"
                    f"# GPUs: {self.world_size}\t{what}\n"
                )
        except OSError as err:
            warnings.warn(f"--log-progress: {self.path}: {err}", stacklevel=2)
