"""--log-progress's reading of Megatron-LM's progress.txt (pure; the file a run writes is tested
in test_training.py)."""

from __future__ import annotations

from datetime import datetime

from megatron.hetero.progress_log import Origin, origin


def _line(when: str, gpus: int, what: str, flops: float | None = None) -> str:
    fields = [f"2026-12-07 {when}", "Job ID: 7", f"# GPUs: {gpus}", what]
    if flops is not None:
        fields += ["Iteration: 5", "Job throughput: 1.0 TFLOP/s/GPU"]
        fields += [
            "Cumulative throughput: 1.0 TFLOP/s/GPU",
            f"Floating-point operations: {flops:.2e}",
        ]
        fields += ["Tokens (in billions): 0.01"]
    return "\t".join(fields) + "\n"


def test_the_cumulative_count_starts_at_the_first_job_of_the_current_world_size():
    lines = [
        _line("10:00:00", 8, "Starting job"),
        _line("10:30:00", 8, "Saved checkpoint", 1e15),
        _line("11:00:00", 8, "Starting job"),  # a restart at the same size: still from 10:00
        _line("11:30:00", 8, "Saved checkpoint", 2e15),
        _line("11:30:01", 8, "Deleted checkpoint\tIteration: 3"),
    ]
    assert origin(lines, 8) == Origin(datetime(2026, 12, 7, 10, 0, 0), 0.0)
    assert origin(lines, 4) is None
    # at another size the count starts over, from the FLOPs saved before that job started
    lines += [_line("12:00:00", 4, "Starting job"), _line("12:30:00", 4, "Saved checkpoint", 3e15)]
    assert origin(lines, 4) == Origin(datetime(2026, 12, 7, 12, 0, 0), 2e15)
    assert origin(lines, 8) is None
    lines += [_line("13:00:00", 8, "Starting job")]
    assert origin(lines, 8) == Origin(datetime(2026, 12, 7, 13, 0, 0), 3e15)
