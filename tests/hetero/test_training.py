"""End-to-end pretraining on real gloo process groups: TP/DP equivalence, exact resume (and
--no-load-rng), real-text training, Megatron-shaped logs and the JSONL metrics file."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest

from hettp.metrics import read_metrics
from tests.utils import (
    ROOT,
    run_ranks,
    train,
    train_drawing_apart,
    train_reading_the_tracker_apart,
    train_with_a_recording_wandb,
    train_with_failing_save,
)

# Vocabulary 255 + EOD = 256 entries, padded to 256 at TP 1, 2 and 4 (divisible-by 64 x TP),
# so every TP size builds the same full model from the same seed. No dropout: its masks in
# TP regions come from per-rank generators and legitimately differ between TP sizes.
MODEL_FLAGS = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --lr-warmup-iters 2 "
    "--mock-data --vocab-size 255 --make-vocab-size-divisible-by 64 "
    "--eval-iters 0 --log-interval 1"
)
MODEL = (MODEL_FLAGS + " --hidden-dropout 0 --attention-dropout 0").split()


def _losses(result):
    return [result["losses"][i] for i in sorted(result["losses"])]


@pytest.fixture(scope="module")
def tp1_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp1")
    argv = MODEL + ["--train-iters", "10", "--metrics-file", str(out / "m.jsonl")]
    return run_ranks(train, 1, argv)[0]


@pytest.mark.parametrize("world,tp", [(2, 2), (4, 4), (4, 2)], ids=["tp2", "tp4", "dp2xtp2"])
def test_parallel_layouts_match_tp1(tp1_run, tmp_path, world, tp):
    argv = MODEL + [
        "--train-iters",
        "10",
        "--tensor-model-parallel-size",
        str(tp),
        "--metrics-file",
        str(tmp_path / "m.jsonl"),
    ]
    results = run_ranks(train, world, argv)
    reference = _losses(tp1_run)
    assert len(reference) == 10
    for rank, result in enumerate(results):
        losses = _losses(result)
        assert len(losses) == 10
        for step, (got, want) in enumerate(zip(losses, reference), 1):
            assert abs(got - want) <= 1e-5 * abs(want), (
                f"TP={tp} DP={world // tp} rank {rank} step {step}: {got} vs TP=1 {want}"
            )
    # the loss must actually move, or equality would prove nothing
    assert reference[-1] < reference[0] - 0.05


def test_log_lines_and_metrics_file(tp1_run):
    stdout = tp1_run["stdout"]
    lines = [x for x in stdout.splitlines() if " iteration " in x and "lm loss:" in x]
    assert len(lines) == 10
    pattern = re.compile(
        r"^ \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}\] iteration +(\d+)/ +10 \|"
        r" consumed samples: +(\d+) \|"
        r" elapsed time per iteration \(ms\): [\d.]+ \| tokens per second: [\d.]+ \|"
        r" learning rate: [\d.E+-]+ \| global batch size: +8 \| lm loss: ([\d.E+-]+) \|"
        r" loss scale: 1\.0 \| grad norm: [\d.]+ \| number of skipped iterations: +0 \|"
        r" number of nan iterations: +0 \|$"
    )
    records = list(read_metrics(tp1_run["metrics_file"], "train"))
    assert [r["iteration"] for r in records] == list(range(1, 11))
    for line, record in zip(lines, records):
        match = pattern.match(line)
        assert match, line
        assert int(match.group(1)) == record["iteration"]
        assert int(match.group(2)) == record["consumed_samples"] == 8 * record["iteration"]
        assert float(match.group(3)) == pytest.approx(record["lm_loss"], rel=1e-6)
        assert record["tokens_per_s"] > 0 and record["elapsed_ms"] > 0
    run = next(read_metrics(tp1_run["metrics_file"], "run"))
    assert run["tensor_model_parallel_size"] == 1 and run["args"]["hidden_size"] == 64
    # Megatron's scheduler: linear warmup from 0 over 2 steps, then linear decay to 0 at step 10
    lrs = [r["lr"] for r in records]
    assert lrs[:3] == pytest.approx([0.0, 5e-4, 1e-3])
    assert lrs[-1] == pytest.approx(1e-3 * 1 / 8)


def test_resume_reproduces_the_run_exactly(tmp_path):
    """A job stopped by --exit-interval at step 5 saves; a new job with --load continues, and
    steps 6-10 match an uninterrupted run bit for bit, dropout included (so the RNG state is
    part of the checkpoint)."""
    argv = (
        MODEL_FLAGS + " --hidden-dropout 0.1 --attention-dropout 0.1"
        " --tensor-model-parallel-size 2 --train-iters 10"
    ).split()
    full = run_ranks(train, 2, argv + ["--metrics-file", str(tmp_path / "full.jsonl")])[0]
    ckpt = tmp_path / "ckpt"
    stopped = run_ranks(train, 2, argv + ["--save", str(ckpt), "--exit-interval", "5"])[0]
    assert sorted(stopped["losses"]) == [1, 2, 3, 4, 5] and stopped["iteration"] == 5
    assert sorted(os.listdir(ckpt)) == [
        "iter_0000005",
        "latest_checkpointed_iteration.txt",
        "metrics.jsonl",
    ]
    resumed = run_ranks(train, 2, argv + ["--load", str(ckpt), "--save", str(ckpt)])[0]
    assert "loaded checkpoint" in resumed["stdout"]
    assert sorted(resumed["losses"]) == [6, 7, 8, 9, 10]
    for step in range(1, 11):
        got = (stopped if step <= 5 else resumed)["losses"][step]
        assert got == full["losses"][step], f"step {step}: {got} vs {full['losses'][step]}"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "10"
    # one metrics file per run directory: both jobs appended to it
    iterations = [r["iteration"] for r in read_metrics(str(ckpt / "metrics.jsonl"), "train")]
    assert iterations == list(range(1, 11))


def test_llama_style_model_matches_tp1(tmp_path):
    """RoPE, SwiGLU, RMSNorm, grouped-query attention, no biases, untied output layer."""
    argv = (
        MODEL_FLAGS + " --hidden-dropout 0 --attention-dropout 0 --train-iters 5"
        " --position-embedding-type rope --rotary-percent 0.5 --swiglu --normalization RMSNorm"
        " --group-query-attention --num-query-groups 2 --disable-bias-linear"
        " --untie-embeddings-and-output-weights"
    ).split()
    tp1 = run_ranks(train, 1, argv + ["--metrics-file", str(tmp_path / "a.jsonl")])[0]
    tp2 = run_ranks(
        train,
        2,
        argv + ["--tensor-model-parallel-size", "2", "--metrics-file", str(tmp_path / "b.jsonl")],
    )[0]
    for step in range(1, 6):
        want, got = tp1["losses"][step], tp2["losses"][step]
        assert abs(got - want) <= 1e-5 * abs(want), f"step {step}: {got} vs {want}"
    assert tp1["losses"][5] < tp1["losses"][1]


@pytest.fixture(scope="module")
def stdlib_corpus(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("corpus") / "stdlib"
    subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "scripts", "preprocess_data.py"),
            "--stdlib",
            "--output-prefix",
            str(prefix),
            "--max-bytes",
            "1500000",
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return f"{prefix}_text_document"


def test_training_on_real_text_lowers_the_loss(stdlib_corpus, tmp_path):
    argv = (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
        "--micro-batch-size 8 --global-batch-size 16 --train-iters 40 --lr 3e-3 "
        "--lr-warmup-iters 4 --tokenizer-type ByteLevelTokenizer --split 95,5,0 "
        "--eval-interval 20 --eval-iters 4 --log-interval 10 "
        "--tensor-model-parallel-size 2 --num-workers 1"
    ).split()
    argv += [
        "--data-path",
        stdlib_corpus,
        "--data-cache-path",
        str(tmp_path / "cache"),
        "--metrics-file",
        str(tmp_path / "m.jsonl"),
        "--tensorboard-dir",
        str(tmp_path / "tb"),
        "--tensorboard-log-interval",
        "5",
        "--tensorboard-queue-size",
        "3",
        "--log-validation-ppl-to-tensorboard",
        "--log-world-size-to-tensorboard",
        "--no-log-loss-scale-to-tensorboard",
        "--wandb-project",
        "hettp-tests",
        "--wandb-exp-name",
        "real-text",
        "--wandb-save-dir",
        str(tmp_path / "wandb"),
        "--timing-log-level",
        "2",
        "--log-timers-to-tensorboard",
    ]
    result, other = run_ranks(train_with_a_recording_wandb, 2, argv)
    losses = _losses(result)
    uniform = math.log(256)
    assert losses[0] == pytest.approx(uniform, rel=0.05)  # untrained: about uniform over bytes
    assert sum(losses[-5:]) / 5 < 0.7 * uniform
    assert result["eval_losses"][40] < result["eval_losses"][20] < uniform
    # Megatron-LM's lines: the job's first iteration, then every --log-interval; a line's lm
    # loss is the mean since the last interval's line (the first line's step counts in it)
    printed = {
        int(m.group(1)): float(m.group(2))
        for m in re.finditer(
            r"iteration +(\d+)/ +40 \|.* lm loss: ([\d.E+-]+) \|", result["stdout"]
        )
    }
    assert sorted(printed) == [1, 10, 20, 30, 40]
    assert printed[1] == pytest.approx(losses[0], rel=1e-6)
    assert printed[10] == pytest.approx(sum(losses[:10]) / 10, rel=1e-6)
    assert printed[20] == pytest.approx(sum(losses[10:20]) / 10, rel=1e-6)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    logged = {e.step: e.value for e in events.Scalars("lm loss")}  # every 5th iteration
    assert logged == pytest.approx({i: losses[i - 1] for i in range(5, 41, 5)}, rel=1e-6)
    validation = events.Scalars("lm loss validation")
    assert [e.step for e in validation] == [20, 40]
    ppl = [e.value for e in events.Scalars("lm loss validation ppl")]
    assert ppl == pytest.approx([math.exp(e.value) for e in validation], rel=1e-5)
    assert {e.value for e in events.Scalars("world-size")} == {2}
    assert "loss-scale" not in events.Tags()["scalars"]
    # megatron-core's timers at each --log-interval: printed (min, max over ranks, ms a step)
    # and their max written (seconds a step)
    blocks = re.findall(
        r"\(min, max\) time across ranks \(ms\):\n((?:    .*\n)+)", result["stdout"]
    )
    assert len(blocks) == 4, result["stdout"]
    for name in ("forward-backward", "forward-compute", "backward-compute", "batch-generator"):
        assert all(re.search(rf"    {name} \.+: \([\d.]+, [\d.]+\)", b) for b in blocks), name
    for name in ("all-grads-sync", "optimizer-inner-step", "optimizer"):
        assert all(f"    {name} ." in b for b in blocks), name
    step = {e.step: e.value for e in events.Scalars("forward-backward-time")}
    assert sorted(step) == [10, 20, 30, 40] and all(0 < v < 60 for v in step.values())
    # Weights & Biases (rank 0's): one run with the flags as its config, then every scalar
    # TensorBoard got, at the same steps
    calls = result["wandb"]
    assert calls[0][0] == "init" and calls[-1] == ("finish",) and not other["wandb"]
    init = calls[0][1]
    assert (init["project"], init["name"], init["dir"]) == (
        "hettp-tests",
        "real-text",
        str(tmp_path / "wandb"),
    )
    assert init["config"]["train_iters"] == 40 and "entity" not in init
    assert os.path.isdir(tmp_path / "wandb")
    for tag in events.Tags()["scalars"]:
        logged = [(c[2], c[1][tag]) for c in calls if c[0] == "log" and tag in c[1]]
        want = [(e.step, pytest.approx(e.value, rel=1e-6)) for e in events.Scalars(tag)]
        assert logged == want, tag


def test_a_scalar_writer_rank_0_cannot_open_stops_every_rank(tmp_path):
    """wandb.init failing on rank 0 (no API key) is raised on every rank at start, where the
    others waited in the first collective until the timeout."""
    argv = MODEL + ["--train-iters", "4", "--tensor-model-parallel-size", "2"]
    argv += ["--wandb-project", "p", "--wandb-exp-name", "e", "--wandb-save-dir", str(tmp_path)]
    with pytest.raises(AssertionError) as err:
        run_ranks(train_with_a_recording_wandb, 2, argv, True, timeout=120)
    text = str(err.value)
    for rank in (0, 1):
        assert (
            f"rank {rank}: RuntimeError: rank 0 could not open --tensorboard-dir / "
            "--wandb-project: PermissionError: no API key (stand-in)" in text
        ), text


def test_failed_save_keeps_the_previous_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    argv = MODEL + ["--train-iters", "6", "--save", str(ckpt), "--save-interval", "3"]
    result = run_ranks(train_with_failing_save, 1, argv, 6)[0]
    assert result["error"] == "disk full (injected)"
    # the tracker still names the last complete checkpoint; the broken one stays in staging,
    # in a folder named after the job
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "3"
    (staging,) = ckpt.glob("iter_0000006.tmp-*")
    assert staging.is_dir() and not (ckpt / "iter_0000006").exists()
    resumed = run_ranks(train, 1, argv + ["--load", str(ckpt)])[0]
    assert sorted(resumed["losses"]) == [4, 5, 6]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "6"
    assert not staging.exists()  # the next job holding the folder cleared the dead staging


def test_save_retain_interval_keeps_its_multiples_and_the_newest(tmp_path):
    """--save-retain-interval 3 with a save every step: each save deletes the checkpoint it
    succeeds unless that one is at a multiple of 3; a resume from the newest works.
    --log-progress logs both jobs, every save and every deletion, as Megatron-LM's file."""
    from megatron.hetero.arguments import build_parser, validate_args
    from megatron.hetero.flops import flops_per_sample

    ckpt = tmp_path / "ckpt"
    argv = MODEL + ["--save", str(ckpt), "--save-interval", "1", "--save-retain-interval", "3"]
    argv += [
        "--lr-decay-iters",
        "10",
        "--log-progress",
    ]  # the resumed run's schedule is the first's
    run_ranks(train, 1, argv + ["--train-iters", "7"])
    assert sorted(p.name for p in ckpt.glob("iter_*")) == [
        "iter_0000003",
        "iter_0000006",
        "iter_0000007",
    ]
    resumed = run_ranks(train, 1, argv + ["--train-iters", "8", "--load", str(ckpt)])[0]
    assert sorted(resumed["losses"]) == [8]
    assert sorted(p.name for p in ckpt.glob("iter_*"))[-2:] == ["iter_0000006", "iter_0000008"]

    lines = [line.split("\t") for line in (ckpt / "progress.txt").read_text().splitlines()]
    assert all(line[1] == "Job ID: " and line[2] == "# GPUs: 1" for line in lines)
    events = [line[3] + (f" {line[4].split(': ')[1]}" if len(line) > 4 else "") for line in lines]
    # a save deletes the checkpoint it succeeds (not 3 nor 6), then logs itself
    deleted = {2: 1, 3: 2, 5: 4, 6: 5, 8: 7}
    expected = []
    for i in range(1, 9):
        expected += ["Starting job"] if i in (1, 8) else []
        expected += [f"Deleted checkpoint {deleted[i]}"] if i in deleted else []
        expected += [f"Saved checkpoint {i}"]
    assert events == expected
    args = build_parser().parse_args(argv + ["--train-iters", "7"])
    validate_args(args, 1, cuda_available=False)
    per_sample = flops_per_sample(args, 256)  # 255 + EOD, padded to a multiple of 64
    for line in (line for line in lines if line[3] == "Saved checkpoint"):
        consumed = 8 * int(line[4].split(": ")[1])  # global batch 8
        assert float(line[7].split(": ")[1]) == pytest.approx(per_sample * consumed, rel=5e-3)
        for field, name in ((line[5], "Job"), (line[6], "Cumulative")):
            assert field.startswith(f"{name} throughput: ") and field.endswith(" TFLOP/s/GPU")
        assert line[8] == "Tokens (in billions): 0.00"


