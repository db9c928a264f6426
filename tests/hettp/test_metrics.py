from __future__ import annotations

import json

from hettp.metrics import MetricsWriter, read_metrics


def test_records_roundtrip_and_filter_by_kind(tmp_path):
    path = tmp_path / "sub" / "m.jsonl"
    with MetricsWriter(str(path)) as w:
        w.write("run", world_size=2)
        w.write("train", iteration=1, lm_loss=1.5)
        w.write("train", iteration=2, lm_loss=float("nan"), grad_norm=float("inf"))
    records = list(read_metrics(str(path)))
    assert [r["kind"] for r in records] == ["run", "train", "train"]
    assert [r["iteration"] for r in read_metrics(str(path), "train")] == [1, 2]
    # strict JSON on disk: non-finite numbers are written as strings
    last = json.loads(path.read_text().splitlines()[-1])
    assert last["lm_loss"] == "nan" and last["grad_norm"] == "inf"


def test_appends_to_an_existing_file(tmp_path):
    path = str(tmp_path / "m.jsonl")
    for i in range(2):
        with MetricsWriter(path) as w:
            w.write("train", iteration=i)
    assert [r["iteration"] for r in read_metrics(path)] == [0, 1]
