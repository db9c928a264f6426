#!/usr/bin/env python3
"""Run upstream Megatron-LM's own pretrain_gpt.py (patched or not) on CPU ranks, torchrun-style:

    torchrun --nproc_per_node 2 scripts/upstream_cpu.py /path/to/Megatron-LM/pretrain_gpt.py \\
        --tensor-model-parallel-size 2 --transformer-impl local ... [--het-tp-policy migrate ...]

For development and CI only: it installs hettp's CPU shims (megatron/hetero/cpu_compat.py and
upstream_cpu.py, each checked against the upstream line it covers) and then runs the script as
its __main__, with the checkout first on sys.path. On a machine with CUDA it refuses to start.
"""

import os
import runpy
import sys


def main(argv):
    if not argv or not argv[0].endswith(".py"):
        print(
            "usage: torchrun --nproc_per_node N scripts/upstream_cpu.py "
            "MEGATRON_LM/pretrain_gpt.py [its flags]",
            file=sys.stderr,
        )
        return 2
    entry = os.path.abspath(argv[0])
    if not os.path.isfile(entry):
        print(f"upstream_cpu: error: {argv[0]} is not a file", file=sys.stderr)
        return 2
    tree = os.path.dirname(entry)
    # upstream's megatron.core (the checkout's copy) must win over an installed megatron-core
    sys.path.insert(0, tree)
    from megatron.hetero import upstream_cpu
    from megatron.hetero.cpu_compat import CompatError

    try:
        upstream_cpu.activate(tree)
    except CompatError as err:
        print(f"upstream_cpu: error: {err}", file=sys.stderr)
        return 1
    flags = list(argv[1:])
    if "--distributed-backend" not in flags:
        flags += ["--distributed-backend", "gloo"]  # CPU ranks: nccl needs GPUs
    sys.argv = [entry, *flags]
    try:
        runpy.run_path(entry, run_name="__main__")
    except SystemExit as done:
        if done.code not in (None, 0):
            raise
        _shut_down()
        raise
    _shut_down()
    return 0


def _shut_down():
    """Close the process group on every rank together. Upstream's script exits with it open,
    which NCCL tolerates; with gloo, a rank whose peer has already exited can abort (SIGABRT)
    when its pairs see the closed sockets, after training went well."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
