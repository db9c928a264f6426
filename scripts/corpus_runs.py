"""Short trainings on the indexed standard-library text, shared by the accuracy benchmarks
(bench_resize_accuracy.py, bench_compression.py): the corpus built where missing, one small
byte-level GPT, `pretrain_gpt.py` on 2 CPU ranks, and what its metrics file says."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from gloo_ranks import pretrain_command  # noqa: E402

from hettp.metrics import read_metrics  # noqa: E402

CORPUS = os.path.join(ROOT, "data", "stdlib_text_document")


def ensure_corpus() -> None:
    """`make corpus`, where it has not been run."""
    if os.path.exists(CORPUS + ".bin"):
        return
    subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "scripts", "preprocess_data.py"),
            "--stdlib",
            "--output-prefix",
            os.path.join(ROOT, "data", "stdlib"),
            "--max-bytes",
            "8000000",
        ],
        check=True,
    )


def byte_gpt_flags(iters: int, micro_batch: int, tp: int = 1) -> list[str]:
    """The benchmarks' model: 2 layers, hidden 64, 8 heads, 16 sequences of 128 bytes a step,
    a cosine schedule, four evaluations on the held-out 2%."""
    return (
        f"--tensor-model-parallel-size {tp} --num-layers 2 --hidden-size 64 "
        "--num-attention-heads 8 --seq-length 128 --max-position-embeddings 128 "
        f"--micro-batch-size {micro_batch} --global-batch-size 16 --lr 5e-3 --min-lr 5e-4 "
        "--lr-decay-style cosine --lr-warmup-iters 30 --weight-decay 0.1 "
        "--hidden-dropout 0 --attention-dropout 0 --tokenizer-type ByteLevelTokenizer "
        f"--split 98,2,0 --log-interval 100 --eval-iters 20 --train-iters {iters} "
        f"--eval-interval {iters // 4} --data-path {CORPUS}"
    ).split()


@dataclasses.dataclass(frozen=True)
class CorpusRun:
    name: str
    flags: list[str]  # what the run added to the model's flags
    evals: dict[int, float]  # iteration -> eval loss
    final_eval: float
    train_tail: float  # mean train loss over the last tenth of the iterations
    seconds: float
    records: list[dict] = dataclasses.field(repr=False)

    @classmethod
    def of(cls, name: str, flags: list[str], records: list[dict], seconds: float) -> CorpusRun:
        evals = {
            r["iteration"]: r["lm_loss"]
            for r in records
            if r["kind"] == "eval" and r.get("split", "validation") == "validation"
        }
        if not evals:
            raise ValueError(f"run '{name}': its metrics hold no evaluation")
        losses = [r["lm_loss"] for r in records if r["kind"] == "train"]
        tail = losses[-max(1, len(losses) // 10) :]
        return cls(
            name, list(flags), evals, evals[max(evals)], sum(tail) / len(tail), seconds, records
        )

    def first(self, kind: str) -> dict | None:
        return next((r for r in self.records if r["kind"] == kind), None)

    def summary(self) -> dict:
        """What the benchmarks write to JSON (the records stay in the metrics files)."""
        return {
            "name": self.name,
            "flags": self.flags,
            "evals": self.evals,
            "final_eval": self.final_eval,
            "train_tail": self.train_tail,
            "seconds": self.seconds,
        }


def metrics_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", name.replace("%", "pct")).strip("_") + ".jsonl"


def train(name: str, model: list[str], flags: list[str], out_dir: str, port: int) -> CorpusRun:
    """Train `model` + `flags` on 2 CPU ranks; exit naming the run if it fails."""
    metrics = os.path.join(out_dir, metrics_name(name))
    if os.path.exists(metrics):
        os.remove(metrics)
    cmd = pretrain_command([*model, *flags, "--metrics-file", metrics], port=port)
    start = time.perf_counter()
    proc = subprocess.run(
        cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, cwd=ROOT
    )
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise SystemExit(f"run '{name}' failed with exit code {proc.returncode}")
    return CorpusRun.of(name, flags, list(read_metrics(metrics)), time.perf_counter() - start)
