"""Run safety on real gloo ranks, launched as a job (one process per rank, as srun starts them):
a non-finite loss stops the run before anything is saved, and a signal or the time budget
ends it cleanly with a checkpoint that resumes on the same trajectory."""

from __future__ import annotations

import json
import os
import time

from tests.utils import Job, exit_watch, run_job, run_ranks, train

FLAGS = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--micro-batch-size 2 --global-batch-size 4 --mock-data --vocab-size 255 --eval-iters 0 "
    "--log-interval 1 --hidden-dropout 0 --attention-dropout 0 --tensor-model-parallel-size 2"
).split()


def _train_records(path):
    if not os.path.exists(path):
        return {}
    records = {}
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            if record.get("kind") == "train":
                records[record["iteration"]] = record
    return records


def _tracker(folder):
    with open(os.path.join(folder, "latest_checkpointed_iteration.txt")) as f:
        return int(f.read())


def test_a_nan_loss_stops_the_run_non_zero_with_the_last_checkpoint_kept(tmp_path):
    ckpt, metrics = str(tmp_path / "ckpt"), str(tmp_path / "m.jsonl")
    argv = FLAGS + ["--lr", "1e6", "--train-iters", "8", "--save", ckpt, "--save-interval", "1"]
    ranks = run_job(argv + ["--metrics-file", metrics], 2)
    records = _train_records(metrics)
    bad = min(i for i, r in records.items() if r["lm_loss"] == "nan")  # written as a string
    assert bad >= 2 and max(records) == bad  # it stopped at the first non-finite step
    assert [r.returncode for r in ranks] == [1, 1], [r.stderr for r in ranks]
    lines = ranks[0].stderr.strip().splitlines()
    assert lines[-1].startswith(f"pretrain_gpt.py: error: iteration {bad}: lm loss is nan")
    assert "Traceback" not in ranks[0].stderr + ranks[1].stderr
    assert _tracker(ckpt) == bad - 1  # the last good step's checkpoint, nothing after it
    assert sorted(os.listdir(ckpt)) == [f"iter_{i:07d}" for i in range(1, bad)] + [
        "latest_checkpointed_iteration.txt"
    ]

    # the opt-out trains on to the end (in forked ranks: no exit status to check here)
    run_ranks(
        train,
        2,
        argv[:-4] + ["--no-check-for-nan-in-loss-and-grad", "--metrics-file", metrics + "2"],
    )
    assert max(_train_records(metrics + "2")) == 8


