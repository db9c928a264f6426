"""One job per --save folder.

Two jobs saving into one folder overwrite each other's staging folders and metrics, and one of
them reports a checkpoint as saved that cannot be loaded. A job therefore claims the folder for
its whole life with a lock file that appears atomically (link(), which also holds on NFS; an
exclusive create where the file system has no hard links), naming the holder: host, PID, the
PID's start time (so a reused PID is not mistaken for the holder), PID namespace and the Slurm
job. A second job is refused with that name. A lock whose holder is gone is taken over with a
warning, and the staging folders the dead job left are removed then: on the same host and in
the same PID namespace, its process is dead; elsewhere (another host, or a container sharing
the host's name), a host that no longer resolves, or (a job of this
Slurm cluster and user) its Slurm job has ended (squeue says so) or is this job requeued (a
higher SLURM_RESTART_COUNT: a requeued job usually lands on another node, and its earlier run
was killed before it could let go).
Staging folders carry the job's token in their name, so even jobs that bypass the lock cannot
write into each other's.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import time
import uuid
from dataclasses import asdict, dataclass

LOCK_FILE = ".hettp-save.lock"
EMPTY_LOCK_SECONDS = 60  # an empty lock older than this was abandoned mid-creation
STAGING_MARK = ".tmp-"  # iter_0000010.tmp-<token>


class SaveLockError(RuntimeError):
    """The --save folder is held by another live job."""


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused PID."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int, started: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's live process
    now = _start_time(pid)
    return started is None or now is None or now == started


def _pid_namespace() -> int | None:
    """This process's PID namespace (Linux): containers sharing a host's name (host networking)
    see other PIDs, so a holder's PID is only checked from within its own namespace."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


# What link() raises on a file system without hard links (FUSE object stores, some SMB mounts)
_NO_LINKS = {errno.EPERM, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}


def _resolves(host: str) -> bool:
    try:
        socket.getaddrinfo(host, None)
    except OSError:
        return False
    return True


# squeue's states of a job that has not ended
_SLURM_ACTIVE = {
    "PENDING",
    "RUNNING",
    "SUSPENDED",
    "COMPLETING",
    "CONFIGURING",
    "RESIZING",
    "REQUEUED",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "RESV_DEL_HOLD",
    "SIGNALING",
    "SPECIAL_EXIT",
    "STAGE_OUT",
    "STOPPED",
}


