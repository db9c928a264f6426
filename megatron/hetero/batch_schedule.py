"""The global batch of each step: constant, or ramped up over the first samples
(`--rampup-batch-size START INCREMENT SAMPLES`), counted as Megatron-LM counts it.

megatron-core's own calculator decides the batch at a given number of consumed samples; the
trainer holds it here instead of installing it as megatron-core's module-global calculator, so a
run's batch schedule lives and dies with the run. The batch depends on consumed samples only, so a
resumed run continues the ramp exactly where its checkpoint left it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepBatch:
    """What one training step consumes."""

    global_batch_size: int  # samples over all data-parallel replicas
    num_microbatches: int  # per replica


@dataclass(frozen=True)
class Rampup:
    """`--rampup-batch-size START INCREMENT SAMPLES`: the global batch grows from START by
    INCREMENT, in equal shares of the first SAMPLES samples, up to --global-batch-size."""

    start: int
    increment: int
    samples: int

    def problems(self, global_batch_size: int, per_microbatch: int) -> list[str]:
        """Why this ramp cannot run, in the flag's words (empty when it can). Every batch the
        ramp reaches must split into whole micro-batches: megatron-core only asserts it
        mid-run."""
        flag = f"--rampup-batch-size {self.start} {self.increment} {self.samples}"
        if self.start <= 0 or self.increment <= 0 or self.samples <= 0:
            return [f"{flag}: START, INCREMENT and SAMPLES must be positive"]
        if self.start >= global_batch_size:
            return [f"{flag}: START must be smaller than --global-batch-size ({global_batch_size})"]
        if (global_batch_size - self.start) % self.increment:
            return [
                f"{flag}: --global-batch-size ({global_batch_size}) minus START is not a "
                "multiple of INCREMENT"
            ]
        schedule = BatchSchedule(global_batch_size, 1, 1, self)  # every size is whole here
        uneven = [b for b in schedule.reached() if b % per_microbatch]
        if uneven:
            return [
                f"{flag}: the ramp reaches a global batch of {uneven[0]}, not a multiple of "
                f"--micro-batch-size x data-parallel size ({per_microbatch})"
            ]
        return []


class BatchSchedule:
    """The batch of the step that starts after `consumed` samples."""

    def __init__(
        self,
        global_batch_size: int,
        micro_batch_size: int,
        data_parallel_size: int,
        rampup: Rampup | None = None,
    ):
        # imported here: argument validation uses this class and should not pay for importing
        # megatron-core (seconds)
        from megatron.core.num_microbatches_calculator import (
            ConstantNumMicroBatchesCalculator,
            RampupBatchsizeNumMicroBatchesCalculator,
        )

        self.global_batch_size = global_batch_size
        self.rampup = rampup
        common = dict(
            global_batch_size=global_batch_size,
            micro_batch_size=micro_batch_size,
            data_parallel_size=data_parallel_size,
            decrease_batch_size_if_needed=False,
            rank=-1,  # megatron-core logs on rank 0 only; the trainer's logger says it instead
        )
        if rampup is None:
            self._calculator = ConstantNumMicroBatchesCalculator(**common)
        else:
            self._calculator = RampupBatchsizeNumMicroBatchesCalculator(
                **common,
                start_global_batch_size=rampup.start,
                batch_size_increment=rampup.increment,
                ramup_samples=rampup.samples,
            )

    @classmethod
    def from_args(cls, args) -> BatchSchedule:
        ramp = args.rampup_batch_size
        return cls(
            args.global_batch_size,
            args.micro_batch_size,
            args.data_parallel_size,
            None if ramp is None else Rampup(*ramp),
        )

    def _ramp_steps(self):
        """(samples consumed before, global batch) of each step on the ramp, up to the first
        that starts past its end (Megatron-LM's walk, shared by reached() and iterations())."""
        consumed = 0
        while consumed <= self.rampup.samples:
            self._calculator.update(consumed, consistency_check=False)
            size = self._calculator.get_current_global_batch_size()
            yield consumed, size
            consumed += size

    def reached(self) -> list[int]:
        """The global batch sizes a run goes through, in order (the ramp's, then the full)."""
        sizes = []
        for _, size in self._ramp_steps() if self.rampup is not None else ():
            if not sizes or sizes[-1] != size:
                sizes.append(size)
        if not sizes or sizes[-1] != self.global_batch_size:
            sizes.append(self.global_batch_size)
        return sizes

    def at(self, consumed: int) -> StepBatch:
        self._calculator.update(consumed, consistency_check=True)
        return StepBatch(self._calculator.get_current_global_batch_size(), self._calculator.get())

    def iterations(self, train_samples: int) -> int:
        """Steps that train on `train_samples` samples: Megatron-LM's count (the ramp's steps,
        the last of which may pass the ramp's end, then whole global batches; a partial last
        batch is dropped)."""
        if self.rampup is None:
            return train_samples // self.global_batch_size
        steps, consumed = 0, 0
        for before, size in self._ramp_steps():
            if before > train_samples:
                break
            steps, consumed = steps + 1, before + size
        if train_samples > consumed:
            steps += (train_samples - consumed) // self.global_batch_size
        return steps