def test_loading_into_a_different_model_names_the_flags(tmp_path):
    ckpt = tmp_path / "ckpt"
    run_ranks(train, 1, MODEL + ["--train-iters", "3", "--save", str(ckpt)])
    wider = [a if a != "64" else "128" for a in MODEL]  # --hidden-size 64 -> 128
    with pytest.raises(AssertionError) as err:
        run_ranks(train, 1, wider + ["--train-iters", "4", "--load", str(ckpt)])
    assert "CheckpointError" in str(err.value)
    assert "--hidden-size 64 (this run: 128)" in str(err.value)
    # flags that add tensors count too (a load would drop or miss them)
    with pytest.raises(AssertionError) as err:
        run_ranks(train, 1, MODEL + ["--train-iters", "4", "--load", str(ckpt), "--qk-layernorm"])
    assert "--qk-layernorm False (this run: True)" in str(err.value)


def test_loading_with_a_different_tokenizer_names_it(tmp_path):
    """The embedding's padded shape cannot tell (megatron-core re-pads it at load, and 255 and
    300 tokens both pad to 320 here); the saved unpadded vocabulary can."""
    ckpt = tmp_path / "ckpt"
    flags = " ".join(MODEL).replace("divisible-by 64", "divisible-by 160").split()
    run_ranks(train, 1, flags + ["--train-iters", "3", "--save", str(ckpt)])
    other = [a if a != "255" else "300" for a in flags]
    with pytest.raises(AssertionError) as err:
        run_ranks(train, 1, other + ["--train-iters", "4", "--load", str(ckpt)])
    assert "CheckpointError" in str(err.value)
    message = str(err.value)
    assert (
        "a vocabulary of 256 entries (this run's --tokenizer-type and --vocab-size give 301)"
        in message
    )
    # the same tokenizer loads
    resumed = run_ranks(
        train,
        1,
        flags + ["--train-iters", "4", "--load", str(ckpt), "--use-checkpoint-opt_param-scheduler"],
    )[0]
    assert sorted(resumed["losses"]) == [4]


