"""het-TP's own records (megatron/hetero/log.py) without a process group: what a timing report
writes, and the line a refused move prints."""

from __future__ import annotations

from hettp.loop import TimingReport, Verdict
from hettp.metrics import MetricsWriter, read_metrics
from megatron.hetero.log import EventLog


def test_a_refused_move_is_in_the_timing_record_and_the_log(tmp_path, capsys):
    path = str(tmp_path / "m.jsonl")
    report = TimingReport(
        12, (0.4, 0.2), (3.0, 1.0), 0.5, fixed=(0.05, 0.05), attention=(0.15, 0.0)
    )
    with MetricsWriter(path) as metrics:
        log = EventLog(metrics)
        log.timing(report, Verdict((1.0, 2.0), None, None, None))
        log.timing(
            report,
            Verdict((1.0, 2.0), None, None, None, "move to x refused: ...", "anchor", (1.0, 1.1)),
        )
    first, second = read_metrics(path, "timing")
    assert first["refused"] is None and second["refused"] == "move to x refused: ..."
    assert first["reading"] is None and second["reading"] == "anchor"
    assert first["modelled"] is None and second["modelled"] == [1.0, 1.1]
    assert second["compute_s"] == [0.4, 0.2] and second["fixed_s"] == [0.05, 0.05]
    assert second["attention_s"] == [0.15, 0.0]
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["> het-TP at iteration 12: move to x refused: ..."]