def test_sigterm_to_one_rank_saves_at_that_step_and_resumes_on_the_same_losses(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    # The schedule must not depend on --train-iters: the runs below stop at different ones.
    argv = FLAGS + ["--lr", "1e-3", "--lr-decay-iters", "1000", "--exit-signal-handler"]
    metrics = str(tmp_path / "interrupted.jsonl")
    job = Job(argv + ["--train-iters", "1000", "--save", ckpt, "--metrics-file", metrics], 2)
    deadline = time.monotonic() + 120
    while len(_train_records(metrics)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    job.signal(1)  # as Slurm would, but to one rank only: the others must stop with it
    ranks = job.wait(120)
    assert [r.returncode for r in ranks] == [0, 0], [r.stderr[-2000:] for r in ranks]
    interrupted = _train_records(metrics)
    stopped = max(interrupted)
    assert 3 <= stopped < 1000
    assert f"exiting program at iteration {stopped}: SIGTERM received by rank 1" in ranks[0].stdout
    assert _tracker(ckpt) == stopped

    total = stopped + 3
    resumed_file, reference_file = str(tmp_path / "resumed.jsonl"), str(tmp_path / "ref.jsonl")
    ranks = run_job(
        argv
        + ["--train-iters", str(total), "--load", ckpt, "--save", ckpt]
        + ["--metrics-file", resumed_file],
        2,
    )
    assert [r.returncode for r in ranks] == [0, 0]
    # the uninterrupted reference, in forked ranks (the same code and threads, a faster start)
    run_ranks(train, 2, argv + ["--train-iters", str(total), "--metrics-file", reference_file])
    reference, resumed = _train_records(reference_file), _train_records(resumed_file)
    assert sorted(resumed) == list(range(stopped + 1, total + 1))
    for step in range(1, total + 1):
        got = (interrupted if step <= stopped else resumed)[step]["lm_loss"]
        want = reference[step]["lm_loss"]
        assert abs(got - want) <= 1e-6 * abs(want), (step, got, want)


def test_the_exit_signal_is_the_one_named_and_the_budget_counts_from_process_start():
    """--exit-signal SIGUSR1 (Slurm's --signal=USR1@120) stops every rank when one gets it;
    Ctrl-C keeps its default; --exit-duration-in-mins counts from the earliest rank's start,
    as Megatron-LM's does, so set-up (imports, the model, a checkpoint load) spends it too."""
    ranks = run_ranks(exit_watch, 2, 2)
    for result in ranks:
        assert result["untouched"]  # SIGINT's handler is not replaced
        assert result["before"] is None
        assert result["after"] == "SIGUSR1 received by rank 1"
        # each rank slept a second before install: the budget had run that long already (from
        # the earlier rank's start, so a little longer than some rank's own)
        assert 1.0 <= result["elapsed"] < 60
        assert abs(result["elapsed"] - result["started"]) < 0.5


def test_the_time_budget_ends_the_run_with_a_checkpoint(tmp_path):
    ckpt, metrics = str(tmp_path / "ckpt"), str(tmp_path / "m.jsonl")
    argv = FLAGS + ["--lr", "1e-3", "--train-iters", "1000", "--save", ckpt]
    ranks = run_job(argv + ["--exit-duration-in-mins", "0.0001", "--metrics-file", metrics], 2)
    assert [r.returncode for r in ranks] == [0, 0]
    assert "--exit-duration-in-mins 0.0001 reached" in ranks[0].stdout
    assert _tracker(ckpt) == max(_train_records(metrics)) == 1


def test_a_second_job_on_the_same_save_folder_is_refused_and_the_first_ones_checkpoints_load(
    tmp_path,
):
    ckpt = str(tmp_path / "ckpt")
    argv = FLAGS + ["--lr", "1e-3", "--save", ckpt, "--save-interval", "2"]
    # a data-loader worker a rank: forked children that must die with their rank below
    first = Job(
        argv
        + ["--train-iters", "1000", "--num-workers", "1"]
        + ["--metrics-file", str(tmp_path / "a.jsonl")],
        2,
    )
    tracker = os.path.join(ckpt, "latest_checkpointed_iteration.txt")
    deadline = time.monotonic() + 120
    while not os.path.exists(tracker) and time.monotonic() < deadline:
        time.sleep(0.05)
    second = run_job(argv + ["--train-iters", "4", "--metrics-file", str(tmp_path / "b.jsonl")], 2)
    assert [r.returncode for r in second] == [2, 2], [r.stderr[-2000:] for r in second]
    line = second[0].stderr.strip().splitlines()[-1]
    holder = first.procs[0].pid
    assert line.startswith(f"pretrain_gpt.py: error: --save {ckpt} is in use by another job")
    assert f"PID {holder} on " in line and "Traceback" not in second[0].stderr
    assert not os.path.exists(tmp_path / "b.jsonl")  # refused before writing anything
    children = [pid for proc in first.procs for pid in _children(proc.pid)]
    assert len(children) >= 2  # the data-loader workers, at least
    first.kill()  # SIGKILL: no clean-up; its lock stays behind, stale
    deadline = time.monotonic() + 10  # ...but no process of it: they die with their rank
    while any(os.path.exists(f"/proc/{pid}") for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if os.path.exists(f"/proc/{pid}")]
    saved = _tracker(ckpt)
    third = run_ranks(
        train,
        2,
        argv
        + ["--train-iters", str(saved + 2), "--load", ckpt, "--metrics-file", metrics(tmp_path)]
        + ["--use-checkpoint-opt_param-scheduler"],  # a longer run: the saved decay goes on
    )
    assert f"WARNING: took over the stale lock of PID {holder} on " in third[0]["stdout"]
    assert f"loaded checkpoint from {ckpt} at iteration {saved}" in third[0]["stdout"]
    assert sorted(_train_records(metrics(tmp_path))) == [saved + 1, saved + 2]
    assert not os.path.exists(os.path.join(ckpt, ".hettp-save.lock"))  # released at the end


def metrics(tmp_path):
    return str(tmp_path / "c.jsonl")


def _children(pid: int) -> list[int]:
    """Live processes whose parent is `pid` (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry))
    return found


class _Evil:
    """A pickle that runs a shell command when loaded."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _rewrite_manifest(folder, name):
    """What an attacker who can write the folder does: list the new file's digest."""
    import hashlib

    with open(os.path.join(folder, "manifest.json")) as f:
        manifest = json.load(f)
    with open(os.path.join(folder, name), "rb") as f:
        data = f.read()
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    with open(os.path.join(folder, "manifest.json"), "w") as f:
        json.dump(manifest, f)


def test_load_refuses_damaged_and_crafted_checkpoints_by_name(tmp_path):
    import io
    import pickle
    import shutil

    import torch

    from megatron.hetero.ckpt_integrity import check_metadata
    from tests.utils import damage

    ckpt = str(tmp_path / "ckpt")
    argv = FLAGS + ["--lr", "1e-3", "--metrics-file", str(tmp_path / "m.jsonl")]
    run_ranks(train, 2, argv + ["--train-iters", "2", "--save", ckpt])
    good = os.path.join(ckpt, "iter_0000002")
    assert os.path.exists(os.path.join(good, "manifest.json"))
    pristine = str(tmp_path / "pristine")
    shutil.copytree(good, pristine)

    def load(expect):
        ranks = run_job(
            argv + ["--train-iters", "3", "--load", ckpt, "--use-checkpoint-opt_param-scheduler"], 2
        )
        assert [r.returncode for r in ranks] == [expect] * 2, [r.stderr[-2000:] for r in ranks]
        return ranks

    # 4 KiB of 0xFF in the middle of a .distcp file: refused, naming it
    shard = os.path.join(good, "__1_0.distcp")
    damage(shard, "ff")
    line = load(1)[0].stderr.strip().splitlines()[-1]
    assert line == (
        f"pretrain_gpt.py: error: {shard} is damaged: its SHA-256 differs from the manifest's"
    )

    # a crafted .metadata, manifest rewritten to match: refused, and nothing of it ran
    shutil.rmtree(good)
    shutil.copytree(pristine, good)
    marker = tmp_path / "pwned"
    with open(os.path.join(good, ".metadata"), "wb") as f:
        pickle.dump(_Evil(str(marker)), f)
    _rewrite_manifest(good, ".metadata")
    line = load(1)[0].stderr.strip().splitlines()[-1]
    assert f"{good}/.metadata refused: needs posix.system" in line, line
    assert not marker.exists()

    # a crafted byte item: torch unpickles these without restriction (dist-checkpoint's
    # load_bytes). The RNG state's entry is pointed at a torch.save of the same object,
    # appended to its file, with .metadata (its own classes only) and the manifest rewritten
    shutil.rmtree(good)
    shutil.copytree(pristine, good)
    meta = check_metadata(os.path.join(good, ".metadata"))
    index, info = next(
        (i, v) for i, v in meta.storage_data.items() if i.fqn.startswith("rng_states")
    )
    crafted = io.BytesIO()
    torch.save(_Evil(str(marker)), crafted)
    shard = os.path.join(good, info.relative_path)
    info.offset, info.length = os.path.getsize(shard), len(crafted.getvalue())
    with open(shard, "ab") as f:
        f.write(crafted.getvalue())
    with open(os.path.join(good, ".metadata"), "wb") as f:
        pickle.dump(meta, f)
    _rewrite_manifest(good, ".metadata")
    _rewrite_manifest(good, info.relative_path)
    line = load(1)[0].stderr.strip().splitlines()[-1]
    assert f"{shard}: item {index.fqn} refused" in line, line
    assert not marker.exists()

    # a checkpoint from before manifests loads, with a warning
    shutil.rmtree(good)
    shutil.copytree(pristine, good)
    os.remove(os.path.join(good, "manifest.json"))
    out = load(0)[0].stdout
    assert f"WARNING: {good} has no manifest.json (saved before manifests): not verified" in out
    assert "loaded checkpoint from" in out


def test_a_starting_plan_over_the_memory_cap_stops_every_rank_with_one_line(tmp_path):
    """Bad input: the refusal names the flag on one line, exits 2 as a bad flag does, and
    nothing is saved."""
    ckpt = str(tmp_path / "ckpt")
    argv = FLAGS + ["--lr", "1e-3", "--train-iters", "2", "--save", ckpt, "--save-interval", "1"]
    plan = ["--het-tp-policy", "migrate", "--het-tp-plan", "attn=3,1;mlp=160,96"]
    plan += ["--het-tp-memory-cap", "1.2"]
    ranks = run_job(argv + plan, 2)
    assert [r.returncode for r in ranks] == [2, 2], [r.stderr[-2000:] for r in ranks]
    lines = ranks[0].stderr.strip().splitlines()
    assert lines[-1] == (
        "pretrain_gpt.py: error: --het-tp-plan puts 1.33x the even split's unit state on TP "
        "rank 0, over --het-tp-memory-cap 1.2"
    )
    assert "Traceback" not in ranks[0].stderr + ranks[1].stderr
    assert not os.path.exists(os.path.join(ckpt, "latest_checkpointed_iteration.txt"))
