"""What the scripts that start their own CPU ranks share: a free port, each spawned rank's
torch.distributed environment (gloo over localhost, one thread a rank, warnings off), and the
torchrun command of pretrain_gpt.py."""

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


def pretrain_command(args: list[str], nproc: int = 2, port: int | None = None) -> list[str]:
    """torchrun of pretrain_gpt.py with `args` on `nproc` local ranks (torchrun's default port
    unless `port`); run it with OMP_NUM_THREADS=1, as ranks share the cores."""
    master = ["--master_port", str(port)] if port is not None else []
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        *master,
        os.path.join(ROOT, "pretrain_gpt.py"),
        *args,
    ]
