"""Child processes that die with their rank, however the rank ends; no results server.

megatron-core's checkpoint writer forks writer processes during a save, and relies on a clean
interpreter exit to stop its children; a rank killed with SIGKILL, or by a signal it does not
handle, would leave them behind for good. `install()`, once per process, asks the kernel to
SIGKILL every forked child (checkpoint writers, data-loader workers) when its parent ends
(Linux's PR_SET_PDEATHSIG), through an at-fork hook.

The writer also collects its results through a queue it makes at the first save: a
multiprocessing Manager, a server process spawned as a fresh interpreter (1.5-2 s of a CPU
core on this VM, at each job's first save), there so that an asynchronous save's background
process can hand its results back. Saves here are synchronous (`--async-save` is refused):
the results are put and read in the rank's own process, so `install()` gives the writer an
in-process queue instead.
"""

from __future__ import annotations

import ctypes
import os
import queue
import signal

_PR_SET_PDEATHSIG = 1
_state = {"installed": False, "parent": None}


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


def _write_results_queue() -> queue.Queue:
    """megatron-core's filesystem_async._get_write_results_queue for synchronous saves: the
    same queue for the process's life, as there, but held in the process."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
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