def test_a_changed_schedule_on_resume_is_refused_unless_a_flag_says_whose(tmp_path):
    """As Megatron-LM: a resumed run whose --lr differs from the checkpoint's is refused
    (megatron-core's default took the checkpoint's silently); --override-opt_param-scheduler
    follows this run's flags, --use-checkpoint-opt_param-scheduler the checkpoint's. Making
    the run longer under a constant rate changes no rate, so it needs neither."""
    ckpt = tmp_path / "ckpt"
    base = " ".join(MODEL).replace("--lr-warmup-iters 2", "--lr-decay-style constant").split()
    run_ranks(train, 1, base + ["--train-iters", "3", "--save", str(ckpt)])
    tracker = (ckpt / "latest_checkpointed_iteration.txt").read_text()
    higher = [a if a != "1e-3" else "2e-3" for a in base] + ["--load", str(ckpt)]
    with pytest.raises(AssertionError) as err:
        run_ranks(train, 1, higher + ["--train-iters", "4"])
    assert "CheckpointError" in str(err.value)
    assert "different learning-rate schedule or optimizer" in str(err.value)
    assert "--lr 0.001 (this run: 0.002)" in str(err.value)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == tracker
    # the optimizer's own constants come back from its state too: a change is named alike
    with pytest.raises(AssertionError) as err:
        run_ranks(
            train, 1, base + ["--load", str(ckpt), "--train-iters", "4", "--adam-beta1", "0.8"]
        )
    assert "--adam-beta1/--adam-beta2 [(0.9, 0.999)] (this run: [(0.8, 0.999)])" in str(err.value)
    # under --bf16 megatron-core nests the groups a level deeper: found there too
    half = tmp_path / "half"
    run_ranks(train, 1, base + ["--bf16", "--train-iters", "3", "--save", str(half)])
    with pytest.raises(AssertionError) as err:
        run_ranks(
            train,
            1,
            base + ["--bf16", "--load", str(half), "--train-iters", "4", "--adam-eps", "1e-6"],
        )
    assert "--adam-eps [1e-08] (this run: [1e-06])" in str(err.value)

    def lr_at_4(*flags, argv=higher):
        metrics = tmp_path / f"m{len(flags)}{flags[:1]}.jsonl"
        run_ranks(train, 1, argv + ["--train-iters", "4", "--metrics-file", str(metrics), *flags])
        (record,) = read_metrics(str(metrics), "train")
        return record["lr"]

    assert lr_at_4("--override-opt_param-scheduler") == pytest.approx(2e-3)
    assert lr_at_4("--use-checkpoint-opt_param-scheduler") == pytest.approx(1e-3)
    assert lr_at_4(argv=base + ["--load", str(ckpt)]) == pytest.approx(1e-3)  # longer, same rate


