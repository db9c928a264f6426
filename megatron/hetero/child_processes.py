"""Child processes that die with their rank, however the rank ends.

megatron-core's checkpoint writer starts a multiprocessing Manager (a server process) for its
writers' results at the first save and relies on a clean interpreter exit to stop it; a rank
killed with SIGKILL, or by a signal it does not handle, leaves it behind, idle, for good (and
writers forked during a save too). `install()`, once per process, asks the kernel to SIGKILL
every child when its parent ends (Linux's PR_SET_PDEATHSIG): forked children (checkpoint
writers, data-loader workers) through an at-fork hook, and the results Manager, which is
spawned rather than forked, through its initializer.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
from multiprocessing.managers import SyncManager

_PR_SET_PDEATHSIG = 1
_state = {"installed": False, "parent": None, "managers": []}


def die_with_parent(parent: int | None = None) -> None:
    """In a child: be killed when the parent ends. If it already ended, exit now."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: nothing to ask for
        return
    if parent is not None and os.getppid() != parent:
        os._exit(1)


def _before_fork() -> None:
    _state["parent"] = os.getpid()


def _after_fork_in_child() -> None:
    die_with_parent(_state["parent"])


def _write_results_queue():
    """megatron-core's filesystem_async._get_write_results_queue, with a Manager that dies
    with this rank."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
        manager.start(initializer=die_with_parent, initargs=(os.getpid(),))
        _state["managers"].append(manager)
        filesystem_async._results_queue = manager.Queue()
    return filesystem_async._results_queue


def install() -> None:
    """Once per process, before the first save or data-loader worker."""
    if _state["installed"]:
        return
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not hasattr(filesystem_async, "_get_write_results_queue"):
        raise RuntimeError(
            "megatron-core's dist_checkpointing no longer has "
            "filesystem_async._get_write_results_queue; update megatron/hetero/child_processes.py"
        )
    filesystem_async._get_write_results_queue = _write_results_queue
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
    _state["installed"] = True
