"""What the benchmarks that spawn their own CPU ranks share: a free port, and each rank's
torch.distributed environment (gloo over localhost, one thread a rank, warnings off)."""

from __future__ import annotations

import os
import socket
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join(rank: int, world: int, port: int) -> None:
    """In a spawned rank, before it imports the trainer: the environment torch.distributed's
    env:// init reads, one intra-op thread (ranks share the cores), and the project importable."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(1)
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