def test_a_wsd_schedule_resumes_with_its_decay_or_a_change_is_named(tmp_path):
    """megatron-core's scheduler state leaves WSD's decay out: the checkpoint keeps it, a
    resumed run with another --lr-wsd-decay-iters is refused naming it, and one told to keep
    the checkpoint's schedule (here with a cosine schedule of its own) decays as the straight
    run did."""
    ckpt = tmp_path / "ckpt"
    base = MODEL + ["--lr-decay-style", "WSD", "--lr-decay-iters", "8", "--min-lr", "1e-4"]
    wsd = ["--lr-wsd-decay-iters", "4"]

    def lrs(argv, name):
        metrics = tmp_path / f"{name}.jsonl"
        run_ranks(train, 1, argv + ["--train-iters", "8", "--metrics-file", str(metrics)])
        return {r["iteration"]: r["lr"] for r in read_metrics(str(metrics), "train")}

    straight = lrs(base + wsd, "straight")
    run_ranks(train, 1, base + wsd + ["--train-iters", "3", "--save", str(ckpt)])
    with pytest.raises(AssertionError, match=r"--lr-wsd-decay-iters/-samples 32 \(this run: 16\)"):
        run_ranks(
            train,
            1,
            base + ["--lr-wsd-decay-iters", "2", "--train-iters", "8", "--load", str(ckpt)],
        )
    cosine = [a if a != "WSD" else "cosine" for a in base]
    kept = lrs(cosine + ["--load", str(ckpt), "--use-checkpoint-opt_param-scheduler"], "kept")
    assert sorted(kept) == [4, 5, 6, 7, 8]
    assert kept == pytest.approx({i: straight[i] for i in kept}, rel=1e-9)
    assert len({round(lr, 12) for lr in kept.values()}) > 2  # decaying, not stable


