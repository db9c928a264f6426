#!/usr/bin/env python
"""Two "clusters" on one machine, joined by a slow link: measured step times across it.

    python scripts/netlab.py probe                 # "ok", or why namespaces cannot be made here
    python scripts/netlab.py run --rate-mbit 50 --tp 2 --pp 2 [--ranks 2,2] [-- MEGATRON FLAGS]
    python scripts/netlab.py bench --rate-mbit 50  # gloo alpha (latency) and beta (bytes/s)
    python scripts/netlab.py groups --tp 2 --pp 2  # which Megatron groups cross the link
    python scripts/netlab.py clean                 # namespaces left by killed processes

Sites A and B are Linux network namespaces (root only), each with `lo` and one end of a veth
pair between them; `tc ... tbf` on both ends' egress limits each direction to the same rate
(netem is not in every kernel, so there is no added delay: alpha is the stack's own). Ranks of
`pretrain_gpt.py` run in the sites through `ip netns exec`, with the env:// variables torchrun
would set and GLOO_SOCKET_IFNAME naming their site's veth, so gloo binds there: traffic between
ranks of one site stays on its own loopback, traffic between sites crosses the limited link.
Megatron orders global ranks TP fastest, then DP, then PP, and ranks 0..a-1 are site A's, so the
caller picks degrees that put a group across the link or inside a site (`groups` checks it).

Namespaces are named hettp_<tag>_a / _b (tag: the pid and a counter unless given) and use
10.79.1.0/24, an address range that exists only inside them: nothing here reaches any address
outside the namespaces it created.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFIX = "hettp_"
SUBNET = "10.79.1"  # /24 inside the two namespaces only
IFNAMES = ("hettp_a", "hettp_b")  # each lives in its own namespace, so names never collide
# A default tag is p<pid>n<counter>: `clean` may delete those whose process is gone.
_DEFAULT_TAG = re.compile(r"^hettp_p(\d+)n\d+_[ab]$")
_counter = itertools.count()

# The tiny GPT of `run`: 4 ranks on 2 cores, ~10 iterations, well under a minute.
TINY_GPT = (
    "--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 128 "
    "--max-position-embeddings 128 --micro-batch-size 2 --global-batch-size 8 --lr 1e-4 "
    "--mock-data --vocab-size 255 --hidden-dropout 0 --attention-dropout 0 --seed 1234"
    " --eval-iters 0"
).split()


class NetlabError(RuntimeError):
    """A namespace, link or job step failed; the message names the step and its output."""


def _cmd(args: Sequence[str], step: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(args), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise NetlabError(f"{step}: `{' '.join(args)}` failed: {proc.stderr.strip()}")
    return proc


def _namespaces() -> list[str]:
    out = _cmd(["ip", "netns", "list"], "list namespaces").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


@dataclasses.dataclass(frozen=True)
class Site:
    """One cluster: a namespace and the veth end its ranks' gloo binds to."""

    name: str  # "a" or "b"
    netns: str
    ifname: str
    addr: str

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns]

    def counters(self) -> tuple[int, int]:
        """(tx, rx) bytes of the veth end: what crossed the link, counted at the link itself."""
        show = ["ip", "-n", self.netns, "-j", "-s", "link", "show", "dev", self.ifname]
        out = _cmd(show, "read link counters")
        stats = json.loads(out.stdout)[0]["stats64"]
        return stats["tx"]["bytes"], stats["rx"]["bytes"]


