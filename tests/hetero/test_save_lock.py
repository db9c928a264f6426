"""One job per --save folder (megatron/hetero/save_lock.py): pure file-system cases, no ranks."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from megatron.hetero.save_lock import LOCK_FILE, Holder, SaveLock, SaveLockError


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _other(**changes) -> Holder:
    return dataclasses.replace(Holder.me(), token="other-job", **changes)


def test_a_live_holder_is_named_and_the_folder_refused(tmp_path):
    first = SaveLock(str(tmp_path))
    assert first.acquire() is None and first.held
    with open(tmp_path / LOCK_FILE) as f:
        assert json.load(f)["pid"] == os.getpid()
    second = SaveLock(str(tmp_path), _other())  # this process is alive: the lock is held
    with pytest.raises(SaveLockError) as err:
        second.acquire()
    assert f"in use by another job (PID {os.getpid()} on {socket.gethostname()}" in str(err.value)
    assert not second.held
    second.release()  # not its lock: stays
    assert (tmp_path / LOCK_FILE).exists()
    first.release()
    assert sorted(os.listdir(tmp_path)) == []  # nothing left behind, no private temp files
    assert SaveLock(str(tmp_path), _other()).acquire() is None  # free again


@pytest.mark.parametrize(
    "gone",
    [
        {"pid": "dead"},  # same host, the process ended
        {"started": "1"},  # same host, the PID now belongs to another process
        {"host": "no-such-host.invalid"},  # a host that no longer resolves
    ],
    ids=["dead-pid", "reused-pid", "host-gone"],
)
def test_a_stale_lock_is_taken_over_with_a_warning_and_its_staging_removed(tmp_path, gone):
    if gone.get("pid") == "dead":
        gone = {"pid": _dead_pid()}
    crashed = SaveLock(str(tmp_path), _other(**gone))
    crashed.acquire()
    (tmp_path / "iter_0000004.tmp-other-job").mkdir()  # it died while saving
    (tmp_path / "iter_0000002").mkdir()  # a finished checkpoint: kept
    lock = SaveLock(str(tmp_path))
    warning = lock.acquire()
    assert lock.held and warning.startswith("took over the stale lock of PID")
    assert "removed its unfinished checkpoints iter_0000004.tmp-other-job" in warning
    assert sorted(os.listdir(tmp_path)) == [LOCK_FILE, "iter_0000002"]
    staging = lock.staging(str(tmp_path / "iter_0000006"))
    assert staging.endswith(f"iter_0000006.tmp-{lock.holder.token}")


def test_a_holder_in_another_pid_namespace_of_this_host_is_respected(tmp_path):
    """A container sharing the host's name (host networking) has its own PIDs: a PID dead
    here says nothing about its job, whose staging folder must survive."""
    assert Holder.me().pidns is not None  # Linux: this test's premise
    other = _other(pid=_dead_pid(), pidns=Holder.me().pidns + 1)
    SaveLock(str(tmp_path), other).acquire()
    (tmp_path / "iter_0000004.tmp-other-job").mkdir()  # it is saving
    with pytest.raises(SaveLockError, match="is in use by another job"):
        SaveLock(str(tmp_path)).acquire()
    assert (tmp_path / "iter_0000004.tmp-other-job").exists()


def test_a_file_system_without_hard_links_gets_an_exclusively_created_lock(tmp_path, monkeypatch):
    def no_links(src, dst):
        raise PermissionError(1, "Operation not permitted", src)

    monkeypatch.setattr(os, "link", no_links)
    first = SaveLock(str(tmp_path))
    assert first.acquire() is None and first.held
    with open(tmp_path / LOCK_FILE) as f:
        assert json.load(f)["token"] == first.holder.token
    with pytest.raises(SaveLockError, match=f"in use by another job \\(PID {os.getpid()}"):
        SaveLock(str(tmp_path), _other()).acquire()
    first.release()
    assert sorted(os.listdir(tmp_path)) == []
    # a job that died between creating the lock and writing it left it empty: refused while
    # it may still be being written, taken over once it is old
    (tmp_path / LOCK_FILE).write_text("")
    with pytest.raises(SaveLockError, match="is unreadable"):
        SaveLock(str(tmp_path)).acquire()
    old = time.time() - 120
    os.utime(tmp_path / LOCK_FILE, (old, old))
    lock = SaveLock(str(tmp_path))
    assert lock.acquire().startswith("took over the empty lock") and lock.held


def test_a_live_remote_holder_is_respected_and_an_unreadable_lock_refused(tmp_path):
    SaveLock(str(tmp_path), _other(host="localhost", pid=1)).acquire()
    with pytest.raises(SaveLockError, match=r"in use by another job \(PID 1 on localhost"):
        SaveLock(str(tmp_path)).acquire()
    (tmp_path / LOCK_FILE).write_text("{not json")
    with pytest.raises(SaveLockError, match="is unreadable; delete it"):
        SaveLock(str(tmp_path)).acquire()


def _squeue(tmp_path, monkeypatch, script: str | None) -> None:
    """A fake `squeue` (its shell body) alone on PATH; None: no squeue at all."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if script is not None:
        (bin_dir / "squeue").write_text(f"#!/bin/sh\n{script}\n")
        (bin_dir / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))


