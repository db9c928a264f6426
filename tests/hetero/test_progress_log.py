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


def test_lines_that_do_not_parse_are_passed_over():
    lines = [
        "garbage\n",
        _line("09:00:00", 8, "Starting job").replace("# GPUs: 8", "# GPUs: "),
        "2026-12-07T09:30:00\tJob ID: 7\t# GPUs: 8\tStarting job\n",  # another clock format
        _line("10:00:00", 8, "Saved checkpoint").rstrip("\n") + "\n",  # no fields after it
        _line("10:30:00", 8, "Starting job"),
    ]
    assert origin(lines, 8) == Origin(datetime(2026, 12, 7, 10, 30, 0), 0.0)


def test_a_save_line_counts_model_flops_over_the_job_and_since_its_first_start(tmp_path):
    """1e12 FLOPs a sample on 2 ranks: 200 samples in the 100 s since the job started are 1.0
    TFLOP/s per GPU, and since the first job of this world size (here the same) too."""
    import time

    from megatron.hetero.progress_log import ProgressLog

    log = ProgressLog(str(tmp_path), 2, 1e12, 1000, 0, time.time() - 100, writer=True)
    log.job_started()
    log.saved(5, 200)
    ProgressLog(str(tmp_path), 2, 1e12, 1000, 0, time.time(), writer=False).saved(6, 300)
    fields = [line.split("\t") for line in (tmp_path / "progress.txt").read_text().splitlines()]
    assert [f[3] for f in fields] == ["Starting job", "Saved checkpoint"]  # one writer
    start, save = fields
    assert save[4:] == [
        "Iteration: 5",
        "Job throughput: 1.0 TFLOP/s/GPU",
        "Cumulative throughput: 1.0 TFLOP/s/GPU",
        "Floating-point operations: 2.00e+14",
        "Tokens (in billions): 0.00",
    ]
    started = datetime.strptime(start[0], "%Y-%m-%d %H:%M:%S")
    assert 99 <= (datetime.now() - started).total_seconds() <= 110  # the job's own start


def test_a_progress_file_that_cannot_be_written_is_warned_of(tmp_path):
    import time

    import pytest

    from megatron.hetero.progress_log import ProgressLog

    log = ProgressLog(str(tmp_path / "gone"), 1, 1e12, 8, 0, time.time(), writer=True)
    with pytest.warns(UserWarning, match="--log-progress: .*progress.txt"):
        log.job_started()