class TwoSites:
    """Sites A and B joined by a veth pair, rate-limited by tbf on both egresses.

    A context manager: entering builds everything (and removes what it built if a step fails),
    leaving deletes it, even after an exception. `setup_s` and `teardown_s` say what each took.
    tbf's burst is at least 64 KiB (one GSO packet of veth, so none is split) and its queue holds
    `latency_ms` of traffic at the rate, so TCP sees a queue rather than early drops.
    """

    def __init__(
        self,
        rate_mbit: float | None,
        tag: str | None = None,
        latency_ms: float = 100.0,
    ):
        if rate_mbit is not None and not rate_mbit > 0:
            raise ValueError(f"rate_mbit must be > 0 or None, got {rate_mbit}")
        if tag is None:
            tag = f"p{os.getpid()}n{next(_counter)}"
        if not re.fullmatch(r"[A-Za-z0-9]+", tag):
            raise ValueError(f"tag must be letters and digits, got {tag!r}")
        self.rate_mbit = rate_mbit
        self.latency_ms = latency_ms
        self.a = Site("a", f"{PREFIX}{tag}_a", IFNAMES[0], f"{SUBNET}.1")
        self.b = Site("b", f"{PREFIX}{tag}_b", IFNAMES[1], f"{SUBNET}.2")
        self.setup_s = float("nan")  # measured on enter and exit
        self.teardown_s = float("nan")
        self._made: list[str] = []

    @property
    def sites(self) -> tuple[Site, Site]:
        return self.a, self.b

    def __enter__(self) -> TwoSites:
        start = time.monotonic()
        try:
            for site in self.sites:
                _cmd(["ip", "netns", "add", site.netns], "create network namespace")
                self._made.append(site.netns)
                _cmd(["ip", "-n", site.netns, "link", "set", "lo", "up"], "bring lo up")
            _cmd(
                ["ip", "link", "add", self.a.ifname, "netns", self.a.netns, "type", "veth"]
                + ["peer", "name", self.b.ifname, "netns", self.b.netns],
                "create veth pair",
            )
            for site in self.sites:
                # no IPv6 on the link: gloo takes the interface's first address, never fe80::
                _cmd(
                    site.exec_prefix()
                    + ["sysctl", "-qw", f"net.ipv6.conf.{site.ifname}.disable_ipv6=1"],
                    "disable IPv6",
                    check=False,
                )
                _cmd(
                    ["ip", "-n", site.netns, "addr", "add", f"{site.addr}/24"]
                    + ["dev", site.ifname],
                    "address veth",
                )
                _cmd(["ip", "-n", site.netns, "link", "set", site.ifname, "up"], "bring veth up")
            self.set_rate(self.rate_mbit)
        except BaseException:
            self._delete()
            raise
        self.setup_s = time.monotonic() - start
        return self

    def __exit__(self, *exc) -> None:
        start = time.monotonic()
        self._delete()
        self.teardown_s = time.monotonic() - start

    def set_rate(self, rate_mbit: float | None) -> None:
        """Limit each direction to rate_mbit (tbf on both egresses), or remove the limit."""
        for site in self.sites:
            if rate_mbit is None:
                _cmd(
                    ["tc", "-n", site.netns, "qdisc", "del", "dev", site.ifname, "root"],
                    "remove tbf",
                    check=False,  # none there yet
                )
                continue
            bits = int(rate_mbit * 1e6)
            burst = max(64 * 1024, bits // 8 // 1000)  # >= 1 ms at the rate
            _cmd(
                ["tc", "-n", site.netns, "qdisc", "replace", "dev", site.ifname, "root", "tbf"]
                + ["rate", f"{bits}bit", "burst", str(burst), "latency", f"{self.latency_ms}ms"],
                "tbf rate limit",
            )
        self.rate_mbit = rate_mbit

    def qdiscs(self) -> list[str]:
        return [
            _cmd(["tc", "-n", s.netns, "qdisc", "show", "dev", s.ifname], "show qdisc").stdout
            for s in self.sites
        ]

    def _delete(self) -> None:
        """Kill what still runs in our namespaces (only ours: started inside them), then delete
        them; a veth end goes with its namespace."""
        for netns in self._made:
            pids = _cmd(["ip", "netns", "pids", netns], "list pids", check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        for netns in reversed(self._made):
            _cmd(["ip", "netns", "del", netns], "delete namespace", check=False)
        self._made.clear()


def unavailable() -> str | None:
    """None where namespaces, veth and tbf can be made here, else why not (the probe builds a
    rate-limited pair and deletes it)."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux, not {sys.platform}"
    if os.geteuid() != 0:
        return "network namespaces need root (euid is not 0)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not on PATH"
    try:
        with TwoSites(rate_mbit=10, tag=f"probe{os.getpid()}n{next(_counter)}"):
            pass
    except (NetlabError, OSError) as err:
        return str(err)
    return None


def clean_stale() -> list[str]:
    """Delete namespaces with a default tag whose process is gone (a SIGKILLed test run)."""
    removed = []
    for netns in _namespaces():
        m = _DEFAULT_TAG.match(netns)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _cmd(["ip", "netns", "del", netns], "delete namespace", check=False)
            removed.append(netns)
    return removed


# ---------------------------------------------------------------------------------------------
# Jobs


@dataclasses.dataclass
class Job:
    """A finished job: each rank's process (stdout/stderr read back from its log files), the
    wall time from the first start to the last exit, and the bytes that crossed the link."""

    procs: list[subprocess.CompletedProcess]
    wall_s: float
    bytes_a_to_b: int
    bytes_b_to_a: int
    log_dir: str
    metrics: str | None = None  # pretrain_gpt.py's JSONL (rank 0 writes it)


def _placement(sites: TwoSites, ranks_per_site: tuple[int, int]) -> list[tuple[Site, int]]:
    """(site, local rank) of each global rank: 0..a-1 in A, a..a+b-1 in B."""
    a, b = ranks_per_site
    if a < 1 or b < 0:
        raise ValueError(f"ranks_per_site must be (>=1, >=0), got {ranks_per_site}")
    return [(sites.a, r) for r in range(a)] + [(sites.b, r) for r in range(b)]


def _free_port() -> int:
    """A fresh namespace has nothing bound, but a new port per job avoids a previous job's
    sockets in TIME_WAIT when one TwoSites runs several."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: str, chars: int = 3000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except FileNotFoundError:
        return ""


def run_ranks(
    sites: TwoSites,
    ranks_per_site: tuple[int, int],
    command: list[str],
    log_dir: str,
    timeout: float,
    extra_env: dict | None = None,
    pin: bool = True,
) -> Job:
    """`command` once per rank, in its site, with torchrun's env:// variables; see launch."""
    placement = _placement(sites, ranks_per_site)
    world = len(placement)
    counts = {"a": ranks_per_site[0], "b": ranks_per_site[1]}
    port = _free_port()
    cores = sorted(os.sched_getaffinity(0))
    os.makedirs(log_dir, exist_ok=True)
    before = sites.a.counters()
    procs: list[tuple[subprocess.Popen, str, str]] = []
    start = time.monotonic()
    try:
        for rank, (site, local) in enumerate(placement):
            env = dict(os.environ)
            env.update(
                RANK=str(rank),
                WORLD_SIZE=str(world),
                LOCAL_RANK=str(local),
                LOCAL_WORLD_SIZE=str(counts[site.name]),
                GROUP_RANK="0" if site.name == "a" else "1",  # the "node"
                MASTER_ADDR=sites.a.addr,
                MASTER_PORT=str(port),
                GLOO_SOCKET_IFNAME=site.ifname,
                OMP_NUM_THREADS="1",  # one thread each, as tests/utils/ranks.py
                MKL_NUM_THREADS="1",
                PYTHONUNBUFFERED="1",
                PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
            )
            env.update(extra_env or {})
            out, err = (os.path.join(log_dir, f"rank{rank}.{x}") for x in ("out", "err"))
            core = cores[rank % len(cores)]
            with open(out, "w") as fo, open(err, "w") as fe:
                proc = subprocess.Popen(
                    site.exec_prefix() + command,  # ip netns exec execs: the pid is the rank's
                    cwd=ROOT,
                    env=env,
                    stdout=fo,
                    stderr=fe,
                    stdin=subprocess.DEVNULL,
                    preexec_fn=(lambda c=core: os.sched_setaffinity(0, {c})) if pin else None,
                )
            procs.append((proc, out, err))
        deadline = start + timeout
        failed = None
        while True:
            codes = [p.poll() for p, _, _ in procs]
            if failed is None:
                failed = next((r for r, c in enumerate(codes) if c not in (None, 0)), None)
            if failed is not None or all(c is not None for c in codes):
                break
            if time.monotonic() > deadline:
                raise NetlabError(
                    f"job exceeded {timeout:.0f} s; ranks still running: "
                    f"{[r for r, c in enumerate(codes) if c is None]}; rank 0's stderr:\n"
                    + _tail(procs[0][2])
                )
            time.sleep(0.1)
        wall = time.monotonic() - start
    finally:
        for p, _, _ in procs:
            if p.poll() is None:
                p.kill()
        for p, _, _ in procs:
            p.wait()
    if failed is not None:
        site = placement[failed][0]
        raise NetlabError(
            f"rank {failed} (site {site.name.upper()}) exited with code "
            f"{procs[failed][0].returncode}; other ranks killed; logs in {log_dir}; its stderr:\n"
            + _tail(procs[failed][2])
        )
    after = sites.a.counters()
    done = [
        subprocess.CompletedProcess(p.args, p.returncode, _tail(out, 10**9), _tail(err, 10**9))
        for p, out, err in procs
    ]
    return Job(done, wall, after[0] - before[0], after[1] - before[1], log_dir)


def launch(
    sites: TwoSites,
    ranks_per_site: tuple[int, int],
    argv: list[str],
    metrics_dir: str,
    timeout: float,
    extra_env: dict | None = None,
) -> Job:
    """`python pretrain_gpt.py <argv>` on a+b ranks: 0..a-1 in site A, the rest in site B.

    Waits for all; when one fails the rest are killed and NetlabError carries its stderr tail.
    Rank 0 writes the metrics to <metrics_dir>/metrics.jsonl (`Job.metrics`); each rank's
    output is in <metrics_dir>/rank<r>.out/.err. Rank r is pinned to core r % cores, as
    scripts/compare.py pins them.
    """
    if any(x.split("=")[0] == "--metrics-file" for x in argv):
        raise ValueError("argv may not set --metrics-file: launch writes it under metrics_dir")
    metrics = os.path.join(metrics_dir, "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    command = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *argv]
    command += ["--metrics-file", metrics]
    job = run_ranks(sites, ranks_per_site, command, metrics_dir, timeout, extra_env)
    job.metrics = metrics
    return job


def step_seconds(metrics_path: str) -> list[float]:
    """Per-iteration step times (s) from rank 0's `train` records. Every step of Megatron ends
    in collectives (loss, grad norm) over all of a rank's groups, so rank 0's step spans the job's
    (with PP, rank 0's stage waits for the last stage's backward)."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from hettp.metrics import read_metrics

    return [r["elapsed_ms"] / 1e3 for r in read_metrics(metrics_path, "train")]


def steady(steps: list[float]) -> float:
    """Median of the second half of the iterations: past warm-up and the first allocations."""
    if not steps:
        raise ValueError("no train records")
    return statistics.median(steps[len(steps) // 2 :])


# ---------------------------------------------------------------------------------------------
# gloo measurements and placement checks (each runs as ranks of this script: `worker ...`)


def _worker_init():
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    return torch, dist


def _worker_bench(out: str, sizes: list[int], repeats: int) -> None:
    """Rank 0 (A) and rank 1 (B). Each timed exchange is rank 0's send of the payload and its
    receipt of a 1-byte ack, back to back with no barrier (the ack already paces them, and a
    barrier's skew between ranks would be timed too); all_reduce of the same bytes in float32.
    Rank 0 writes every time (s)."""
    torch, dist = _worker_init()
    rank = dist.get_rank()
    ack = torch.zeros(1, dtype=torch.uint8)

    def exchange(payload) -> float:
        t = time.perf_counter()
        if rank == 0:
            dist.send(payload, 1)
            dist.recv(ack, 1)
        else:
            dist.recv(payload, 0)
            dist.send(ack, 0)
        return time.perf_counter() - t

    result: dict = {"sendrecv": {}, "allreduce": {}}
    for _ in range(5):  # connections up, buffers warm
        dist.all_reduce(torch.ones(1024))
    result["pingpong"] = [exchange(ack) for _ in range(50 * repeats)]  # 2 alphas each
    for size in sizes:
        payload = torch.ones(size, dtype=torch.uint8)
        exchange(payload)
        result["sendrecv"][str(size)] = [exchange(payload) for _ in range(repeats)]
        floats = torch.ones(max(size // 4, 1))
        dist.all_reduce(floats)
        times = []
        for _ in range(repeats):
            dist.barrier()
            t = time.perf_counter()
            dist.all_reduce(floats)
            times.append(time.perf_counter() - t)
        result["allreduce"][str(size)] = times
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def _worker_groups(out_dir: str, tp: int, pp: int) -> None:
    """Megatron's own groups for this layout, from parallel_state on the real ranks."""
    torch, dist = _worker_init()
    from megatron.core import parallel_state as ps

    from megatron.hetero import cpu_compat

    cpu_compat.activate()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    groups = {
        "tp": ps.get_tensor_model_parallel_group(),
        "pp": ps.get_pipeline_model_parallel_group(),
        "dp": ps.get_data_parallel_group(),
    }
    record = {
        "rank": dist.get_rank(),
        "ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
        **{k: dist.get_process_group_ranks(g) for k, g in groups.items()},
    }
    with open(os.path.join(out_dir, f"groups{dist.get_rank()}.json"), "w") as f:
        json.dump(record, f)
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


@dataclasses.dataclass
class LinkBench:
    """gloo between the sites: alpha = one-way latency of a tiny message (s), beta = bytes/s of
    the largest send; `sendrecv`/`allreduce`: median seconds per payload size."""

    alpha_s: float
    beta_bytes_s: float
    sendrecv: dict[int, float]
    allreduce: dict[int, float]
    wall_s: float
    round_trips: list[float]  # every tiny round trip (s): on a busy machine the median jitters


def bench(
    sites: TwoSites,
    sizes: Sequence[int] = (1024, 65536, 1 << 20, 4 << 20),
    repeats: int = 3,
    timeout: float = 120.0,
) -> LinkBench:
    """One rank per site; see _worker_bench. beta subtracts the ack's one-way time."""
    with tempfile.TemporaryDirectory(prefix="netlab-bench-") as tmp:
        out = os.path.join(tmp, "bench.json")
        command = [sys.executable, os.path.abspath(__file__), "worker", "bench", out]
        command += ["--repeats", str(repeats), "--sizes", ",".join(map(str, sizes))]
        job = run_ranks(sites, (1, 1), command, tmp, timeout)
        with open(out) as f:
            raw = json.load(f)
    alpha = statistics.median(raw["pingpong"]) / 2
    sendrecv = {int(k): statistics.median(v) for k, v in raw["sendrecv"].items()}
    allreduce = {int(k): statistics.median(v) for k, v in raw["allreduce"].items()}
    big = max(sendrecv)
    beta = big / max(sendrecv[big] - 2 * alpha, 1e-9)  # the payload's alpha and the ack's
    return LinkBench(alpha, beta, sendrecv, allreduce, job.wall_s, raw["pingpong"])


def groups(
    sites: TwoSites, ranks_per_site: tuple[int, int], tp: int, pp: int, timeout: float = 120.0
) -> dict[str, list[list[int]]]:
    """Megatron's TP/PP/DP groups for this layout on these sites (each once, sorted)."""
    with tempfile.TemporaryDirectory(prefix="netlab-groups-") as tmp:
        command = [sys.executable, os.path.abspath(__file__), "worker", "groups", tmp]
        command += ["--tp", str(tp), "--pp", str(pp)]
        run_ranks(sites, ranks_per_site, command, tmp, timeout)
        world = sum(ranks_per_site)
        records = []
        for r in range(world):
            with open(os.path.join(tmp, f"groups{r}.json")) as f:
                records.append(json.load(f))
    return {k: sorted({tuple(x[k]) for x in records}) for k in ("tp", "pp", "dp")}


def crossing(group: Sequence[int], ranks_per_site: tuple[int, int]) -> bool:
    """Whether a group has ranks in both sites."""
    return len({r < ranks_per_site[0] for r in group}) > 1


# ---------------------------------------------------------------------------------------------
# CLI


def _ranks_arg(text: str) -> tuple[int, int]:
    a, b = (int(x) for x in text.split(","))
    return a, b


def _describe_groups(found: dict, ranks_per_site: tuple[int, int]) -> str:
    lines = []
    for kind, gs in found.items():
        text = " ".join(f"{list(g)}{'*' * crossing(g, ranks_per_site)}" for g in gs)
        lines.append(f"  {kind.upper()} groups: {text}")
    return "\n".join(lines) + "\n  (* crosses the link)"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("probe", help="print 'ok' or why namespaces cannot be made here")
    sub.add_parser("clean", help="delete namespaces of processes that are gone")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--rate-mbit", type=float, default=None, help="default: no limit")
    common.add_argument("--ranks", type=_ranks_arg, default=(2, 2), help="A,B (default 2,2)")
    run = sub.add_parser("run", parents=[common], help="one pretrain_gpt.py job; median step")
    run.add_argument("--tp", type=int, default=2)
    run.add_argument("--pp", type=int, default=1)
    run.add_argument("--iters", type=int, default=10)
    run.add_argument("--out", default=None, help="logs and metrics (default: a temp folder)")
    run.add_argument("--timeout", type=float, default=300.0)
    run.add_argument("--json", action="store_true", help="print one JSON line of results")
    b = sub.add_parser("bench", parents=[common], help="gloo alpha and beta across the link")
    b.add_argument("--repeats", type=int, default=3)
    g = sub.add_parser("groups", parents=[common], help="Megatron's groups on the sites")
    g.add_argument("--tp", type=int, default=2)
    g.add_argument("--pp", type=int, default=1)
    w = sub.add_parser("worker")  # a rank of bench/groups, inside a site
    w.add_argument("what", choices=["bench", "groups"])
    w.add_argument("out")
    w.add_argument("--sizes", default="")
    w.add_argument("--repeats", type=int, default=3)
    w.add_argument("--tp", type=int, default=1)
    w.add_argument("--pp", type=int, default=1)
    a = p.parse_args(argv)

    if a.cmd == "worker":
        if a.what == "bench":
            _worker_bench(a.out, [int(x) for x in a.sizes.split(",")], a.repeats)
        else:
            _worker_groups(a.out, a.tp, a.pp)
        return 0
    if a.cmd == "probe":
        reason = unavailable()
        print(reason or "ok")
        return 1 if reason else 0
    if a.cmd == "clean":
        removed = clean_stale()
        print("removed: " + (" ".join(removed) if removed else "nothing"))
        return 0
    reason = unavailable()
    if reason:
        raise SystemExit(f"netlab: {reason}")
    rate = "no limit" if a.rate_mbit is None else f"{a.rate_mbit:g} Mbit/s"
    with TwoSites(a.rate_mbit) as sites:
        if a.cmd == "bench":
            res = bench(sites, repeats=a.repeats)
            print(
                f"link {rate}: alpha {res.alpha_s * 1e6:.0f} us one way (min "
                f"{min(res.round_trips) / 2 * 1e6:.0f}), beta "
                f"{res.beta_bytes_s * 8 / 1e6:.1f} Mbit/s ({res.beta_bytes_s / 1e6:.2f} MB/s)"
            )
            for size, t in res.sendrecv.items():
                print(
                    f"  {size:>9d} B: send/recv {t * 1e3:8.2f} ms, all_reduce "
                    f"{res.allreduce[size] * 1e3:8.2f} ms"
                )
        elif a.cmd == "groups":
            print(f"groups with TP={a.tp} PP={a.pp} on sites {a.ranks}:")
            print(_describe_groups(groups(sites, a.ranks, a.tp, a.pp), a.ranks))
        else:
            out = a.out or tempfile.mkdtemp(prefix="netlab-run-")
            flags = [*TINY_GPT, "--tensor-model-parallel-size", str(a.tp)]
            flags += ["--pipeline-model-parallel-size", str(a.pp)]
            flags += ["--train-iters", str(a.iters), "--log-interval", str(a.iters), *extra]
            job = launch(sites, a.ranks, flags, out, a.timeout)
            steps = step_seconds(job.metrics)
            result = dict(
                rate_mbit=a.rate_mbit,
                tp=a.tp,
                pp=a.pp,
                ranks=list(a.ranks),
                median_step_s=steady(steps),
                steps_s=steps,
                wall_s=job.wall_s,
                bytes_a_to_b=job.bytes_a_to_b,
                bytes_b_to_a=job.bytes_b_to_a,
                out=out,
            )
            if a.json:
                print(json.dumps(result))
            else:
                print(
                    f"TP={a.tp} PP={a.pp} ranks {a.ranks} at {rate}: median step "
                    f"{result['median_step_s']:.3f} s (second half of {len(steps)}), wall "
                    f"{job.wall_s:.1f} s, link bytes A->B {job.bytes_a_to_b} B->A "
                    f"{job.bytes_b_to_a}; logs {out}"
                )
    print(f"setup {sites.setup_s:.2f} s, teardown {sites.teardown_s:.2f} s")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except NetlabError as err:
        raise SystemExit(f"netlab: {err}") from None