@pytest.mark.parametrize(
    "squeue, taken_over",
    [
        ("echo COMPLETED", True),
        ("echo CANCELLED", True),
        ("", True),  # no longer listed
        ("echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1", True),
        ("echo RUNNING", False),
        ("echo COMPLETING", False),
        ("echo 'slurm_load_jobs error: Unable to contact slurm controller' >&2; exit 1", False),
        (None, False),  # no Slurm here: a remote holder on a resolving host stays
    ],
    ids=[
        "completed",
        "cancelled",
        "unlisted",
        "unknown-job",
        "running",
        "completing",
        "controller-down",
        "no-squeue",
    ],
)
def test_a_remote_holder_whose_slurm_job_ended_is_taken_over(
    tmp_path, monkeypatch, squeue, taken_over
):
    """A job killed on another node (a time limit, scancel) cannot let go of the lock: Slurm
    tells whether it ended; where squeue cannot tell, the holder is taken as alive."""
    folder = tmp_path / "ckpt"
    monkeypatch.setenv("SLURM_JOB_ID", "43")
    monkeypatch.setenv("SLURM_CLUSTER_NAME", "main")
    SaveLock(str(folder), _other(host="localhost", pid=1, job="42")).acquire()
    _squeue(tmp_path, monkeypatch, squeue)
    lock = SaveLock(str(folder))
    if taken_over:
        assert lock.acquire().startswith("took over the stale lock of Slurm job 42, PID 1")
    else:
        with pytest.raises(SaveLockError, match="in use by another job .Slurm job 42, PID 1"):
            lock.acquire()


@pytest.mark.parametrize(
    "holder",
    [{"cluster": "other"}, {"cluster": None}, {"uid": -7}],
    ids=["another-cluster", "cluster-unknown", "another-user"],
)
def test_squeue_is_not_asked_about_jobs_it_cannot_see(tmp_path, monkeypatch, holder):
    """Another Slurm cluster on the same file system does not know the holder's job, and
    squeue may hide another user's (PrivateData=jobs): "no such job" proves nothing there."""
    monkeypatch.setenv("SLURM_JOB_ID", "43")
    monkeypatch.setenv("SLURM_CLUSTER_NAME", "main")
    SaveLock(str(tmp_path / "ckpt"), _other(host="localhost", pid=1, job="42", **holder)).acquire()
    _squeue(
        tmp_path, monkeypatch, "echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1"
    )
    with pytest.raises(SaveLockError, match="in use by another job"):
        SaveLock(str(tmp_path / "ckpt")).acquire()


@pytest.mark.parametrize("restarts, taken_over", [("1", True), ("0", False), (None, False)])
def test_a_requeued_job_takes_over_its_earlier_run_s_lock(
    tmp_path, monkeypatch, restarts, taken_over
):
    """Slurm requeues a job under its own ID, often onto another node: a higher
    SLURM_RESTART_COUNT shows the earlier run ended; the same count is another step of the
    same run, alive."""
    _squeue(tmp_path, monkeypatch, "echo RUNNING")  # the job itself runs: squeue cannot tell
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_CLUSTER_NAME", "main")
    SaveLock(str(tmp_path / "ckpt"), _other(host="localhost", pid=1, restart="0")).acquire()
    if restarts is None:
        monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    else:
        monkeypatch.setenv("SLURM_RESTART_COUNT", restarts)
    lock = SaveLock(str(tmp_path / "ckpt"))
    if taken_over:
        assert lock.acquire().startswith("took over the stale lock of Slurm job 42, PID 1")
    else:
        with pytest.raises(SaveLockError, match="in use by another job"):
            lock.acquire()