def test_a_distributed_optimizer_saves_the_rates_it_trained_at(tmp_path):
    """A run resumed with --use-checkpoint-opt_param-scheduler trains at the checkpoint's rates,
    not its flags'; its own checkpoint must keep them. Under the distributed optimizer the
    checkpoint is a plain twin's, which was built from the flags: a third run from it
    trained at the second's flags' rate."""
    base = (
        " ".join(MODEL).replace("--lr-warmup-iters 2", "--lr-decay-style constant")
        + " --use-distributed-optimizer"
    ).split()
    first, second = tmp_path / "first", tmp_path / "second"
    run_ranks(train, 2, base + ["--train-iters", "3", "--save", str(first)])
    higher = [a if a != "1e-3" else "2e-3" for a in base] + ["--use-checkpoint-opt_param-scheduler"]
    run_ranks(
        train, 2, higher + ["--train-iters", "4", "--load", str(first), "--save", str(second)]
    )
    metrics = tmp_path / "third.jsonl"
    argv = higher + ["--train-iters", "5", "--load", str(second), "--metrics-file", str(metrics)]
    run_ranks(train, 2, argv)
    (record,) = read_metrics(str(metrics), "train")
    assert record["iteration"] == 5 and record["lr"] == pytest.approx(1e-3)


def test_a_resume_with_nothing_left_to_train_does_not_save_again(tmp_path):
    """A job resumed from --save's own newest checkpoint with --train-iters already reached
    keeps that checkpoint as it is; a save over an existing iteration (a fresh run into the
    same folder) replaces it whole, leaving nothing aside."""
    ckpt = tmp_path / "ckpt"
    argv = MODEL + ["--train-iters", "3", "--save", str(ckpt)]
    run_ranks(train, 1, argv)
    saved = (ckpt / "iter_0000003" / "common.pt").stat()
    again = run_ranks(train, 1, argv + ["--load", str(ckpt)])[0]
    assert "saved checkpoint" not in again["stdout"] and not again["losses"]
    assert (ckpt / "iter_0000003" / "common.pt").stat().st_mtime_ns == saved.st_mtime_ns
    fresh = run_ranks(train, 1, argv)[0]
    assert "saved checkpoint" in fresh["stdout"]
    assert (ckpt / "iter_0000003" / "common.pt").stat().st_mtime_ns != saved.st_mtime_ns
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("iter_")) == ["iter_0000003"]


