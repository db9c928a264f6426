"""scripts/corpus_runs.py, the accuracy benchmarks' shared runner: what it reads back from a
metrics file (pure; the benchmarks themselves train for minutes and are not run here)."""

from __future__ import annotations

import pytest

from tests.utils import load_script

corpus_runs = load_script("corpus_runs")


def _records(evals: dict, losses: list) -> list[dict]:
    out = [{"kind": "run", "parameters_rank0": 1000}]
    out += [{"kind": "train", "iteration": i + 1, "lm_loss": v} for i, v in enumerate(losses)]
    out += [{"kind": "eval", "iteration": i, "lm_loss": v} for i, v in evals.items()]
    out.append({"kind": "resize", "shares": [0.0, 0.5], "realized": [0.0, 0.49]})
    return out


def test_a_run_reads_its_last_eval_and_the_mean_of_its_last_tenth():
    losses = [5.0 - 0.1 * i for i in range(20)]
    run = corpus_runs.CorpusRun.of("r", ["--seed", "1"], _records({10: 3.5, 20: 3.0}, losses), 2.0)
    assert run.final_eval == 3.0 and run.evals == {10: 3.5, 20: 3.0}
    assert run.train_tail == pytest.approx((losses[-1] + losses[-2]) / 2)
    assert run.first("resize")["realized"] == [0.0, 0.49] and run.first("nothing") is None
    assert run.summary()["flags"] == ["--seed", "1"] and "records" not in run.summary()
    with pytest.raises(ValueError, match="run 'r': its metrics hold no evaluation"):
        corpus_runs.CorpusRun.of("r", [], _records({}, losses), 1.0)


def test_run_names_become_file_names_and_the_model_takes_its_parallel_sizes():
    assert corpus_runs.metrics_name("resize 25% dw") == "resize_25pct_dw.jsonl"
    assert corpus_runs.metrics_name("exact, another seed") == "exact_another_seed.jsonl"
    flags = corpus_runs.byte_gpt_flags(400, micro_batch=8, tp=2)
    value = dict(zip(flags, flags[1:]))
    assert value["--tensor-model-parallel-size"] == "2" and value["--micro-batch-size"] == "8"
    assert value["--eval-interval"] == "100" and value["--data-path"] == corpus_runs.CORPUS
