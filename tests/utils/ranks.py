"""Run a function on N real gloo ranks, spawned from pytest.

Each rank is a process forked from a `forkserver` that has imported torch and megatron-core once
(about 8 s a rank under `spawn`, most of a short test's time); the server never initialises
anything, so CPU shims and process groups still never leak into pytest or between tests. Ranks
get the env:// variables torchrun would set. The function's return value on
every rank comes back as a list; an exception on any rank fails the test with its traceback.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import pickle
import socket
import tempfile
import time
import traceback

import torch.multiprocessing as mp

# Imported once by the fork server; every rank forks from it with these already loaded.
# pretrain_gpt comes first: it silences megatron-core's import-time warnings about GPU extras.
PRELOAD = ["pretrain_gpt", "megatron.hetero.training", "tests.utils.workers"]
FAILURE_GRACE = 10.0  # seconds the other ranks get to finish after one failed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world_size: int, port: int) -> dict:
    """What torchrun or srun give a rank of a single-node job, one thread each."""
    return dict(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )


def _entry(rank, world_size, port, fn, args, kwargs, out_dir):
    os.environ.update(rank_env(rank, world_size, port))
    import warnings

    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).* not installed.*")
    import torch

    torch.set_num_threads(1)
    try:
        result = ("ok", fn(*args, **kwargs))
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        result = ("error", f"rank {rank}: {type(err).__name__}: {err}\n{traceback.format_exc()}")
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    if result[0] == "error":
        os._exit(1)  # do not wait on peers stuck in a collective


def _wait(processes, deadline: float, what: str, timeout: float) -> None:
    """Until every rank has exited, or FAILURE_GRACE seconds after one failed: the others
    may be failing too (a failure broadcast, a peer's closed connection) and write their
    results, or be stuck in a collective. torch's ProcessContext.join terminates them at
    the first failure, and a test of every rank's error then saw one rank's, or none."""
    failed_at = None
    while True:
        alive = [p for p in processes if p.exitcode is None]
        if not alive:
            return
        now = time.monotonic()
        if failed_at is None and any(p.exitcode not in (None, 0) for p in processes):
            failed_at = now
        if failed_at is not None and now > failed_at + FAILURE_GRACE:
            return
        if now > deadline:
            raise TimeoutError(f"{what} exceeded {timeout:.0f} s")
        multiprocessing.connection.wait([p.sentinel for p in alive], timeout=1.0)


def run_ranks(fn, world_size: int, *args, timeout: float = 240.0, **kwargs) -> list:
    """fn(*args, **kwargs) on `world_size` gloo ranks; returns each rank's result."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _entry,
            args=(world_size, _free_port(), fn, args, kwargs, out_dir),
            nprocs=world_size,
            join=False,
            start_method="forkserver",
        )
        deadline = time.monotonic() + timeout
        errors = []
        try:
            _wait(ctx.processes, deadline, f"{fn.__name__} on {world_size} ranks", timeout)
        finally:
            for process in ctx.processes:
                if process.is_alive():
                    process.kill()
        results = []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.pkl")
            if not os.path.exists(path):
                errors.append(f"rank {rank}: exited without a result")
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                errors.append(value)
            results.append(value)
        if errors:
            raise AssertionError("distributed run failed:\n" + "\n".join(errors))
        return results