def test_after_the_last_iteration_validation_then_test_as_megatron_lm(tmp_path):
    """Megatron-LM's end of training: the validation split once more and the test split, in its
    lines; the loop's own evaluation at the last iteration is not recorded twice. A run stopped
    by --exit-interval skips them, as there, even at the last iteration."""
    evals = ["--eval-iters", "1", "--eval-interval", "2", "--split", "90,5,5"]
    metrics = tmp_path / "m.jsonl"
    flags = " ".join(MODEL).replace("--eval-iters 0", "").split() + evals
    result = run_ranks(train, 1, flags + ["--train-iters", "4", "--metrics-file", str(metrics)])[0]
    lines = [x for x in result["stdout"].splitlines() if "validation loss at" in x]
    assert [x.split(" | ")[0].strip() for x in lines] == [
        "validation loss at iteration 2",
        "validation loss at iteration 4",
        "validation loss at iteration 4 on validation set",
        "validation loss at iteration 4 on test set",
    ]
    records = [(r["iteration"], r["split"]) for r in read_metrics(str(metrics), "eval")]
    assert records == [(2, "validation"), (4, "validation"), (4, "test")]
    assert result["test_loss"] is not None and result["test_loss"] != result["eval_losses"][4]
    # stopped by --exit-interval, before or at the last iteration: Megatron-LM exits there
    for exit_at in ("3", "4"):
        stopped = run_ranks(train, 1, flags + ["--train-iters", "4", "--exit-interval", exit_at])
        assert "on validation set" not in stopped[0]["stdout"], exit_at
        assert stopped[0]["test_loss"] is None


