"""One job per --save folder.

Two jobs saving into one folder overwrite each other's staging folders and metrics, and one of
them reports a checkpoint as saved that cannot be loaded. A job therefore claims the folder for
its whole life with a lock file that appears atomically (link(), which also holds on NFS), naming
the holder: host, PID, the PID's start time (so a reused PID is not mistaken for the holder) and
the Slurm job. A second job is refused with that name. A lock whose holder is gone (same host
and the process is dead, or a host that no longer resolves) is taken over with a warning; the
staging folders the dead job left are removed then. Staging folders carry the job's token in
their name, so even jobs that bypass the lock cannot write into each other's.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
import uuid
from dataclasses import asdict, dataclass

LOCK_FILE = ".hettp-save.lock"
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


def _resolves(host: str) -> bool:
    try:
        socket.getaddrinfo(host, None)
    except OSError:
        return False
    return True


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    started: str | None
    job: str | None
    since: float
    token: str

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
        )

    def describe(self) -> str:
        job = f"Slurm job {self.job}, " if self.job else ""
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"{job}PID {self.pid} on {self.host}, since {since}"

    def gone(self, here: str) -> bool:
        """Whether the holder can be shown to have ended (never guessed: a live remote job on a
        host that resolves is taken as alive)."""
        if self.host == here:
            return not _alive(self.pid, self.started)
        return not _resolves(self.host)


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
        # lock exists, so the lock appears atomically and always with its holder in it.
        mine = f"{self.path}.{self.holder.token}"
        with open(mine, "w") as f:
            json.dump(asdict(self.holder), f)
        try:
            warning = None
            for _ in range(2):  # a second try after removing a stale lock
                try:
                    os.link(mine, self.path)
                except FileExistsError:
                    other = self._read()
                    if other is None:
                        raise SaveLockError(
                            f"--save {self.folder}: the lock {self.path} is unreadable; "
                            "delete it if no job uses this folder"
                        ) from None
                    if not other.gone(self.holder.host):
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

    def _read(self) -> Holder | None:
        try:
            with open(self.path) as f:
                return Holder(**json.load(f))
        except (OSError, ValueError, TypeError):
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
