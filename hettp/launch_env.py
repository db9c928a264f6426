"""torch.distributed's environment from Slurm's: what the sbatch scripts in scripts/slurm use.

    eval "$(python -m hettp.launch_env)"            # one task per GPU (srun): RANK, LOCAL_RANK, ...
    eval "$(python -m hettp.launch_env --per-node)"  # one torchrun per node: NNODES, NODE_RANK, ...

MASTER_ADDR is the first host of SLURM_JOB_NODELIST (expanded here: no scontrol needed, so
the derivation is testable anywhere); MASTER_PORT is derived from the job id so that two jobs
sharing a node do not collide. Variables already set win (MASTER_ADDR, MASTER_PORT).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from collections.abc import Mapping

PORT_BASE, PORT_SPAN = 20000, 20000


class SlurmEnvError(ValueError):
    """Slurm's variables are missing or malformed."""


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise SlurmEnvError(f"node list '{text}': unbalanced ']'")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise SlurmEnvError(f"node list '{text}': unbalanced '['")
    parts.append(cur)
    return [p for p in parts if p]


def _expand_range(body: str, text: str) -> list[str]:
    out = []
    for piece in body.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", piece)
        if not m:
            raise SlurmEnvError(f"node list '{text}': bad range '{piece}'")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise SlurmEnvError(f"node list '{text}': descending range '{piece}'")
        width = len(lo)  # zero padding as written: node[08-10] -> node08 node09 node10
        out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    return out


def expand_nodelist(text: str) -> list[str]:
    """'gpu[01-03,07],rack[1-2]-n[1-2],login' -> every host name, in Slurm's order."""
    hosts = []
    for item in _split_top(text.strip()):
        names = [""]
        for literal, body in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", item):
            expansions = _expand_range(body, text) if body else [""]
            names = [n + literal + e for n in names for e in expansions]
        hosts.extend(names)
    if not hosts:
        raise SlurmEnvError(f"node list '{text}' names no host")
    return hosts


def master_port(job_id: int | str) -> int:
    """A port per job, in [20000, 40000): clear of the ephemeral range on Linux."""
    try:
        return PORT_BASE + int(str(job_id).split("_")[0]) % PORT_SPAN
    except ValueError:
        raise SlurmEnvError(f"SLURM_JOB_ID '{job_id}' is not a job number") from None


def _need(env: Mapping[str, str], *names: str) -> list[str]:
    missing = [n for n in names if not env.get(n)]
    if missing:
        raise SlurmEnvError(
            f"not inside a Slurm job step: {', '.join(missing)} unset "
            "(run under srun, or set them for a dry run)"
        )
    return [env[n] for n in names]


def distributed_env(env: Mapping[str, str], per_node: bool = False) -> dict[str, str]:
    """RANK/WORLD_SIZE/LOCAL_RANK (one task per GPU) or NNODES/NODE_RANK (one torchrun per
    node), plus MASTER_ADDR and MASTER_PORT, from a Slurm task's environment."""
    job_id, nodelist = _need(env, "SLURM_JOB_ID", "SLURM_JOB_NODELIST")
    hosts = expand_nodelist(nodelist)
    out = {
        "MASTER_ADDR": env.get("MASTER_ADDR") or hosts[0],
        "MASTER_PORT": env.get("MASTER_PORT") or str(master_port(job_id)),
    }
    if per_node:
        (node_rank,) = _need(env, "SLURM_NODEID")
        out.update(NNODES=str(len(hosts)), NODE_RANK=node_rank)
    else:
        rank, world, local = _need(env, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
        if not int(rank) < int(world):
            raise SlurmEnvError(f"SLURM_PROCID {rank} is not below SLURM_NTASKS {world}")
        out.update(
            RANK=rank,
            WORLD_SIZE=world,
            LOCAL_RANK=local,
            LOCAL_WORLD_SIZE=env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
            or str(int(world) // len(hosts)),
        )
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--per-node",
        action="store_true",
        help="one torchrun per node: NNODES and NODE_RANK instead of RANK etc.",
    )
    a = p.parse_args(argv)
    try:
        env = distributed_env(os.environ, a.per_node)
    except SlurmEnvError as err:
        print(f"hettp.launch_env: {err}", file=sys.stderr)
        return 2
    for key, value in env.items():
        print(f"export {key}={shlex.quote(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