def test_each_data_parallel_replica_resumes_its_own_generators(tmp_path):
    """--het-dp's replicas draw different numbers of dropout masks (different micro-batch
    counts): a checkpoint keeps every rank's generators, and a resumed replica continues its
    own stream, not replica 0's. Here each replica draws its own count after every step."""
    ckpt = str(tmp_path / "ckpt")
    argv = MODEL + ["--train-iters", "5"]
    full = run_ranks(train_drawing_apart, 2, argv)
    assert full[0]["rng"][5] != full[1]["rng"][5]  # the replicas' streams did part
    run_ranks(train_drawing_apart, 2, argv + ["--save", ckpt, "--exit-interval", "3"])
    # The replicas' model and optimizer were written a share by each (Megatron-LM's default,
    # --ckpt-fully-parallel-save); with --no-ckpt-fully-parallel-save by replica 0 alone
    alone = str(tmp_path / "alone")
    run_ranks(
        train_drawing_apart,
        2,
        argv + ["--save", alone, "--exit-interval", "3", "--no-ckpt-fully-parallel-save"],
    )
    for folder, low, high in ((ckpt, 0.3, 0.7), (alone, 0.0, 0.05)):
        written = [
            sum(p.stat().st_size for p in (tmp_path / folder / "iter_0000003").glob(f"__{r}_*"))
            for r in (0, 1)
        ]
        assert low <= written[1] / sum(written) <= high, (folder, written)
    # read a share by each replica and exchanged (--no-load-rng below reads it all on each)
    resumed = run_ranks(
        train_drawing_apart, 2, argv + ["--load", ckpt, "--ckpt-fully-parallel-load"]
    )
    for rank in (0, 1):
        assert sorted(resumed[rank]["rng"]) == [4, 5]
        assert resumed[rank]["rng"] == {i: full[rank]["rng"][i] for i in (4, 5)}, rank
        assert resumed[rank]["losses"] == pytest.approx(
            {i: full[rank]["losses"][i] for i in (4, 5)}, rel=1e-6
        )
    # --no-load-rng: the generators start from --seed (no dropout here: the losses carry on)
    fresh = run_ranks(train_drawing_apart, 2, argv + ["--load", ckpt, "--no-load-rng"])
    for rank in (0, 1):
        assert all(fresh[rank]["rng"][i] != full[rank]["rng"][i] for i in (4, 5)), rank
        assert fresh[rank]["losses"] == pytest.approx(resumed[rank]["losses"], rel=1e-6)
    # at another data-parallel size every replica takes replica 0's generators, read once and
    # exchanged under --ckpt-fully-parallel-load (each replica its own copy, not one replica's)
    alone = run_ranks(train_drawing_apart, 1, argv)[0]
    one = str(tmp_path / "one")
    run_ranks(train_drawing_apart, 1, argv + ["--save", one, "--exit-interval", "3"])
    grown = run_ranks(train_drawing_apart, 2, argv + ["--load", one, "--ckpt-fully-parallel-load"])
    assert all(sorted(rank["losses"]) == [4, 5] for rank in grown)
    assert grown[0]["rng"][4] == alone["rng"][4]  # replica 0 draws 1 value, as the one rank


def test_every_rank_loads_the_iteration_rank_0_read_from_the_tracker(tmp_path):
    """Another job saving into --load may move its tracker while this one starts: the ranks
    verify and load the one iteration rank 0 read, not each the one it happened to read."""
    ckpt = str(tmp_path / "ckpt")
    argv = MODEL + ["--tensor-model-parallel-size", "2", "--train-iters", "8"]
    run_ranks(train, 2, argv + ["--save", ckpt, "--save-interval", "3", "--exit-interval", "6"])
    resumed = run_ranks(train_reading_the_tracker_apart, 2, argv + ["--load", ckpt], 3, timeout=90)
    for rank in resumed:
        assert sorted(rank["losses"]) == [7, 8]  # from iteration 6 (rank 0's), not 3