def _slurm_job_ended(job: str) -> bool | None:
    """Whether squeue shows Slurm job `job` ended (True), not ended (False), or cannot tell
    (None: no squeue, or it failed for another reason than an unknown job)."""
    try:
        proc = subprocess.run(
            ["squeue", "--noheader", "--jobs", job, "--format", "%T"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:  # a job long gone is one the controller no longer knows
        return True if "invalid job id" in proc.stderr.lower() else None
    states = set(proc.stdout.split())
    return not states & _SLURM_ACTIVE


def _restarts(count: str | None) -> int:
    return int(count) if count and count.isdigit() else 0


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    started: str | None
    job: str | None
    since: float
    token: str
    restart: str | None = None  # SLURM_RESTART_COUNT: how often Slurm requeued the job
    cluster: str | None = None  # SLURM_CLUSTER_NAME: whose squeue knows the job
    uid: int | None = None  # squeue may hide other users' jobs (PrivateData=jobs)
    pidns: int | None = None  # the PID namespace `pid` is in (None: not known)

    @classmethod
    def me(cls) -> Holder:
        pid = os.getpid()
        return cls(
            socket.gethostname(),
            pid,
            _start_time(pid),
            os.environ.get("SLURM_JOB_ID"),
            time.time(),
            f"{socket.gethostname()}-{pid}-{uuid.uuid4().hex[:8]}",
            os.environ.get("SLURM_RESTART_COUNT"),
            os.environ.get("SLURM_CLUSTER_NAME"),
            os.getuid(),
            _pid_namespace(),
        )

    def describe(self) -> str:
        job = f"Slurm job {self.job}, " if self.job else ""
        if self.job and _restarts(self.restart):
            job = f"Slurm job {self.job} (requeued {self.restart}x), "
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"{job}PID {self.pid} on {self.host}, since {since}"

    def gone(self, me: Holder) -> bool:
        """Whether the holder can be shown to have ended (never guessed: a remote holder whose
        end neither Slurm nor its host's name shows is taken as alive)."""
        namespaces = (self.pidns, me.pidns)
        if self.host == me.host and (None in namespaces or self.pidns == me.pidns):
            return not _alive(self.pid, self.started)
        if not _resolves(self.host):
            return True
        # Slurm is asked only about a job of this cluster and user: another cluster sharing
        # the file system does not know the job, and squeue may hide other users' jobs
        if self.job is None or self.cluster is None or self.cluster != me.cluster:
            return False
        if self.uid != me.uid:
            return False
        if self.job == me.job:  # another step of this job runs alongside, unless requeued
            return _restarts(me.restart) > _restarts(self.restart)
        return bool(_slurm_job_ended(self.job))


class SaveLock:
    """Rank 0's claim on a --save folder: `acquire()` returns the warning to log (a taken-over
    stale lock) or None, and raises SaveLockError when a live job holds it; `release()`."""

    def __init__(self, folder: str, holder: Holder | None = None):
        self.folder = folder
        self.path = os.path.join(folder, LOCK_FILE)
        self.holder = holder or Holder.me()
        self.held = False

    def acquire(self) -> str | None:
        os.makedirs(self.folder, exist_ok=True)
        # Written in full under a private name, then linked into place: link() fails if the
        # lock exists, so the lock appears atomically and always with its holder in it (on a
        # file system without hard links it is created exclusively, then written: _place).
        mine = f"{self.path}.{self.holder.token}"
        with open(mine, "w") as f:
            json.dump(asdict(self.holder), f)
        try:
            warning = None
            for _ in range(2):  # a second try after removing a stale lock
                try:
                    self._place(mine)
                except FileExistsError:
                    other = self._read()
                    if other is None and self._abandoned_empty():
                        warning = f"took over the empty lock {self.path} (its job died creating it)"
                        os.remove(self.path)
                        continue
                    if other is None:
                        raise SaveLockError(
                            f"--save {self.folder}: the lock {self.path} is unreadable; "
                            "delete it if no job uses this folder"
                        ) from None
                    if not other.gone(self.holder):
                        raise SaveLockError(
                            f"--save {self.folder} is in use by another job "
                            f"({other.describe()}; lock {self.path}): give this job its own "
                            "--save, or delete the lock if that job is gone"
                        ) from None
                    warning = f"took over the stale lock of {other.describe()}"
                    os.remove(self.path)
                    continue
                self.held = True
                removed = self._remove_stale_staging()
                if warning and removed:
                    warning += f"; removed its unfinished checkpoints {', '.join(removed)}"
                return warning
            raise SaveLockError(
                f"--save {self.folder}: another job took the lock {self.path} first"
            )
        finally:
            os.remove(mine)

    def _abandoned_empty(self) -> bool:
        """An exclusively created lock still empty a minute on: its job died between creating
        and writing it (a hard-linked lock is never empty)."""
        try:
            info = os.stat(self.path)
        except OSError:
            return False
        return info.st_size == 0 and time.time() - info.st_mtime > EMPTY_LOCK_SECONDS

    def _place(self, mine: str) -> None:
        """The lock at self.path with `mine`'s content; FileExistsError if there is one."""
        try:
            os.link(mine, self.path)
            return
        except OSError as err:
            if err.errno not in _NO_LINKS:
                raise
        # no hard links here: created exclusively, then written (_read waits for the content)
        with open(mine) as f:
            content = f.read()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(content)

    def _read(self) -> Holder | None:
        for attempt in range(3):  # an exclusively created lock is empty until written
            try:
                with open(self.path) as f:
                    text = f.read()
                if text or attempt == 2:
                    return Holder(**json.loads(text))
            except (OSError, ValueError, TypeError):
                if attempt == 2:
                    return None
            time.sleep(0.2)
        return None

    def _remove_stale_staging(self) -> list[str]:
        """Staging folders of other (dead: we hold the lock) jobs."""
        removed = []
        for name in sorted(os.listdir(self.folder)):
            if STAGING_MARK in name and not name.endswith(self.holder.token):
                shutil.rmtree(os.path.join(self.folder, name), ignore_errors=True)
                removed.append(name)
        return removed

    def staging(self, final: str) -> str:
        return f"{final}{STAGING_MARK}{self.holder.token}"

    def release(self) -> None:
        if self.held:
            other = self._read()
            if other is not None and other.token == self.holder.token:
                os.remove(self.path)
            self.held = False
