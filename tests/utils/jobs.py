"""pretrain_gpt.py as a job: one process per rank started the way Slurm's srun starts them
(RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment), so tests see real exit statuses and can
signal single ranks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from tests.utils.paths import ROOT
from tests.utils.ranks import _free_port, rank_env


@dataclass
class Finished:
    returncode: int
    stdout: str
    stderr: str


class Job:
    def __init__(self, argv: list[str], nproc: int, env: dict | None = None):
        port = _free_port()
        self.procs = []
        for rank in range(nproc):
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *argv],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env={**os.environ, **rank_env(rank, nproc, port), **(env or {})},
                    cwd=ROOT,
                )
            )

    def signal(self, rank: int, sig=signal.SIGTERM) -> None:
        self.procs[rank].send_signal(sig)

    def wait(self, timeout: float = 240.0) -> list[Finished]:
        """Every rank's status and output; kills the job if it outlives `timeout`."""
        deadline = time.monotonic() + timeout
        out = []
        try:
            for proc in self.procs:
                stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
                out.append(Finished(proc.returncode, stdout, stderr))
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        return out

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.communicate(timeout=60)  # a child holding its pipes would hang us here


def run_job(argv: list[str], nproc: int, timeout: float = 240.0, env=None) -> list[Finished]:
    return Job(argv, nproc, env).wait(timeout)
