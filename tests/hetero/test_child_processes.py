"""A rank's children die with it, and a save starts no results server."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

from tests.utils.paths import ROOT

# A "rank": installs the hooks, forks a child that would sleep for ten minutes, asks the
# checkpoint writer for its results queue, and reports what it found
_RANK = textwrap.dedent(
    """
    import multiprocessing, os, queue, sys, time
    from megatron.hetero import child_processes
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    child_processes.install()
    results = filesystem_async._get_write_results_queue()
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,))
    child.start()
    same = filesystem_async._get_write_results_queue() is results
    print(child.pid, type(results).__name__, same, len(multiprocessing.active_children()),
          flush=True)
    time.sleep(600)
    """
)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_forked_child_dies_with_its_rank_and_the_writer_queue_is_in_process():
    rank = subprocess.Popen(
        [sys.executable, "-c", _RANK], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        pid, kind, same, children = rank.stdout.readline().split()
    finally:
        rank.send_signal(signal.SIGKILL)  # no clean-up, no atexit: the kernel's hook alone
        rank.wait(timeout=60)
    # synchronous saves put and read their results here: no Manager process was started
    assert (kind, same, children) == ("Queue", "True", "1")
    deadline = time.monotonic() + 5
    while _alive(int(pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(int(pid)), "the forked child outlived its SIGKILLed parent"
